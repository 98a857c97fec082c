"""The few device decisions outside the kernels: which device and dtype, and how to time.

Nothing else in the engine names "cuda" or synchronises (STYLE.md section 5).
"""

from __future__ import annotations

import time

import torch


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


def prefers_input_major_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights should be stored input-major ([in, out] contiguous) here: float32 on
    CPU, where MKL multiplies them faster that way (every linear of the 0.5B, AVX2 EPYC, 2 threads:
    99 vs 125 ms for one token, 171 vs 249 for two, never slower; benchmarks/RESULTS.md). bf16
    keeps the loaded layout: its kernels want it (8x slower input-major without AMX)."""
    return device.type == "cpu" and dtype == torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """Seconds, after the device has finished the work queued so far."""
    sync(device)
    return time.perf_counter()
