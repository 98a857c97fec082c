"""Smoke test of the batching benchmark (benchmarks/batch.py --quick) on real weights: it runs end to
end, the batched greedy answers equal the lone ones, and forwards were shared. No timing assertions."""

import json

import pytest

from benchmarks import batch
from tests.conftest import packaged_or_skip

pytestmark = pytest.mark.slow


def test_quick_run_batches_and_matches_lone_answers(tmp_path):
    packaged_or_skip("smollm2-135m")
    out = tmp_path / "batch.json"
    assert batch.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (ctx,) = report["contexts"]
    assert [row["levels"] for row in ctx["stacks"]] == ["plain", "ngram>retrieval>full"]
    for row in ctx["stacks"]:
        one, two = row["runs"]
        assert one["n_sessions"] == 1 and two["n_sessions"] == 2
        assert two["greedy_equal"] is True
        assert two["mean_segments_per_forward"] > 1.0
        assert all(u["n_tokens"] >= 1 for u in two["users"])
    assert "| 512 | `plain` | 2 |" in out.with_suffix(".md").read_text()
