"""benchmarks/ceiling.py: the tuner's model of what a stack gains, and a quick run on SmolLM2."""

import json

import pytest

from benchmarks import ceiling
from tests.conftest import packaged_or_skip


def test_the_speedup_model_is_the_tuners():
    free_checks = {1: 10.0, 2: 10.0, 4: 10.0}  # a check costs a step: all accepted drafts are pure gain
    assert ceiling.speedup(10.0, free_checks, 0.0, 1.0) == (5.0, 4)
    costly = {1: 20.0, 2: 30.0, 4: 50.0}  # a check of g drafts costs g + 1 steps: nothing pays
    up, _ = ceiling.speedup(10.0, costly, 0.0, 1.0)
    assert up == pytest.approx(1.0)
    up, g = ceiling.speedup(10.0, free_checks, 2.0, 0.5)  # (1 - 0.5^2) / 0.5 = 1.5 tokens in 12 ms
    assert (g, up) == (1, pytest.approx(1.5 / 12.0 * 10.0))


def test_a_quick_run_reports_every_context_and_budget(tmp_path):
    packaged_or_skip("smollm2-135m")
    out = tmp_path / "ceiling.json"
    ceiling.main(["--model", "smollm2-135m", "--contexts", "64,128", "--budgets", "32", "--threads", "1",
                  "--repeats", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["contexts"]) == {"64", "128"} and set(report["middle_ms"]) == {"32"}
    assert set(report["contexts"]["128"]["check_ms"]) == {"1", "2", "4"}
    assert len(report["contexts"]["64"]["speedup_budget_32"]) == len(ceiling.ACCEPTANCES)
