"""Batched decoding (engine/batch.py) commits, for every session, what the session commits alone:
greedy tokens identical for every stack with sessions of different lengths joining and leaving
mid-answer; sampled tokens identical seed for seed when draft lengths are fixed, and distributed
as plain decoding's (chi-square) when they are tuned; a stopped session never disturbs the others."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from engine.batch import Batcher, Job
from engine.config import LEVEL_STACKS, BadTokens, Busy, SamplingConfig
from engine.session import Event
from tests.conftest import tiny_engine
from tests.engine.test_speculative import CHI_SAMPLES, CHI_VOCAB, chi_setup, chi_square_pvalue, random_ids

DOCS = [random_ids(123, 128, 21), random_ids(77, 128, 22), random_ids(150, 128, 23)]
QUESTIONS = [random_ids(5, 128, 31), random_ids(9, 128, 32), random_ids(3, 128, 33)]
MAX_NEW = [18, 9, 14]  # answers end at different rounds


def answer(job: Job) -> tuple[list[int], str | None]:
    """Tokens and finish reason of a job whose answer is over (its queue holds every item)."""
    events = list(job.stream())
    assert all(isinstance(e, Event) for e in events)
    return [t for e in events for t in e.tokens], events[-1].finish_reason


def alone(engine, sampling: SamplingConfig, seeds=(0, 1, 2)):
    out = []
    for doc, q, n, seed in zip(DOCS, QUESTIONS, MAX_NEW, seeds):
        s = replace(sampling, max_new_tokens=n, seed=seed)
        events = list(engine.open(doc).ask(q, s))
        out.append(([t for e in events for t in e.tokens], events[-1].finish_reason))
    return out


def batched(engine, sampling: SamplingConfig, seeds=(0, 1, 2), cancel_second_after: int | None = None):
    """Sessions 0 and 1 start together, session 2 joins after 3 rounds; rounds run until all end."""
    sessions = [engine.open(doc) for doc in DOCS]
    batcher = Batcher(max_active=8, background=False)
    cancel = threading.Event()
    jobs = []

    def submit(i, cancel_flag=None):
        s = replace(sampling, max_new_tokens=MAX_NEW[i], seed=seeds[i])
        jobs.append(batcher.submit(sessions[i].answer_steps(QUESTIONS[i], s, cancel_flag)))

    submit(0)
    submit(1, cancel)
    sizes = []
    for r in range(200):
        if r == 3:
            submit(2)
        if cancel_second_after is not None and r == cancel_second_after:
            cancel.set()
        if not batcher.active and not batcher.waiting and r > 3:
            break
        batcher.round()
        sizes.append(len(batcher.active))
    return [answer(job) for job in jobs], batcher, sizes


@pytest.mark.parametrize("levels", LEVEL_STACKS)
def test_batched_greedy_equals_each_session_alone(levels):
    want = alone(tiny_engine(levels), SamplingConfig())
    got, batcher, sizes = batched(tiny_engine(levels), SamplingConfig())
    assert got == want
    assert [r for _, r in got] == ["length"] * 3
    assert batcher.n_segments > batcher.n_forwards  # forwards were really shared
    assert max(sizes) == 3 and sizes[-1] < 3  # all three at once, then sessions left


@pytest.mark.parametrize("levels", ["ngram>full", "draft>retrieval>full", "ngram>retrieval>full"])
def test_batched_sampling_equals_alone_seed_for_seed_with_fixed_draft_lengths(levels):
    """With fixed draft lengths every random draw happens in the same order, so a session's
    sampled answer in the batch is the one it samples alone (same seed)."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    fixed = dict(gamma_bottom=3, gamma_middle=4)
    want = alone(tiny_engine(levels, **fixed), sampling, seeds=(5, 6, 7))
    got, _, _ = batched(tiny_engine(levels, **fixed), sampling, seeds=(5, 6, 7))
    assert got == want


@pytest.mark.parametrize("levels", ["ngram>retrieval>full", "draft>full"])
def test_stopping_one_session_leaves_the_others_unchanged(levels):
    want = alone(tiny_engine(levels), SamplingConfig())
    got, _, _ = batched(tiny_engine(levels), SamplingConfig(), cancel_second_after=2)
    assert got[0] == want[0] and got[2] == want[2]
    tokens, reason = got[1]
    assert reason == "cancelled" and len(tokens) < MAX_NEW[1]
    assert tokens == want[1][0][:len(tokens)]


@pytest.mark.parametrize("levels", ["ngram>retrieval>full", "draft>retrieval>full"])
def test_batched_sampled_tokens_follow_plain_decoding(levels):
    """Tuned draft lengths (so draws differ from a lone run): the second answer token of 400
    seeded answers, decoded 8 sessions at a time, against plain decoding's exact distribution."""
    doc, q, sampling, probs = chi_setup(1.0, 1.0)
    engine = tiny_engine(levels, vocab=CHI_VOCAB)
    sessions = [engine.open(doc) for _ in range(8)]
    batcher = Batcher(max_active=8, background=False)
    counts = torch.zeros(CHI_VOCAB)
    for first in range(0, CHI_SAMPLES, len(sessions)):
        jobs = [batcher.submit(s.answer_steps(q, replace(sampling, seed=first + i))) for i, s in enumerate(sessions)]
        while batcher.active or batcher.waiting:
            batcher.round()
        for job, s in zip(jobs, sessions):
            counts[answer(job)[0][1]] += 1
            s.truncate(len(doc))
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_background_thread_serves_concurrent_consumers_and_errors_stay_local():
    engine = tiny_engine("ngram>retrieval>full")
    want = alone(engine, SamplingConfig())
    sessions = [engine.open(doc) for doc in DOCS]
    batcher = Batcher(max_active=2)  # the third waits for a free place
    results: dict[int, list[int]] = {}

    def consume(i):
        s = SamplingConfig(max_new_tokens=MAX_NEW[i])
        results[i] = [t for e in batcher.ask(sessions[i], QUESTIONS[i], s) for t in e.tokens]

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(3)] == [w[0] for w in want]
    with pytest.raises(BadTokens):  # a bad request fails alone; the batcher keeps serving
        list(batcher.ask(sessions[0], [10**6], SamplingConfig(max_new_tokens=2)))
    assert len(list(batcher.ask(sessions[1], [3], SamplingConfig(max_new_tokens=2)))) >= 1


def test_answers_beyond_max_active_wait_their_turn():
    engine = tiny_engine("plain")
    want = alone(engine, SamplingConfig())
    sessions = [engine.open(doc) for doc in DOCS]
    batcher = Batcher(max_active=2, background=False)
    jobs = [batcher.submit(sessions[i].answer_steps(QUESTIONS[i], SamplingConfig(max_new_tokens=MAX_NEW[i])))
            for i in range(3)]
    batcher.round()
    assert (len(batcher.active), len(batcher.waiting)) == (2, 1)  # the third waits for a free place
    most_active = 0
    while batcher.active or batcher.waiting:
        batcher.round()
        most_active = max(most_active, len(batcher.active))
    assert most_active == 2
    assert [answer(job) for job in jobs] == want


def test_one_answer_at_a_time_per_session():
    engine = tiny_engine("plain")
    session = engine.open(DOCS[0])
    first = session.answer_steps(QUESTIONS[0], SamplingConfig(max_new_tokens=4))
    next(first)  # holds the session
    with pytest.raises(Busy):
        next(session.answer_steps(QUESTIONS[1], SamplingConfig(max_new_tokens=4)))
    first.close()  # releases it
    assert len([t for e in session.ask(QUESTIONS[1], SamplingConfig(max_new_tokens=4)) for t in e.tokens]) == 4


def test_stop_while_reading_a_long_question_keeps_the_chat_as_it_was():
    engine = tiny_engine("ngram>retrieval>full")  # prefill chunks of 7 tokens: cancel between them
    session = engine.open(DOCS[0])
    n_doc = session.length
    cancel = threading.Event()
    long_question = random_ids(40, 128, 40)

    def stop_after_two_chunks(done, total):
        if done >= 14:
            cancel.set()

    engine_prefill = engine.prefill_steps
    engine.prefill_steps = lambda *a, **k: engine_prefill(*a[:3], on_progress=stop_after_two_chunks, cancel=cancel)
    events = list(session.ask(long_question, SamplingConfig(max_new_tokens=5), cancel=cancel))
    engine.prefill_steps = engine_prefill
    assert [e.finish_reason for e in events] == ["cancelled"] and session.length == n_doc
    assert session.full.length <= n_doc
    again = [t for e in session.ask(QUESTIONS[0], SamplingConfig(max_new_tokens=6)) for t in e.tokens]
    fresh = tiny_engine("ngram>retrieval>full").open(DOCS[0])
    assert again == [t for e in fresh.ask(QUESTIONS[0], SamplingConfig(max_new_tokens=6)) for t in e.tokens]
