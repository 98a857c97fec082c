"""The retrieval cache of the middle level (docs/ALGORITHM.md section 4).

Per layer and KV head, `budget` entries copied from the full cache, laid out as
[sinks | retrieved chunks, best score first | recent window + accepted tokens | scratch].
Scratch holds the middle level's own unverified tokens; `truncate` drops it. Attention ignores
key order, so a layout that differs from the full cache is harmless.
"""

from __future__ import annotations

import math

import torch

from engine.kv import SlotCache
from engine.kv.full import FullCache

# Chunk means are taken this many keys at a time: a rebuild's scratch on the device is a slice of
# one layer's keys (and its float32 copy), not the whole layer (engine/memory.py plans it).
MEAN_SLICE_TOKENS = 8192


def chunk_means(keys: torch.Tensor, chunk_tokens: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Mean key of each whole chunk: keys [B, Hkv, n*C(+rest), D] (on the host when offloaded)
    -> [B, Hkv, n, D] on `device` in `dtype`, copied and widened `MEAN_SLICE_TOKENS` at a time."""
    B, Hkv, S, D = keys.shape
    n, step = S // chunk_tokens, max(1, MEAN_SLICE_TOKENS // chunk_tokens)
    means = torch.empty(B, Hkv, n, D, dtype=dtype, device=device)
    for a in range(0, n, step):
        b = min(n, a + step)
        part = keys[:, :, a * chunk_tokens:b * chunk_tokens].to(device)  # [B, Hkv, (b-a)*C, D]
        means[:, :, a:b] = part.reshape(B, Hkv, b - a, chunk_tokens, D).to(dtype).mean(3)
    return means


def score_chunks(queries: torch.Tensor, keys: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Each whole chunk's score per KV head (docs/ALGORITHM.md section 4): keys [B, Hkv, n*C, D] on
    any device, recent post-RoPE queries [B, H, M, D] -> [B, Hkv, n] on the queries' device."""
    B, H, M, D = queries.shape
    Hkv = keys.shape[1]
    dtype = torch.promote_types(keys.dtype, torch.float32)
    means = chunk_means(keys, chunk_tokens, queries.device, dtype)
    q = queries.reshape(B, Hkv, (H // Hkv) * M, D).to(dtype)
    logits = q @ means.transpose(-1, -2) / math.sqrt(D)  # [B, Hkv, G*M, n]
    return logits.softmax(-1).sum(2)


class RetrievalCache(SlotCache):
    keys_at_positions = False  # a selection: a sliding layer of the middle level reads all of it (a draft)

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int,
                 budget_tokens: int, sink_tokens: int, window_tokens: int, chunk_tokens: int,
                 scratch_tokens: int, dtype: torch.dtype, device: torch.device):
        super().__init__(n_layers, batch, n_kv_heads, head_dim, budget_tokens + scratch_tokens, dtype, device)
        self.budget_tokens, self.sink_tokens = budget_tokens, sink_tokens
        self.window_tokens, self.chunk_tokens = window_tokens, chunk_tokens
        self.n_sinks = self.n_chunks = 0
        self.chunk_starts = torch.zeros(n_layers, batch, n_kv_heads, 0, dtype=torch.long)
        self.committed = 0  # sinks + chunks + recent: entries that outlive a check; + scratch = length
        self.synced = 0  # full-cache length these entries reflect
        self.version = 0  # changes whenever the selected chunks do

    def build(self, full: FullCache, queries: list[torch.Tensor] | None) -> None:
        """(Re)select sinks, chunks and window from the full cache; queries: per layer [B, H, M, D]."""
        S, C = full.length, self.chunk_tokens
        sinks = min(self.sink_tokens, S)
        n_avail = max(0, S - self.window_tokens - sinks) // C
        window_start = sinks + n_avail * C
        n_keep = min(n_avail, (self.budget_tokens - sinks - (S - window_start)) // C)
        L, B, Hkv, _, D = full.k.shape
        starts = torch.empty(L, B, Hkv, n_keep, dtype=torch.long)
        end = sinks + n_keep * C
        for layer_idx in range(L):
            if n_keep < n_avail and queries and queries[layer_idx] is not None:
                region = full.k[layer_idx, :, :, sinks:window_start]  # offloaded: host; score_chunks slices it
                top = score_chunks(queries[layer_idx], region, C).topk(n_keep, dim=-1).indices
            else:  # everything fits, or no queries yet: evenly spaced chunks
                top = torch.linspace(0, n_avail - 1, n_keep).long().expand(B, Hkv, n_keep)
            starts[layer_idx] = sinks + top.cpu() * C
            idx = (starts[layer_idx, ..., None] + torch.arange(C)).reshape(B, Hkv, -1, 1)  # [B, Hkv, n_keep*C, 1]
            idx = idx.expand(B, Hkv, n_keep * C, D).to(full.k.device)
            self.k[layer_idx, :, :, sinks:end] = full.k[layer_idx].gather(2, idx)
            self.v[layer_idx, :, :, sinks:end] = full.v[layer_idx].gather(2, idx)
        self.k[:, :, :, :sinks], self.v[:, :, :, :sinks] = full.entries(0, sinks)
        self.n_sinks, self.n_chunks, self.chunk_starts = sinks, n_keep, starts
        self.version += 1
        self.committed = self.length = end
        self.synced = window_start
        self.append(full, window_start, S)

    def append(self, full: FullCache, start: int, end: int) -> None:
        """Drop the scratch and append the full cache's entries [start, end) (accepted tokens)."""
        assert start == self.synced, f"appending from {start}, but synced up to {self.synced}"
        n = end - start
        self._make_room(n)
        at = self.committed
        self.k[:, :, :, at:at + n], self.v[:, :, :, at:at + n] = full.entries(start, end)
        self.committed = self.length = at + n
        self.synced = end

    def _make_room(self, n_tokens: int) -> None:
        """Evict the lowest-scoring chunks, then the oldest recent tokens, so n_tokens fit."""
        C = self.chunk_tokens
        while self.committed + n_tokens > self.budget_tokens and self.n_chunks > 0:
            self._drop(self.n_sinks + (self.n_chunks - 1) * C, C)
            self.n_chunks -= 1
            self.chunk_starts = self.chunk_starts[..., : self.n_chunks]
            self.version += 1
        overflow = self.committed + n_tokens - self.budget_tokens
        if overflow > 0:
            self._drop(self.n_sinks, min(overflow, self.committed - self.n_sinks))

    def _drop(self, at: int, n: int) -> None:
        """Remove committed slots [at, at + n), shifting the later ones left."""
        end = self.committed
        for t in (self.k, self.v):
            t[:, :, :, at:end - n] = t[:, :, :, at + n:end].clone()
        self.committed = self.length = end - n

    def truncate(self, length: int) -> None:
        assert self.committed <= length, "only the scratch can be truncated"
        super().truncate(length)
