"""The context n-gram database (engine/drafters/ngram.py) against a brute-force search: the longest
suffix that occurred before wins, its most recent earlier occurrence drafts, and the index after
any mix of extend and truncate is the one a fresh build of the same tokens gives."""

from __future__ import annotations

import random

from engine.drafters.ngram import NgramDrafter


def brute_force(tokens: list[int], max_ngram: int, gamma: int) -> tuple[int, list[int]]:
    for n in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first, the suffix itself excluded
            if tokens[start:start + n] == suffix and gamma:
                return n, tokens[start + n:start + n + gamma]
    return 0, []


def test_hand_cases():
    d = NgramDrafter(3)
    d.reset([1, 2, 3, 9, 2, 3, 8, 1, 2, 3])  # "1 2 3" occurred at the start: 3 tokens beat the later "2 3"
    assert d.longest_match(2) == (3, [9, 2])
    d.extend([7])  # "7" never occurred before
    assert d.longest_match(2) == (0, [])
    d.truncate(9)  # "... 1 2": "1 2" last occurred at the start
    assert d.longest_match(4) == (2, [3, 9, 2, 3])
    assert d.longest_match(0) == (0, [])  # gamma 0: nothing to propose


def test_random_sequences_match_brute_force_through_extend_and_truncate():
    rng = random.Random(0)
    for trial in range(200):
        max_ngram, tokens = rng.randint(1, 4), []
        d = NgramDrafter(max_ngram)
        d.reset([])
        for _ in range(30):
            if tokens and rng.random() < 0.3:
                del tokens[rng.randint(0, len(tokens) - 1):]
                d.truncate(len(tokens))
            else:
                new = [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
                tokens += new
                d.extend(new)
            gamma = rng.randint(0, 5)
            assert d.longest_match(gamma) == brute_force(tokens, max_ngram, gamma), (trial, tokens)
            fresh = NgramDrafter(max_ngram)
            fresh.reset(tokens)
            assert d.index == fresh.index and d.tokens == tokens
