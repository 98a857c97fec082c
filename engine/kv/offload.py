"""The full KV cache offloaded to host memory (docs/ALGORITHM.md section 8, "Offloaded").

Host memory is pinned on CUDA, so copies are asynchronous (pageable where the system refuses that
much, as WSL2 does). New entries go to the device copy and back to the host copy, which the
retrieval cache and snapshots read. On CPU a side stream that copies inline runs the same code, so
the tests exercise every copy. Storage is token-major, [L, S_max, B, Hkv, D]: a layer's filled
prefix is one contiguous block.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.kv import SlotCache

log = logging.getLogger(__name__)
PINNED_CACHE_MB = 64  # pinned blocks above this are allocated exactly and freed at once (below)


@functools.cache
def limit_pinned_caching() -> str:
    """Make pinned blocks above `PINNED_CACHE_MB` exact and uncached (torch rounds each up to a power
    of two and keeps freed ones for reuse), unless the user set `pinned_max_*` in PYTORCH_ALLOC_CONF.
    Returns the allocator settings now."""
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):  # torch before 2.13: env only
        log.warning("this torch cannot limit pinned-memory rounding at run time: a host cache may take up "
                    "to twice its size unless PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:%d is set "
                    "before start (torch>=2.13 does this itself)", PINNED_CACHE_MB)
        return os.environ.get("PYTORCH_ALLOC_CONF", "")
    current = torch._C._accelerator_getAllocatorSettings()
    user = current + os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_max" not in user:
        ours = f"pinned_max_round_threshold_mb:{PINNED_CACHE_MB},pinned_max_cached_size_mb:{PINNED_CACHE_MB}"
        try:
            torch._C._accelerator_setAllocatorSettings(f"{current},{ours}" if current else ours)
        except RuntimeError as error:  # never run on a GPU: a refusal must not stop the offload
            log.warning("could not limit pinned-memory rounding (%s): set PYTORCH_ALLOC_CONF=%s", error, ours)
    return torch._C._accelerator_getAllocatorSettings()


def wants_pinned_memory(device: torch.device) -> bool:
    """Host blocks are pinned for a CUDA device (copies overlap compute); on CPU there is no copy to overlap."""
    return device.type == "cuda"


class SideStream:
    """Host->device copies on a CUDA side stream; on CPU a stand-in that copies at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy after the compute stream's work queued so far; returns what `wait` needs."""
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # dst's last reader is done
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, done) -> None:
        """Make the compute stream wait for a copy before it reads the destination."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def sync_host(self) -> None:
        """Block until device->host write-backs queued on the compute stream have landed."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).synchronize()


def to_heads(t: torch.Tensor) -> torch.Tensor:
    """Token-major [..., S, B, Hkv, D] -> the engine-wide layout [..., B, Hkv, S, D] (a view)."""
    return t.movedim(-4, -2)


class OffloadCache(SlotCache):
    """SlotCache's length, truncate, growth, entries and state over the host copy
    (`k`, `v`), plus the device copies and the streaming (see the module doc)."""

    grow_hint = "open the book with fewer resident layers"

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, n_resident_layers: int = 0):
        # no SlotCache.__init__: its device-sized K and V are what this cache keeps off the device
        assert 0 <= n_resident_layers <= n_layers, f"{n_resident_layers} resident of {n_layers} layers"
        self.n_layers, self.n_resident_layers, self.device = n_layers, n_resident_layers, device
        self.entry_shape = (batch, n_kv_heads, head_dim)
        self.dtype, self.is_pinned = dtype, wants_pinned_memory(device)
        self.side = SideStream(device)
        self.length = 0
        self.n_copied_bytes = 0  # host->device, for tests and benchmarks
        self.n_written_bytes = 0  # device->host write-backs of new entries
        if self.is_pinned:
            limit_pinned_caching()
        self.host_k, self.host_v = self._new(n_layers, capacity, True), self._new(n_layers, capacity, True)
        self._allocate_device(capacity)

    @property
    def host_memory(self) -> str:
        """"pinned" (asynchronous copies) or "pageable" (on CPU, or pinning was refused)."""
        return "pinned" if self.is_pinned else "pageable"

    def _new(self, n_layers: int, capacity: int, on_host: bool) -> torch.Tensor:
        shape = (n_layers, capacity, *self.entry_shape)  # [L, S_max, B, Hkv, D]
        if on_host and self.is_pinned:
            try:
                return torch.empty(shape, dtype=self.dtype, pin_memory=True)
            except RuntimeError as error:  # cudaHostAlloc refused (WSL2 caps pinned memory)
                log.warning("pinned host memory for the offloaded KV cache was refused (%s): using pageable "
                            "memory, whose copies wait for the host", error)
                self.is_pinned = False  # every later block too: write-backs then copy synchronously
        return torch.empty(shape, dtype=self.dtype, device="cpu" if on_host else self.device)

    def _allocate_device(self, capacity: int) -> None:
        """Device K/V of the resident layers (filled from the host copy) and the two-layer buffer."""
        self.resident_k = self._new(self.n_resident_layers, capacity, False)
        self.resident_v = self._new(self.n_resident_layers, capacity, False)
        self._refill_resident(self.length)
        n_buffers = min(2, self.n_layers - self.n_resident_layers)
        self.buffer_k, self.buffer_v = self._new(n_buffers, capacity, False), self._new(n_buffers, capacity, False)
        self.pending: dict[int, object] = {}  # layer -> the end of its in-flight copies into its buffer slot

    @property
    def capacity(self) -> int:
        return min(self.host_k.shape[1], self.host_v.shape[1])  # they differ only after a failed growth

    def _grow(self, capacity: int) -> None:
        """The device copies are dropped first and refilled from the host copy (which holds
        every layer), so the GPU never holds an old and a new cache at once."""
        n, old_capacity = self.length, self.capacity
        self.side.sync_host()
        self._forget_prefetches()
        self.resident_k = self.resident_v = self.buffer_k = self.buffer_v = None
        try:
            self._allocate_device(capacity)
        except torch.OutOfMemoryError:
            self._allocate_device(old_capacity)  # what fitted before fits again: the cache stays usable
            raise
        for name in ("host_k", "host_v"):
            old = getattr(self, name)
            new = self._new(self.n_layers, capacity, True)
            new[:, :n] = old[:, :n]
            setattr(self, name, new)
            del old, new  # freed now (pinned: uncached, see limit_pinned_caching)

    def _refill_resident(self, n: int) -> None:
        """The resident layers' first `n` entries, from the host copy (which holds every layer)."""
        for layer_idx in range(self.n_resident_layers):  # a contiguous block each
            self.resident_k[layer_idx, :n] = self.host_k[layer_idx, :n]
            self.resident_v[layer_idx, :n] = self.host_v[layer_idx, :n]

    def _prefetch(self, layer_idx: int) -> None:
        """Start copying an offloaded layer's filled entries into its half of the buffer."""
        if layer_idx >= self.n_layers or layer_idx in self.pending:
            return
        n, slot = self.length, self._slot(layer_idx)
        self.side.copy(self.buffer_k[slot, :n], self.host_k[layer_idx, :n])  # done before V's: one stream
        self.pending[layer_idx] = self.side.copy(self.buffer_v[slot, :n], self.host_v[layer_idx, :n])
        self.n_copied_bytes += 2 * self.host_k[layer_idx, :n].nbytes

    def _forget_prefetches(self) -> None:
        """Copies left over by a forward that stopped early are waited for and not trusted."""
        for done in self.pending.values():
            self.side.wait(done)
        self.pending.clear()

    def _device_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device copy of a layer ([S_max, B, Hkv, D] each), filled up to `length`."""
        if layer_idx < self.n_resident_layers:
            return self.resident_k[layer_idx], self.resident_v[layer_idx]
        self._prefetch(layer_idx)  # only the first offloaded layer of a call starts here
        self.side.wait(self.pending.pop(layer_idx))
        self._prefetch(layer_idx + 1)  # overlaps with this layer's attention and MLP
        slot = self._slot(layer_idx)
        return self.buffer_k[slot], self.buffer_v[slot]

    def _slot(self, layer_idx: int) -> int:
        return (layer_idx - self.n_resident_layers) % 2

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        assert (k.shape[0], k.shape[1], k.shape[3]) == self.entry_shape, f"KV of shape {tuple(k.shape)}"
        if layer_idx == 0:
            self._forget_prefetches()
            self.reserve(k.shape[2])
            if self.n_resident_layers > 0:
                self._prefetch(self.n_resident_layers)  # streams while the resident layers compute
        start, end = self.length, self.length + k.shape[2]
        dev_k, dev_v = self._device_layer(layer_idx)
        for dev, host, new in ((dev_k, self.host_k, k), (dev_v, self.host_v, v)):
            dev[start:end] = new.movedim(2, 0)  # [T, B, Hkv, D]
            host[layer_idx, start:end].copy_(dev[start:end], non_blocking=self.is_pinned)
            self.n_written_bytes += dev[start:end].nbytes
        return to_heads(dev_k[:end]), to_heads(dev_v[:end])

    @property
    def k(self) -> torch.Tensor:  # [L, B, Hkv, S_max, D] host view, as FullCache.k
        self.side.sync_host()
        return to_heads(self.host_k)

    @property
    def v(self) -> torch.Tensor:
        self.side.sync_host()
        return to_heads(self.host_v)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], capacity: int, device: torch.device,
                   n_resident_layers: int = 0) -> OffloadCache:
        L, B, Hkv, S, D = state["k"].shape
        cache = cls(L, B, Hkv, D, max(capacity, S), state["k"].dtype, device, n_resident_layers)
        for host, saved in ((cache.host_k, state["k"]), (cache.host_v, state["v"])):
            host[:, :S] = saved.movedim(3, 1)  # [L, S, B, Hkv, D]
        cache._refill_resident(S)
        cache.length = S
        return cache
