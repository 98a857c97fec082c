"""Context n-gram database: a model-free drafter (docs/ALGORITHM.md section 5, after Hierarchy Drafting).

One index over the committed sequence: each n-gram (1..max_ngram tokens) maps to the positions that
follow its occurrences, in increasing order, so tokens are added and removed incrementally and a
lookup reads the most recent occurrences first.
"""

from __future__ import annotations

import torch

from engine.config import SamplingConfig
from engine.model import Steps
from engine.sampling import Coins, Draft

MAX_SCAN = 64  # occurrences examined per suffix length: bounds a lookup of a frequent n-gram


class NgramDrafter:
    def __init__(self, max_ngram: int, n_candidates: int):
        self.max_ngram, self.n_candidates = max_ngram, n_candidates
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

    def longest_match(self, gamma: int) -> tuple[int, list[list[int]]]:
        """(length of the longest suffix that occurs earlier with a continuation, 0 if none;
        the distinct continuations of it and of shorter suffixes, most recent first)."""
        found: list[list[int]] = []
        longest = 0
        for key in reversed(self._last_ngrams()):
            for p in reversed(self.index.get(key, [])[-MAX_SCAN:]):
                cont = self.tokens[p:p + gamma]
                if cont and cont not in found:
                    longest = longest or len(key)
                    found.append(cont)
                    if len(found) == self.n_candidates:
                        return longest, found
        return longest, found

    def propose(self, gamma: int, sampling: SamplingConfig, coins: Coins) -> Steps[Draft]:
        """A generator like every drafter's `propose`, though it never asks for a forward."""
        yield from ()
        return trie(self.longest_match(gamma)[1])


def trie(candidates: list[list[int]]) -> Draft:
    """Merge candidate sequences into a token tree (shared prefixes become one path)."""
    tokens, parents = [], []
    node_of: dict[tuple[int, ...], int] = {(): -1}  # a path from the root -> its node
    for cand in candidates:
        for depth in range(len(cand)):
            key = tuple(cand[: depth + 1])
            if key not in node_of:
                node_of[key] = len(tokens)
                tokens.append(cand[depth])
                parents.append(node_of[key[:-1]])
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None)
