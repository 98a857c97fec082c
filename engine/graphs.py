"""CUDA graphs for fixed-shape steps, wrapped from outside and off by default (STYLE.md section 5).

`graphed(step, device, use_cuda_graphs)` returns `step` itself (eager, the reference the tests
run) unless graphs are wanted and the device is CUDA; on any other device it says once in the log
that it runs eager. On CUDA, `CudaGraphStep` captures `step` once per signature of its tensor
arguments (shapes, dtypes) into static input buffers, then replays it: new inputs are copied in,
the static outputs come back (valid until the next call).
A step qualifies only if every tensor it reads that changes between calls is an argument and
its Python side effects do not depend on the call: the drafter and retrieval-level forwards of
today's caches do not qualify yet (their KV views grow every step), so the engine records the
switch but routes nothing through it; see README "Running on GPUs". Never run on a GPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


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
    """`step(*tensors) -> tensor` captured per input signature and replayed (CUDA only)."""

    def __init__(self, step: Callable[..., torch.Tensor], max_graphs: int = 16):
        self.step, self.max_graphs = step, max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by every captured graph

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        key = tuple((t.shape, t.dtype) for t in inputs)
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:  # too many shapes: this call runs eager
                return self.step(*inputs)
            self.graphs[key] = self._capture(inputs)
        graph, static_inputs, static_output = self.graphs[key]
        for buffer, t in zip(static_inputs, inputs):
            buffer.copy_(t)
        graph.replay()
        return static_output

    def _capture(self, inputs):
        static_inputs = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (cuBLAS handles, autotuning)
            self.step(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_output = self.step(*static_inputs)
        self.pool = graph.pool()
        return graph, static_inputs, static_output


def graphed(step: Callable[..., torch.Tensor], device: torch.device, use_cuda_graphs: bool):
    """`step` captured as CUDA graphs when wanted and possible, else `step` itself (eager)."""
    return CudaGraphStep(step) if graphs_available(device, use_cuda_graphs) else step
