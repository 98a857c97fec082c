"""Sources from the model's attention (engine/sources.py): the shares equal a brute-force oracle,
and scoring a question leaves the session exactly as it was, so the answer after it is the answer
without it, token for token, greedy and sampled, for every kind of level stack."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import DocumentTooLong, EmptyPrompt, SamplingConfig
from engine.sources import chunk_ranges, contrast, layer_shares
from tests.conftest import tiny_engine
from tests.engine.test_speculative import random_ids


def oracle_shares(queries, keys, start, end, C):
    """Loops over layers and query heads: the last query's softmax over the span, summed per chunk."""
    L, B, Hkv, S, D = keys.shape
    n = (end - start) // C
    rows = []
    for layer_idx, q in enumerate(queries):
        G, total = q.shape[1] // Hkv, [0.0] * n
        for h in range(q.shape[1]):
            logits = [float(q[0, h, -1] @ keys[layer_idx, 0, h // G, start + j]) / math.sqrt(D) for j in range(n * C)]
            z = sum(math.exp(x) for x in logits)
            for j, x in enumerate(logits):
                total[j // C] += math.exp(x) / z
        rows.append([t / sum(total) for t in total])
    return rows


def test_layer_shares_equal_a_brute_force_oracle():
    torch.manual_seed(0)
    keys = torch.randn(3, 1, 2, 50, 8, dtype=torch.float64)  # [L, B, Hkv, S, D]
    queries = [torch.randn(1, 4, 3, 8, dtype=torch.float64) for _ in range(3)]  # [B, H, M, D]
    shares = layer_shares(queries, keys, 5, 47, 4)  # 10 whole chunks, 2 positions left out
    assert shares.shape == (3, 10)
    assert torch.allclose(shares, torch.tensor(oracle_shares(queries, keys, 5, 47, 4), dtype=torch.float64),
                          atol=1e-12)
    ranges = chunk_ranges(contrast(shares, shares.flip(1)), 5, 4)
    assert [r[:2] for r in ranges[:2]] == [(5, 9), (9, 13)] and ranges[-1][1] == 45
    assert abs(sum(r[2] for r in ranges) - 1) < 1e-12


def test_contrast_keeps_what_the_question_reads_more_than_the_neutral_one():
    neutral = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.2, 0.2, 0.2]], dtype=torch.float64)
    asked = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.4, 0.1, 0.2, 0.3]], dtype=torch.float64)
    # chunk 0: read less than by the neutral question; chunk 2: +0.2 in layer 0; chunk 3: +0.1 in layer 1
    assert torch.allclose(contrast(asked, neutral), torch.tensor([0, 0, 2 / 3, 1 / 3], dtype=torch.float64))
    assert torch.allclose(contrast(neutral, neutral), neutral.sum(0) / 2)  # nothing more: its own shares


def test_no_whole_chunk_gives_no_shares():
    keys = torch.randn(1, 1, 2, 10, 8, dtype=torch.float64)
    assert layer_shares([torch.randn(1, 4, 2, 8, dtype=torch.float64)], keys, 4, 7, 4).numel() == 0


def answer(session, q, sampling):
    return [t for e in session.ask(q, sampling) for t in e.tokens]


@pytest.mark.parametrize("levels", ["plain", "ngram>full", "retrieval>full", "ngram>retrieval>full"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scoring_a_question_leaves_its_answer_unchanged(levels, temperature):
    engine = tiny_engine(levels, gamma_bottom=3, gamma_middle=2)  # adaptive lengths follow timings
    doc, q1, q2, neutral = (random_ids(n, 128, seed) for n, seed in ((90, 1), (6, 2), (5, 3), (4, 9)))
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=12, seed=4)
    plain = engine.open(doc)
    expected = [answer(plain, q1, sampling), answer(plain, q2, sampling)]
    scored = engine.open(doc)
    got = []
    for q in (q1, q2):  # the second question also scores after an answer (its last token not in the cache)
        n_held, queries = scored.length, list(scored.query_log.queries)
        ranges = scored.score_document(q, 3, 90, neutral)
        assert scored.length == n_held and scored.full.length <= n_held
        assert all(a is b for a, b in zip(scored.query_log.queries, queries, strict=True))
        assert len(ranges) == (90 - 3) // engine.config.retrieval.chunk_tokens
        assert abs(sum(s for _, _, s in ranges) - 1) < 1e-9
        got.append(answer(scored, q, sampling))
    assert got == expected


def test_scoring_refuses_what_asking_refuses():
    session = tiny_engine("plain").open(random_ids(40, 128, 5))
    with pytest.raises(EmptyPrompt):
        session.score_document([], 0, 40, [5])
    with pytest.raises(DocumentTooLong):
        session.score_document(random_ids(5000, 128, 6), 0, 40, [5])
    assert session.score_document(random_ids(3, 128, 7), 38, 40, [5]) == []  # no whole chunk: no sources
