"""The few device decisions outside the kernels: which device and dtype, and how to time.

Nothing else in the engine names "cuda" or synchronises (STYLE.md section 5).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA and on CPUs with AMX-BF16 (matmuls as fast as one row), else float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" or cpu_has_amx_bf16():
        return torch.bfloat16
    return torch.float32


def linear_layout(device: torch.device, dtype: torch.dtype) -> str:
    """How linear weights are stored here, chosen once when the engine is built:
    - "packed": float32 on a CPU where oneDNN prepacks linears (`Transformer.pack_linear_weights`).
      Every linear of the 0.5B, AVX2 EPYC, 2 threads, T = 1 / 5 / 9 tokens: 94 / 80 / 96 ms
      vs 100 / 244 / 293 input-major (benchmarks/RESULTS.md): a check of several drafted tokens
      reads the weights once, as one token does, so speculation pays on such CPUs too;
    - "input-major": float32 on a CPU without it (MKL: 99 vs 125 ms for one token as loaded);
    - "as loaded" otherwise: CUDA, and bf16 (its kernels want rows, 8x slower input-major without
      AMX; packed bf16 is not measured on an AMX CPU yet, so it is not chosen)."""
    if device.type != "cpu":
        return "as loaded"
    if dtype == torch.float32:
        return "packed" if can_pack_linear_weights(dtype) else "input-major"
    return "as loaded"


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
