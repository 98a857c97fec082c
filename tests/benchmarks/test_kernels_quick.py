"""Smoke test of the kernel micro-benchmark's attention comparison (no timing assertions)."""

import json

import pytest

from benchmarks import kernels
from engine.attention import cpu_kernel


def test_cpu_attention_bench_times_both_kernels(tmp_path):
    if cpu_kernel() is None:
        pytest.skip("the CPU attention kernel does not build here")
    out = tmp_path / "kernels.json"
    assert kernels.main(["--only", "cpu-attention", "--contexts", "256", "--repeats", "1", "--dtype", "bfloat16",
                         "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["cpu-attention S=256"]
    steps = ["T=1", "T=2", "T=5", "T=9"]
    assert sorted(result) == steps + [f"bfloat16 {t}" for t in steps]  # float32 and the model's dtype
    for row in result.values():
        assert set(row) == {"sdpa_attention", "cpu_attention"}
        assert all(t["min_ms"] > 0 for t in row.values())
