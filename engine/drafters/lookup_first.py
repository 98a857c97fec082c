"""Look up first, then the small model: Hierarchy Drafting's order of drafters (docs/ALGORITHM.md section 5).

The n-gram database drafts when a suffix of `min_match` tokens or more matches (the answer copies the
book); a match of one or two common tokens ("of the") is mostly rejected, so the small model drafts then.
"""

from __future__ import annotations

from engine.config import SamplingConfig
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.model import Steps
from engine.sampling import Coins, Draft


class LookupFirst:
    def __init__(self, ngram: NgramDrafter, model: ModelDrafter, min_match: int = 3):
        self.ngram, self.model, self.min_match = ngram, model, min_match

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
        n, found = self.ngram.longest_match(gamma)  # gamma 0: no match, and the model runs no forward
        if n >= self.min_match:
            return Draft(found)
        return (yield from self.model.propose(gamma, sampling, coins))
