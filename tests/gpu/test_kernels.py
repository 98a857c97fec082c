"""Kernel switches without a GPU: flash-attn absent -> torch SDPA, said once in the log; the
flash path's own fallbacks (float32/64, wide heads) are SDPA exactly; CUDA graphs wanted on CPU
-> eager, said once; the engine's switches reach the kernels."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from engine import attention, graphs
from engine.attention import flash_attention, pick_attention, sdpa_attention
from tests.conftest import tiny_engine

CUDA = torch.device("cuda")  # only a name here: picking a kernel does not touch the device


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    attention.has_flash_attn.cache_clear()
    yield
    attention.has_flash_attn.cache_clear()


def test_without_flash_attn_cuda_falls_back_to_sdpa_and_says_so_once(no_flash_attn, caplog):
    with caplog.at_level(logging.INFO, logger="engine.attention"):
        picked = [pick_attention(CUDA), pick_attention(CUDA), pick_attention(CUDA, use_flash_attn=True)]
    assert all(p is sdpa_attention for p in picked)
    notes = [r.getMessage() for r in caplog.records if "flash-attn" in r.getMessage()]
    assert len(notes) == 1 and "torch SDPA" in notes[0] and "requirements-gpu.txt" in notes[0]


def test_flash_attn_when_importable_on_cuda_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))  # a stand-in module
    capability = {"sm": (8, 9)}  # an RTX 4090; a CPU-only torch cannot ask a GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["sm"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    attention.has_flash_attn.cache_clear()
    try:
        assert pick_attention(CUDA) is flash_attention
        assert pick_attention(CUDA, use_flash_attn=False) is sdpa_attention
        assert pick_attention(torch.device("cpu")) is sdpa_attention
        capability["sm"] = (7, 5)  # a T4: flash-attn 2 does not run there
        assert pick_attention(CUDA) is sdpa_attention
    finally:
        attention.has_flash_attn.cache_clear()


def test_flash_path_routes_what_flash_attn_cannot_run_to_sdpa_exactly():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)  # [B, H, T, D]
    k, v = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64) for _ in "kv")
    chain = torch.ones(3, 3, dtype=torch.bool).tril()
    for tail in (chain, None):
        q1 = q[:, :, :1] if tail is None else q
        assert torch.equal(flash_attention(q1, k, v, tail), sdpa_attention(q1, k, v, tail))


def test_cuda_graphs_on_cpu_run_eager_and_say_so_once(caplog):
    graphs._say_eager.cache_clear()
    with caplog.at_level(logging.INFO, logger="engine.graphs"):
        engine = tiny_engine("selfspec>full", use_cuda_graphs=True)
        drafter = engine.build_stack(engine.new_full_cache(8), None, "selfspec>full")[0].drafter
        assert not graphs.graphs_available(torch.device("cpu"), use_cuda_graphs=True)
    assert not engine.uses_cuda_graphs and drafter.decode_step is None  # the eager path, unchanged
    notes = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert len(notes) == 1 and "running eager" in notes[0]


def test_engine_switches_reach_the_kernels(no_flash_attn):
    engine = tiny_engine("plain", use_flash_attn=True, use_cpu_kernel=False)
    assert engine.target.model.layers[0].self_attn.attend is sdpa_attention  # CPU: never flash-attn
    engine = tiny_engine("plain", use_cpu_kernel=True)
    want = attention.cpu_attention if attention.cpu_kernel() is not None else sdpa_attention
    assert engine.target.model.layers[0].self_attn.attend is want


def test_flash_path_runs_fp16_and_bf16_calls_on_flash_attn_causally(monkeypatch):
    """A check's tail is causal (every drafter proposes a chain): flash-attn takes it with its
    bottom-right causal alignment; float32 and head dims over 256 go to SDPA."""
    calls = []
    fake = type(sys)("flash_attn")
    fake.flash_attn_with_kvcache = lambda q, k, v, causal: (calls.append(causal), q)[1]
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=g)
    k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in "kv")
    chain = torch.ones(3, 3, dtype=torch.bool).tril()
    flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), chain)
    assert calls == [True]
    assert torch.equal(flash_attention(q, k, v, chain), sdpa_attention(q, k, v, chain))
    q, k = torch.randn(1, 4, 3, 320, generator=g).bfloat16(), torch.randn(1, 2, 10, 320, generator=g).bfloat16()
    assert torch.equal(flash_attention(q, k, k, chain), sdpa_attention(q, k, k, chain))
    assert calls == [True]  # neither went to flash-attn


def test_a_check_is_one_causal_chain_after_the_pending_tokens():
    """The checker's forward: the pending token and the draft at consecutive positions, a causal tail,
    a logit row for each; the kernels see that tail."""
    from engine.model import QueryLog, run
    from engine.sampling import Draft
    from engine.speculative import Scorer

    engine = tiny_engine("plain")
    tails = []

    def attend(q, k, v, tail):
        tails.append(tail)
        return sdpa_attention(q, k, v, tail)

    engine.target.set_attention(attend)
    cache = engine.new_full_cache(64)
    run(engine.prefill_steps(cache, list(range(5, 25)), None))
    request = Scorer(engine.target, cache, QueryLog(2, 4))._request([6], 20, Draft([7, 8, 9]))
    segment = request.segment
    assert segment.ids.tolist() == [[6, 7, 8, 9]] and segment.pos.tolist() == [20, 21, 22, 23]
    assert segment.n_logits == 4
    tails.clear()
    logits = engine.target.forward_packed([segment])[0]
    assert logits.shape[1] == 4 and tails and all(torch.equal(t, torch.ones(4, 4).tril().bool()) for t in tails)


def test_the_gpu_install_lines_are_ones_pip_can_run():
    """Issue 54 row 5: flash-attn is an sdist whose isolated build fails ("No module named torch"),
    so `pip install -r requirements-gpu.txt` must not ask for it; the README gives the command that
    builds it against the installed torch, the same one requirements-gpu.txt names."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    lines = [line.split("#")[0].strip() for line in (root / "requirements-gpu.txt").read_text().splitlines()]
    assert not [line for line in lines if line.lower().startswith("flash")], "flash-attn in the -r install"
    assert "-r requirements.txt" in lines
    command = "pip install flash-attn==2.8.3.post2 --no-build-isolation"
    assert command in (root / "requirements-gpu.txt").read_text() and command in (root / "README.md").read_text()
