"""Context n-gram database: a model-free drafter (docs/ALGORITHM.md section 5, after Hierarchy Drafting).

One index over the committed sequence: each n-gram (1..max_ngram tokens) maps to the positions that
follow its occurrences, in increasing order, so tokens are added and removed incrementally and a
lookup reads the most recent earlier occurrence of the longest suffix that has one.
"""

from __future__ import annotations

from engine.config import SamplingConfig
from engine.model import Steps
from engine.sampling import Coins, Draft


class NgramDrafter:
    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self.index = [], {}
        self.extend(tokens)

    def _last_ngrams(self) -> list[tuple[int, ...]]:
        """The n-grams ending with the last token, shortest first: each is followed by `len(tokens)`."""
        end = len(self.tokens)
        return [tuple(self.tokens[end - n:end]) for n in range(1, min(self.max_ngram, end) + 1)]

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            for key in self._last_ngrams():
                self.index.setdefault(key, []).append(len(self.tokens))

    def truncate(self, length: int) -> None:
        while len(self.tokens) > length:
            for key in self._last_ngrams():
                self.index[key].pop()
                if not self.index[key]:
                    del self.index[key]
            self.tokens.pop()

    def longest_match(self, gamma: int) -> tuple[int, list[int]]:
        """(length of the longest suffix that occurred before, 0 if none; up to `gamma` tokens that
        followed its most recent earlier occurrence). Each suffix's last position is this end."""
        for key in reversed(self._last_ngrams()):
            positions = self.index[key]
            if len(positions) > 1 and gamma:
                return len(key), self.tokens[positions[-2]:positions[-2] + gamma]
        return 0, []

    def propose(self, gamma: int, sampling: SamplingConfig, coins: Coins) -> Steps[Draft]:
        """A generator like every drafter's `propose`, though it never asks for a forward."""
        yield from ()
        return Draft(self.longest_match(gamma)[1])
