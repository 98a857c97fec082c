"""Where a question reads in the document: the sources of an answer, from the model's own attention.

The document's chunks are scored with the question's post-RoPE queries over the full cache, by
the retrieval level's rule (`score_chunks`, docs/ALGORITHM.md section 4: per layer and KV head, a
softmax over chunks of q . mean_key / sqrt(D), summed over the group's queries), here summed over
every layer and KV head and normalised, so each chunk gets its share of the question's attention.
`Session.score_document` runs the question through the target to get its queries and then drops
its KV, so the answer that follows is exactly the one asked without scoring. Turning chunks into
passages of text (paragraphs, labels) is the app's (app/sources.py): the engine knows tokens only.
"""

from __future__ import annotations

import torch

from engine.kv.retrieval import score_chunks


def chunk_shares(queries: list[torch.Tensor | None], keys: torch.Tensor, start: int, end: int,
                 chunk_tokens: int) -> torch.Tensor:
    """Share of attention of each whole chunk of positions [start, end) (the last, partial one
    left out): queries per layer [B, H, M, D]; keys [L, B, Hkv, S, D] (any device: a host copy
    when offloaded). Returns [n] float, summing to 1 over the chunks (all zeros when n = 0)."""
    C = chunk_tokens
    n = max(0, end - start) // C
    total = torch.zeros(n, dtype=torch.float64)
    if n == 0:
        return total
    for layer_idx, q in enumerate(queries):
        if q is None:
            continue
        region = keys[layer_idx, :, :, start:start + n * C]  # [B, Hkv, n*C, D]
        total += score_chunks(q, region, C).sum((0, 1)).double().cpu()  # [n]
    return total / total.sum() if total.sum() > 0 else total


def chunk_ranges(shares: torch.Tensor, start: int, chunk_tokens: int) -> list[tuple[int, int, float]]:
    """(start, end, share) of every chunk, in document order: shares [n] from `chunk_shares`."""
    return [(start + i * chunk_tokens, start + (i + 1) * chunk_tokens, s) for i, s in enumerate(shares.tolist())]
