"""Where a question reads in the document: the sources of an answer, from the model's own attention.

The question's last query (whose output is the answer's first token) attends, in every layer and
query head, over the document's keys in the full cache; each chunk gets that attention's mass,
normalised per layer (`layer_shares`), contrasted with a neutral question's (`contrast`: a book's
opening and headings draw attention whatever is asked). Text passages are the app's.
"""

from __future__ import annotations

import math

import torch


def layer_shares(queries: list[torch.Tensor | None], keys: torch.Tensor, start: int, end: int,
                 chunk_tokens: int) -> torch.Tensor:
    """Attention of the last query over each whole chunk of positions [start, end) (the last,
    partial chunk left out), per layer: queries per layer [B, H, M, D] (post-RoPE, the last one
    used); keys [L, B, Hkv, S, D] (any device: read a layer at a time). The softmax runs over the
    chunks' positions only. Returns [L, n] float64, each row summing to 1 (zeros where n = 0)."""
    C, L = chunk_tokens, len(queries)
    n = max(0, end - start) // C
    shares = torch.zeros(L, n, dtype=torch.float64)
    for layer_idx, q in enumerate(queries):
        if q is None:
            continue
        B, H, _, D = q.shape
        k = keys[layer_idx, :, :, start:start + n * C].to(q.device)  # [B, Hkv, n*C, D]
        Hkv = k.shape[1]
        dtype = torch.promote_types(k.dtype, torch.float32)
        last = q[:, :, -1].reshape(B, Hkv, H // Hkv, D).to(dtype)  # [B, Hkv, G, D]
        p = (last @ k.to(dtype).transpose(-1, -2) / math.sqrt(D)).softmax(-1)  # [B, Hkv, G, n*C]
        mass = p.reshape(B, Hkv, H // Hkv, n, C).sum((0, 1, 2, 4)).double().cpu()  # [n]
        shares[layer_idx] = mass / mass.sum()
    return shares


def contrast(shares: torch.Tensor, neutral: torch.Tensor) -> torch.Tensor:
    """[n] share of each chunk: what the question ([L, n] `layer_shares`) reads more than the
    neutral question does, summed over layers and normalised; the question's own shares where it
    reads nothing more (e.g. it is the neutral question)."""
    excess = (shares - neutral).clamp(min=0).sum(0)  # [n]
    total = excess if excess.sum() > 0 else shares.sum(0)
    return total / total.sum() if total.sum() > 0 else total


def chunk_ranges(shares: torch.Tensor, start: int, chunk_tokens: int) -> list[tuple[int, int, float]]:
    """(start, end, share) of every chunk, in document order: shares [n] from `contrast`."""
    return [(start + i * chunk_tokens, start + (i + 1) * chunk_tokens, s) for i, s in enumerate(shares.tolist())]
