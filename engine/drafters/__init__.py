"""Drafters: the levels that propose tokens. A drafter follows the committed token sequence
(`reset`, `extend`, `truncate`) and proposes a continuation of it (`propose` -> sampling.Draft)."""

from typing import Protocol

from engine.config import SamplingConfig
from engine.model import Steps
from engine.sampling import Coins, Draft


class Drafter(Protocol):
    def reset(self, tokens: list[int]) -> None:
        """Start over from this committed sequence (document + chat so far)."""

    def extend(self, tokens: list[int]) -> None:
        """The committed sequence grew by `tokens`."""

    def truncate(self, length: int) -> None:
        """The committed sequence shrank to `length` tokens."""

    def propose(self, gamma: int, sampling: SamplingConfig, coins: Coins) -> Steps[Draft]:
        """Up to `gamma` tokens continuing the committed sequence (an empty Draft when none);
        a generator of the forwards it needs (engine/model.py `Steps`)."""
