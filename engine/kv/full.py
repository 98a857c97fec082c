"""The full KV cache: every token of the document and the chat, at its absolute position.

Appending writes after `length`; rejection is `truncate` (O(1)); a verified token-tree keeps its
accepted path with `keep_tail`. Capacity grows by reallocation, so one cache serves a whole chat.
It does not know about retrieval or offloading (engine/kv/retrieval.py, engine/kv/offload.py).
"""

from __future__ import annotations

import torch


class FullCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, B, Hkv, S_max, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` more entries (grows by 1.5x to amortise copies)."""
        needed = self.length + n_tokens
        if needed <= self.capacity:
            return
        new_capacity = max(needed, int(self.capacity * 1.5))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:3] + (new_capacity, old.shape[4]))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        T = k.shape[2]
        if layer_idx == 0:
            self.reserve(T)
        end = self.length + T
        self.k[layer_idx, :, :, self.length:end] = k
        self.v[layer_idx, :, :, self.length:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, f"truncate({length}) of a cache holding {self.length}"
        self.length = length

    def keep_tail(self, start: int, keep_idx: torch.Tensor) -> None:
        """Keep entries start+keep_idx (sorted, [n]) of the last call, moved to follow `start`."""
        n = keep_idx.shape[0]
        src = start + keep_idx.to(self.k.device)
        for t in (self.k, self.v):
            t[:, :, :, start:start + n] = t[:, :, :, src]
        self.length = start + n

    def entries(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) for all layers: [L, B, Hkv, end-start, D]."""
        return self.k[:, :, :, start:end], self.v[:, :, :, start:end]

    def state(self) -> dict[str, torch.Tensor]:
        return {"k": self.k[:, :, :, : self.length].clone(), "v": self.v[:, :, :, : self.length].clone()}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], capacity: int) -> FullCache:
        L, B, Hkv, S, D = state["k"].shape
        cache = cls(L, B, Hkv, D, max(capacity, S), state["k"].dtype, state["k"].device)
        cache.k[:, :, :, :S] = state["k"]
        cache.v[:, :, :, :S] = state["v"]
        cache.length = S
        return cache
