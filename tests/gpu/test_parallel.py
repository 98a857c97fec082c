"""Tensor parallel on CPU: two gloo processes (this one is rank 0, `parallel.start` spawns rank 1)
against one process: the same greedy tokens for plain decoding and the default stack, logits
within 1e-5 in float32, for Llama (tied off) and Qwen2 (q/k/v biases, tied embeddings); two
sessions answered in one batch too. Sharding itself is checked against the unsharded weights,
and its refusal when heads do not divide evenly."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engine import parallel
from engine.batch import Batcher
from engine.config import (
    BadTokens,
    Cancelled,
    EngineConfig,
    EngineError,
    HeadsNotDivisible,
    RetrievalConfig,
    SamplingConfig,
)
from engine.kv.full import FullCache
from engine.kv.offload import OffloadCache
from engine.model import run
from engine.session import Engine
from tests.conftest import ours, tiny_hf
from tests.engine.test_loading import word_tokenizer
from tests.engine.test_speculative import random_ids
from tests.gpu.test_offload import doc_with_repeats

RETRIEVAL = RetrievalConfig(budget_tokens=48, sink_tokens=4, window_tokens=16, chunk_tokens=4,
                            n_score_queries=4, rebuild_every_tokens=16)
STACKS = ("plain", "ngram>retrieval>full")


def tiny_rank_engine(family: str, gamma: int | None = None) -> Engine:
    """This process's engine: the tiny model in float32, sharded when a process group is up;
    draft lengths adaptive (timing-dependent) unless `gamma` fixes them."""
    torch.set_num_threads(1)
    model = ours(tiny_hf(family)).float()
    n_ranks = dist.get_world_size() if dist.is_initialized() else 1
    if n_ranks > 1:
        parallel.shard(model, dist.get_rank(), n_ranks)
    config = EngineConfig(target="tiny", device="cpu", dtype="float32", retrieval=RETRIEVAL,
                          prefill_chunk_tokens=16, n_gpus=n_ranks, gamma_bottom=gamma, gamma_middle=gamma)
    return Engine(config, model)


def logits_of(ranks: parallel.Ranks, ids: list[int]) -> torch.Tensor:
    """One prefill forward over `ids` on this rank (run on every rank through Leader.call)."""
    c = ranks.engine.target.config
    cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, len(ids), torch.float32, torch.device("cpu"))
    return ranks.engine.target(torch.tensor([ids]), torch.arange(len(ids)), cache)


def tokens_of_every_rank(ranks: parallel.Ranks, sid: int) -> list[list[int]]:
    tokens = [None] * dist.get_world_size()
    dist.all_gather_object(tokens, ranks.sessions[sid].tokens)
    return tokens


def conversation(engine, is_sampled: bool) -> dict:
    """Greedy answers of each stack, with a regenerate in between; then a sampled one."""
    out = {}
    session = engine.open(doc_with_repeats())
    for levels in STACKS:
        session.set_levels(levels)
        sampling = SamplingConfig(max_new_tokens=16)
        first = [t for e in session.ask(random_ids(4, 128, 4), sampling) for t in e.tokens]
        session.truncate(session.length - 6)
        second = [t for e in session.ask(random_ids(3, 128, 5), sampling) for t in e.tokens]
        out[levels] = (first, second)
    if is_sampled:  # the same coins in the same order only when the draft lengths are fixed
        sampling = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=3)
        out["sampled"] = [t for e in session.ask(random_ids(3, 128, 6), sampling) for t in e.tokens]
    out["tokens"] = session.tokens
    return out


@pytest.mark.timeout(180)  # ranks that disagree wait for each other forever: fail, do not hang
@pytest.mark.parametrize("family, gamma", [("llama", None), ("qwen2", 3)])
def test_two_gloo_ranks_match_one_process(family, gamma, tmp_path):
    ids = random_ids(40, 128, 3)
    engine = tiny_rank_engine(family, gamma)
    one, one_logits = conversation(engine, gamma is not None), logits_of(parallel.Ranks(engine), ids)
    leader = parallel.start(functools.partial(tiny_rank_engine, family, gamma), 2, torch.device("cpu"))
    try:
        assert leader.target.config.n_kv_heads == 1  # this process really is a shard
        two, two_logits = conversation(leader, gamma is not None), leader.call(logits_of, ids)
        session = leader.open(random_ids(30, 128, 7))
        events = session.ask(random_ids(3, 128, 8), SamplingConfig(max_new_tokens=50))
        next(events)
        events.close()  # the reader went away mid-answer: every rank stops at the same token
        first, second = leader.call(tokens_of_every_rank, session.sid)
        assert first == second and 30 + 3 < len(first) < 30 + 3 + 50
        doc, cancel = doc_with_repeats(), threading.Event()
        parted = leader.open(doc, n_first=16)  # a long book read in parts, stopped, read on
        with pytest.raises(Cancelled):  # rank 0's stop reaches every rank after the same chunk
            parted.read(doc[16:], on_progress=lambda done, total: cancel.set(), cancel=cancel)
        assert parted.length == 32
        parted.read(doc[32:])
        read_in_parts = [t for e in parted.ask(random_ids(4, 128, 4), SamplingConfig(max_new_tokens=16))
                         for t in e.tokens]
        parted_tokens = leader.call(tokens_of_every_rank, parted.sid)
        leader.open(doc[:20]).save(tmp_path / "start.pt")  # a book that begins as this one, read before
        shared = leader.restore(tmp_path / "start.pt", len(doc), doc)  # every rank keeps the chunk both share
        assert leader.call(tokens_of_every_rank, shared.sid) == [doc[:16], doc[:16]]
        shared.read(doc[16:])
        events = shared.ask(random_ids(4, 128, 4), SamplingConfig(max_new_tokens=16))
        from_shared = [t for e in events for t in e.tokens]
    finally:
        leader.close()
    assert not dist.is_initialized()
    for levels in STACKS:
        assert two[levels] == one[levels], levels
        assert len(two[levels][0]) == 16
    assert two.get("sampled") == one.get("sampled") and two["tokens"] == one["tokens"]
    assert (two_logits - one_logits).abs().max() <= 1e-5
    assert read_in_parts == one["plain"][0] and parted_tokens[0] == parted_tokens[1]
    assert from_shared == one["plain"][0]


@pytest.mark.timeout(180)
def test_two_gloo_ranks_answer_two_sessions_in_one_batch_as_one_process_one_at_a_time():
    """The app's path under tensor parallel: its batcher packs two readers' forwards on every rank
    (greedy, and sampled with fixed draft lengths) and commits what one process commits alone; a
    third reader's bad question fails alone, on every rank alike."""
    docs, questions = [random_ids(40, 128, 11), doc_with_repeats()], [random_ids(4, 128, 12), random_ids(3, 128, 13)]
    samplings = [SamplingConfig(max_new_tokens=12),
                 SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=4)]
    engine = tiny_rank_engine("qwen2", 3)
    want = [[t for e in engine.open(d).ask(q, s) for t in e.tokens] for d, q, s in zip(docs, questions, samplings)]
    leader = parallel.start(functools.partial(tiny_rank_engine, "qwen2", 3), 2, torch.device("cpu"))
    try:
        sessions = [leader.open(doc) for doc in docs]
        batcher = Batcher(max_active=3, background=False)
        streams = [batcher.ask(s, q, sampling) for s, q, sampling in zip(sessions, questions, samplings)]
        bad = batcher.ask(leader.open(docs[0]), [10**6], samplings[0])
        while batcher.active or batcher.waiting:
            batcher.round()
        got = [[t for e in stream for t in e.tokens] for stream in streams]
        with pytest.raises(BadTokens):
            list(bad)
        first, second = leader.call(tokens_of_every_rank, sessions[1].sid)
    finally:
        leader.close()
    assert got == want and [len(tokens) for tokens in got] == [12, 10]
    assert batcher.n_segments > batcher.n_forwards  # the two answers shared forwards
    assert first == second == docs[1] + questions[1] + got[1]


def test_shard_keeps_each_ranks_heads_and_columns():
    whole = ours(tiny_hf("qwen2"))
    part = parallel.shard(ours(tiny_hf("qwen2")), 1, 2)
    a, b = whole.model.layers[0], part.model.layers[0]
    D = whole.config.head_dim
    assert torch.equal(b.self_attn.q_proj.weight, a.self_attn.q_proj.weight[2 * D:4 * D])  # query heads 2, 3
    assert torch.equal(b.self_attn.k_proj.bias, a.self_attn.k_proj.bias[D:2 * D])  # their KV head 1
    assert torch.equal(b.self_attn.o_proj.weight, a.self_attn.o_proj.weight[:, 2 * D:4 * D])
    assert torch.equal(b.mlp.down_proj.weight, a.mlp.down_proj.weight[:, 64:128])
    assert (part.config.n_heads, part.config.n_kv_heads, part.config.intermediate) == (2, 1, 64)
    assert part.lm_head.weight is part.model.embed_tokens.weight  # tied, replicated


def test_shard_refuses_heads_that_do_not_divide():
    with pytest.raises(HeadsNotDivisible, match="2 KV heads to divide evenly; use one of"):
        parallel.shard(ours(tiny_hf("llama")), 0, 4)  # 4 query heads divide by 4, 2 KV heads do not


@pytest.mark.timeout(180)
def test_engine_load_with_two_gpus_starts_the_workers_itself(tmp_path):
    """The app's and the CLI's path: Engine.load(n_gpus=2) spawns rank 1, loads and shards the
    saved model in both processes (offloaded KV too), and answers as one process does."""
    tiny_hf("qwen2").float().save_pretrained(tmp_path)
    word_tokenizer([f"w{i}" for i in range(128)]).save_pretrained(tmp_path)
    config = EngineConfig(target=str(tmp_path), device="cpu", dtype="float32", retrieval=RETRIEVAL,
                          offload_kv=True)
    sampling, answers = SamplingConfig(max_new_tokens=12), []
    for n_gpus in (1, 2):
        engine = Engine.load(replace(config, n_gpus=n_gpus))
        try:
            session = engine.open(doc_with_repeats())
            answers.append([t for e in session.ask(random_ids(4, 128, 6), sampling) for t in e.tokens])
            assert isinstance(session.full, OffloadCache) and session.full.n_resident_layers == 0  # CPU
            session.save(tmp_path / f"snapshot{n_gpus}.pt")  # a prefill snapshot, restored on every rank
            restored = engine.restore(tmp_path / f"snapshot{n_gpus}.pt")
            answers.append([t for e in restored.ask(random_ids(3, 128, 7), sampling) for t in e.tokens])
        finally:
            if n_gpus > 1:
                assert isinstance(engine, parallel.Leader)
                engine.close()
    assert answers[:2] == answers[2:] and len(answers[0]) == len(answers[1]) == 12


class Fault(RuntimeError):
    pass


def faulty_rank_engine() -> Engine:
    """Rank 1 fails in its 6th forward (mid-answer: out of memory on one GPU, say); rank 0 is fine."""
    engine = tiny_rank_engine("llama", gamma=2)
    if dist.get_rank() == 1:
        n_calls = [0]

        def hook(module, args):
            n_calls[0] += 1
            if n_calls[0] == 6:
                raise Fault("injected on rank 1")

        engine.target.model.layers[0].register_forward_pre_hook(hook)
    return engine


@pytest.mark.timeout(180)
def test_a_rank_that_fails_mid_answer_makes_rank_0_fail_cleanly_within_seconds():
    leader = parallel.start(faulty_rank_engine, 2, torch.device("cpu"))
    try:
        session = leader.open(random_ids(20, 128, 1))  # 2 prefill forwards (chunks of 16)
        with pytest.raises(EngineError, match="empty"):  # bad input fails alike on every rank: still in step
            list(session.ask([], SamplingConfig(max_new_tokens=4)))
        started = time.monotonic()
        with pytest.raises(parallel.RankFailed, match="rank 1: Fault: injected on rank 1"):
            list(session.ask(random_ids(3, 128, 2), SamplingConfig(max_new_tokens=30)))
        assert time.monotonic() - started < 20
        with pytest.raises(parallel.RankFailed, match="restart"):  # at once, never a hang
            leader.open(random_ids(5, 128, 3))
    finally:
        leader.close()
    assert not dist.is_initialized() and not leader.workers[0].is_alive()


def test_idle_ranks_wait_less_than_the_collective_timeout():
    assert parallel.HEARTBEAT_FRACTION * 3 < 1 and parallel.COLLECTIVE_TIMEOUT.total_seconds() <= 120  # not 5 min


def hung_rank_engine() -> Engine:
    """Rank 1 stops in its 6th forward and never comes back (a hung kernel, a GPU stuck in NCCL)."""
    engine = tiny_rank_engine("llama", gamma=2)
    if dist.get_rank() == 1:
        n_calls = [0]

        def hook(module, args):
            n_calls[0] += 1
            if n_calls[0] == 6:
                time.sleep(3600)

        engine.target.model.layers[0].register_forward_pre_hook(hook)
    return engine


@pytest.mark.timeout(120)
def test_a_hung_rank_ends_in_rank_failed_at_the_collective_timeout():
    """Issue 54 row 4: a rank that hangs mid-answer is noticed at the collective timeout (NCCL's
    blocking waits make it raise, as gloo's does), rank 0 raises the typed RankFailed, and
    closing ends the hung process instead of waiting for it."""
    leader = parallel.start(hung_rank_engine, 2, torch.device("cpu"), timeout=timedelta(seconds=4))
    try:
        session = leader.open(random_ids(20, 128, 1))
        started = time.monotonic()
        with pytest.raises(parallel.RankFailed, match="restart"):
            list(session.ask(random_ids(3, 128, 2), SamplingConfig(max_new_tokens=30)))
        assert 4 <= time.monotonic() - started < 20
    finally:
        leader.close()
    assert not dist.is_initialized() and not leader.workers[0].is_alive()


def test_gpus_without_peer_access_get_nccl_without_p2p_and_blocking_waits(monkeypatch):
    """Issue 54 row 4: RTX 4090s have no P2P (torch.cuda.can_device_access_peer is False there),
    where NCCL's P2P transport is known to hang: it is turned off before the group is made; a
    user's own setting wins; GPUs with peer access keep it."""
    monkeypatch.setattr(parallel.os, "environ", {})
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: False)
    assert parallel.nccl_environment(2) == {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_P2P_DISABLE": "1"}
    assert parallel.os.environ == {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_P2P_DISABLE": "1"}
    monkeypatch.setattr(parallel.os, "environ", {"NCCL_P2P_DISABLE": "0"})
    parallel.nccl_environment(2)
    assert parallel.os.environ["NCCL_P2P_DISABLE"] == "0"
    monkeypatch.setattr(parallel.os, "environ", {})
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)  # NVLink, datacentre cards
    assert parallel.nccl_environment(2) == {"TORCH_NCCL_BLOCKING_WAIT": "1"} == parallel.os.environ


def prefill_logits_and_greedy(ranks: parallel.Ranks, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The last position's logits of a prefill of `ids`, and 8 greedy tokens after them."""
    session = ranks.engine.open(ids)
    tokens = [t for e in session.ask([ids[-1]], SamplingConfig(max_new_tokens=8)) for t in e.tokens]
    return logits_of(ranks, ids)[0, -1], tokens


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_gloo_ranks_of_the_packaged_gguf_match_one_process():
    """`--gpus 2` with the packaged GGUF (issue 54 row 1): the blocks are dequantized before the
    shard is cut (sliced as bytes, rank 1's narrow failed and rank 0 kept garbage); both ranks'
    sum gives the one-process model's logits (its block kernel) and its greedy tokens."""
    from engine.quant import is_quantized
    from tests.conftest import packaged_or_skip

    packaged_or_skip("qwen2.5-coder-0.5b")  # 14 query / 2 KV heads: 7 and 1 per rank
    config = EngineConfig(target="qwen2.5-coder-0.5b", draft=None, levels="plain", device="cpu", dtype="float32",
                          prefill_chunk_tokens=64)
    ids = random_ids(40, 1000, 9)
    one = Engine.load(config)
    want_logits, want_tokens = prefill_logits_and_greedy(parallel.Ranks(one), ids)
    del one
    leader = Engine.load(replace(config, n_gpus=2))
    try:
        assert leader.target.config.n_kv_heads == 1 and not is_quantized(leader.target)
        got_logits, got_tokens = leader.call(prefill_logits_and_greedy, ids)
    finally:
        leader.close()
    assert (got_logits - want_logits).abs().max() <= 1e-3 * want_logits.abs().max()
    assert got_tokens == want_tokens and len(got_tokens) == 8


def greedy_drafts_with_logits_that_differ_by_rank(ranks: parallel.Ranks) -> list[list[int]]:
    """Every rank's greedy draft of a tiny model drafter whose logits differ by 2e-6 between the
    ranks at a near-tie (tokens 5 and 7), as partial sums added in another order can."""
    from engine.drafters.model import ModelDrafter
    from engine.kv.streaming import StreamingCache
    from engine.sampling import GeneratorCoins

    model = ours(tiny_hf("llama")).float()
    nudge = 1e-6 if dist.get_rank() == 0 else -1e-6

    def near_tie(module, args, logits):
        top = logits.amax(-1)
        logits[..., 7], logits[..., 5] = top, top + nudge  # rank 0's argmax is 5, rank 1's is 7
        return logits

    model.lm_head.register_forward_hook(near_tie)
    c = model.config
    cache = StreamingCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 4, 16, 24, model.rotate, torch.float32,
                           torch.device("cpu"))
    drafter = ModelDrafter(model, cache)
    drafter.reset(random_ids(12, 128, 3))
    coins = parallel.SharedCoins(GeneratorCoins(torch.Generator().manual_seed(0)))
    draft = run(drafter.propose(4, SamplingConfig(), coins))  # greedy
    return parallel.gathered(draft.tokens)


@pytest.mark.timeout(180)
def test_under_tensor_parallel_a_greedy_draft_is_the_same_on_every_rank():
    """Issue 54 row 10: each rank took its own argmax, so ranks could feed different ids to their
    next forwards (out of step); rank 0's draft is shared, as a sampled one already was."""
    leader = parallel.start(functools.partial(tiny_rank_engine, "llama"), 2, torch.device("cpu"))
    try:
        first, second = leader.call(greedy_drafts_with_logits_that_differ_by_rank)
    finally:
        leader.close()
    assert first == second and len(first) == 4 and first[0] == 5  # rank 0's near-tie pick
