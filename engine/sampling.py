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


def draft_histories(tokens: list[int], draft: Draft, sampling: SamplingConfig) -> list[list[int]]:
    """Each row's penalty history when a level whose sequence is `tokens` (committed, then what
    it drafted itself) checks `draft`: row 0 (after the root) the answer so far, `tokens` from
    `sampling.penalty_start` on; row i + 1 (after node i) that plus the path from the root to
    node i. [] when the penalties are off (nothing to count)."""
    if (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (1.0, 0.0, 0.0):
        return []
    history, tokens = tokens[sampling.penalty_start or 0:], draft.tokens.tolist()
    paths = draft.ancestor_mask()[1:, 1:].tolist()  # [N, N]: node j is on the path to node i
    return [history] + [history + [t for t, on in zip(tokens, path) if on] for path in paths]


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
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
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
    """A proposal: a token tree, parents before children, siblings in the order to try them."""

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long; -1 = child of the last committed token (the root)
    probs: torch.Tensor | None  # [N, V] r at each node's position; None = deterministic

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> Draft:
        return cls(torch.tensor(tokens, dtype=torch.long), torch.arange(len(tokens)) - 1, probs)

    def depths(self) -> torch.Tensor:  # [N], root children at depth 0
        return self.ancestor_mask()[1:, 1:].sum(-1) - 1  # a node's ancestors and itself, less itself

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes...): entry [i, j] = j is i or an ancestor of i."""
        n = len(self)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i + 1] |= mask[p + 1]
        return mask


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
    path: list[int]  # accepted node indices, root to leaf
    token: int  # the token emitted after the path (residual draw or bonus)
    n_tested: int  # nodes whose acceptance was tested (for acceptance statistics)


def verify(q: torch.Tensor, draft: Draft, coins: Coins) -> Verdict:
    """Accept a prefix of `draft` so that every emitted token is distributed as q ([N+1, V]: q[0]
    after the root, q[i+1] after node i). Stochastic drafts must be chains; deterministic ones may branch."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents.tolist()):
        children.setdefault(p, []).append(i)
    assert draft.probs is None or all(len(c) == 1 for c in children.values()), "stochastic tree"
    tokens = draft.tokens.tolist()
    path, node, n_tested, q_cur = [], -1, 0, q[0]
    while True:
        for c in children.get(node, []):  # siblings in order until one is accepted
            n_tested += 1
            r = None if draft.probs is None else draft.probs[c]
            accept_prob, residual = acceptance(q_cur, tokens[c], r)
            if coins.accept(accept_prob):
                break
            q_cur = residual
        else:  # none accepted (or a leaf): the residual draw, or the bonus
            return Verdict(path, coins.sample(q_cur), n_tested)
        path.append(c)
        node, q_cur = c, q[c + 1]
