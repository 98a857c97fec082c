"""What this machine can do, measured in the benchmark's own process, and the per-token floor.

`measure_hardware` times a large copy (bytes read + written per second), a large read (a sum),
a large square matmul in bfloat16 and float32, plus the decode-shaped matmuls ([1 or 8, dim] x
[dim, 4*dim]) that show whether a dtype costs the same for 8 rows as for one (their 8.7 MB weight
is reused, so it stays in cache: they do not measure memory bandwidth). `token_floor` turns those
into the physical floor of one full-model forward: max(bytes read / the better of the two
bandwidths, FLOPs / peak matmul rate).
A peak RSS sampler lives here too (a thread reading psutil every few milliseconds).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import psutil
import torch


def _best_s(fn, n_repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(n_repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class Hardware:
    copy_gb_s: float  # (bytes read + bytes written) / s of a 512 MiB tensor copy
    read_gb_s: float  # bytes read / s of a sum over a 512 MiB float32 tensor (what decoding does)
    matmul_tflops: dict[str, float]  # dtype name -> best rate of a 2048^3 matmul
    decode_matmul_ms: dict[str, float]  # "bfloat16 T=1" -> ms of [T, 896] x [896, 4864]
    n_threads: int

    def to_json(self) -> dict:
        return asdict(self)


def measure_hardware(n_repeats: int = 5, copy_mib: int = 512,
                     dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> Hardware:
    """Bandwidths, and matmul rates of `dtypes` (a bf16 matmul without AMX or AVX512-BF16 takes
    seconds: measure only the dtypes a run uses)."""
    src = torch.empty(copy_mib << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    copy_s = _best_s(lambda: dst.copy_(src), n_repeats)
    tflops, decode_ms = {}, {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        a = torch.randn(2048, 2048).to(dtype)
        b = torch.randn(2048, 2048).to(dtype)
        tflops[name] = 2 * 2048**3 / _best_s(lambda a=a, b=b: a @ b, n_repeats) / 1e12
        w = torch.randn(4864, 896).to(dtype)  # Qwen-0.5B gate_proj shape, [out, in] as nn.Linear
        for n_rows in (1, 8):
            x = torch.randn(1, n_rows, 896).to(dtype)
            decode_ms[f"{name} T={n_rows}"] = 1000 * _best_s(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), 20 * n_repeats)
    return Hardware(2 * (copy_mib << 20) / copy_s / 1e9, read_gb_s(src.view(torch.float32), n_repeats), tflops,
                    decode_ms, torch.get_num_threads())


def read_gb_s(src: torch.Tensor | None = None, n_repeats: int = 3) -> float:
    """Bytes read / s of a sum over `src` (default 256 MiB of float32). Cheap enough to run
    before every measured answer: a shared host's memory bandwidth changes between phases of a
    day without it showing in the load average."""
    src = torch.ones(64 << 20) if src is None else src
    return src.numel() * src.element_size() / _best_s(lambda: src.sum(), n_repeats) / 1e9


@dataclass
class Floor:
    weight_bytes: int
    kv_bytes: int  # KV of the context the token attends to
    flops: float  # matmuls (2 per weight) + attention (4 * S * H * D per layer)
    bytes_ms: float
    flops_ms: float

    @property
    def ms(self) -> float:
        return max(self.bytes_ms, self.flops_ms)


def token_floor(model, context_tokens: int, hw: Hardware) -> Floor:
    """Floor of one plain decoding step of `model` (our Transformer) over `context_tokens`.

    Every matmul weight is read once: the layers' and the LM head (a tied one too, or its packed
    copy, engine/model.py `PackedLinear`); the embedding lookup reads a row, not the table.
    """
    c = model.config
    dtype = model.dtype  # of the arithmetic and the KV cache; weights may be stored narrower
    matmul_params = [p for n, p in model.named_parameters(remove_duplicate=False) if "embed_tokens" not in n]
    weight_bytes = sum(p.numel() * p.element_size() for p in matmul_params)
    kv_bytes = c.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * context_tokens
    attention_flops = 4 * c.n_layers * c.n_heads * c.head_dim * context_tokens
    flops = 2 * sum(p.numel() for p in matmul_params if p.dim() == 2) + attention_flops
    peak = hw.matmul_tflops[str(dtype).removeprefix("torch.")] * 1e12
    bandwidth = max(hw.copy_gb_s, hw.read_gb_s) * 1e9  # the floor is a lower bound: the faster one
    return Floor(weight_bytes, kv_bytes, flops, 1000 * (weight_bytes + kv_bytes) / bandwidth,
                 1000 * flops / peak)


class RssSampler:
    """Peak resident set size of this process while a `with` block runs (sampled every 10 ms)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.peak_bytes = self.start_bytes = 0
        self._stop = threading.Event()

    def __enter__(self) -> RssSampler:
        self.peak_bytes = self.start_bytes = self.process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)

    @property
    def delta_bytes(self) -> int:
        """Peak minus the RSS when the block started: what the block itself needed."""
        return self.peak_bytes - self.start_bytes

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)
