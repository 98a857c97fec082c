"""The level stack and its decoding step (docs/ALGORITHM.md sections 2, 3, 6, 7; engine/README.md).

A `Scorer` is a checking level's weights and cache; `CheckingDrafter` is the middle level;
`LevelStack` owns the committed tokens and runs the top level's checks. Methods that run a model
are `model.Steps` generators. No concrete cache or drafter is named here (engine/session.py builds them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch

from engine.config import Cancelled, SamplingConfig
from engine.drafters import Drafter
from engine.kv import KVCache
from engine.model import Forward, QueryLog, Segment, Steps, Transformer
from engine.sampling import Coins, Draft, Verdict, draft_histories, token_probs, verify

EMPTY_DRAFT = Draft([])
Prefill = Callable[[list[int], object], Steps[None]]  # (ids, cancel flag) -> forwards writing their KV


@dataclass
class LevelStats:
    """Counters of one checking level (docs/ALGORITHM.md section 9)."""

    name: str
    n_checks: int = 0
    n_tested: int = 0  # proposals whose acceptance was tested
    n_accepted: int = 0
    n_emitted: int = 0  # accepted + one residual/bonus token per check
    time_s: float = 0.0  # forward + verify of this level (its drafter's time excluded)
    n_alone: int = 0  # checks of no draft: at the top, plain decoding's step
    alone_s: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_tested if self.n_tested else 0.0

    @property
    def tokens_per_check(self) -> float:
        return self.n_emitted / self.n_checks if self.n_checks else 0.0

    def reset(self) -> None:
        self.__init__(self.name)  # every counter back to its default

    def record(self, verdict: Verdict, seconds: float) -> None:
        self.n_checks += 1
        self.n_tested += verdict.n_tested
        self.n_accepted += verdict.n_accepted
        self.n_emitted += verdict.n_accepted + 1
        self.time_s += seconds
        if not verdict.n_tested:
            self.n_alone += 1
            self.alone_s += seconds


class GammaTuner:
    """Draft length that maximises expected tokens per second (docs/ALGORITHM.md section 6). When
    plain decoding (g = 0) is expected to be fastest, every `retry_every`-th check still drafts 1
    token: the cheapest way to keep measuring acceptance as the text changes."""

    decay = 0.8  # of the moving averages: the weight of the past
    retry_every = 16

    def __init__(self, fixed: int | None, max_gamma: int, check_s: dict[int, float] | None = None,
                 share: Callable[[float], float] | None = None):
        self.fixed, self.max_gamma = fixed, max_gamma
        # tensor parallel: every rank takes rank 0's lengths and rates (engine/parallel.py `shared`)
        self.share = share or (lambda value: value)
        self.acceptance = 0.7  # prior before the first check
        self.draft_s_per_token: float | None = None  # set by the first drafted check
        # tokens checked -> seconds (moving average): the checking level's costs, so the tuners
        # of two drafters that propose to the same level share them (LevelStack `direct_tuner`)
        self.check_s: dict[int, float] = {} if check_s is None else check_s
        self.n_undrafted = 0

    def gamma(self) -> int:
        return int(self.share(self._gamma()))

    def expected_rate(self, g: int) -> float:
        """Expected tokens per second with draft length g (0: plain decoding); 0 until 2 check sizes are timed."""
        return self.share(self._rate(g) if len(self.check_s) >= 2 else 0.0)

    def _gamma(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.check_s and 1 not in self.check_s:  # measure the plain step every draft length is
            return 0  # compared with; drafts of one length all accepted would never measure it
        if len(self.check_s) < 2:
            return min(4, self.max_gamma)
        best = max(range(1, self.max_gamma + 1), key=self._rate)
        if self._rate(best) >= self._rate(0):
            self.n_undrafted = 0
            return best
        self.n_undrafted = (self.n_undrafted + 1) % self.retry_every
        return 0 if self.n_undrafted else 1  # 0: checking the last token alone is expected to be faster

    def _rate(self, g: int) -> float:
        a = min(self.acceptance, 0.999)
        tokens = (1 - a ** (g + 1)) / (1 - a)
        return tokens / (g * (self.draft_s_per_token or 0.0) + self._check_seconds(g + 1))

    def _check_seconds(self, n: int) -> float:
        """Seconds to check n tokens, interpolated between measured counts (not linear in n on every
        CPU: 2 tokens cost about twice 1 on some, about as much on others); a fitted line beyond."""
        lower = [m for m in self.check_s if m <= n]
        upper = [m for m in self.check_s if m >= n]
        if lower and upper:
            lo, hi = max(lower), min(upper)
            return self.check_s[lo] + (self.check_s[hi] - self.check_s[lo]) * (n - lo) / max(hi - lo, 1)
        xs, ys = zip(*self.check_s.items())
        c1 = max(0.0, statistics.linear_regression(xs, ys).slope)
        return max(statistics.fmean(ys) - c1 * statistics.fmean(xs), 1e-6) + c1 * n

    def observe(self, gamma: int, draft_s: float, verdict: Verdict, n_checked: int, check_s: float):
        d = self.decay
        if verdict.n_tested:
            self.acceptance = d * self.acceptance + (1 - d) * verdict.n_accepted / verdict.n_tested
        if gamma:  # the first measurement replaces the prior (an average from 0 would take ~10 checks)
            per_token, prev = draft_s / gamma, self.draft_s_per_token
            self.draft_s_per_token = per_token if prev is None else d * prev + (1 - d) * per_token
        prev = self.check_s.get(n_checked)
        self.check_s[n_checked] = check_s if prev is None else d * prev + (1 - d) * check_s


class Scorer:
    """A checking level: the target weights with one cache (full at the top, retrieval in the middle)."""

    def __init__(self, model: Transformer, cache: KVCache, query_log: QueryLog | None = None,
                 decode_step: Callable[[int, int], torch.Tensor] | None = None):
        self.model, self.cache, self.query_log = model, cache, query_log
        self.decode_step = decode_step  # (token, pos) -> logits [1, 1, V] at a fixed shape (CUDA graphs)

    def score(self, pending: list[int], start_pos: int, draft: Draft, sampling: SamplingConfig,
              tokens: list[int]) -> Steps[torch.Tensor]:
        """q after the last pending token and after each drafted token: [N+1, V] (float64).

        pending: the committed tokens this cache lacks (at least the last), the first at absolute
        position `start_pos` (a retrieval cache holds fewer slots); tokens: the level's sequence
        before the draft, ending with `pending` (the penalties' history)."""
        if len(pending) + len(draft) == 1 and self.decode_step and self.query_log is None:
            logits = self.decode_step(pending[0], start_pos)  # a one-token chain at a fixed shape
        else:
            logits = yield self._request(pending, start_pos, draft)
        return token_probs(logits[0], draft_histories(tokens, draft.tokens, sampling), sampling)

    def _request(self, pending: list[int], start_pos: int, draft: Draft) -> Forward:
        device = self.model.lm_head.weight.device
        ids = torch.tensor([pending + draft.tokens], device=device)
        pos = torch.arange(start_pos, start_pos + ids.shape[1], device=device)
        return Forward(self.model, Segment(ids, pos, self.cache, self.query_log, len(draft) + 1))


def check(scorer: Scorer, drafter: Drafter | None, gamma: int, tuner: GammaTuner, stats: LevelStats,
          pending: list[int], tokens: list[int], sampling: SamplingConfig, coins: Coins
          ) -> Steps[tuple[Draft, Verdict, torch.Tensor, float]]:
    """One round of a checking level: `drafter` proposes up to `gamma` tokens after `tokens`, the
    scorer scores them after `pending` (the tokens of `tokens` its cache lacks), `verify` accepts
    a prefix. Returns the draft, the verdict, q ([N+1, V], on the host) and the drafter's seconds.
    One device sync, the copy of q; the clock needs none: a proposal ends in host values (tokens)."""
    t0 = time.perf_counter()
    draft = (yield from drafter.propose(gamma, sampling, coins)) if drafter else EMPTY_DRAFT
    t1 = time.perf_counter()
    q = yield from scorer.score(pending, len(tokens) - len(pending), draft, sampling, tokens)
    if draft.probs is None or (q.device.type == "cpu" and draft.probs.device.type == "cpu"):
        q = q.cpu()  # (on a CPU: no copy at all)
    else:  # q and r in host memory in one copy: `verify` reads them per node, each a sync on a GPU
        both = torch.cat([q, draft.probs.to(q.device, q.dtype)]).cpu()  # [N+1 + N, V]
        q, draft = both[:q.shape[0]], replace(draft, probs=both[q.shape[0]:])
    verdict = verify(q, draft, coins)
    scorer.cache.truncate(scorer.cache.length - len(draft) + verdict.n_accepted)  # the rejected tail goes
    t2 = time.perf_counter()
    tuner.observe(len(draft), t1 - t0, verdict, len(pending) + len(draft), t2 - t1)
    stats.record(verdict, t2 - t1)
    return draft, verdict, q, t1 - t0


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share from the start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def emitted(draft: Draft, verdict: Verdict) -> list[int]:
    return draft.tokens[:verdict.n_accepted] + [verdict.token]


class CheckingDrafter:
    """The middle level: checks the drafts of the level below, drafts for the level above. Its
    cache is reached through callbacks: `synced_length()` (the full-cache length it reflects),
    `sync()` (copy in the KV the top level accepted) and `rebuild()` (re-select it)."""

    def __init__(self, scorer: Scorer, below: Drafter | None, stats: LevelStats, tuner: GammaTuner,
                 synced_length: Callable[[], int], sync: Callable[[], None],
                 rebuild: Callable[[], None], rebuild_every_tokens: int, rebuild_below: float):
        self.scorer, self.below, self.stats, self.tuner = scorer, below, stats, tuner
        self.synced_length, self.sync, self.rebuild = synced_length, sync, rebuild
        self.rebuild_every_tokens, self.rebuild_below = rebuild_every_tokens, rebuild_below
        self.tokens: list[int] = []
        # what this level drafted after `tokens` at the top's request; None: no request since
        # the last extend, so the next extension is a prompt (a question), not checked tokens
        self.drafted: list[int] | None = None
        self.n_since_rebuild = 0
        self.window = LevelStats("window")  # acceptance since the last rebuild

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self.drafted = list(tokens), None
        if self.below:
            self.below.reset(tokens)
        self._rebuild()

    def _rebuild(self) -> None:
        self.rebuild()
        self.n_since_rebuild, self.window = 0, LevelStats("window")

    def extend(self, tokens: list[int]) -> None:
        is_prompt, n_same = self.drafted is None, shared_prefix(tokens, self.drafted or [])
        if self.below:
            self.below.truncate(len(self.tokens) + n_same)
            self.below.extend(tokens[n_same:])
        self.tokens += tokens
        self.drafted = None
        if is_prompt:
            self.n_since_rebuild = self.rebuild_every_tokens  # re-select for the new question
        else:
            self.n_since_rebuild += len(tokens)
            self.sync()

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        self.drafted = None
        if self.below:
            self.below.truncate(length)
        if length - 1 >= self.synced_length():  # only tokens this cache never took: the selection stands
            self.sync()
        else:
            self._rebuild()

    def propose(self, gamma: int, sampling: SamplingConfig, coins: Coins) -> Steps[Draft]:
        w = self.window
        is_poor = w.n_tested >= 32 and w.acceptance < self.rebuild_below
        if self.n_since_rebuild >= self.rebuild_every_tokens or is_poor:
            self._rebuild()
        pending = self.tokens[self.synced_length():]
        drafted, qs = [], []
        while len(drafted) < gamma:
            g = min(self.tuner.gamma(), gamma - len(drafted))
            draft, verdict, q, _ = yield from check(self.scorer, self.below, g, self.tuner, self.stats, pending,
                                                    self.tokens + drafted, sampling, coins)
            self.window.record(verdict, 0.0)
            new = emitted(draft, verdict)
            qs += q[:verdict.n_accepted + 1]
            drafted += new
            if self.below:
                self.below.extend(new)
            pending = [verdict.token]
        self.drafted = drafted
        probs = None if sampling.is_greedy or not gamma else torch.stack(qs[:gamma])
        return Draft(drafted[:gamma], probs)


class LevelStack:
    """The committed tokens of one conversation and the levels that extend them.

    The rule every method keeps: the top cache holds every committed token but the last (after a
    prefill or a rollback, all of them); the tokens it lacks are fed with the top's next forward.
    """

    def __init__(self, top: Scorer, drafter: Drafter | None, top_stats: LevelStats, tuner: GammaTuner,
                 direct_tuner: GammaTuner | None = None, prefill: Prefill | None = None):
        self.top, self.drafter, self.top_stats, self.tuner = top, drafter, top_stats, tuner
        self.direct_tuner = direct_tuner  # draft lengths of the bottom drafter checked by the top
        self.prefill = prefill  # (ids, cancel) -> the forwards that write ids' KV after the top cache's
        self.tokens: list[int] = []
        self.drafter_s = 0.0

    def reset(self, tokens: list[int]) -> None:
        """Start from committed tokens whose KV is in the top cache up to its length."""
        self.tokens = list(tokens)
        if self.drafter:
            self.drafter.reset(tokens)

    def _hold_all_but_last(self) -> None:
        self.top.cache.truncate(min(self.top.cache.length, len(self.tokens) - 1))

    def truncate(self, length: int) -> None:
        """Roll back to `length` tokens, keeping their KV in the top cache, all of them as after
        a prefill: a question asked again is prefilled as it was the first time (re-feeding the
        last token with it would round its KV differently, and a greedy answer could change)."""
        del self.tokens[length:]
        self.top.cache.truncate(min(self.top.cache.length, length))
        if self.drafter:
            self.drafter.truncate(length)

    def extend(self, prompt: list[int], cancel=None) -> Steps[None]:
        """Commit `prompt` (a question): its KV but the last token's is prefilled, in chunks
        between which `cancel` is checked; `Cancelled` leaves the stack as it was."""
        n_kept = self.top.cache.length
        try:
            yield from self.prefill(self.tokens[n_kept:] + prompt[:-1], cancel)
        except Cancelled:
            self.top.cache.truncate(n_kept)
            raise
        self.tokens += prompt
        if self.drafter:
            self.drafter.extend(prompt)

    def _goes_direct(self, gamma: int, direct_gamma: int) -> bool:
        """Whether the drafter below the middle level proposes to the top itself this check: the
        top's tuner declined the middle level (gamma 0), or, adaptive, expects more tokens per second
        from that (`direct_tuner`). Past timings and acceptance decide, never this check's coins
        (both tuners price the top's checks, so both rates are measured or neither)."""
        if gamma == 0:
            return True
        if self.tuner.fixed is not None:
            return False
        return self.direct_tuner.expected_rate(direct_gamma) > self.tuner.expected_rate(gamma)

    def step(self, sampling: SamplingConfig, coins: Coins, limit: int, stop_ids: Collection[int] = ()
             ) -> Steps[tuple[list[int], str | None]]:
        """One check of the top level: the tokens it commits (1 to `limit`, cut after the first
        stop token) and why the answer ends ("stop", "length") or None."""
        self._hold_all_but_last()  # (after a rollback the cache may hold the last token too)
        pending = self.tokens[self.top.cache.length:]
        drafter, tuner = self.drafter, self.tuner
        gamma = tuner.gamma() if drafter else 0
        direct_gamma = self.direct_tuner.gamma() if self.direct_tuner is not None else None
        if direct_gamma is not None and self._goes_direct(gamma, direct_gamma):
            # the middle level does not pay now: its drafter proposes to the top; the middle runs
            # no forward, but re-selects its cache on schedule ("where the model is reading")
            yield from drafter.propose(0, sampling, coins)
            drafter, tuner, gamma = drafter.below, self.direct_tuner, direct_gamma
        draft, verdict, _, draft_s = yield from check(self.top, drafter, gamma, tuner, self.top_stats, pending,
                                                      self.tokens, sampling, coins)
        self.drafter_s += draft_s
        new, reason = cut(emitted(draft, verdict), limit, stop_ids)
        self.tokens += new
        self._hold_all_but_last()  # a cut token's KV is in the top cache
        if self.drafter:
            self.drafter.extend(new)
        return new, reason


def cut(new: list[int], limit: int, stop_ids: Collection[int]) -> tuple[list[int], str | None]:
    """`new` up to its first stop token and at most `limit` tokens, and why the answer ends there."""
    for i, t in enumerate(new[:limit]):
        if t in stop_ids:
            return new[:i + 1], "stop"
    return new[:limit], "length" if len(new) >= limit else None
