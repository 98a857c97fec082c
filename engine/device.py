"""The few device decisions outside the kernels: which device and dtype, how a CPU stores linear
weights, and how to time. Nothing else in the engine names "cuda" or synchronises (docs/STYLE.md 5).
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


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA GPUs that compute in it (Ampere and later; float16 on T4 or V100,
    which only emulate it) and on CPUs with bf16 dot products (AMX-BF16, AVX512-BF16), else float32:
    without them torch's bf16 matmuls of more than one row are many times slower than float32's."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):  # of the current device: this rank's
            return torch.bfloat16
        log.warning("this GPU has no native bfloat16: the model runs in float16")
        return torch.float16
    return torch.bfloat16 if cpu_flags() & {"amx_bf16", "avx512_bf16"} else torch.float32


def linear_layout(device: torch.device, dtype: torch.dtype, weights_fit_bf16: bool = False) -> str:
    """How a safetensors checkpoint's linear weights are stored here (engine/layouts.py), chosen once per
    model: "bf16-stored" multiplies the same products on half float32's bytes (engine/csrc/linear_cpu.cpp);
    "packed" (oneDNN) lets a check of several drafted tokens read the weights once, as one token does."""
    if device.type != "cpu":
        return "as loaded"
    if dtype == torch.float32 and weights_fit_bf16 and cpu_linear_kernel() is not None:
        return "bf16-stored"
    is_avx512_bf16_without_amx = "avx512_bf16" in cpu_flags() and "amx_bf16" not in cpu_flags()
    is_worth_packing = dtype == torch.float32 or (dtype == torch.bfloat16 and is_avx512_bf16_without_amx)
    return "packed" if is_worth_packing and can_pack_linear_weights(dtype) else "as loaded"


def build_cpu_extension(name: str, source: Path, fallback: str, wait_s: float = extensions.WAIT_S,
                        extra_cflags: tuple[str, ...] = ()):
    """A C++ extension of engine/csrc, compiled on first use (engine/extensions.py), or None where it
    cannot be: no AVX2, no C++ compiler or ninja, or another process still building it after `wait_s`.
    `fallback` says, in the one log line, what runs instead."""
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


def now(device: torch.device) -> float:
    """Seconds, after the device has finished the work queued so far: the one place that synchronises."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
