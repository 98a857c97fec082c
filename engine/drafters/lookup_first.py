"""Look up first, then the small model: Hierarchy Drafting's order of drafters (docs/ALGORITHM.md section 5).

When the answer copies the book, the context n-gram database drafts for free and is accepted
long; when it does not, a match of one or two common tokens ("of the") is mostly rejected and
the small model drafts better. `LookupFirst` proposes the database's candidates when the
committed sequence's last `min_match` tokens or more occur earlier with a continuation, and asks
the model otherwise. Both drafters follow the committed sequence; the model is fed the tokens it
missed at its next draft. Which drafter proposed changes only the drafts, never the output: the
level above checks either with the exact rule.
"""

from __future__ import annotations

from engine.config import SamplingConfig
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter, trie
from engine.model import Steps
from engine.sampling import Coins, Draft


class LookupFirst:
    def __init__(self, ngram: NgramDrafter, model: ModelDrafter, min_match: int = 3):
        self.ngram, self.model, self.min_match = ngram, model, min_match
        self.n_lookups = self.n_model_drafts = 0  # which drafter proposed, for the benchmarks

    def reset(self, tokens: list[int]) -> None:
        self.ngram.reset(tokens)
        self.model.reset(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.ngram.extend(tokens)
        self.model.extend(tokens)

    def truncate(self, length: int) -> None:
        self.ngram.truncate(length)
        self.model.truncate(length)

    def propose(self, gamma: int, sampling: SamplingConfig, coins: Coins) -> Steps[Draft]:
        if gamma == 0:
            return (yield from self.model.propose(0, sampling, coins))
        n, found = self.ngram.longest_match(gamma)
        if n >= self.min_match:
            self.n_lookups += 1
            return trie(found)
        self.n_model_drafts += 1
        return (yield from self.model.propose(gamma, sampling, coins))
