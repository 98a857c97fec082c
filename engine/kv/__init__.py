"""KV caches. Every cache keeps the engine-wide layout [L, B, Hkv, S, D] and hands the model a
view whose last T entries are the tokens of the current call (see engine/attention.py)."""

from typing import Protocol

import torch


class KVCache(Protocol):
    length: int  # tokens held; slots past it are stale and never in a view

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this call's T new entries ([B, Hkv, T, D]) after `length`; return the view."""

    def advance(self, n_tokens: int) -> None:
        """After every layer has been updated: the T new entries now count."""

    def truncate(self, length: int) -> None:
        """Forget everything from `length` on (O(1): only the length changes)."""
