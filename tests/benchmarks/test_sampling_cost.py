"""benchmarks/sampling_cost.py: before and after timed side by side per thread count and row count
(no timing assertions)."""

import json

import torch

from benchmarks import sampling_cost


def test_each_shape_and_thread_count_is_timed_both_ways_on_the_same_distribution(tmp_path, capsys):
    threads = torch.get_num_threads()
    report = sampling_cost.main(["--threads", "1", "--rows", "1", "3", "--vocab", "4000", "--repeats", "3",
                                 "--out", str(tmp_path / "sc.json")])
    assert torch.get_num_threads() == threads  # restored
    assert json.loads((tmp_path / "sc.json").read_text()) == json.loads(json.dumps(report))
    assert [(r["threads"], r["rows"]) for r in report["rows"]] == [(1, 1), (1, 3)]
    for row in report["rows"]:
        assert row["same_kept_set"] and row["max_abs_diff"] < 1e-12
        assert min(row["penalize_ms"], row["before_ms"], row["after_ms"]) > 0
    assert "before/after" in capsys.readouterr().out
