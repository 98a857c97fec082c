"""A model drafter: a small model (or the target itself, MagicDec) over a StreamingLLM cache
(docs/ALGORITHM.md section 5). It samples `gamma` tokens from its own `r`, then rolls its cache
back to the committed tokens. On a document it reads only the sinks and the last window (a full
streaming pass would give them slightly different KV: other drafts, never another output).
"""

from __future__ import annotations

import torch

from engine.config import SamplingConfig
from engine.graphs import StaticDecodeStep
from engine.kv.streaming import StreamingCache
from engine.model import Forward, Segment, Steps, Transformer
from engine.sampling import Coins, Draft, draft_histories, token_probs


class ModelDrafter:
    def __init__(self, model: Transformer, cache: StreamingCache, decode_step: StaticDecodeStep | None = None):
        self.model, self.cache = model, cache
        self.decode_step = decode_step  # one-token steps at a fixed shape (CUDA graphs), else None
        self.tokens: list[int] = []
        self.n_fed = 0  # committed tokens whose KV is in the cache (the last ones, contiguously)

    def reset(self, tokens: list[int]) -> None:
        """Start over; the sinks are fed at the next `propose` (the only method that runs the model)."""
        self.tokens, self.n_fed = list(tokens), 0
        self.cache.truncate(0)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        if length < self.n_fed:
            self._unfeed(self.n_fed - length)

    def _unfeed(self, n_tokens: int) -> None:
        """Drop the last n fed tokens from the cache; start over when they reach into the sinks."""
        if self.cache.length - n_tokens < self.cache.sink_tokens:
            self.reset(self.tokens)
        else:
            self.cache.truncate(self.cache.length - n_tokens)
            self.n_fed -= n_tokens

    def _feed(self, tokens: list[int]) -> Steps[torch.Tensor]:
        """Run `tokens` through the model in pieces that fit; return the last logits [V]."""
        step = self.cache.max_new_tokens
        device = self.model.lm_head.weight.device
        for i in range(0, len(tokens), step):
            piece = tokens[i:i + step]
            self.cache.make_room(len(piece))
            start = self.cache.length
            if len(piece) == 1 and self.decode_step:
                logits = self.decode_step(piece[0], start)[0, -1]
                continue
            ids = torch.tensor([piece], device=device)
            pos = torch.arange(start, start + len(piece), device=device)
            logits = (yield Forward(self.model, Segment(ids, pos, self.cache)))[0, -1]
        return logits

    def propose(self, gamma: int, sampling: SamplingConfig, coins: Coins) -> Steps[Draft]:
        if gamma == 0:  # no forward: the committed tokens are fed with the next real draft
            return Draft([])
        c = self.cache
        if self.n_fed == len(self.tokens):  # the last token must be fed again to get its logits
            self._unfeed(1)
        if self.n_fed == 0 and c.length == 0 and len(self.tokens) > c.sink_tokens + c.window_tokens + 1:
            # after a reset: the sinks, then the last window, as a StreamingLLM cache holds them
            yield from self._feed(self.tokens[:c.sink_tokens])
            self.n_fed = len(self.tokens) - c.window_tokens - 1
        pending = self.tokens[self.n_fed:]
        n_head = max(0, len(pending) - (c.max_new_tokens - gamma))
        if n_head:
            yield from self._feed(pending[:n_head])
        c.make_room(len(pending) - n_head + gamma)  # no eviction while drafting
        logits = yield from self._feed(pending[n_head:])
        self.n_fed = len(self.tokens)
        committed_length = c.length
        drafted, probs = [], []
        for i in range(gamma):
            histories = draft_histories(self.tokens + drafted, [], sampling)
            r = token_probs(logits.double()[None], histories, sampling)[0]
            # greedy too through `coins` (r is one-hot): under tensor parallel rank 0 draws for every
            # rank (parallel.SharedCoins), whose logits, summed in another order, could differ
            x = coins.sample(r)
            drafted.append(x)
            probs.append(r)
            if i + 1 < gamma:
                logits = yield from self._feed([x])
        c.truncate(committed_length)
        return Draft(drafted, None if sampling.is_greedy else torch.stack(probs))
