"""The compiled CPU kernels release the GIL while they compute (engine/csrc `nogil`), so the app's
threads (Gradio's queue, the UI's redraws) run beside a decoding step instead of waiting for it.

A kernel call of a few hundred milliseconds runs in a thread while this thread counts, waking every
millisecond (`Event.wait` lets the GIL go and takes it back). While a call keeps the GIL, this
thread cannot take it back, so it counts at most once or twice (when the call returns, before the
caller reads the count); a call that lets it go is counted through. The control is a C call known
to keep the GIL (sorting a list of floats).
"""

from __future__ import annotations

import threading

import pytest
import torch
from gguf import GGMLQuantizationType

from engine.attention import cpu_kernel
from engine.quant import cpu_quant_kernel
from tests.engine.test_quant import random_blocks


def counted_during(call) -> int:
    """How many times this thread woke while `call()` ran in another thread."""
    count, during, done = [0], [], threading.Event()

    def worker():
        start = count[0]
        call()
        during.append(count[0] - start)
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    while not done.wait(0.001):
        count[0] += 1
    thread.join()
    return during[0]


def test_a_call_that_keeps_the_gil_stops_the_count():
    values = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0)).tolist()
    assert counted_during(lambda: sorted(values)) <= 2


def test_the_gguf_linear_kernel_lets_python_run_beside_it():
    kernel = cpu_quant_kernel()
    if kernel is None:
        pytest.skip("the GGUF kernel cannot build here")
    blocks = torch.from_numpy(random_blocks("Q8_0", 4096, 4096))
    x = torch.randn(64, 4096)
    assert counted_during(lambda: kernel.quant_linear(x, blocks, int(GGMLQuantizationType.Q8_0))) > 2


def test_the_attention_kernel_lets_python_run_beside_it():
    kernel = cpu_kernel()
    if kernel is None:
        pytest.skip("the attention kernel cannot build here")
    q = torch.randn(1, 2, 7, 128)
    k, v = torch.randn(1, 2, 200_000, 128), torch.randn(1, 2, 200_000, 128)
    assert counted_during(lambda: kernel.few_row_attention(q, k, v)) > 2
