"""Exact enumeration of every random outcome of a program that draws through `Coins`.

`exact_distribution(run)` re-runs `run(coins)` once per path of coin outcomes (depth first,
replaying the choices of the path so far) and sums each output's probability in float64.
Paths less likely than `min_prob` are dropped; their total mass is returned so a test can bound
the error it causes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import torch


class _NewChoice(Exception):
    def __init__(self, options: list[tuple[object, float]]):
        self.options = options


class ScriptedCoins:
    """Answers with a fixed script of outcomes; asks for a new branch when the script runs out."""

    def __init__(self, script: list[object]):
        self.script, self.i = script, 0

    def _choose(self, options: list[tuple[object, float]]):
        if self.i == len(self.script):
            raise _NewChoice(options)
        self.i += 1
        return self.script[self.i - 1]

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
        script, weight = stack.pop()
        try:
            out = run(ScriptedCoins(script))
        except _NewChoice as choice:
            for outcome, w in choice.options:
                if w == 0:
                    continue
                if weight * w < min_prob:
                    pruned += weight * w
                else:
                    stack.append((script + [outcome], weight * w))
            continue
        n_paths += 1
        assert n_paths <= max_paths, "too many paths to enumerate"
        dist[out] += weight
    return dict(dist), pruned
