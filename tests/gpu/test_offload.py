"""The offloaded full cache on CPU (separate "host" and "device" tensors, prefetch on): the same
views as the on-chip FullCache under every operation, the same greedy tokens through the
engine, only the filled length copied, and layer i+1's copy issued before layer i attends."""

from __future__ import annotations

import pytest
import torch

from engine.attention import sdpa_attention
from engine.config import SamplingConfig
from engine.kv.full import FullCache
from engine.kv.offload import OffloadCache
from tests.conftest import tiny_engine
from tests.engine.test_speculative import random_ids

CPU = torch.device("cpu")
L, B, HKV, D = 3, 1, 2, 4


def both(capacity: int, n_resident: int) -> tuple[FullCache, OffloadCache]:
    return (FullCache(L, B, HKV, D, capacity, torch.float64, CPU),
            OffloadCache(L, B, HKV, D, capacity, torch.float64, CPU, n_resident))


def call(caches, n_new: int, seed: int):
    """One forward's worth of updates (every layer, then advance); asserts equal views."""
    g = torch.Generator().manual_seed(seed)
    for layer_idx in range(L):
        k, v = (torch.randn(B, HKV, n_new, D, generator=g, dtype=torch.float64) for _ in "kv")
        views = [cache.update(layer_idx, k, v) for cache in caches]
        for (k_ref, v_ref), (k_off, v_off) in zip(views, views[1:]):
            assert k_off.shape == k_ref.shape == (B, HKV, caches[0].length + n_new, D)
            assert torch.equal(k_off, k_ref) and torch.equal(v_off, v_ref)
    for cache in caches:
        cache.advance(n_new)


@pytest.mark.parametrize("n_resident", [0, 1, L])
def test_offloaded_views_equal_the_full_cache_through_growth_and_truncate(n_resident):
    full, offload = both(capacity=4, n_resident=n_resident)
    call((full, offload), 6, seed=0)  # grows past the capacity of 4
    call((full, offload), 3, seed=1)
    for cache in (full, offload):
        cache.truncate(7)  # a rejected draft
    call((full, offload), 5, seed=2)  # a check of 5 of which 3 are accepted
    for cache in (full, offload):
        cache.truncate(10)
    assert offload.length == full.length == 10
    call((full, offload), 1, seed=3)
    for a, b in zip(full.entries(2, 11), offload.entries(2, 11)):
        assert torch.equal(a, b)
    assert offload.k.shape[:3] == full.k.shape[:3]  # what the retrieval cache reads
    assert torch.equal(offload.state()["v"], full.state()["v"])
    restored = OffloadCache.from_state(full.state(), 16, CPU, n_resident)
    call((full, restored), 2, seed=4)


def test_only_the_filled_length_is_copied():
    engine = tiny_engine("plain", offload_kv=True, resident_kv_layers=0)
    c = engine.target.config
    cache = engine.new_full_cache(capacity=500)
    assert isinstance(cache, OffloadCache) and cache.capacity == 500
    ids = torch.tensor([random_ids(37, 128, 0)])
    engine.target(ids, torch.arange(37), cache)  # prefill: nothing is filled yet, nothing copied
    assert cache.n_copied_bytes == 0
    engine.target(ids[:, :3], torch.arange(37, 40), cache)
    entry_bytes = c.n_kv_heads * c.head_dim * 8  # float64, one token, one layer, K or V
    assert cache.n_copied_bytes == c.n_layers * 2 * 37 * entry_bytes  # not the 500 slots
    assert cache.n_written_bytes == c.n_layers * 2 * 40 * entry_bytes  # new entries back to host


def test_next_layer_is_copied_before_this_layer_attends():
    engine = tiny_engine("plain", offload_kv=True, resident_kv_layers=0)
    cache, log = engine.new_full_cache(capacity=64), []
    engine.target(torch.tensor([random_ids(5, 128, 1)]), torch.arange(5), cache)
    copy = cache.side.copy
    cache.side.copy = lambda dst, src: (log.append("copy"), copy(dst, src))[1]
    engine.target.set_attention(lambda *args: (log.append("attend"), sdpa_attention(*args))[1])
    engine.target(torch.tensor([[1]]), torch.tensor([5]), cache)
    # tiny model: 2 layers; each copy is K then V
    assert log == ["copy", "copy", "copy", "copy", "attend", "attend"]


def test_resident_layers_are_never_copied():
    engine = tiny_engine("plain", offload_kv=True, resident_kv_layers=2)
    cache = engine.new_full_cache(capacity=64)
    engine.target(torch.tensor([random_ids(9, 128, 2)]), torch.arange(9), cache)
    engine.target(torch.tensor([[3]]), torch.tensor([9]), cache)
    assert cache.n_resident_layers == 2 and cache.n_copied_bytes == 0


def doc_with_repeats() -> list[int]:
    part = random_ids(30, 128, 7)
    return part + random_ids(20, 128, 8) + part + part[:15]  # the n-gram drafter finds matches


@pytest.mark.parametrize("levels", ["plain", "ngram>retrieval>full"])
@pytest.mark.parametrize("n_resident", [0, 1])
def test_offloaded_engine_gives_the_on_chip_tokens(levels, n_resident):
    sampling = SamplingConfig(max_new_tokens=20)
    answers = {}
    for is_offloaded in (False, True):
        engine = tiny_engine(levels, offload_kv=is_offloaded, resident_kv_layers=n_resident)
        session = engine.open(doc_with_repeats())
        assert isinstance(session.full, OffloadCache) == is_offloaded
        first = [t for e in session.ask(random_ids(4, 128, 9), sampling) for t in e.tokens]
        session.truncate(session.length - 5)  # regenerate the end of the answer
        second = [t for e in session.ask(random_ids(3, 128, 10), sampling) for t in e.tokens]
        answers[is_offloaded] = (first, second, session.tokens)
    assert answers[True] == answers[False]
    assert len(answers[True][0]) == 20


def test_the_engine_allocates_the_planned_capacity_once(monkeypatch):
    from engine import session as engine_module
    from engine.kv import GROW_TOKENS

    n_host = []
    new = OffloadCache._new
    monkeypatch.setattr(OffloadCache, "_new", lambda self, n_layers, capacity, on_host: (
        n_host.append(capacity) if on_host else None, new(self, n_layers, capacity, on_host))[1])
    engine = tiny_engine("ngram>retrieval>full", offload_kv=True, resident_kv_layers=1)
    doc = doc_with_repeats()
    session = engine.open(doc)
    for question in range(3):
        for _ in session.ask(random_ids(4, 128, question), SamplingConfig(max_new_tokens=20)):
            pass
    assert session.full.capacity == len(doc) + engine_module.CHAT_CAPACITY_TOKENS
    assert n_host == [session.full.capacity] * 2  # host K and V, once
    assert GROW_TOKENS < engine_module.CHAT_CAPACITY_TOKENS


def test_growth_never_holds_an_old_and_a_new_device_copy(monkeypatch):
    import weakref

    device_tensors, old_alive_at_new = [], []
    new = OffloadCache._new

    def tracked(self, n_layers, capacity, on_host):
        if not on_host:
            old_alive_at_new.append(sum(1 for ref, gen in device_tensors if gen == "old" and ref() is not None))
        t = new(self, n_layers, capacity, on_host)
        if not on_host:
            device_tensors.append((weakref.ref(t), generation[0]))
        return t

    monkeypatch.setattr(OffloadCache, "_new", tracked)
    generation = ["old"]
    full, offload = both(capacity=8, n_resident=1)
    call((full, offload), 6, seed=0)
    generation[0], old_alive_at_new[:] = "new", []
    call((full, offload), 5, seed=1)  # grows: 11 > 8
    assert offload.capacity >= 11 and old_alive_at_new and not any(old_alive_at_new)
    call((full, offload), 2, seed=2)  # the grown cache still equals the on-chip one


def test_pinned_blocks_are_neither_rounded_up_nor_cached(monkeypatch):
    from engine.kv import offload

    store = {"settings": "expandable_segments:True"}  # a user's own setting is kept
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: store["settings"])
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: store.update(settings=s))
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    got = offload.limit_pinned_caching.__wrapped__()
    assert got == "expandable_segments:True,pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:64"
    store["settings"] = ""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_cached_size_mb:0")  # the user's choice wins
    assert offload.limit_pinned_caching.__wrapped__() == ""


def test_a_torch_without_run_time_allocator_settings_still_offloads(monkeypatch):
    """torch 2.11 (seen on an H200) has no `_accelerator_getAllocatorSettings`: the offloaded
    cache crashed at its first allocation; now it warns and goes on with torch's own rounding."""
    from engine.kv import offload

    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert offload.limit_pinned_caching.__wrapped__() == "expandable_segments:True"


def test_a_cache_that_cannot_grow_says_what_to_do(monkeypatch):
    from engine.config import OutOfMemoryPlan

    full = FullCache(L, B, HKV, D, 4, torch.float64, CPU)
    call((full,), 3, seed=0)

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch.Tensor, "new_empty", no_memory)
    with pytest.raises(OutOfMemoryPlan, match="start a new chat"):
        full.reserve(5)
    assert full.capacity == 4 and full.length == 3


@pytest.mark.parametrize("offload_kv", [False, True])
def test_snapshots_go_through_host_memory_and_restore_the_same_answers(tmp_path, monkeypatch, offload_kv):
    """A snapshot is written from host memory and read back memory-mapped into host memory; the
    cache copies it to the device a layer at a time (a GPU never holds a second whole cache, and
    an offloaded cache is restored rather than prefilled again)."""
    from engine import session as engine_module

    engine = tiny_engine("ngram>retrieval>full", offload_kv=offload_kv, resident_kv_layers=1)
    session = engine.open(doc_with_repeats())
    session.save(tmp_path / "snap.pt")
    loads = []
    load = torch.load
    monkeypatch.setattr(engine_module.torch, "load", lambda *a, **kw: (loads.append(kw), load(*a, **kw))[1])
    want = [t for e in session.ask(random_ids(4, 128, 9), SamplingConfig(max_new_tokens=16)) for t in e.tokens]
    restored = engine.restore(tmp_path / "snap.pt")
    assert loads == [dict(map_location="cpu", mmap=True, weights_only=True)]
    assert isinstance(restored.full, OffloadCache) == offload_kv and engine.n_prefills == 1
    got = [t for e in restored.ask(random_ids(4, 128, 9), SamplingConfig(max_new_tokens=16)) for t in e.tokens]
    assert got == want and len(got) == 16
    assert all(t.device.type == "cpu" for t in session.full.state().values())


def test_offloaded_prefill_with_flash_attn_runs_in_large_chunks():
    """Each offloaded prefill forward copies every offloaded layer's filled prefix to the device:
    with flash-attn (no [T, S] masks to plan) the prefill runs in chunks of 8192 tokens."""
    from engine.attention import flash_attention
    from engine.session import OFFLOAD_PREFILL_CHUNK_TOKENS

    engine = tiny_engine("plain", offload_kv=True, resident_kv_layers=0)  # chunks of 7 tokens
    doc = random_ids(300, 128, 4)
    small_chunks = engine.open(doc)
    engine.attend = flash_attention  # as picked on CUDA with flash-attn (the layers keep SDPA here)
    assert engine.prefill_chunk_tokens == OFFLOAD_PREFILL_CHUNK_TOKENS
    large_chunks = engine.open(doc)
    assert large_chunks.full.n_copied_bytes == 0 < small_chunks.full.n_copied_bytes  # 1 forward: nothing filled
    for a, b in zip(small_chunks.full.entries(0, 300), large_chunks.full.entries(0, 300)):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("offload_kv", [False, True])
def test_a_gpu_that_cannot_hold_the_book_refuses_before_allocating(monkeypatch, offload_kv):
    """On a GPU the full cache is planned before it is allocated, on chip or offloaded: a document
    that does not fit is refused with the largest length that does, not a CUDA out-of-memory
    error mid-prefill. (The device is only named: nothing is allocated on it.)"""
    from engine import session as engine_module
    from engine.config import OutOfMemoryPlan

    engine = tiny_engine("plain", offload_kv=offload_kv)
    free = {"cuda": 6_000_000, "cpu": 1 << 40}  # 4,096 tokens (document + chat room) do not fit
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: free[torch.device(device).type])
    engine.device = torch.device("cuda")
    # the tiny engine's retrieval settings (4-token chunks) size the planned rebuild; its 16 KiB
    # of scoring queries are counted too (16 tokens of KV), its logits only for the rows asked for
    with pytest.raises(OutOfMemoryPlan, match="largest length that fits is 2,250 tokens"):
        engine.open(random_ids(3000, 128, 1))


def test_an_offloaded_cache_that_cannot_grow_stays_usable(monkeypatch):
    from engine.config import OutOfMemoryPlan

    full, offload = both(capacity=8, n_resident=1)
    call((full, offload), 6, seed=0)
    new = OffloadCache._new

    def no_room_on_the_device(self, n_layers, capacity, on_host):
        if not on_host and capacity > 8:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return new(self, n_layers, capacity, on_host)

    monkeypatch.setattr(OffloadCache, "_new", no_room_on_the_device)
    with pytest.raises(OutOfMemoryPlan, match="start a new chat"):
        offload.reserve(5)
    assert offload.capacity == 8
    full.truncate(6)
    call((full, offload), 2, seed=1)  # still the on-chip cache's views


def test_an_offloaded_cache_whose_host_copy_cannot_grow_stays_usable(monkeypatch):
    """Host memory runs out between K's and V's larger copies: the device copies (already
    reallocated) get their entries back, and the capacity stays what both copies hold."""
    from engine.config import OutOfMemoryPlan

    full, offload = both(capacity=8, n_resident=1)
    call((full, offload), 6, seed=0)
    new, n_host_calls = OffloadCache._new, []

    def no_room_for_a_second_host_copy(self, n_layers, capacity, on_host):
        if on_host and capacity > 8:
            n_host_calls.append(capacity)
            if len(n_host_calls) == 2:
                raise torch.OutOfMemoryError("out of pinned memory")
        return new(self, n_layers, capacity, on_host)

    monkeypatch.setattr(OffloadCache, "_new", no_room_for_a_second_host_copy)
    with pytest.raises(OutOfMemoryPlan, match="start a new chat"):
        offload.reserve(5)
    assert offload.capacity == 8 and offload.length == 6
    full.truncate(6)
    call((full, offload), 2, seed=1)  # still the on-chip cache's views, resident layer included


def test_refused_pinned_memory_falls_back_to_pageable_and_says_so(monkeypatch):
    """Issue 54 row 8: where the system refuses pinned host memory (WSL2 caps it far below a
    book's KV cache), the offloaded cache takes pageable memory, answers the same tokens, and
    the metrics say so. The refusal is simulated: torch.empty(pin_memory=True) raises."""
    from engine.kv import offload

    real_empty, n_refused = torch.empty, [0]

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            n_refused[0] += 1
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    sampling = SamplingConfig(max_new_tokens=16)
    on_chip = tiny_engine("ngram>retrieval>full").open(doc_with_repeats())
    want = [t for e in on_chip.ask(random_ids(4, 128, 4), sampling) for t in e.tokens]
    monkeypatch.setattr(offload, "wants_pinned_memory", lambda device: True)  # as on CUDA
    monkeypatch.setattr(offload, "limit_pinned_caching", lambda: "")
    monkeypatch.setattr(offload.torch, "empty", empty)
    engine = tiny_engine("ngram>retrieval>full", offload_kv=True, resident_kv_layers=1)
    session = engine.open(doc_with_repeats())
    events = list(session.ask(random_ids(4, 128, 4), sampling))
    assert n_refused[0] == 1 and session.full.host_memory == "pageable" and not session.full.is_pinned
    assert [t for e in events for t in e.tokens] == want
    assert events[-1].stats.kv_host_memory == "pageable"


def test_an_offloaded_engine_drafts_longer():
    """Issue 54, the offloaded case's defaults: a top step waits on PCIe, so the adaptive draft
    lengths may grow to offload_max_gamma (TriForce's 16) instead of max_gamma."""
    on_chip, offloaded = tiny_engine("ngram>retrieval>full"), tiny_engine("ngram>retrieval>full", offload_kv=True)
    assert on_chip.config.gamma_limit == on_chip.config.max_gamma == 8
    assert offloaded.config.gamma_limit == offloaded.config.offload_max_gamma == 16
    session = offloaded.open(doc_with_repeats())
    assert session.stack.tuner.max_gamma == 16 and on_chip.open(doc_with_repeats()).stack.tuner.max_gamma == 8
