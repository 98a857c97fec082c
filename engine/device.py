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
    linears run on them, at a higher rate than float32's on half its bytes."""
    return "avx512_bf16" in cpu_flags()


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA GPUs that compute in it (Ampere, sm80, and later; float16 on older
    ones: T4, V100, which only emulate bf16) and on CPUs with AMX-BF16 or AVX512-BF16, else
    float32. Without them torch's bf16 matmuls of more than one row are many times slower than
    float32's; with them packed bf16 linears beat packed float32 ones (benchmarks/history/2026-11-
    results.md, "oneDNN-packed linears")."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):  # of the current device: this rank's
            return torch.bfloat16
        log.warning("this GPU has no native bfloat16: the model runs in float16")
        return torch.float16
    if cpu_has_amx_bf16() or cpu_has_avx512_bf16():
        return torch.bfloat16
    return torch.float32


def linear_layout(device: torch.device, dtype: torch.dtype, weights_fit_bf16: bool = False) -> str:
    """How a safetensors checkpoint's linear weights are stored here (a GGUF's blocks on a CPU keep
    the file's layout), chosen once per model when the engine is built. The default for:
    - "bf16-stored": float32 (the auto dtype of AVX2 and AVX-512 CPUs without BF16) with weights
      that are all bf16 values (a checkpoint published in bf16): stored as bf16 and multiplied in
      float32 by engine/csrc/linear_cpu.cpp, the same products on half the bytes read;
    - "packed" (engine/layouts.py `PackedLinear`): float32 with other weights (float16 or float32
      checkpoints, or where the kernel did not build), and bf16 on AVX512-BF16 CPUs without AMX
      (Zen 4): a check of several drafted tokens reads the weights once, as one token does;
    - "as loaded": GPUs, bf16 on AMX, and wherever oneDNN cannot pack (oneDNN packs float32 on
      every x86 level from SSE4.1 to AMX).
    Measured against each other: benchmarks/history/2026-11-results.md ("oneDNN-packed linears",
    "bf16-stored weights")."""
    if device.type != "cpu":
        return "as loaded"
    if dtype == torch.float32:
        if weights_fit_bf16 and cpu_linear_kernel() is not None:
            return "bf16-stored"
        return "packed" if can_pack_linear_weights(dtype) else "as loaded"
    if dtype == torch.bfloat16 and cpu_has_avx512_bf16() and not cpu_has_amx_bf16() and can_pack_linear_weights(dtype):
        return "packed"
    return "as loaded"


def build_cpu_extension(name: str, source: Path, fallback: str, wait_s: float = extensions.WAIT_S,
                        extra_cflags: tuple[str, ...] = ()):
    """A C++ extension of engine/csrc compiled by torch on first use (once, and scripts/setup.sh
    does it ahead; cached in ~/.cache/torch_extensions; engine/extensions.py), or None where it
    cannot be: no AVX2, no C++ compiler or ninja, or another process still building it after
    `wait_s`. `fallback` says, in the one log line, what runs instead."""
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
