"""engine/drafters/lookup_first.py: the n-gram database drafts when the answer repeats the context,
the small model when it does not, and both follow the committed sequence."""

import torch

from engine.config import SamplingConfig
from engine.drafters.lookup_first import LookupFirst
from engine.drafters.ngram import NgramDrafter
from engine.sampling import GeneratorCoins
from tests.conftest import tiny_engine


def drive(steps):
    """Run a drafter's forward requests alone; returns (result, number of forwards)."""
    n, request = 0, None
    try:
        request = next(steps)
        while True:
            n += 1
            request = steps.send(request.model.forward_packed([request.segment])[0])
    except StopIteration as stop:
        return stop.value, n


def drafter(min_match: int = 3) -> LookupFirst:
    engine = tiny_engine("draft>full")
    return LookupFirst(NgramDrafter(4), engine._bottom_drafter("draft"), min_match)


def test_a_long_match_drafts_from_the_database_without_a_forward():
    d, coins = drafter(), GeneratorCoins(torch.Generator().manual_seed(0))
    d.reset([5, 6, 7, 8, 9, 10, 11, 20, 21, 5, 6, 7])  # "5 6 7" occurred before, followed by "8 9 10"
    draft, n_forwards = drive(d.propose(3, SamplingConfig(), coins))
    assert n_forwards == 0 and draft.tokens[:3] == [8, 9, 10]


def test_a_short_match_asks_the_model_which_has_seen_every_committed_token():
    d, coins = drafter(), GeneratorCoins(torch.Generator().manual_seed(0))
    d.reset([5, 6, 7, 8, 9, 10, 11, 20, 21, 40, 6, 7])  # only "6 7" (2 tokens) occurred before
    draft, n_forwards = drive(d.propose(3, SamplingConfig(), coins))
    assert n_forwards >= 3 and len(draft.tokens) == 3
    assert d.model.tokens == d.ngram.tokens == [5, 6, 7, 8, 9, 10, 11, 20, 21, 40, 6, 7]
    d.extend([8, 9])  # now "6 7 8 9": a 4-token match ("6 7 8" -> 9 10 11)
    draft, n_forwards = drive(d.propose(2, SamplingConfig(), coins))
    assert n_forwards == 0 and draft.tokens[:2] == [10, 11]
    d.truncate(11)
    assert d.model.tokens == d.ngram.tokens == [5, 6, 7, 8, 9, 10, 11, 20, 21, 40, 6]


def test_the_model_draft_equals_the_model_drafters_own_after_skipped_tokens():
    """Tokens committed while the database drafted are fed to the model at its next draft: its
    draft is the one a model drafter that had drafted all along would give (greedy)."""
    a, b = drafter(min_match=1), drafter(min_match=99)  # a: database whenever it can; b: model always
    greedy, coins = SamplingConfig(temperature=0.0), GeneratorCoins(torch.Generator().manual_seed(0))
    history = [5, 6, 7, 8, 9, 10, 11, 20, 21, 5, 6, 7]
    for d in (a, b):
        d.reset(history)
    assert drive(a.propose(2, greedy, coins))[1] == 0  # database
    drive(b.propose(2, greedy, coins))
    for d in (a, b):
        d.extend([8, 9, 33])
    a.min_match = 99
    (draft_a, _), (draft_b, _) = drive(a.propose(3, greedy, coins)), drive(b.propose(3, greedy, coins))
    assert draft_a.tokens == draft_b.tokens
