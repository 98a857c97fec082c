"""The caches against brute-force oracles: retrieval selection = brute-force top-k of chunk
scores, accepted tokens appended exactly, eviction of the lowest chunk; StreamingLLM window
positions renumbered by re-rotation; O(1) rollback."""

from __future__ import annotations

import math

import torch

from engine.kv.full import FullCache
from engine.kv.retrieval import RetrievalCache, score_chunks
from engine.kv.streaming import StreamingCache
from tests.conftest import ours, tiny_hf

L, B, HKV, D = 2, 1, 2, 8


def filled_full(n: int, seed: int = 0) -> FullCache:
    g = torch.Generator().manual_seed(seed)
    full = FullCache(L, B, HKV, D, n + 8, torch.float64, torch.device("cpu"))
    full.k.zero_()  # the spare room is uninitialized memory, which may hold NaNs
    full.v.zero_()
    full.k[:, :, :, :n] = torch.randn(L, B, HKV, n, D, generator=g, dtype=torch.float64)
    full.v[:, :, :, :n] = torch.randn(L, B, HKV, n, D, generator=g, dtype=torch.float64)
    full.length = n
    return full


def test_score_chunks_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 4, 3, D, generator=g, dtype=torch.float64)  # 4 query heads share 2 KV heads
    k = torch.randn(B, HKV, 20, D, generator=g, dtype=torch.float64)  # 5 chunks of 4
    got = score_chunks(q, k, 4)
    for h in range(HKV):
        means = [k[0, h, c * 4:(c + 1) * 4].mean(0) for c in range(5)]
        want = torch.zeros(5, dtype=torch.float64)
        for qh in (2 * h, 2 * h + 1):  # the query heads of KV head h (HF layout)
            for m in range(3):
                logits = torch.stack([q[0, qh, m] @ mu for mu in means]) / math.sqrt(D)
                want += logits.softmax(0)
        assert torch.allclose(got[0, h], want)


def test_retrieval_selects_brute_force_top_chunks_with_sinks_and_window():
    full = filled_full(103)
    queries = [torch.randn(B, 4, 3, D, dtype=torch.float64) for _ in range(L)]
    cache = RetrievalCache(L, B, HKV, D, budget_tokens=40, sink_tokens=4, window_tokens=10,
                           chunk_tokens=4, scratch_tokens=8, dtype=torch.float64, device=torch.device("cpu"))
    cache.build(full, queries)
    # chunks cover [4, 4 + 22*4 = 92); the window is [92, 103) (11 tokens: the partial chunk joins it)
    assert cache.n_chunks == (40 - 4 - 11) // 4 == 6 and cache.committed == 4 + 24 + 11
    for layer in range(L):
        scores = score_chunks(queries[layer], full.k[layer, :, :, 4:92], 4)
        for h in range(HKV):
            want = sorted((4 + 4 * scores[0, h].topk(6).indices).tolist())
            assert sorted(cache.chunk_starts[layer, 0, h].tolist()) == want
            positions = list(range(4)) + [s + i for s in cache.chunk_starts[layer, 0, h].tolist()
                                          for i in range(4)] + list(range(92, 103))
            assert torch.equal(cache.k[layer, 0, h, :cache.committed], full.k[layer, 0, h, positions])
            assert torch.equal(cache.v[layer, 0, h, :cache.committed], full.v[layer, 0, h, positions])


def test_retrieval_appends_accepted_tokens_and_evicts_the_lowest_chunk():
    full = filled_full(100)
    cache = RetrievalCache(L, B, HKV, D, 40, 4, 10, 4, 8, torch.float64, torch.device("cpu"))
    full.length = 60
    cache.build(full, [torch.randn(B, 4, 3, D, dtype=torch.float64) for _ in range(L)])
    lowest = cache.chunk_starts[..., -1].clone()
    n_chunks, committed = cache.n_chunks, cache.committed
    full.length = 63
    cache.append(full, 60, 63)  # 3 new tokens overflow the budget by 2: one chunk goes
    assert cache.n_chunks == n_chunks - 1 and cache.committed == committed + 3 - 4
    assert not (cache.chunk_starts == lowest[..., None]).any()
    assert torch.equal(cache.k[:, :, :, cache.committed - 3:cache.committed], full.k[:, :, :, 60:63])


def test_retrieval_holds_everything_when_the_document_fits():
    full = filled_full(30)
    cache = RetrievalCache(L, B, HKV, D, 64, 4, 10, 4, 8, torch.float64, torch.device("cpu"))
    cache.build(full, None)
    assert cache.committed == 30 and torch.equal(cache.k[:, :, :, :30], full.k[:, :, :, :30])


def test_full_cache_truncate_is_o1():
    full = filled_full(10)
    before = full.k.clone()
    full.truncate(7)
    assert full.length == 7 and torch.equal(full.k, before)  # nothing copied


def test_full_cache_grows_and_keeps_its_content():
    full = filled_full(10)
    before = full.k[:, :, :, :10].clone()
    full.reserve(100)
    assert full.capacity >= 110 and torch.equal(full.k[:, :, :, :10], before)


def test_streaming_cache_renumbers_positions_by_rerotation():
    """After the window slides, cached keys equal keys computed directly at the new positions."""
    model = ours(tiny_hf("llama"))
    c = model.config
    cache = StreamingCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, sink_tokens=2, window_tokens=5,
                           max_new_tokens=3, rotate=model.rotate, dtype=torch.float64, device=torch.device("cpu"))
    ids = torch.randint(0, 128, (1, 12))
    for i in range(0, 12, 3):
        cache.make_room(3)
        model(ids[:, i:i + 3], torch.arange(cache.length, cache.length + 3), cache)
    # sinks = tokens 0, 1; window = the newest tokens; all at positions 0..length-1
    assert cache.length <= 2 + 5 + 3
    x = model.model.embed_tokens(ids)
    layer0 = model.model.layers[0]
    kept = [0, 1] + list(range(12 - (cache.length - 2), 12))
    h = layer0.input_layernorm(x[:, kept])
    k = layer0.self_attn.k_proj(h).view(1, len(kept), c.n_kv_heads, c.head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(k, torch.arange(len(kept))[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.allclose(cache.k[0, :, :, :cache.length], k_rot, atol=1e-10)


def test_chunk_means_are_read_a_slice_at_a_time(monkeypatch):
    from engine.kv import retrieval

    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, 4, 3, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, 22, D, generator=g, dtype=torch.float64)  # 5 chunks of 4, 2 keys over
    whole = score_chunks(q, k, 4)
    copied = []
    to = torch.Tensor.to
    monkeypatch.setattr(retrieval, "MEAN_SLICE_TOKENS", 8)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: (copied.append(t.shape[2]), to(t, *a, **kw))[1])
    assert torch.equal(score_chunks(q, k, 4), whole)
    assert max(copied) == 8  # never the whole region
