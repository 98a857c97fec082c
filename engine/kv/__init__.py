"""KV caches. Every cache keeps the engine-wide layout [L, B, Hkv, S, D] and hands the model a
view whose last T entries are the tokens of the current call (see engine/attention.py)."""

from typing import Protocol

import torch

from engine.config import OutOfMemoryPlan

GROW_TOKENS = 1024  # past the planned capacity (session.py allocates it once), grow this much at a time


class KVCache(Protocol):
    """What the model (`update`, `advance`) and the levels (`truncate`, `reserve`) call."""

    length: int  # tokens held; slots past it are stale and never in a view

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this call's T new entries ([B, Hkv, T, D]) after `length`; return the view."""

    def advance(self, n_tokens: int) -> None:
        """After every layer has been updated: the T new entries now count."""

    def truncate(self, length: int) -> None:
        """Forget everything from `length` on (O(1): only the length changes)."""

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` more entries before a long write (a prefill)."""


class SlotCache:
    """K and V slots [L, B, Hkv, S_max, D] filled up to `length`: the shared mechanics of every cache.
    Only the full caches grow (`_grow`, by at least `GROW_TOKENS` slots); the others refuse."""

    grow_hint = "open the book with --offload"  # what to do when growing runs out of memory
    keys_at_positions = True  # key i of a view is the token at position i (a sliding layer's window reads it)

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, B, Hkv, S_max, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return min(self.k.shape[3], self.v.shape[3])  # they differ only after a failed growth

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if layer_idx == 0:
            self.reserve(k.shape[2])
        end = self.length + k.shape[2]  # within the capacity: reserved at layer 0
        self.k[layer_idx, :, :, self.length:end] = k
        self.v[layer_idx, :, :, self.length:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, f"truncate({length}) of a cache holding {self.length}"
        self.length = length

    def reserve(self, n_tokens: int) -> None:
        needed = self.length + n_tokens
        if needed <= self.capacity:
            return
        try:
            self._grow(max(needed, self.capacity + GROW_TOKENS))
        except torch.OutOfMemoryError as error:  # _grow left the capacity as it was
            raise OutOfMemoryPlan(f"The chat outgrew the memory planned for this book ({self.capacity:,} tokens): "
                                  f"start a new chat, or {self.grow_hint}.") from error

    def _grow(self, capacity: int) -> None:
        """Reallocate for `capacity` slots keeping the first `length` entries (OutOfMemoryError
        leaves the cache as it was)."""
        raise AssertionError(f"{capacity} entries do not fit in a cache of {self.capacity} slots")

    def entries(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) for all layers: [L, B, Hkv, end-start, D]."""
        return self.k[:, :, :, start:end], self.v[:, :, :, start:end]

    def state(self) -> dict[str, torch.Tensor]:
        """{"k", "v"} of [L, B, Hkv, S, D] in host memory, copied a layer at a time: the device
        never holds a second copy of the cache (a snapshot of a long book would not fit)."""
        state = {}
        for name, t in (("k", self.k), ("v", self.v)):  # [L, B, Hkv, S_max, D]
            state[name] = torch.empty(t.shape[:3] + (self.length, t.shape[4]), dtype=t.dtype)
            for layer_idx in range(t.shape[0]):
                state[name][layer_idx] = t[layer_idx, :, :, :self.length]
        return state


class StaticSlots:
    """A SlotCache seen by a static-shape step (engine/graphs.py): this call's entries go to the
    slots in `slot_idx` (a device tensor, read by a captured graph at replay), the view is the whole
    capacity (the step's key mask hides the rest), and the caller advances the length (outside a graph)."""

    def __init__(self, cache: SlotCache, slot_idx: torch.Tensor):  # slot_idx: [T] long
        self.cache, self.slot_idx = cache, slot_idx
        self.keys_at_positions = cache.keys_at_positions

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        self.cache.k[layer_idx].index_copy_(2, self.slot_idx, k)  # [B, Hkv, S_max, D] <- [B, Hkv, T, D]
        self.cache.v[layer_idx].index_copy_(2, self.slot_idx, v)
        return self.cache.k[layer_idx], self.cache.v[layer_idx]

    def advance(self, n_tokens: int) -> None:
        pass
