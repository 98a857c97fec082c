"""Sampling transforms and the acceptance rule of speculative decoding (docs/ALGORITHM.md section 3).

`q` is the distribution of the level that checks, `r` that of the level that proposed (one-hot for a
deterministic proposal). `token_probs` is the one distribution every level uses; `verify` takes its
randomness as an input (`Coins`), so tests enumerate every coin outcome. Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.config import SamplingConfig


def token_probs(logits: torch.Tensor, histories: list[list[int]], sampling: SamplingConfig) -> torch.Tensor:
    """The one distribution every level samples from: [R, V] logits, each row's answer so far
    (`draft_histories`) -> [R, V] probabilities. Penalties first, then `sampling_probs`."""
    logits = penalize(logits, histories, sampling.repetition_penalty, sampling.presence_penalty,
                      sampling.frequency_penalty)
    return sampling_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)


def draft_histories(tokens: list[int], drafted: list[int], sampling: SamplingConfig) -> list[list[int]]:
    """Each row's penalty history when a level whose sequence is `tokens` (committed, then what
    it drafted itself) checks the chain `drafted`: row 0 the answer so far, `tokens` from
    `sampling.penalty_start` on; row i + 1 that plus the first i + 1 drafted tokens. [] when the
    penalties are off (nothing to count)."""
    if (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (1.0, 0.0, 0.0):
        return []
    history = tokens[sampling.penalty_start or 0:]
    return [history + drafted[:i] for i in range(len(drafted) + 1)]


def penalize(logits: torch.Tensor, histories: list[list[int]], repetition: float = 1.0, presence: float = 0.0,
             frequency: float = 0.0) -> torch.Tensor:
    """[R, V] logits with the penalties for the tokens in each row's history ([R] lists): repetition
    as Hugging Face's `RepetitionPenaltyLogitsProcessor`, then presence and frequency as OpenAI's."""
    if (repetition, presence, frequency) == (1.0, 0.0, 0.0) or not any(histories):
        return logits
    assert len(histories) == logits.shape[0], f"{len(histories)} histories for {logits.shape[0]} rows"
    out = logits.to(torch.float64, copy=True)
    for i, history in enumerate(histories):
        if history:
            ids, counts = torch.tensor(history, device=out.device).unique(return_counts=True)
            seen = out[i, ids]
            seen = torch.where(seen < 0, seen * repetition, seen / repetition)
            out[i, ids] = seen - presence - frequency * counts.double()
    return out


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> torch.Tensor:
    """The distribution plain decoding samples from: [..., V] logits -> [..., V] probabilities.
    Hugging Face's order: temperature, top-k, top-p (keeping at least one), min-p. Ties at a cut are
    kept together, so the result does not depend on how a sort orders them."""
    if temperature == 0:  # one-hot at the argmax, written in place (no int64 one_hot to cast: a copy of V)
        hot = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
        return hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits.double() / temperature
    if 0 < top_k < logits.shape[-1]:
        return top_k_probs(logits, top_k, top_p, min_p)
    probs = logits.softmax(-1)
    if top_p < 1.0:
        probs = probs.masked_fill(probs < nucleus_threshold(probs, top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def top_k_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`sampling_probs` after the temperature, top-k on: the same transforms on the k largest only.
    Tokens tied with the k-th beyond them are counted, not sorted: they weigh in every sum, cannot move
    top-p's threshold and get the k-th's probability back. No host read: a check syncs only to copy q."""
    top, top_idx = logits.topk(top_k, dim=-1)  # [..., k] descending
    is_tied = logits == top[..., -1:]  # [..., V]
    n_beyond = is_tied.sum(-1, keepdim=True) - (top == top[..., -1:]).sum(-1, keepdim=True)  # [..., 1]

    def normalised(p: torch.Tensor) -> torch.Tensor:  # over the k and the ties beyond them
        return p / (p.sum(-1, keepdim=True) + n_beyond * p[..., -1:])

    probs = normalised((top - top[..., :1]).exp())
    if top_p < 1.0:  # nucleus_threshold's rule on values already sorted
        n_keep = ((probs.cumsum(-1) - probs) < top_p).sum(-1, keepdim=True)
        probs = normalised(probs.masked_fill(probs < probs.gather(-1, n_keep - 1), 0.0))
    if min_p > 0:
        probs = normalised(probs.masked_fill(probs < min_p * probs[..., :1], 0.0))
    return torch.where(is_tied, probs[..., -1:], 0.0).scatter_(-1, top_idx, probs)


TOP_P_CANDIDATES = 256  # first guess at the nucleus size; grown 8x until it holds top_p mass


def nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., 1]: the smallest probability top-p keeps. Keeps x when the mass of the tokens more
    probable than x is below top_p. Only the k largest are sorted (`topk`), which is exact once
    they hold top_p mass: every other token has at least that much mass before it."""
    V = probs.shape[-1]
    k = min(TOP_P_CANDIDATES, V)
    while True:
        top = probs.topk(k, dim=-1).values  # [..., k] descending
        mass = top.cumsum(-1)
        if k == V or bool((mass[..., -1] >= top_p).all()):
            break
        k = min(8 * k, V)
    n_keep = ((mass - top) < top_p).sum(-1, keepdim=True)  # >= 1: nothing comes before the first
    return top.gather(-1, n_keep - 1)


@dataclass
class Draft:
    """A proposal: a chain of tokens after the last committed one."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [N, V] r at each token's position; None = deterministic

    def __len__(self) -> int:
        return len(self.tokens)


class Coins(Protocol):
    """Where the acceptance rule gets its randomness (tests substitute an exact enumerator)."""

    def accept(self, p: float) -> bool:
        """True with probability p."""

    def sample(self, probs: torch.Tensor) -> int:
        """A draw from [V] probabilities (need not be normalised)."""


class GeneratorCoins:
    """Production coins: one uniform from a seeded generator per call, in call order."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen

    def _uniform(self) -> float:
        return float(torch.rand(1, generator=self.gen, dtype=torch.float64))

    def accept(self, p: float) -> bool:
        return self._uniform() < p

    def sample(self, probs: torch.Tensor) -> int:  # inverse CDF
        cdf = probs.cumsum(0)
        idx = int(torch.searchsorted(cdf, self._uniform() * cdf[-1], right=True))
        return min(idx, probs.shape[0] - 1)


def acceptance(q: torch.Tensor, x: int, r: torch.Tensor | None) -> tuple[float, torch.Tensor]:
    """The rule for one proposal x against q ([V]): (probability to accept, q after a rejection).
    r ([V]) for a stochastic proposal x ~ r, None for a deterministic one (docs/ALGORITHM.md section 3)."""
    if r is None:
        accept_prob, residual = float(q[x]), q.clone()
        residual[x] = 0
    else:
        accept_prob = min(1.0, float(q[x] / r[x])) if r[x] > 0 else 1.0
        residual = (q - r).clamp(min=0)
    total = residual.sum()
    return accept_prob, (residual / total if total > 0 else q)


@dataclass
class Verdict:
    n_accepted: int  # drafted tokens accepted, a prefix of the draft
    token: int  # the token emitted after them (residual draw or bonus)
    n_tested: int  # drafted tokens whose acceptance was tested (for acceptance statistics)


def verify(q: torch.Tensor, draft: Draft, coins: Coins) -> Verdict:
    """Accept a prefix of `draft` so that every emitted token is distributed as q ([N+1, V]: q[i]
    after the first i drafted tokens): each token in turn, until one is rejected."""
    for i, x in enumerate(draft.tokens):
        r = None if draft.probs is None else draft.probs[i]
        accept_prob, residual = acceptance(q[i], x, r)
        if not coins.accept(accept_prob):
            return Verdict(i, coins.sample(residual), i + 1)
    return Verdict(len(draft), coins.sample(q[len(draft)]), len(draft))
