"""Attention kernels over a KV view: torch SDPA always; flash-attn when importable on CUDA; on
CPU our compiled kernel (engine/csrc/attention_cpu.cpp) when it builds: few-row calls, and a bf16
model's prefill chunks where the CPU has AVX512-BF16.

A view's last `T` keys are this call's tokens and every earlier key is visible to all of them
(docs/ALGORITHM.md section 7), so the only mask is over that tail: causal, for every call is a chain
of tokens. GQA folds each KV head's query heads into the query length, one SDPA call
on [B, Hkv, G*T, D], so each KV head is read once; on CPU no [T, S] mask is built (`_split_attention`).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.device import build_cpu_extension

log = logging.getLogger(__name__)

# torch's CPU flash kernel (the one SDPA calls), which also returns its log-sum-exp
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Up to this many folded query rows (G*T) the compiled kernel beats torch's flash kernel; larger float32
# calls (prefill chunks) are GEMM-shaped and stay on flash (benchmarks/history/2026-11-results.md).
FEW_ROWS = 64
HEAD_DIMS = (16, 32, 64, 128)  # the kernel's instantiations
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of the cache; the kernel sums in float32
_CPU_SOURCE = Path(__file__).parent / "csrc" / "attention_cpu.cpp"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and later (its README); T4 / V100 cannot


def tail_mask(n_keys: int, tail: torch.Tensor) -> torch.Tensor:
    """[T, S] boolean mask: all keys before the tail visible, `tail` ([T, T]) over the last T."""
    return F.pad(tail, (n_keys - tail.shape[0], 0), value=True)


def sdpa_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,  # [B, Hkv, S, D]
    tail: torch.Tensor | None,  # [T, T] bool, or None when T == 1
) -> torch.Tensor:  # [B, H, T, D]
    if tail is None or q.shape[2] == 1:
        return masked_attention(q, k, v, None)
    if q.device.type == "cpu" and _flash_cpu is not None:
        return _split_attention(q, k, v, tail)
    return masked_attention(q, k, v, tail_mask(k.shape[2], tail))


def masked_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,  # [B, Hkv, S, D]
    key_mask: torch.Tensor | None,  # [T, S] bool: the keys each query sees; None: all
    scale: float | None = None,  # with `softcap` only; SDPA scales by D ** -0.5
    softcap: float | None = None,  # Gemma 2: scores become cap * tanh(scores / cap), which SDPA cannot do
) -> torch.Tensor:  # [B, H, T, D]
    """One SDPA call with each KV head's query heads folded into the query length. Static-shape
    steps (engine/graphs.py) pass the whole fixed-capacity cache: their mask, not a slice, hides
    the slots past its length, so the shapes do not change between calls."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    q = q.reshape(B, Hkv, (H // Hkv) * T, D)  # query heads of one KV head are adjacent (HF layout)
    mask = None if key_mask is None else key_mask.repeat(H // Hkv, 1)  # [G*T, S]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(B, H, T, D)
    scores = torch.tanh(q @ k.transpose(2, 3) * scale / softcap) * softcap  # [B, Hkv, G*T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # as transformers' eager attention
    return (probs @ v).reshape(B, H, T, D)


def _split_attention(q, k, v, tail):
    """Softmax over (keys before the tail) and over (the tail) as two calls merged by their
    log-sum-exp: o = o_tail + (o_head - o_tail) * sigmoid(lse_head - lse_tail), both on torch's flash kernel."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    o_tail, lse_tail = _flash_cpu(q, k[:, :, S - T:], v[:, :, S - T:], is_causal=True)
    if S == T:
        return o_tail
    q_folded = q.reshape(B, Hkv, (H // Hkv) * T, D)  # one KV head's query heads share its reads
    o_head, lse_head = _flash_cpu(q_folded, k[:, :, :S - T], v[:, :, :S - T])
    o_head, lse_head = o_head.reshape(B, H, T, D), lse_head.reshape(B, H, T, 1)
    share = torch.sigmoid(lse_head - lse_tail.unsqueeze(-1))  # [B, H, T, 1] softmax mass before the tail
    return torch.lerp(o_tail.to(share.dtype), o_head.to(share.dtype), share).to(q.dtype)


@functools.cache
def cpu_kernel():
    """The compiled few-row attention module, built once (scripts/setup.sh), or None (`build_cpu_extension`)."""
    return build_cpu_extension("bookchat_attention_cpu", _CPU_SOURCE, "attention on CPU runs on torch SDPA")


def cpu_attention(q, k, v, tail):
    """`sdpa_attention` with the compiled kernel for calls of few rows (decoding, drafts, checks)
    and a bf16 model's causal chains of any length (prefill, in BF16 dot products where the CPU has
    them): SDPA's answer up to float32 rounding, summed in float32 as torch's flash kernel does."""
    B, H, T, D = q.shape
    G, kernel = H // k.shape[1], cpu_kernel()
    if (kernel is None or q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or D not in HEAD_DIMS
            or k.stride(3) != 1 or v.stride(3) != 1):
        return sdpa_attention(q, k, v, tail)
    has_tail = tail is not None and T > 1
    if G * T > FEW_ROWS and not (has_tail and q.dtype == torch.bfloat16 and kernel.uses_bf16_dots()):
        return sdpa_attention(q, k, v, tail)  # a float32 prefill chunk: GEMM-shaped, flash
    # A chain in one kernel call: token t sees the keys before the tail and the tail up to itself. In at most
    # FEW_ROWS rows each row is what decoding its token alone computes, bit for bit (a check commits decoding's
    # tokens); more rows (a bf16 prefill chunk) take the kernel's packed path.
    row_keys = (k.shape[2] - T + 1 + torch.arange(T)).repeat(G) if has_tail else None  # folded row g * T + t
    out, _ = kernel.few_row_attention(_kernel_rows(q.reshape(B, k.shape[1], G * T, D)), k, v, row_keys)
    return out.reshape(B, H, T, D).to(q.dtype)


def _kernel_rows(q_folded):  # bf16 queries stay bf16: the kernel's BF16 dots where it has them
    return (q_folded if q_folded.dtype == torch.bfloat16 else q_folded.float()).contiguous()


def flash_attention(q, k, v, tail):
    """flash-attn's `flash_attn_with_kvcache` in fp16/bf16 (its bottom-right causal alignment is
    our tail mask); float32/64 and head dims over 256 go through SDPA."""
    if q.dtype not in FLASH_DTYPES or q.shape[-1] > 256:
        return sdpa_attention(q, k, v, tail)
    from flash_attn import flash_attn_with_kvcache  # importable: checked by pick_attention

    # [B, S, H, D] views with a contiguous last dim, as flash-attn reads them: no copy
    out = flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


@functools.cache
def has_flash_attn() -> bool:
    """Whether flash-attn imports here; says once per process when it does not."""
    try:
        import flash_attn  # noqa: F401
    except ImportError as error:
        log.warning("flash-attn is not available (%s): attention runs on torch SDPA, the exact fallback; "
                    "on a CUDA machine `pip install -r requirements-gpu.txt` enables it", error)
        return False
    return True


@functools.cache
def _say_no_flash(reason: str) -> None:
    log.warning("%s: attention runs on torch SDPA, the exact fallback", reason)


def pick_attention(device: torch.device, use_flash_attn: bool = True, use_cpu_kernel: bool = False):
    """Choose the kernel once, at construction: flash-attn on a CUDA GPU it runs on (sm80+) when
    wanted and importable (says once why not); on CPU the compiled kernel when wanted and it builds."""
    if use_flash_attn and device.type == "cuda" and has_flash_attn():
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) >= FLASH_MIN_CAPABILITY:
            return flash_attention
        _say_no_flash(f"{torch.cuda.get_device_name(device)} is sm{capability[0]}{capability[1]}, flash-attn 2 "
                      f"needs sm{FLASH_MIN_CAPABILITY[0]}{FLASH_MIN_CAPABILITY[1]} or later")
    if use_cpu_kernel and device.type == "cpu" and cpu_kernel() is not None:
        return cpu_attention
    return sdpa_attention
