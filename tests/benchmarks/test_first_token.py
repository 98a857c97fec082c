"""benchmarks/first_token.py: each question asked plainly and re-reading, alternating, on one book."""

import torch

from benchmarks import first_token
from tests.conftest import packaged_or_skip


def test_each_question_is_timed_both_ways_and_re_reading_reads_more(tmp_path):
    packaged_or_skip("smollm2-135m")
    threads = torch.get_num_threads()
    try:
        report = first_token.main(["--model", "smollm2-135m", "--context", "1024", "--questions", "2",
                                   "--threads", "1", "--out", str(tmp_path / "ft.json")])
    finally:
        torch.set_num_threads(threads)
    assert len(report["rows"]) == 2
    assert list(report["rows"][0]) == ["question", "plain", "reread"]  # the order alternates
    assert list(report["rows"][1]) == ["question", "reread", "plain"]
    for row in report["rows"]:
        assert row["reread"]["prompt_tokens"] > row["plain"]["prompt_tokens"] + 100  # its passages
        assert row["plain"]["s"] > 0 and row["reread"]["s"] > 0
