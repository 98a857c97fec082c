"""The few device decisions outside the kernels: which device and dtype, and how to time.

Nothing else in the engine names "cuda" or synchronises (docs/STYLE.md section 5).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import extensions

log = logging.getLogger(__name__)
_LINEAR_SOURCE = Path(__file__).parent / "csrc" / "linear_cpu.cpp"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where that cannot be read."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """bf16 dot products in AVX-512 (Zen 4, Cooper Lake and later): oneDNN's packed bf16
    linears run on them, twice float32's rate on half its bytes."""
    return "avx512_bf16" in cpu_flags()


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else float32. Without
    them torch's bf16 matmuls of more than one row are tens of times slower than float32's.
    Every linear of the 0.5B, AVX512-BF16 EPYC without AMX, 2 threads, T = 1 / 9 tokens: 51 / 55
    ms in packed bf16 vs 89 / 85 in packed float32 (benchmarks/RESULTS.md)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" or cpu_has_amx_bf16() or cpu_has_avx512_bf16():
        return torch.bfloat16
    return torch.float32


def linear_layout(device: torch.device, dtype: torch.dtype, weights_fit_bf16: bool = False) -> str:
    """How linear weights are stored here, chosen once per model when the engine is built:
    - "bf16-stored": float32 on a CPU with AVX2 whose weights are all exactly bf16 values (a
      checkpoint published or converted in bf16, as every packaged model): stored as bf16 and
      multiplied in float32 by engine/csrc/linear_cpu.cpp, the same products as float32 on half
      the bytes. Every linear of the 0.5B, AVX2 EPYC, 2 threads, T = 1 / 5 / 9 tokens: 46 / 89 /
      111 ms vs 103 / 134 / 180 packed (benchmarks/RESULTS.md);
    - "packed": on a CPU where oneDNN prepacks linears (engine/layouts.py `PackedLinear`), for
      float32, and for bf16 where the CPU has AVX512-BF16 but no AMX. Every linear of the 0.5B,
      AVX2 EPYC, float32, 2 threads, T = 1 / 5 / 9 tokens: 94 / 80 / 96 ms vs 100 / 244 / 293
      input-major; AVX512-BF16 EPYC, bf16, T = 1 / 9: 51 / 55 ms vs 98 / 103 as loaded
      (benchmarks/RESULTS.md): a check of several drafted tokens reads the weights once, as one
      token does, so speculation pays on such CPUs too;
    - "input-major": float32 on a CPU without it (MKL: 99 vs 125 ms for one token as loaded);
    - "as loaded" otherwise: CUDA, and bf16 on AMX (not measured packed there) or on CPUs
      without bf16 instructions (its kernels want rows, 8x slower input-major)."""
    if device.type != "cpu":
        return "as loaded"
    if dtype == torch.float32:
        if weights_fit_bf16 and cpu_linear_kernel() is not None:
            return "bf16-stored"
        return "packed" if can_pack_linear_weights(dtype) else "input-major"
    if dtype == torch.bfloat16 and cpu_has_avx512_bf16() and not cpu_has_amx_bf16() and can_pack_linear_weights(dtype):
        return "packed"
    return "as loaded"


def build_cpu_extension(name: str, source: Path, fallback: str, wait_s: float = extensions.WAIT_S,
                        extra_cflags: tuple[str, ...] = ()):
    """A C++ extension of engine/csrc compiled by torch on first use (~30-50 s, cached in
    ~/.cache/torch_extensions; engine/extensions.py), or None where it cannot be: no AVX2, no C++
    compiler or ninja, or another process still building it after `wait_s`. `fallback` says, in
    the one log line, what runs instead."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("this CPU has no AVX2: %s", fallback)
        return None
    with contextlib.suppress(ImportError):  # without the pip package, a system ninja may still be on PATH
        import ninja  # the pip package (requirements.txt): torch runs `ninja` from PATH

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    try:
        flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", *extra_cflags]
        return extensions.load_extension(name, source, flags, wait_s)
    except extensions.BuildBusy as error:
        log.warning("%s: %s, the exact fallback, for this run", error, fallback)
        return None
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as error:
        log.warning("%s did not build (%s): %s, the exact fallback; a C++ compiler and ninja enable it",
                    source.name, error, fallback)
        return None


@functools.cache
def cpu_linear_kernel():
    """engine/csrc/linear_cpu.cpp (float32 linears over bf16-stored weights), or None."""
    return build_cpu_extension("bookchat_linear_cpu", _LINEAR_SOURCE, "linears on CPU stay float32")


@functools.cache
def can_pack_linear_weights(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN prepacks linear weights of `dtype` on this CPU and multiplies
    with them as F.linear does (a tiny product, checked once per process)."""
    try:
        w, x = torch.randn(16, 8).to(dtype), torch.randn(3, 8).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """Seconds, after the device has finished the work queued so far."""
    sync(device)
    return time.perf_counter()
