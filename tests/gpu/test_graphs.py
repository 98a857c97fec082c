"""The static-shape one-token steps that CUDA graphs capture (engine/graphs.py), run uncaptured
on CPU against the eager path they replace: the model drafter over its StreamingLLM cache
(window eviction, re-rotation, rollback) and the target over the retrieval cache (rebuilds,
appends, truncates) give the same logits to float64 precision, and the engine with the static
steps forced on decodes exactly as plain decoding, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from engine import graphs
from engine.config import SamplingConfig
from engine.drafters.model import ModelDrafter
from engine.graphs import StaticDecodeStep
from engine.kv.full import FullCache
from engine.kv.retrieval import RetrievalCache
from engine.kv.streaming import StreamingCache
from engine.model import QueryLog, run
from engine.sampling import GeneratorCoins
from engine.speculative import EMPTY_DRAFT, Scorer
from tests.conftest import ours, tiny_engine, tiny_hf
from tests.engine.test_speculative import SAMPLINGS, chat, exact_answers, random_ids

CPU = torch.device("cpu")
T1 = SamplingConfig(temperature=1.0)  # q over the whole vocabulary: a fine comparison of logits


def counted(step: StaticDecodeStep) -> list[int]:
    """Count the static step's forwards (so a test notices when it is not used at all)."""
    calls, forward = [], step.step
    step.step = lambda *inputs: calls.append(1) or forward(*inputs)
    return calls


def garbage(cache) -> None:
    """Slots never written may hold anything, NaN included: the static step must not read them."""
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))


def streaming_drafter(model, is_static: bool) -> tuple[ModelDrafter, list[int]]:
    c = model.config
    cache = StreamingCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, sink_tokens=2, window_tokens=5,
                           max_new_tokens=4, rotate=model.rotate, dtype=torch.float64, device=CPU)
    if not is_static:
        return ModelDrafter(model, cache), []
    garbage(cache)
    step = StaticDecodeStep(model, cache, is_captured=False)
    return ModelDrafter(model, cache, step), counted(step)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_drafter_steps_match_eager_through_eviction_and_rollback(family):
    model = ours(tiny_hf(family))
    (eager, _), (static, calls) = streaming_drafter(model, False), streaming_drafter(model, True)
    tokens = random_ids(13, 128, 7)
    for d in (eager, static):
        d.reset(tokens)
    gen = torch.Generator().manual_seed(0)
    n_rotations, rotate = [], eager.cache.rotate
    eager.cache.rotate = lambda k, delta: n_rotations.append(1) or rotate(k, delta)
    for round_idx in range(12):
        sampling = T1 if round_idx % 2 else SamplingConfig()
        draws = [run(d.propose(3, sampling, GeneratorCoins(torch.Generator().manual_seed(round_idx))))
                 for d in (eager, static)]
        assert draws[0].tokens == draws[1].tokens, round_idx
        if draws[0].probs is not None:
            assert torch.allclose(draws[0].probs, draws[1].probs, rtol=0, atol=1e-10)
        length = eager.cache.length
        assert static.cache.length == length
        assert torch.allclose(eager.cache.k[:, :, :, :length], static.cache.k[:, :, :, :length], atol=1e-10)
        accepted = draws[0].tokens[: int(torch.randint(0, 4, (1,), generator=gen))]
        for d in (eager, static):  # the top keeps part of the draft, then its own token
            d.extend(accepted + random_ids(1, 128, 100 + round_idx))
            if round_idx % 5 == 4:  # regenerate: roll back a few committed tokens
                d.truncate(len(d.tokens) - 3)
    assert len(n_rotations) >= 3 and len(calls) >= 12  # the window slid, and the static step ran


def retrieval_pair(model, budget: int = 32):
    c = model.config
    caches = [RetrievalCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, budget_tokens=budget, sink_tokens=4,
                             window_tokens=8, chunk_tokens=4, scratch_tokens=4, dtype=torch.float64, device=CPU)
              for _ in range(2)]
    garbage(caches[1])
    step = StaticDecodeStep(model, caches[1], is_captured=False)
    return [Scorer(model, caches[0]), Scorer(model, caches[1], None, step)], counted(step)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_middle_steps_match_eager_through_rebuilds_appends_and_truncates(family):
    model = ours(tiny_hf(family))
    c = model.config
    full = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 256, torch.float64, CPU)
    query_log = QueryLog(c.n_layers, 4)
    doc = random_ids(61, 128, 3)
    model(torch.tensor([doc]), torch.arange(61), full, query_log=query_log)
    scorers, calls = retrieval_pair(model)
    for s in scorers:
        s.cache.build(full, query_log.queries)
    gen = torch.Generator().manual_seed(1)
    n_chunks, n_steps = {scorers[0].cache.n_chunks}, 0
    for round_idx in range(10):
        n_scratch = 1 + round_idx % 3
        chain = random_ids(n_scratch, 128, 50 + round_idx)
        for i, token in enumerate(chain):  # the middle level's own unverified one-token chain
            qs = [run(s.score([token], full.length + i, EMPTY_DRAFT, T1, doc + chain[:i + 1])) for s in scorers]
            assert torch.allclose(qs[0], qs[1], rtol=0, atol=1e-10), (round_idx, i)
            assert int(qs[0].argmax()) == int(qs[1].argmax())
            n_steps += 1
        n_kept = int(torch.randint(0, n_scratch + 1, (1,), generator=gen))
        accepted = chain[:n_kept] + random_ids(1, 128, 80 + round_idx)
        model(torch.tensor([accepted]), torch.arange(full.length, full.length + len(accepted)), full,
              query_log=query_log)
        for s in scorers:
            s.cache.truncate(s.cache.committed)  # the scratch goes, the top's tokens come in
            s.cache.append(full, s.cache.synced, full.length)
            if round_idx % 4 == 3:
                s.cache.build(full, query_log.queries)
        a, b = (s.cache for s in scorers)
        n_chunks.add(a.n_chunks)
        assert (a.length, a.n_chunks) == (b.length, b.n_chunks) and torch.equal(a.chunk_starts, b.chunk_starts)
        assert torch.allclose(a.k[:, :, :, :a.length], b.k[:, :, :, :b.length], atol=1e-10)
    assert len(n_chunks) > 1 and len(calls) == n_steps  # chunks were evicted; every step was static


@pytest.fixture
def static_steps(monkeypatch):
    """Force the static steps on (uncaptured, on CPU) and count their calls."""
    monkeypatch.setattr(graphs, "force_static_steps", True)
    calls = []
    call = StaticDecodeStep.__call__
    monkeypatch.setattr(StaticDecodeStep, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    return calls


STATIC_STACKS = ["draft>retrieval>full", "selfspec>full", "retrieval>full"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("levels", STATIC_STACKS)
def test_engine_with_static_steps_decodes_as_plain(levels, family, static_steps):
    doc = random_ids(123, 128, 1)
    questions = [random_ids(n, 128, 10 + n) for n in (5, 9, 3)]
    _, got = chat(tiny_engine(levels, family), doc, questions)
    assert static_steps, "the static steps never ran"
    _, plain = chat(tiny_engine("plain", family), doc, questions)
    assert got == plain


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-p0.9"])
@pytest.mark.parametrize("levels", ["selfspec>full", "retrieval>full"])  # the draft model's steps are selfspec's
def test_engine_with_static_steps_preserves_the_distribution_exactly(levels, sampling, static_steps):
    got, pruned = exact_answers(levels, sampling)
    assert static_steps, "the static steps never ran"
    want, want_pruned = exact_answers("plain", sampling)
    assert pruned < 1e-7 and want_pruned < 1e-7
    for seq in set(want) | set(got):
        assert abs(got.get(seq, 0.0) - want.get(seq, 0.0)) < 1e-6, seq


def test_the_override_builds_uncaptured_steps_and_the_default_builds_none(monkeypatch):
    model = ours(tiny_hf("llama"))
    cache = streaming_drafter(model, False)[0].cache
    assert graphs.static_decode_step(model, cache, use_cuda_graphs=True) is None  # CPU: the eager path
    monkeypatch.setattr(graphs, "force_static_steps", True)
    step = graphs.static_decode_step(model, cache, use_cuda_graphs=True)
    assert isinstance(step, StaticDecodeStep) and step.step == step.forward  # never captured on CPU


class FakeCuda:
    """torch.cuda's stream/graph API as CudaGraphStep uses it, on CPU: records the current device
    at each call; a "graph" replays the step it captured on its static inputs."""

    def __init__(self):
        self.current, self.calls = "cuda:0", []

    def device(self, device):
        fake, previous = self, [None]

        class Scope:
            def __enter__(self):
                previous[0], fake.current = fake.current, str(device)

            def __exit__(self, *exc):
                fake.current = previous[0]
        return Scope()

    def _note(self, what):
        self.calls.append((what, self.current))

    def Stream(self):  # noqa: N802 (torch's name)
        self._note("stream")
        return type("S", (), {"wait_stream": lambda s, other: None})()

    def current_stream(self):
        self._note("current_stream")
        return type("S", (), {"wait_stream": lambda s, other: None})()

    def stream(self, s):
        self._note("stream scope")
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)  # any no-op context

    def CUDAGraph(self):  # noqa: N802
        fake = self

        class Graph:
            def replay(self):
                fake._note("replay")
                self.out.copy_(self.step(*self.inputs))
        return Graph()

    def graph(self, graph, capture_error_mode=None):
        fake = self

        class Capture:
            def __enter__(self):
                fake._note("capture")
                fake.capturing = graph

            def __exit__(self, *exc):
                fake.capturing = None
        return Capture()

    def captured(self, step):
        """`step`, telling a capture in progress its static inputs and output."""
        def run(*inputs):
            out = step(*inputs)
            if getattr(self, "capturing", None) is not None:
                self.capturing.step, self.capturing.inputs, self.capturing.out = step, inputs, out
            return out
        return run


def test_cuda_graphs_capture_and_replay_on_their_own_device(monkeypatch):
    """A step of a model on cuda:1 while cuda:0 is current captures and replays on cuda:1."""
    fake = FakeCuda()
    for name in ("device", "Stream", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    graph_step = graphs.CudaGraphStep(fake.captured(lambda x: x * 2), torch.device("cuda", 1), torch.zeros(2))
    first = graph_step(torch.tensor([1.0, 2.0]))
    second = graph_step(torch.tensor([3.0, 4.0]))
    assert torch.equal(first, torch.tensor([2.0, 4.0])) and torch.equal(second, torch.tensor([6.0, 8.0]))
    assert ("replay", "cuda:1") in fake.calls and ("capture", "cuda:1") in fake.calls
    assert all(device == "cuda:1" for _, device in fake.calls), fake.calls
    assert fake.current == "cuda:0"  # restored after each call


def test_steps_are_captured_when_the_stack_is_built_one_at_a_time(monkeypatch):
    """Issue 54 row 7: the capture ran lazily, at a step's first call on the thread answering,
    while other threads prefilled (a capture synchronises the device). Now each static step is
    captured with the stack, under one process-wide lock; answering only replays, and the answer
    is the eager one. (torch.cuda is faked: FakeCuda's graphs replay their step for real.)"""
    fake, locked_at_capture = FakeCuda(), []
    for name in ("device", "Stream", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: locked_at_capture.append(graphs.CAPTURE_LOCK.locked())
                        or fake.graph(g, **kw))

    def cuda_graph():  # a real replay writes the captured output's memory; the fake's copy_ needs this mode
        g = fake.CUDAGraph()
        replay = g.replay
        g.replay = torch.inference_mode()(replay)
        return g
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cuda_graph)
    init = graphs.CudaGraphStep.__init__
    monkeypatch.setattr(graphs.CudaGraphStep, "__init__",
                        lambda self, step, device, *inputs: init(self, fake.captured(step), device, *inputs))
    monkeypatch.setattr(graphs, "graphs_available", lambda device, use_cuda_graphs: use_cuda_graphs)
    sampling, doc, question = SamplingConfig(max_new_tokens=16), random_ids(60, 128, 3) * 2, random_ids(4, 128, 4)
    want = [t for e in tiny_engine("ngram>retrieval>full").open(doc).ask(question, sampling) for t in e.tokens]
    engine = tiny_engine("ngram>retrieval>full")
    engine.uses_cuda_graphs = True  # as on a CUDA device with use_cuda_graphs
    session = engine.open(doc)
    n_captures = [what for what, _ in fake.calls].count("capture")
    assert n_captures == 1 and locked_at_capture == [True]  # the middle level's step, with the stack
    got = [t for e in session.ask(question, sampling) for t in e.tokens]
    assert got == want
    assert [what for what, _ in fake.calls].count("capture") == 1  # answering replays only
    assert [what for what, _ in fake.calls].count("replay") > 0
