"""Attention kernels over a KV view: torch SDPA always; flash-attn when importable on CUDA.

Every cache hands the model a view whose last `T` keys are the tokens of this call, and every
earlier key is visible to all of them (ALGORITHM.md section 7: stale slots are never in a view).
So the only mask is over that tail: causal for a chain, an ancestor matrix for a token tree.
GQA folds each KV head's query heads into the query length, one SDPA call on
[B, Hkv, G*T, D]: on this CPU 2.7x faster than `enable_gqa=True` at 32K keys (ASSETS.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def tail_mask(n_keys: int, tail: torch.Tensor) -> torch.Tensor:
    """[T, S] boolean mask: all keys before the tail visible, `tail` ([T, T]) over the last T."""
    T = tail.shape[0]
    head = torch.ones(T, n_keys - T, dtype=torch.bool, device=tail.device)
    return torch.cat([head, tail], dim=1)


def sdpa_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,  # [B, Hkv, S, D]
    tail: torch.Tensor | None,  # [T, T] bool, or None when T == 1
) -> torch.Tensor:  # [B, H, T, D]
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    q = q.reshape(B, Hkv, G * T, D)  # query heads of one KV head are adjacent (HF layout)
    mask = None
    if tail is not None and T > 1:
        mask = tail_mask(S, tail).repeat(G, 1)  # [G*T, S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(B, H, T, D)


def _flash_attention(q, k, v, tail):
    """flash-attn's kernel for causal chains; token trees go through SDPA."""
    if tail is not None and is_tree_mask(tail):
        return sdpa_attention(q, k, v, tail)
    from flash_attn import flash_attn_func  # guarded by pick_attention

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


def is_tree_mask(tail: torch.Tensor) -> bool:
    T = tail.shape[0]
    return not torch.equal(tail, torch.ones(T, T, dtype=torch.bool, device=tail.device).tril())


def pick_attention(device: torch.device, prefer_flash: bool = True):
    """Choose the kernel once, at construction; flash-attn only on CUDA and when importable."""
    if prefer_flash and device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return _flash_attention
        except ImportError:
            log.info("flash-attn is not installed; using torch SDPA attention (exact fallback)")
    return sdpa_attention
