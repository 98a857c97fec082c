"""Engine and Session: the face of the engine (its use: docs/DESIGN.md "The engine's face"; a
request through the modules: engine/README.md). `Engine` holds the loaded models and prefills a
document once into a `Session`, which answers questions as a stream of `Event`s.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine import layouts, parallel
from engine.attention import flash_attention, pick_attention
from engine.config import BadTokens, Busy, Cancelled, DocumentTooLong, EmptyPrompt, EngineConfig, Levels, SamplingConfig
from engine.device import linear_layout, now, pick_device, pick_dtype
from engine.drafters.lookup_first import LookupFirst
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.graphs import graphs_available, static_decode_step
from engine.kv.full import FullCache
from engine.kv.offload import OffloadCache
from engine.kv.retrieval import RetrievalCache
from engine.kv.streaming import StreamingCache
from engine.memory import Workload, free_memory_bytes, resident_kv_layers
from engine.model import Forward, QueryLog, Segment, Steps, Transformer, drive, run
from engine.quant import is_quantized, quick_view
from engine.sampling import Coins, GeneratorCoins
from engine.sources import chunk_ranges, contrast, layer_shares
from engine.speculative import CheckingDrafter, GammaTuner, LevelStack, LevelStats, Scorer, shared_prefix

Progress = Callable[[int, int], None]  # (tokens done, tokens total)
# full-cache slots past the document for the chat, allocated and planned with it: a cache that
# grows holds its old and new copies at once
CHAT_CAPACITY_TOKENS = 2048
OFFLOAD_PREFILL_CHUNK_TOKENS = 8192  # see Engine.prefill_chunk_tokens


@dataclass
class Stats:
    """Metrics streamed with every event (docs/ALGORITHM.md section 9)."""

    levels: list[LevelStats]  # checking levels, bottom-most checker first, "full" last
    n_tokens: int = 0
    ttft_s: float = 0.0  # question prefill + first check
    tbt_ms_last: float = 0.0  # time per token of the last check
    tbt_ms_mean: float = 0.0  # decode time per token, first check excluded
    drafter_s: float = 0.0  # time in the drafters below the top level
    step_ms_mean: float = 0.0  # tbt_ms_mean less the caller's time between steps
    # plain decoding's time per token here (the top level's undrafted checks; 0: none yet):
    # plain_ms / step_ms_mean is the speedup, whatever the caller takes between steps
    plain_ms: float = 0.0
    kv_host_memory: str = ""  # an offloaded full cache's: "pinned", or "pageable" where pinning was refused

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 / self.tbt_ms_mean if self.tbt_ms_mean else 0.0


@dataclass
class Event:
    tokens: list[int]  # newly committed token ids
    stats: Stats
    reading: list[tuple[int, int, float]] | None = None  # (start, end, share) token ranges
    finish_reason: str | None = None  # "stop", "length", "cancelled" on the last event


class Engine:
    def __init__(self, config: EngineConfig, target: Transformer, tokenizer=None,
                 draft: Transformer | None = None, generation: tuple[dict, set[int]] = ({}, set()),
                 load_draft: Callable[[], Transformer] | None = None):
        self.config, self.target, self.tokenizer = config, target, tokenizer
        # the draft model, or `load_draft`, called at the first stack that drafts with it
        self._draft, self._load_draft, self._draft_lock = draft, load_draft, threading.Lock()
        # how the model is meant to be sampled and the tokens that end its turn (loading.generation_defaults)
        self.default_sampling = SamplingConfig(**generation[0])
        self.end_ids: set[int] = set(generation[1])
        self.device = target.lm_head.weight.device
        self.dtype = target.dtype
        self.attend = pick_attention(self.device, config.use_flash_attn, config.use_cpu_kernel)
        # drafter and middle-level steps (engine/graphs.py), not around tensor parallel's all-reduces
        self.uses_cuda_graphs = graphs_available(self.device, config.use_cuda_graphs and config.n_gpus == 1)
        # the levels below the top may read a GGUF's blocks with int8 activations (costs only acceptance)
        self.quick_drafts = config.quick_drafts
        self._quick: dict[Transformer, Transformer] = {}
        for model in (target, draft):
            if model is not None:
                self._prepare(model)
        self.n_prefills = 0  # documents prefilled (the app asserts a question does not add one)
        self.n_prefill_tokens = 0

    def _prepare(self, model: Transformer) -> Transformer:
        """`model` on this engine's attention, its linears laid out for the device, and its int8 view."""
        model.set_attention(self.attend)
        if not is_quantized(model):  # a GGUF's blocks (engine/quant.py) stay as in the file
            fits_bf16 = self.dtype == torch.float32 and layouts.linear_weights_fit_bf16(model)  # bf16 file
            layouts.lay_out_linears(model, linear_layout(self.device, self.dtype, fits_bf16))
        else:
            self._quick[model] = quick_view(model)
            self._quick[model].set_attention(self.attend)
        return model

    @property
    def draft(self) -> Transformer | None:
        """The draft model; loaded here, once, where `Engine.load` deferred it."""
        with self._draft_lock:
            if self._draft is None and self._load_draft is not None:
                self._draft = self._prepare(self._load_draft())
                self._load_draft = None
            return self._draft

    @property
    def has_draft(self) -> bool:
        """Whether stacks that draft with the draft model can run (it may be loaded at the first)."""
        return self._draft is not None or self._load_draft is not None

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """The engine of `config`; with n_gpus > 1, rank 0's `parallel.Leader` (it serves as an Engine)
        over the ranks it starts, or, in a rank's process (`parallel.start`), that rank's shard."""
        from engine.loading import check_same_tokenizer, generation_defaults, load_model, load_tokenizer_of

        device = pick_device(config.device)
        if config.n_gpus > 1 and not torch.distributed.is_initialized():
            return parallel.start(functools.partial(cls.load, config), config.n_gpus, device)
        dtype = pick_dtype(config.dtype, device)
        if config.n_gpus == 1:
            target, tokenizer = load_model(config.target, dtype, device, config.yarn_factor)
        else:  # loaded on the host, so only this rank's shard reaches its GPU
            device = parallel.rank_device(device)
            target, tokenizer = load_model(config.target, dtype, torch.device("cpu"), config.yarn_factor)
            target = parallel.shard(target, torch.distributed.get_rank(), config.n_gpus).to(device)
        generation = generation_defaults(config.target, Path(tokenizer.name_or_path))
        if not config.draft:
            return cls(config, target, tokenizer, None, generation)

        def load_draft() -> Transformer:  # native RoPE: its StreamingLLM cache renumbers positions in its window
            draft, draft_tokenizer = load_model(config.draft, dtype, device)
            check_same_tokenizer(tokenizer, draft_tokenizer, config.target, config.draft)
            return draft
        if device.type == "cpu" and config.n_gpus == 1 and not Levels.parse(config.levels).needs_draft:
            # no CPU default stack drafts with it: loaded when one does; another tokenizer is refused now
            check_same_tokenizer(tokenizer, load_tokenizer_of(config.draft, dtype, device), config.target, config.draft)
            return cls(config, target, tokenizer, None, generation, load_draft=load_draft)
        return cls(config, target, tokenizer, load_draft(), generation)

    @property
    def max_context(self) -> int:
        return self.target.config.max_positions

    def new_full_cache(self, capacity: int, state: dict | None = None) -> FullCache | OffloadCache:
        """The top level's cache for `capacity` tokens (from a snapshot's `state` when given): on
        the device, or in host memory streamed per layer when `config.offload_kv`."""
        c, cfg = self.target.config, self.config
        if not cfg.offload_kv:
            self._planned_resident_layers(capacity, offload_allowed=False)  # on a GPU: refuses what cannot fit
            if state is not None:
                return FullCache.from_state(state, capacity, self.device)
            return FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, capacity, self.dtype, self.device)
        n_resident = cfg.resident_kv_layers
        if n_resident is None:
            n_resident = self._planned_resident_layers(capacity)
        n_resident = min(n_resident, c.n_layers)
        if state is not None:
            return OffloadCache.from_state(state, capacity, self.device, n_resident)
        return OffloadCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, capacity, self.dtype, self.device, n_resident)

    @property
    def prefill_chunk_tokens(self) -> int:
        """Tokens per prefill forward; at least `OFFLOAD_PREFILL_CHUNK_TOKENS` for an offloaded cache with
        flash-attn (no [T, S] masks): each forward copies every offloaded layer's filled prefix to the GPU."""
        chunk = self.config.prefill_chunk_tokens
        if self.config.offload_kv and self.attend is flash_attention:
            return max(chunk, OFFLOAD_PREFILL_CHUNK_TOKENS)
        return chunk

    def _planned_resident_layers(self, capacity: int, offload_allowed: bool = True) -> int:
        """The memory plan's resident layers for `capacity` tokens (0 on CPU); raises OutOfMemoryPlan
        when nothing fits. Under tensor parallel a collective: the plan is made from every rank's
        free memory and rank 0's host memory, so every rank keeps the same layers."""
        if self.device.type != "cuda":
            return 0
        c, n_ranks = self.target.config, self.config.n_gpus
        whole = replace(c, n_heads=c.n_heads * n_ranks, n_kv_heads=c.n_kv_heads * n_ranks,
                        intermediate=c.intermediate * n_ranks)  # the planner splits it again
        loaded = sum(p.numel() * p.element_size() for m in (self.target, self.draft) if m is not None
                     for p in m.parameters())  # on the GPU already, out of the free memory measured now
        gpus = parallel.gathered(free_memory_bytes(self.device) + loaded)
        host = parallel.gathered(free_memory_bytes("cpu"))[0]
        r = self.config.retrieval
        work = Workload(self.dtype.itemsize, self.draft and self.draft.config, r.budget_tokens, r,
                        self.prefill_chunk_tokens, offload_allowed=offload_allowed,
                        has_tail_masks=self.attend is not flash_attention, n_logit_rows=self.config.gamma_limit + 1)
        return resident_kv_layers(whole, capacity, gpus, host, work)

    def prefill_steps(self, cache: FullCache, ids: list[int], query_log: QueryLog | None,
                      on_progress: Progress | None = None, cancel=None) -> Steps[None]:
        """Chunked prefill of `ids` after the cache's length; cancel is checked between chunks."""
        chunk = self.prefill_chunk_tokens
        cache.reserve(len(ids))
        for i in range(0, len(ids), chunk):
            if cancel is not None and cancel.is_set():
                raise Cancelled("prefill")
            piece = ids[i:i + chunk]
            tokens = torch.tensor([piece], device=self.device)  # [1, T]
            pos = torch.arange(cache.length, cache.length + len(piece), device=self.device)  # [T]
            yield Forward(self.target, Segment(tokens, pos, cache, query_log))
            self.n_prefill_tokens += len(piece)
            if on_progress:
                on_progress(i + len(piece), len(ids))

    def restore(self, path: str | Path, n_total: int | None = None, doc_ids: list[int] | None = None) -> Session:
        """Reopen a prefill snapshot (`Session.save`) without prefilling again. `n_total`: the length of
        the document it begins, allocated for now (`Session.read` reads the rest); `doc_ids`: another
        document, keeping the whole prefill chunks it shares with the snapshot (`shared_start`)."""
        # memory-mapped in host memory: the cache copies it to the device a layer at a time
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self.restore_state(state, n_total, doc_ids)

    def restore_state(self, state: dict, n_total: int | None = None, doc_ids: list[int] | None = None) -> Session:
        """A session from a snapshot's state (`Session.state`), e.g. one rank's heads of it."""
        if doc_ids is not None:
            state = shared_start(state, doc_ids, self.prefill_chunk_tokens)
        n_tokens = max(state["cache"]["k"].shape[3], n_total or 0)
        full = self.new_full_cache(min(self.max_context, n_tokens + CHAT_CAPACITY_TOKENS), state["cache"])
        session = Session(self, full)
        session.query_log.queries = [q if q is None else q.to(self.device) for q in state["queries"]]
        session.start(state["tokens"])
        return session

    def check_ids(self, ids: list[int], what: str, n_held: int = 0) -> None:
        """Ids in the vocabulary, and room for them after `n_held` tokens and for one token after."""
        vocab, n_tokens = self.target.config.vocab_size, n_held + len(ids) + 1
        if min(ids) < 0 or max(ids) >= vocab:
            raise BadTokens(what, vocab)
        if n_tokens > self.max_context:
            raise DocumentTooLong(n_tokens, self.max_context)

    def open(self, doc_ids: list[int], on_progress: Progress | None = None, cancel=None,
             n_first: int | None = None) -> Session:
        """Prefill the document once; the returned session answers questions about it. `n_first`:
        read only the first tokens now, with room for all of them; `Session.read` reads the rest."""
        if not doc_ids:
            raise EmptyPrompt("document")
        self.check_ids(doc_ids, "document")
        session = Session(self, self.new_full_cache(min(self.max_context, len(doc_ids) + CHAT_CAPACITY_TOKENS)))
        first = doc_ids[:n_first or len(doc_ids)]
        run(self.prefill_steps(session.full, first, session.query_log, on_progress, cancel))
        self.n_prefills += 1
        session.start(first)
        return session

    def build_stack(self, full: FullCache, query_log: QueryLog, name: str
                    ) -> tuple[LevelStack, list[LevelStats], RetrievalCache | None]:
        """The levels of the stack `name` (a LEVEL_STACKS entry) over this full cache."""
        cfg, c, levels = self.config, self.target.config, Levels.parse(name)
        levels.check_draft(self.has_draft)
        share = parallel.shared if cfg.n_gpus > 1 else None  # every rank tunes as rank 0 does
        tuner = functools.partial(GammaTuner, max_gamma=cfg.gamma_limit, share=share)
        stats = [LevelStats(name) for name in levels.names if name in ("retrieval", "full")]  # checking levels
        bottom = self._bottom_drafter(levels.bottom) if levels.bottom else None
        retrieval, drafter = None, bottom
        if levels.has_retrieval:
            r = cfg.retrieval
            scratch = 2 + 2 * cfg.gamma_limit  # a check's tokens: the pending ones and the draft
            retrieval = RetrievalCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, r.budget_tokens, r.sink_tokens,
                                       r.window_tokens, r.chunk_tokens, scratch, self.dtype, self.device)
            model = self.drafting(self.target)
            middle = Scorer(model, retrieval, None, static_decode_step(model, retrieval, self.uses_cuda_graphs))
            drafter = CheckingDrafter(
                middle, bottom, stats[0], tuner(cfg.gamma_bottom),
                synced_length=lambda: retrieval.synced,
                sync=lambda: retrieval.append(full, retrieval.synced, full.length),
                rebuild=lambda: retrieval.build(full, query_log.queries),
                rebuild_every_tokens=r.rebuild_every_tokens, rebuild_below=r.rebuild_below_acceptance)
        top = tuner(cfg.gamma_middle if levels.has_retrieval else cfg.gamma_bottom)
        direct = None  # the bottom drafter proposing to the top while the middle does not pay
        if retrieval is not None and bottom is not None:
            direct = tuner(cfg.gamma_bottom, check_s=top.check_s)
        prefill = lambda ids, cancel: self.prefill_steps(full, ids, query_log, cancel=cancel)
        stack = LevelStack(Scorer(self.target, full, query_log), drafter, stats[-1], top, direct, prefill)
        return stack, stats, retrieval

    def drafting(self, model: Transformer) -> Transformer:
        """`model` as a level below the top runs it: its int8-activation view when `quick_drafts`."""
        return self._quick.get(model, model) if self.quick_drafts else model

    def _bottom_drafter(self, name: str):
        cfg = self.config
        if name == "ngram":
            return NgramDrafter(cfg.max_ngram)
        if name == "ngram+draft":
            return LookupFirst(self._bottom_drafter("ngram"), self._bottom_drafter("draft"))
        model = self.drafting(self.draft if name == "draft" else self.target)
        c = model.config
        cache = StreamingCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, cfg.streaming_sink_tokens,
                               cfg.streaming_window_tokens, cfg.prefill_chunk_tokens + cfg.gamma_limit,
                               model.rotate, self.dtype, self.device)
        return ModelDrafter(model, cache, static_decode_step(model, cache, self.uses_cuda_graphs))


class Session:
    """One open document: its full cache, its committed tokens and its level stack."""

    # on rank 0 of tensor parallel (engine/parallel.py): the session's id on every rank, and the
    # `parallel.Leader` that makes its changes (`parallel.everywhere`) and answers on every rank
    sid: int | None = None
    leader: parallel.Leader | None = None

    def __init__(self, engine: Engine, full: FullCache):
        self.engine, self.full = engine, full
        self.query_log = QueryLog(engine.target.config.n_layers, engine.config.retrieval.n_score_queries)
        self.levels = engine.config.levels
        self.stack, self.level_stats, self.retrieval = engine.build_stack(full, self.query_log, self.levels)
        self.lock = threading.Lock()  # one answer at a time per session
        self._neutral_shares: dict = {}  # score_document's neutral question: {(ids, start, end): [L, n]}

    @parallel.everywhere
    def set_levels(self, levels: str) -> None:
        """Switch the level stack; the full cache (the prefilled document) is kept."""
        if levels != self.levels:
            tokens = self.tokens
            self.stack, self.level_stats, self.retrieval = self.engine.build_stack(self.full, self.query_log, levels)
            self.levels = levels
            self.stack.reset(tokens)

    @parallel.everywhere
    def probe_plain_tbt(self, n_tokens: int = 8) -> float:
        """Milliseconds per token of plain decoding at this context length (the speedup's
        baseline, measured on this machine); the session is left as it was."""
        plain = LevelStack(Scorer(self.engine.target, self.full), None, LevelStats("probe"), GammaTuner(0, 1))
        plain.reset(self.tokens)
        coins = GeneratorCoins(torch.Generator().manual_seed(0))
        t0 = now(self.engine.device)
        for _ in range(n_tokens):
            run(plain.step(SamplingConfig(), coins, n_tokens))
        ms = 1000 * (now(self.engine.device) - t0) / n_tokens
        plain.truncate(self.length)
        return ms

    @parallel.everywhere
    def start(self, tokens: list[int]) -> None:
        self.stack.reset(tokens)

    def read(self, ids: list[int], on_progress: Progress | None = None, cancel=None) -> None:
        """Prefill more of the document, before any question (a long book read in parts). Stopped by
        `cancel` (or failed), the session keeps every whole chunk read: its `length` says where to go on."""
        if self.leader is not None:  # tensor parallel: every rank reads, taking rank 0's cancel flag
            return self.leader.call(parallel.read, self.sid, list(ids), on_progress=on_progress, cancel=cancel)
        self.read_here(ids, on_progress, cancel)

    def read_here(self, ids: list[int], on_progress: Progress | None = None, cancel=None) -> None:
        """`read` in this process (under tensor parallel: this rank's part)."""
        if self.full.length != self.length:
            raise ValueError("read() continues the document: it goes before the first question")
        if not ids:
            return
        n_held = self.length
        self.engine.check_ids(ids, "document", n_held)
        try:
            run(self.engine.prefill_steps(self.full, ids, self.query_log, on_progress, cancel))
        finally:  # the chunks whose KV is in the full cache are committed, all of them
            self.stack.reset(self.tokens + ids[:self.full.length - n_held])

    @property
    def tokens(self) -> list[int]:
        return self.stack.tokens

    @property
    def length(self) -> int:
        return len(self.stack.tokens)

    @parallel.everywhere
    def score_document(self, question_ids: list[int], start: int, end: int,
                       neutral_ids: list[int]) -> list[tuple[int, int, float]]:
        """(start, end, share) of every retrieval chunk of document positions [start, end): how much more
        the question's attention reads it than the neutral question's (engine/sources.py; under tensor
        parallel, rank 0's heads). Both run through the target; the session is left as it was."""
        if not question_ids or not neutral_ids:
            raise EmptyPrompt("question")
        key = (tuple(neutral_ids), start, end)
        if key not in self._neutral_shares:
            self._neutral_shares = {key: self._layer_shares(neutral_ids, start, end)}
        shares = contrast(self._layer_shares(question_ids, start, end), self._neutral_shares[key])
        return chunk_ranges(shares, start, self.engine.config.retrieval.chunk_tokens)

    def _layer_shares(self, ids: list[int], start: int, end: int):
        """[L, n] attention of the last of `ids`, asked now, over the chunks of [start, end)."""
        self.engine.check_ids(ids, "question", self.length)
        with self.lock:
            n_kept = self.full.length
            log = QueryLog(self.engine.target.config.n_layers, 1)
            try:
                run(self.engine.prefill_steps(self.full, self.tokens[n_kept:] + ids, log))
            finally:  # slots past the length are stale: the next question writes its own
                self.full.truncate(n_kept)
            return layer_shares(log.queries, self.full.k, start, min(end, n_kept),
                                self.engine.config.retrieval.chunk_tokens)

    @parallel.everywhere
    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (regenerate / edit-and-resend)."""
        if not 1 <= length <= self.length:
            raise ValueError(f"truncate({length}) of a session holding {self.length} tokens")
        self.stack.truncate(length)

    def ask(self, question_ids: list[int], sampling: SamplingConfig = SamplingConfig(),
            cancel=None, stop_ids: set[int] | None = None, coins: Coins | None = None) -> Iterator[Event]:
        """Append the question and stream the answer. Randomness: `sampling.seed`, unless tests
        pass their own `coins` (an exact enumerator of every random outcome)."""
        if self.leader is not None:  # tensor parallel: every rank answers, in the leader's batch rounds
            yield from self.leader.batcher.ask(self, question_ids, sampling, cancel, stop_ids)
            return
        with self.lock:
            yield from drive(self._answer(question_ids, sampling, cancel, stop_ids, coins))

    def answer_steps(self, question_ids: list[int], sampling: SamplingConfig = SamplingConfig(),
                     cancel=None, stop_ids: set[int] | None = None, coins: Coins | None = None
                     ) -> Generator[Forward | Event, torch.Tensor | None, None]:
        """`ask` as a generator of forward requests and events: how engine/batch.py runs it
        (under tensor parallel only there: `Batcher.ask` runs it on every rank)."""
        if not self.lock.acquire(blocking=False):
            raise Busy()
        try:
            yield from self._answer(question_ids, sampling, cancel, stop_ids, coins)
        finally:
            self.lock.release()

    def _answer(self, question_ids, sampling, cancel, stop_ids, coins):
        engine, stack = self.engine, self.stack
        if not question_ids:
            raise EmptyPrompt("question")
        engine.check_ids(question_ids, "question", self.length)
        coins = coins or GeneratorCoins(torch.Generator().manual_seed(sampling.seed))
        if engine.config.n_gpus > 1:  # tensor parallel: every rank takes rank 0's draws and cancel flag
            coins, cancel = parallel.SharedCoins(coins), parallel.SharedFlag(cancel)
        max_new = min(sampling.max_new_tokens, engine.max_context - self.length - len(question_ids))
        for s in self.level_stats:
            s.reset()
        stack.drafter_s = 0.0
        t_start, stats = now(engine.device), Stats(self.level_stats)
        n_new, n_first, t_first, steps_s = 0, 0, 0.0, 0.0
        reason, reading_version = None, None
        try:
            yield from stack.extend(question_ids, cancel)  # stopped here: the chat stays as it was
            if sampling.penalty_start is None:  # the penalties count this answer's tokens
                sampling = replace(sampling, penalty_start=self.length)
            while reason is None:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("answer")
                t0 = now(engine.device)
                new, reason = yield from stack.step(sampling, coins, max_new - n_new, stop_ids or set())
                t1 = now(engine.device)
                n_new += len(new)
                if t_first:
                    steps_s += t1 - t0
                else:
                    t_first, n_first = t1, n_new
                    top = self.level_stats[-1]
                    top.n_alone, top.alone_s = 0, 0.0  # the first check also read the question's last token
                stats = self._stats(n_new, n_first, t_start, t_first, t1, (t1 - t0) / max(len(new), 1), steps_s)
                reading, reading_version = self._reading(reading_version)
                yield Event(new, stats, reading, reason)
        except Cancelled:
            yield Event([], stats, None, "cancelled")

    def _stats(self, n_new, n_first, t_start, t_first, t_now, tbt_last_s, steps_s) -> Stats:
        n_after_first, top = n_new - n_first, self.level_stats[-1]
        mean_s = (t_now - t_first) / n_after_first if n_after_first else tbt_last_s
        step_s = steps_s / n_after_first if n_after_first else tbt_last_s
        plain_s = top.alone_s / top.n_alone if top.n_alone else self.stack.tuner.check_s.get(1, 0.0)
        host_memory = self.full.host_memory if isinstance(self.full, OffloadCache) else ""
        return Stats([replace(s) for s in self.level_stats], n_new, ttft_s=t_first - t_start,
                     tbt_ms_last=1000 * tbt_last_s, tbt_ms_mean=1000 * mean_s, drafter_s=self.stack.drafter_s,
                     step_ms_mean=1000 * step_s, plain_ms=1000 * plain_s, kv_host_memory=host_memory)

    def _reading(self, seen_version):
        """Token ranges the retrieval cache reads, when they changed since `seen_version`."""
        r = self.retrieval
        if r is None or r.n_chunks == 0 or r.version == seen_version:
            return None, seen_version
        return reading_ranges(r.chunk_starts, r.chunk_tokens), r.version

    @parallel.everywhere
    def save(self, path: str | Path, meta: dict | None = None) -> None:
        """A prefill snapshot: tokens and full cache (the app adds model and document hashes);
        under tensor parallel one file with every rank's heads, written by rank 0."""
        state = self.state(meta) if self.engine.config.n_gpus == 1 else parallel.whole_state(self.state(meta))
        if state is not None:
            torch.save(state, path)

    def state(self, meta: dict | None = None) -> dict:
        """What a snapshot holds, in host memory: {"tokens", "cache": {"k", "v"} of
        [L, B, Hkv, S, D], "queries": per layer [B, H, M, D] or None, "meta"}."""
        queries = [q if q is None else q.cpu() for q in self.query_log.queries]
        return {"tokens": self.tokens, "cache": self.full.state(), "queries": queries, "meta": meta or {}}


def shared_start(state: dict, doc_ids: list[int], chunk_tokens: int) -> dict:
    """A snapshot's state cut to the whole prefill chunks its tokens share with `doc_ids`, leaving
    at least one token of `doc_ids` to read. Their KV is what reading `doc_ids` gives, bit for bit
    (the same tokens in the same forwards); the retrieval queries belong to later tokens, so they go."""
    saved = state["tokens"]
    n = shared_prefix(saved, doc_ids[:-1])
    n -= n % chunk_tokens
    if n == 0:
        raise ValueError("the snapshot and the document share no whole prefill chunk")
    cache = {name: t[:, :, :, :n] for name, t in state["cache"].items()}  # [L, B, Hkv, S, D]
    return {**state, "tokens": saved[:n], "cache": cache, "queries": [None] * len(state["queries"])}


def reading_ranges(chunk_starts: torch.Tensor, chunk_tokens: int, top: int = 12) -> list[tuple[int, int, float]]:
    """Merge selected chunks ([L, B, Hkv, n] start positions) into ranges weighted by selection share."""
    starts, counts = chunk_starts.flatten().unique(return_counts=True)
    ranges: list[list[float]] = []
    for s, share in zip(starts.tolist(), (counts.double() / counts.sum()).tolist()):
        if ranges and ranges[-1][1] == s:
            ranges[-1][1] = s + chunk_tokens
            ranges[-1][2] += share
        else:
            ranges.append([s, s + chunk_tokens, share])
    ranges.sort(key=lambda r: -r[2])
    return [(int(a), int(b), w) for a, b, w in ranges[:top]]

