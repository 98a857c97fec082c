"""StreamingLLM cache: `sink` first tokens + a window of recent tokens, positions renumbered.

Used by the bottom level (a small draft model, or the target itself for self-speculation,
docs/ALGORITHM.md section 5). Keys are stored rotated at their in-cache position; when the window
slides by n, the kept keys are rotated back by n (RoPE composes: R(p - n) = R(-n) R(p)), so the
drafter always runs at positions < sink + window, within its trained length. Evicting happens in
`make_room`, before the new tokens' positions are chosen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kv import SlotCache


class StreamingCache(SlotCache):
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int,
                 sink_tokens: int, window_tokens: int, max_new_tokens: int,
                 rotate: Callable[[torch.Tensor, int], torch.Tensor], dtype: torch.dtype, device: torch.device):
        capacity = sink_tokens + window_tokens + max_new_tokens
        super().__init__(n_layers, batch, n_kv_heads, head_dim, capacity, dtype, device)
        self.sink_tokens, self.window_tokens = sink_tokens, window_tokens
        self.max_new_tokens = max_new_tokens
        self.rotate = rotate  # rotate(k [L, B, Hkv, n, D], delta) -> k rotated by `delta` positions

    def make_room(self, n_tokens: int) -> None:
        """Make `n_tokens` fit; when full, evict the oldest window entries down to sink + window.
        Evicting in bulk keeps re-rotation rare, and never happens between `make_room` and the
        `truncate` that rolls back a draft, so the drafter's lengths stay valid."""
        assert n_tokens <= self.max_new_tokens, f"{n_tokens} new tokens > {self.max_new_tokens}"
        if self.length + n_tokens <= self.k.shape[3]:
            return
        s, n_evict = self.sink_tokens, self.length - self.sink_tokens - self.window_tokens
        kept = slice(s + n_evict, self.length)
        self.k[:, :, :, s:self.length - n_evict] = self.rotate(self.k[:, :, :, kept], -n_evict)
        self.v[:, :, :, s:self.length - n_evict] = self.v[:, :, :, kept].clone()
        self.length -= n_evict
