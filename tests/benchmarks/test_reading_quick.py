"""benchmarks/reading.py on SmolLM2: a reading stopped and read on equals one uninterrupted read."""

import json

from app import reading as app_reading
from benchmarks import reading
from tests.conftest import packaged_or_skip


def test_a_quick_run_reads_on_to_the_same_cache_and_answer(tmp_path, monkeypatch):
    packaged_or_skip("smollm2-135m")
    monkeypatch.setattr(app_reading, "READ_PART_TOKENS", 512)  # one prefill chunk a part: the book has three
    out = tmp_path / "reading.json"
    reading.main(["--model", "smollm2-135m", "--tokens", "1400", "--stop-at", "600", "--threads", "1",
                  "--save-sizes", "300", "--out", str(out)])
    report = json.loads(out.read_text())
    row = report["reading"]
    assert row["n_read"] == 1024 and row["tokens"] == 1400  # stopped after the chunk that passed 600
    assert row["kv_equal"] and row["answers_equal"]
    more = report["more_of_the_book"]  # its first 600 tokens read before: the whole chunk they share kept
    assert more["n_shared"] == 512 and more["kv_equal"]
    assert [c["tokens"] for c in report["long_book_costs"]] == [300]
