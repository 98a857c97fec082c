"""Smoke test of the kernel micro-benchmark's attention comparison (no timing assertions)."""

import json

import pytest

from benchmarks import kernels
from benchmarks.kernels import ROOT
from engine.attention import cpu_kernel


def test_cpu_attention_bench_times_both_kernels(tmp_path):
    if cpu_kernel() is None:
        pytest.skip("the CPU attention kernel does not build here")
    out = tmp_path / "kernels.json"
    assert kernels.main(["--only", "cpu-attention", "--contexts", "256", "--repeats", "1", "--dtype", "bfloat16",
                         "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["cpu-attention S=256"]
    steps = ["T=1", "T=2", "T=5", "T=9"]
    dots = cpu_kernel().uses_bf16_dots()  # AVX512-BF16: the widened path beside, and a prefill chunk (packed)
    prefill = ["bfloat16 T=512"] if dots else []
    assert sorted(result) == sorted(steps + [f"bfloat16 {t}" for t in steps] + prefill)  # float32, the model's dtype
    widened = {"cpu_attention, widened to float32"} if dots else set()
    for name, row in result.items():
        is_widened = name.startswith("bfloat16") and name not in prefill
        assert set(row) == {"sdpa_attention", "cpu_attention"} | (widened if is_widened else set())
        assert all(t["min_ms"] > 0 for t in row.values())


def test_cpu_attention_bench_times_another_version_of_the_kernel_beside_this_one(tmp_path, monkeypatch):
    if cpu_kernel() is None:
        pytest.skip("the CPU attention kernel does not build here")
    other = tmp_path / "attention_cpu_old.cpp"  # stands for `git show OLD:engine/csrc/attention_cpu.cpp`
    other.write_text((ROOT / "engine" / "csrc" / "attention_cpu.cpp").read_text())
    built = []  # the same source: this kernel's build stands in for a second one (~40 s saved)
    monkeypatch.setattr(kernels, "build_cpu_extension",
                        lambda name, source, fallback: built.append(source) or cpu_kernel())
    out = tmp_path / "kernels.json"
    assert kernels.main(["--model", "smollm2-135m", "--only", "cpu-attention", "--contexts", "64", "--repeats", "1",
                         "--dtype", "float32", "--attention-source", str(other), "--threads", "1",
                         "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["cpu-attention S=64"]
    # SmolLM2: 9 query heads per 3 KV heads, so T = 1, 2, 5, 9 fold 3 to 27 rows, all within FEW_ROWS
    for row in result.values():
        assert set(row) == {"sdpa_attention", "cpu_attention", "this kernel", "attention_cpu_old.cpp"}
    assert built == [other]


def test_block_types_bench_times_every_kept_type_beside_its_float32_weights():
    from engine.quant import KERNEL_TYPES, cpu_quant_kernel

    if cpu_quant_kernel() is None:
        pytest.skip("the GGUF blocks kernel does not build here")
    result = kernels.bench_block_types(repeats=1, n_out=32, n_in=512)
    assert sorted(result) == sorted(KERNEL_TYPES.values())
    for row in result.values():
        assert row["MB read"]["blocks"] < row["MB read"]["float32"]
        assert all(t["min_ms"] > 0 for T in ("T=1", "T=5") for t in row[T].values())
