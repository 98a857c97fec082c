"""Context n-gram database: a model-free drafter (docs/ALGORITHM.md section 5, after Hierarchy Drafting).

One index over the committed sequence (document, chat, this answer): each n-gram (1..max_ngram
tokens) maps to the positions that follow its occurrences, in increasing order. A lookup tries
the longest suffix first and walks occurrences from the most recent back, so this answer's
tokens come before the chat's and the chat's before the document's (temporal locality). It
returns up to `n_candidates` distinct continuations as a token tree (a trie), checked with the
multi-candidate rule. The document is indexed once; later tokens are added and removed
incrementally. No static table of frequent model n-grams (yet).
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

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)  # the n-grams ending at `end - 1` are followed by position `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                self.index.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def truncate(self, length: int) -> None:
        while len(self.tokens) > length:
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                key = tuple(self.tokens[end - n:end])
                positions = self.index[key]
                positions.pop()
                if not positions:
                    del self.index[key]
            self.tokens.pop()

    def longest_match(self, gamma: int) -> tuple[int, list[list[int]]]:
        """(length of the longest suffix that occurs earlier with a continuation, 0 if none;
        the distinct continuations of it and of shorter suffixes, most recent first)."""
        found: list[list[int]] = []
        end, longest = len(self.tokens), 0
        for n in range(min(self.max_ngram, end), 0, -1):
            positions = self.index.get(tuple(self.tokens[end - n:end]), [])
            for p in reversed(positions[-MAX_SCAN:]):
                cont = self.tokens[p:p + gamma]
                if cont and cont not in found:
                    longest = longest or n
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
    node_of: dict[tuple[int, ...], int] = {}
    for cand in candidates:
        for depth in range(len(cand)):
            key = tuple(cand[: depth + 1])
            if key not in node_of:
                node_of[key] = len(tokens)
                tokens.append(cand[depth])
                parents.append(node_of[key[:-1]] if depth else -1)
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None)
