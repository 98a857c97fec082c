"""The full KV cache: every token of the document and the chat, at its absolute position.

SlotCache's appending and O(1) `truncate`, plus growth by reallocation, so one cache
serves a whole chat. Retrieval and offloading are engine/kv/retrieval.py's and engine/kv/offload.py's.
"""

from __future__ import annotations

import torch

from engine.kv import SlotCache


class FullCache(SlotCache):
    def _grow(self, capacity: int) -> None:
        """K then V, so the peak is the cache plus one new K (or V)."""
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:3] + (capacity, old.shape[4]))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)
            del old, new

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], capacity: int, device: torch.device) -> FullCache:
        """The cache on `device` from a `SlotCache.state` (may be memory-mapped), a layer at a time."""
        L, B, Hkv, S, D = state["k"].shape
        cache = cls(L, B, Hkv, D, max(capacity, S), state["k"].dtype, device)
        for layer_idx in range(L):
            cache.k[layer_idx, :, :, :S] = state["k"][layer_idx]
            cache.v[layer_idx, :, :, :S] = state["v"][layer_idx]
        cache.length = S
        return cache
