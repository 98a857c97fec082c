"""The full KV cache: every token of the document and the chat, at its absolute position.

Appending writes after `length`; rejection is `truncate` (O(1)); a verified token-tree keeps its
accepted path with `keep_tail`. Capacity grows by reallocation, so one cache serves a whole chat.
It does not know about retrieval or offloading (engine/kv/retrieval.py, engine/kv/offload.py).
"""

from __future__ import annotations

import torch

from engine.kv import SlotCache


class FullCache(SlotCache):

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
        if layer_idx == 0:
            self.reserve(k.shape[2])
        return super().update(layer_idx, k, v)

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
