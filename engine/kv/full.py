"""The full KV cache: every token of the document and the chat, at its absolute position.

Appending writes after `length`; rejection is `truncate` (O(1)); a verified token-tree keeps its
accepted path with `keep_tail`. Capacity grows by reallocation, so one cache serves a whole chat.
It does not know about retrieval or offloading (engine/kv/retrieval.py, engine/kv/offload.py).
"""

from __future__ import annotations

import torch

from engine.config import OutOfMemoryPlan
from engine.kv import SlotCache

GROW_TOKENS = 1024  # past the planned capacity (session.py allocates it once), grow this much at a time


class FullCache(SlotCache):

    @property
    def capacity(self) -> int:
        return min(self.k.shape[3], self.v.shape[3])  # they differ only after a failed growth

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` more entries. The engine allocates the planned capacity once
        (document + chat room); past it the cache grows `GROW_TOKENS` at a time, K then V, so
        the peak is the cache plus one new K (or V), and running out of memory says what to do."""
        needed = self.length + n_tokens
        if needed <= self.capacity:
            return
        new_capacity = max(needed, self.capacity + GROW_TOKENS)
        try:
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[:3] + (new_capacity, old.shape[4]))
                new[:, :, :, : self.length] = old[:, :, :, : self.length]
                setattr(self, name, new)
                del old, new
        except torch.OutOfMemoryError as error:
            raise OutOfMemoryPlan(f"The chat outgrew the memory planned for this book ({self.capacity:,} tokens): "
                                  "start a new chat, or open the book with --offload.") from error

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if layer_idx == 0:
            self.reserve(k.shape[2])
        return super().update(layer_idx, k, v)

    def entries(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) for all layers: [L, B, Hkv, end-start, D]."""
        return self.k[:, :, :, start:end], self.v[:, :, :, start:end]

    def state(self) -> dict[str, torch.Tensor]:
        """{"k", "v"} of [L, B, Hkv, S, D] in host memory, copied a layer at a time: the device
        never holds a second copy of the cache (a snapshot of a long book would not fit)."""
        return {name: _host_copy(getattr(self, name), self.length) for name in ("k", "v")}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], capacity: int,
                   device: torch.device | None = None) -> FullCache:
        """The cache on `device` (default: the state's) from a `state` that may be in host memory
        (memory-mapped from a snapshot file): copied a layer at a time."""
        L, B, Hkv, S, D = state["k"].shape
        cache = cls(L, B, Hkv, D, max(capacity, S), state["k"].dtype, device or state["k"].device)
        for layer_idx in range(L):
            cache.k[layer_idx, :, :, :S] = state["k"][layer_idx]
            cache.v[layer_idx, :, :, :S] = state["v"][layer_idx]
        cache.length = S
        return cache


def _host_copy(t: torch.Tensor, length: int) -> torch.Tensor:
    """t[:, :, :, :length] ([L, B, Hkv, S_max, D]) in host memory, one layer at a time."""
    out = torch.empty(t.shape[:3] + (length, t.shape[4]), dtype=t.dtype)
    for layer_idx in range(t.shape[0]):
        out[layer_idx] = t[layer_idx, :, :, :length]
    return out
