"""CUDA graphs for the one-token steps over fixed-capacity caches, off by default (docs/STYLE.md 5).

`StaticDecodeStep` is a one-token forward whose shapes never change (the model drafter's steps, the
middle level's single-token chains): token, position and slot arrive as device tensors and attention
runs over the whole capacity with a [1, S_max] key mask. `CudaGraphStep` captures it once and replays
it; elsewhere the eager `Forward` path runs, the reference for the uncaptured static step.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import torch

from engine.kv import SlotCache, StaticSlots
from engine.model import Segment, Transformer

log = logging.getLogger(__name__)

# Tests set this to build the static steps on any device and run them uncaptured: the exact
# check of the code CUDA captures (as nanochat's flash-attention override).
force_static_steps = False
CAPTURE_LOCK = threading.Lock()  # a capture synchronises the device: one at a time in the process


@functools.cache
def _say_eager(device_type: str) -> None:
    log.warning("CUDA graphs need a CUDA device, this one is %s: running eager (exact, slower "
                "launches)", device_type)


def graphs_available(device: torch.device, use_cuda_graphs: bool) -> bool:
    """Whether steps on `device` will be captured; logs the eager fallback once per device type."""
    if use_cuda_graphs and device.type != "cuda":
        _say_eager(device.type)
    return use_cuda_graphs and device.type == "cuda"


class CudaGraphStep:
    """`step(*inputs) -> tensor` captured once, at construction, and replayed (CUDA only). Calls
    pass tensors of `inputs`' shapes and dtypes; the step reads everything that changes from them,
    and its Python side effects must not depend on the call: a replay runs no Python."""

    def __init__(self, step: Callable[..., torch.Tensor], device: torch.device, *inputs: torch.Tensor):
        self.device = device
        # streams, capture and replay belong to the current device: make it the step's (cuda:1
        # under cuda:0 as current would capture on the wrong device and replay stale outputs)
        with torch.cuda.device(device), CAPTURE_LOCK:
            self.inputs = [t.clone() for t in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph (cuBLAS handles, autotuning)
                step(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: other threads may serve other readers' eager forwards meanwhile
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.output = step(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(self.device):
            for buffer, t in zip(self.inputs, inputs):
                buffer.copy_(t)
            self.graph.replay()
            return self.output.clone()  # the static buffer is overwritten by the next replay


class StaticDecodeStep:
    """`step(token, pos) -> logits [1, 1, V]` of `model` over `cache`, at slot `cache.length`. The
    cache's buffers must never be reallocated (a graph holds their addresses): true of the
    streaming and retrieval caches, whose capacity is fixed at construction."""

    def __init__(self, model: Transformer, cache: SlotCache, is_captured: bool):
        self.model, self.cache = model, cache
        for t in (cache.k, cache.v):  # never-written slots may hold NaN, which a masked key's
            t[:, :, :, cache.length:].zero_()  # weight 0 does not cancel (0 * NaN); stale ones are finite
        self.step = self.forward
        if is_captured:  # now, with the stack: the cache's next slot takes the warm-up's K/V (stale, never read)
            self.step = CudaGraphStep(self.forward, cache.k.device, *self._inputs(0, cache.length))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor:
        """ids: [1, 1]; pos: [1] absolute (RoPE); slot_idx: [1], the cache's length."""
        capacity = self.cache.k.shape[3]
        key_mask = (torch.arange(capacity, device=slot_idx.device) <= slot_idx)[None]  # [T=1, S_max]
        segment = Segment(ids, pos, StaticSlots(self.cache, slot_idx), key_mask=key_mask)
        return self.model.forward_packed([segment])[0]

    def __call__(self, token: int, pos: int) -> torch.Tensor:  # [1, 1, V]
        c = self.cache
        assert c.length < c.k.shape[3], f"no free slot: {c.length} of {c.k.shape[3]} used"
        logits = self.step(*self._inputs(token, pos))
        c.advance(1)
        return logits

    def _inputs(self, token: int, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [1, 1], pos [1], slot [1] (the cache's length), in one host->device copy."""
        inputs = torch.tensor([token, pos, self.cache.length], device=self.cache.k.device)
        return inputs[:1].view(1, 1), inputs[1:2], inputs[2:]


def static_decode_step(model: Transformer, cache: SlotCache, use_cuda_graphs: bool) -> StaticDecodeStep | None:
    """The captured one-token step over `cache` when CUDA graphs are on and possible, else None
    (the caller keeps its eager `Forward` path). Dynamic RoPE picks its frequencies on the host
    from the positions (a device sync, which a capture forbids), so it stays eager."""
    is_dynamic_rope = "dynamic" in str(model.model.rotary_emb.rope_type)
    if graphs_available(cache.k.device, use_cuda_graphs) and not is_dynamic_rope:
        return StaticDecodeStep(model, cache, is_captured=True)
    return StaticDecodeStep(model, cache, is_captured=False) if force_static_steps else None
