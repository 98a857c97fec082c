"""Exact enumeration of every random outcome of a program that draws through `Coins`.

`exact_distribution(run)` runs `run(coins)` once per path of coin outcomes (depth first: a run
replays the choices of a path so far, then follows first outcomes to the end, leaving the other
outcomes as paths to run) and sums each output's probability in float64.
Paths less likely than `min_prob` are dropped; their total mass is returned so a test can bound
the error it causes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import torch


class _Pruned(Exception):
    """Every outcome of a new choice is less likely than `min_prob`: the path ends here."""


class ScriptedCoins:
    """Replays a script of outcomes; past its end, takes the first outcome of each new choice and
    records the others as branches still to run (so one run walks a whole path to its end)."""

    def __init__(self, script: list[object], weight: float, min_prob: float):
        self.script, self.i, self.weight, self.min_prob = script, 0, weight, min_prob
        self.branches: list[tuple[list[object], float]] = []  # (script, probability) to run later
        self.pruned = 0.0  # probability of the outcomes dropped for being less likely than min_prob

    def _choose(self, options: list[tuple[object, float]]):
        if self.i < len(self.script):  # replaying: the script's weight already counts this choice
            self.i += 1
            return self.script[self.i - 1]
        kept = []
        for outcome, w in options:
            if self.weight * w < self.min_prob:
                self.pruned += self.weight * w
            elif w > 0:
                kept.append((outcome, self.weight * w))
        if not kept:
            raise _Pruned()
        self.branches += [(self.script + [outcome], w) for outcome, w in kept[1:]]
        outcome, self.weight = kept[0]
        self.script = self.script + [outcome]
        self.i += 1
        return outcome

    def accept(self, p: float) -> bool:
        return self._choose([(True, p), (False, 1.0 - p)])

    def sample(self, probs: torch.Tensor) -> int:
        probs = probs / probs.sum()
        return self._choose([(t, float(w)) for t, w in enumerate(probs.tolist()) if w > 0])


def exact_distribution(run: Callable[[ScriptedCoins], Hashable], min_prob: float = 0.0,
                       max_paths: int = 2_000_000) -> tuple[dict[Hashable, float], float]:
    """(output -> probability, probability mass of the pruned paths)."""
    dist: dict[Hashable, float] = defaultdict(float)
    pruned, stack, n_paths = 0.0, [([], 1.0)], 0
    while stack:
        coins = ScriptedCoins(*stack.pop(), min_prob)
        try:
            out = run(coins)
        except _Pruned:
            out = None
        stack += coins.branches
        pruned += coins.pruned
        if out is not None:
            n_paths += 1
            assert n_paths <= max_paths, "too many paths to enumerate"
            dist[out] += coins.weight
    return dict(dist), pruned
