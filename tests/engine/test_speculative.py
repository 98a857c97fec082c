"""Every level stack is lossless end to end, on tiny random Llama / Qwen2 models in float64:
greedy output equals plain decoding and Hugging Face `generate` across three chat turns, and
the sampled output distribution, enumerated exactly over every random outcome, equals plain
decoding's; a chi-square test on seeded samples agrees and fails on a wrong acceptance rule."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from engine import sampling as sampling_module
from engine import speculative as speculative_module
from engine.config import LEVEL_STACKS, SamplingConfig
from engine.sampling import GeneratorCoins, Verdict
from tests.conftest import tiny_engine, tiny_hf
from tests.engine.enumerate import exact_distribution

SPECULATIVE = [s for s in LEVEL_STACKS if s != "plain"]


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chat(engine, doc, questions, sampling=SamplingConfig(max_new_tokens=14)):
    session = engine.open(doc)
    answers = []
    for q in questions:
        answers.append([t for event in session.ask(q, sampling) for t in event.tokens])
    return session, answers


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("levels", SPECULATIVE)
def test_greedy_equals_plain_and_hf_generate_over_three_turns(levels, family):
    doc = random_ids(123, 128, 1)  # not a multiple of the prefill chunk (7) nor of retrieval chunks (4)
    questions = [random_ids(n, 128, 10 + n) for n in (5, 9, 3)]
    _, plain = chat(tiny_engine("plain", family), doc, questions)
    session, got = chat(tiny_engine(levels, family), doc, questions)
    assert got == plain
    hf, context = tiny_hf(family), list(doc)
    first = hf.generate(torch.tensor([doc + questions[0]]), max_new_tokens=len(plain[0]),
                        min_new_tokens=len(plain[0]), do_sample=False, pad_token_id=0)
    assert first[0, len(doc) + len(questions[0]):].tolist() == plain[0]
    for q, answer in zip(questions, plain):  # every turn: HF's forward without a cache, argmax
        context += q
        for t in answer:
            assert int(hf(torch.tensor([context])).logits[0, -1].argmax()) == t
            context.append(t)
    assert session.tokens == context


@pytest.mark.parametrize("levels", SPECULATIVE)
def test_regenerate_after_truncate_gives_the_same_answer(levels):
    engine = tiny_engine(levels)
    doc, q = random_ids(90, 128, 2), random_ids(6, 128, 3)
    session = engine.open(doc)
    first = [t for e in session.ask(q, SamplingConfig(max_new_tokens=20)) for t in e.tokens]
    session.truncate(len(doc))
    # the book's KV all kept, as after its prefill: the question is prefilled exactly as the first
    # time (re-feeding the book's last token with it rounded differently: a bf16 answer changed)
    assert session.stack.top.cache.length == len(doc)
    again = [t for e in session.ask(q, SamplingConfig(max_new_tokens=20)) for t in e.tokens]
    assert again == first
    session.truncate(len(doc) + len(q) + 7)  # keep part of the answer: the rest must follow it
    rest = [t for e in session.ask(random_ids(2, 128, 4), SamplingConfig(max_new_tokens=5)) for t in e.tokens]
    assert len(rest) == 5 and engine.n_prefills == 1


SAMPLINGS = [SamplingConfig(temperature=1.0, max_new_tokens=2),
             SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=2)]
# strong penalties, so the first answer token reshapes the second's distribution (and min-p cuts)
PENALIZED = SamplingConfig(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.4,
                           min_p=0.02, max_new_tokens=2)


def exact_answers(levels: str, sampling: SamplingConfig, vocab: int = 6, gamma_middle: int = 1):
    """Every answer's exact probability. Sampled drafts are 1 token long (each one multiplies
    the paths by the vocabulary), n-gram drafts alone 2; the document is longer than the retrieval
    budget, so the middle level's q differs from the top's."""
    gamma_bottom = 2 if levels.startswith("ngram>") else 1  # "ngram+draft": the model may draft
    engine = tiny_engine(levels, vocab=vocab, gamma_bottom=gamma_bottom, gamma_middle=gamma_middle,
                         prefill_chunk_tokens=64)
    doc, q = random_ids(100, vocab, 5), random_ids(3, vocab, 6)

    def run(coins):
        session = engine.open(doc)
        return tuple(t for e in session.ask(q, sampling, coins=coins) for t in e.tokens)

    return exact_distribution(run, min_prob=1e-10)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-p0.9"])
@pytest.mark.parametrize("levels", SPECULATIVE)
def test_every_stack_preserves_the_distribution_exactly(levels, sampling):
    if levels.endswith("draft>retrieval>full"):  # three sampled levels: one token has ~10^3 paths, two ~10^6
        sampling = replace(sampling, max_new_tokens=1)
    # "ngram+draft" under the middle level at T = 1: two bottom drafts per middle draft, so the
    # second follows a longer sequence and both the n-gram lookup and the model draft run
    gamma_middle = 2 if levels == "ngram+draft>retrieval>full" and sampling.top_p == 1.0 else 1
    want, want_pruned = exact_answers("plain", sampling)
    got, pruned = exact_answers(levels, sampling, gamma_middle=gamma_middle)
    assert pruned < 1e-7 and want_pruned < 1e-7
    for seq in set(want) | set(got):
        assert abs(got.get(seq, 0.0) - want.get(seq, 0.0)) < 1e-6, seq


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-p0.9"])
@pytest.mark.parametrize("levels", ["ngram>retrieval>full", "draft>retrieval>full"])
def test_the_bottom_drafting_for_the_top_directly_preserves_the_distribution(levels, sampling):
    """The middle level declined (gamma_middle = 0, as the tuner does where it does not pay):
    every check is the bottom drafter's draft checked by the top itself (LevelStack
    `direct_tuner`), and the output distribution is still exactly plain decoding's."""
    doc, q = random_ids(100, 128, 5), random_ids(3, 128, 6)
    session = tiny_engine(levels, gamma_bottom=2, gamma_middle=0).open(doc + doc[:40])  # n-grams repeat
    answer = [t for e in session.ask(q + doc[:4], SamplingConfig(max_new_tokens=12)) for t in e.tokens]
    middle, top = session.level_stats
    assert answer and middle.n_tested == 0 and top.n_tested > 0  # the direct path was taken
    assert session.stack.direct_tuner.check_s is session.stack.tuner.check_s  # the top's costs
    want, want_pruned = exact_answers("plain", sampling)
    got, pruned = exact_answers(levels, sampling, gamma_middle=0)
    assert pruned < 1e-7 and want_pruned < 1e-7
    for seq in set(want) | set(got):
        assert abs(got.get(seq, 0.0) - want.get(seq, 0.0)) < 1e-6, seq


def token_counts(engine, doc, q, sampling, n_samples: int, vocab: int, position: int, first_seed: int = 0):
    """How often each token appears at `position` of the answer over `n_samples` seeds from `first_seed`."""
    session = engine.open(doc)
    counts = torch.zeros(vocab)
    for seed in range(first_seed, first_seed + n_samples):
        answer = [t for e in session.ask(q, replace(sampling, seed=seed)) for t in e.tokens]
        counts[answer[position]] += 1
        session.truncate(len(doc))
    return counts


CHI_VOCAB, CHI_SAMPLES = 24, 400


@functools.cache
def chi_setup(temperature: float, top_p: float, **penalties):
    """Document, question and the exact distribution of plain decoding's second answer token."""
    # longer than the retrieval budget (64), so the middle level's q differs from the top's p
    doc, q = random_ids(100, CHI_VOCAB, 7), random_ids(3, CHI_VOCAB, 8)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=2, **penalties)
    engine = tiny_engine("plain", vocab=CHI_VOCAB)
    want, _ = exact_distribution(
        lambda coins: tuple(t for e in engine.open(doc).ask(q, sampling, coins=coins) for t in e.tokens)[1],
        min_prob=1e-12)
    return doc, q, sampling, torch.tensor([want.get(t, 0.0) for t in range(CHI_VOCAB)])


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # rare tokens pooled into one bin
    f_obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    f_exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if f_exp[-1] == 0 and f_obs[-1] == 0:  # nothing rare (min-p may zero tokens out): no pooled bin
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return float(chisquare(f_obs.numpy(), (f_exp * f_obs.sum() / f_exp.sum()).numpy()).pvalue)


@pytest.mark.parametrize("sampling", SAMPLINGS + [PENALIZED], ids=["T1", "T0.7-p0.9", "penalties"])
@pytest.mark.parametrize("levels", SPECULATIVE)
def test_chi_square_of_sampled_tokens(levels, sampling):
    """End-to-end seeded samples of the second answer token (drafted, checked by every level)."""
    penalties = {} if sampling is not PENALIZED else dict(
        repetition_penalty=PENALIZED.repetition_penalty, presence_penalty=PENALIZED.presence_penalty,
        frequency_penalty=PENALIZED.frequency_penalty, min_p=PENALIZED.min_p)
    doc, q, sampling, probs = chi_setup(sampling.temperature, sampling.top_p, **penalties)
    # penalized runs use seeds of their own. The stacks share coin streams, so one unlucky seed range
    # is unlucky for many stacks at once: seeds 1000..1399 gave retrieval>full p = 7e-4 (3,000
    # samples from seed 5000 gave p = 0.45, and exact enumeration of every stack agrees with plain)
    first_seed = 5000 if penalties else 0
    # fixed draft lengths: tuned ones follow measured timings, so the samples (and p) changed from
    # run to run, and 24 tests at p > 1e-3 failed about one run in 40 by chance (once, p = 6.9e-4);
    # fixed, each stack drafts on every check (the tuners often check undrafted on a CPU)
    engine = tiny_engine(levels, vocab=CHI_VOCAB, gamma_bottom=2, gamma_middle=3)
    counts = token_counts(engine, doc, q, sampling, CHI_SAMPLES, CHI_VOCAB, 1, first_seed)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_same_seed_same_answer_and_generator_coins_are_seeded():
    """With fixed draft lengths; tuned ones follow measured timings, and which coins are drawn
    follows the draft lengths (the distribution is exact either way)."""
    doc, q = random_ids(60, 128, 9), random_ids(4, 128, 10)
    s = SamplingConfig(temperature=0.8, top_k=20, max_new_tokens=12, seed=123)
    a, b = ([t for e in tiny_engine("ngram>retrieval>full", gamma_bottom=2, gamma_middle=3).open(doc).ask(q, s)
             for t in e.tokens] for _ in range(2))
    assert a == b
    c1, c2 = (GeneratorCoins(torch.Generator().manual_seed(5)) for _ in range(2))
    assert [c1.accept(0.5) for _ in range(8)] == [c2.accept(0.5) for _ in range(8)]


def wrong_acceptance(q, x, r):
    """The public TriForce rule: on rejection draw again from q, not from the residual."""
    accept_prob, _ = right_acceptance(q, x, r)
    return accept_prob, q


right_acceptance = sampling_module.acceptance


@pytest.mark.parametrize("levels", ["draft>full", "ngram>retrieval>full"])
def test_exact_enumeration_fails_on_a_wrong_rule(levels, monkeypatch):
    """One token is enough to see it; the wrong rule's full-support resamples also make a second
    token's paths many times more numerous than the right rule's (~15 minutes for three levels)."""
    sampling = replace(SAMPLINGS[0], max_new_tokens=1)
    want, _ = exact_answers("plain", sampling)
    monkeypatch.setattr(sampling_module, "acceptance", wrong_acceptance)
    got, _ = exact_answers(levels, sampling)
    assert max(abs(got.get(k, 0.0) - p) for k, p in want.items()) > 1e-3


def test_chi_square_fails_on_a_wrong_rule(monkeypatch):
    """The statistical test has power: a draft sharpened towards the target's argmax, checked
    with the wrong rule, is rejected at the first speculated token; the right rule passes."""
    doc, q, sampling, _ = chi_setup(1.0, 1.0)
    engine = tiny_engine("draft>full", vocab=CHI_VOCAB, sharpen_draft=True, gamma_bottom=3)
    want, _ = exact_distribution(lambda coins: tuple(
        t for e in tiny_engine("plain", vocab=CHI_VOCAB).open(doc).ask(q, sampling, coins=coins) for t in e.tokens)[0])
    probs = torch.tensor([want.get(t, 0.0) for t in range(CHI_VOCAB)])
    right = token_counts(engine, doc, q, sampling, CHI_SAMPLES, CHI_VOCAB, 0)
    monkeypatch.setattr(sampling_module, "acceptance", wrong_acceptance)
    wrong = token_counts(engine, doc, q, sampling, CHI_SAMPLES, CHI_VOCAB, 0)
    assert chi_square_pvalue(right, probs) > 1e-3 and chi_square_pvalue(wrong, probs) < 1e-4


def observed_tuner(check_s: dict[int, float], acceptance: float, draft_s_per_token: float = 0.0):
    from engine.speculative import GammaTuner

    tuner = GammaTuner(None, max_gamma=8)
    tuner.check_s, tuner.acceptance, tuner.draft_s_per_token = dict(check_s), acceptance, draft_s_per_token
    return tuner


def test_tuner_drafts_long_when_checking_more_tokens_is_nearly_free():
    # a check of 9 tokens costs 10% more than 1 (AMX-like); 90% acceptance: the longest draft
    assert observed_tuner({1: 0.100, 9: 0.110}, acceptance=0.9).gamma() == 8


def test_tuner_checks_undrafted_when_no_draft_pays_and_retries_now_and_then():
    # each extra checked token costs half a plain step and drafts are accepted 20% of the time:
    # g = 1 gives 1.2 tokens per 1.5 steps, worse than 1 token per step
    tuner = observed_tuner({1: 0.100, 3: 0.200}, acceptance=0.2)
    choices = [tuner.gamma() for _ in range(32)]
    assert choices == ([0] * 15 + [1]) * 2  # every 16th check drafts one token to re-measure
    tuner.acceptance = 0.9  # the text turned repetitive: drafting pays again at once
    assert tuner.gamma() > 0


def test_tuner_uses_measured_costs_where_a_line_would_mislead():
    # AVX2-like: checking 2 tokens costs nearly 2 single steps, 9 tokens only 2.5; the fitted line
    # would price 2 tokens at ~0.13 s and draft; measured, no draft length beats 10 tokens/s
    tuner = observed_tuner({1: 0.10, 2: 0.19, 9: 0.25}, acceptance=0.5)
    assert tuner.gamma() == 0


def test_tuner_measures_the_undrafted_check_even_when_every_draft_is_accepted():
    """A retrieval level whose 4-token drafts are always accepted checks 5 tokens every time:
    without measuring a 1-token check, the cost of plain decoding was extrapolated from the
    question's check and 5-token checks, and the tuner drafted 4 forever (AVX2, 8K: 250 ms per
    token against 175 undrafted). The first drafted check also sets the drafting cost at once."""
    from engine.speculative import GammaTuner

    def start(question_check_s: float, draft_s_per_token: float, step_s: float) -> GammaTuner:
        tuner, all_accepted = GammaTuner(None, max_gamma=8), Verdict(4, 7, 4)
        assert tuner.gamma() == 4  # the question: 30 tokens + a draft of 4, all accepted
        tuner.observe(4, 4 * draft_s_per_token, all_accepted, 34, question_check_s)
        assert tuner.gamma() == 0  # then one check of the last token alone
        tuner.observe(0, 0.0, Verdict(0, 7, 0), 1, step_s)
        return tuner

    # AVX2, 8K: a retrieval draft costs 3/4 of a plain step, 34 tokens 3.4 steps: no draft pays
    assert start(question_check_s=0.60, draft_s_per_token=0.13, step_s=0.175).gamma() == 0
    # AMX-like: drafts cost 1/5 of a step and 34 tokens cost 2 steps: it drafts (3 at the
    # acceptance estimated from one check)
    assert start(question_check_s=0.20, draft_s_per_token=0.02, step_s=0.10).gamma() == 3


def test_the_direct_tuner_shares_the_top_levels_check_costs():
    """Check costs are the checking level's, whoever drafted: the top's first undrafted check,
    run on the direct path, must count for the middle level's tuner too, or that tuner would
    wait for it forever and never draft again."""
    from engine.speculative import GammaTuner

    def after_direct_undrafted_check(shared: bool) -> int:
        top = GammaTuner(None, max_gamma=8)
        direct = GammaTuner(None, max_gamma=8, check_s=top.check_s if shared else None)
        top.observe(4, 0.004, Verdict(4, 7, 4), 5, 0.11)  # a cheap middle, all accepted
        assert top.gamma() == 0  # next: the cost of checking one token, measured...
        direct.observe(0, 0.0, Verdict(0, 7, 0), 1, 0.10)  # ...on the direct path
        return top.gamma()

    assert after_direct_undrafted_check(shared=True) > 0
    assert after_direct_undrafted_check(shared=False) == 0


def test_the_bottom_drafts_for_the_top_directly_when_that_is_expected_to_be_faster():
    """The middle level beats plain decoding, yet n-gram drafts accepted as often cost nothing:
    the top checks those (copied text at long context); with poor n-gram acceptance it keeps
    the middle level, and a fixed middle draft length is always kept."""
    from engine.speculative import LevelStack

    middle = observed_tuner({1: 0.20, 5: 0.25}, acceptance=0.8, draft_s_per_token=0.1)
    direct = observed_tuner({}, acceptance=0.8)
    direct.check_s = middle.check_s  # the top level's check costs, as Engine.build_stack shares them
    stack = LevelStack(None, None, None, middle, direct)
    gamma = middle.gamma()
    assert gamma > 0 and middle.expected_rate(gamma) > middle.expected_rate(0)  # the middle pays...
    assert stack._goes_direct(gamma, direct.gamma())  # ...and the direct path pays more
    direct.acceptance = 0.05
    assert not stack._goes_direct(gamma, direct.gamma())
    assert stack._goes_direct(0, direct.gamma())  # the middle declined: direct, drafted or not
    middle.fixed = 3
    direct.acceptance = 0.8
    assert not stack._goes_direct(3, direct.gamma())


@pytest.mark.parametrize("levels", ["ngram>full", "draft>full", "ngram>retrieval>full", "draft>retrieval>full"])
def test_undrafted_checks_mixed_with_drafts_stay_lossless(levels, monkeypatch):
    """Draft lengths 0 (plain decoding) and > 0 in turn at every level, over three turns:
    greedy output still equals plain decoding, sampling runs, and an undrafted check is not
    mistaken for a new question (which would re-select the retrieval cache every time)."""
    from engine.speculative import CheckingDrafter, GammaTuner

    doc = random_ids(123, 128, 1)
    questions = [random_ids(n, 128, 20 + n) for n in (5, 9, 3)]
    _, plain = chat(tiny_engine("plain"), doc, questions)
    cycle = iter([0, 2, 0, 0, 3, 1] * 400)
    monkeypatch.setattr(GammaTuner, "gamma", lambda self: next(cycle))
    n_rebuilds = [0]
    rebuild = CheckingDrafter._rebuild
    monkeypatch.setattr(CheckingDrafter, "_rebuild", lambda self: (n_rebuilds.__setitem__(0, n_rebuilds[0] + 1),
                                                                   rebuild(self)))
    _, got = chat(tiny_engine(levels), doc, questions)
    assert got == plain
    if "retrieval" in levels:  # open + one per question + one per 16 tokens (tiny_engine's schedule)
        assert n_rebuilds[0] <= 1 + 3 + sum(map(len, got)) // 16
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=14, seed=3)
    _, answers = chat(tiny_engine(levels), doc, questions, sampled)
    assert all(answers)


@pytest.mark.parametrize("levels", SPECULATIVE)
def test_every_stack_preserves_the_penalized_distribution_exactly(levels):
    """Penalties on: every level computes each row's distribution after the committed answer plus
    its draft path, so the output is exactly plain decoding's penalized distribution. The
    penalties start before the question, so even the first answer token is penalized."""
    sampling = replace(PENALIZED, penalty_start=97)
    if levels.endswith("draft>retrieval>full"):  # three sampled levels
        sampling = replace(sampling, max_new_tokens=1)
    want, want_pruned = exact_answers("plain", sampling)
    got, pruned = exact_answers(levels, sampling)
    assert pruned < 1e-7 and want_pruned < 1e-7
    plain_unpenalized, _ = exact_answers("plain", replace(sampling, repetition_penalty=1.0, presence_penalty=0.0,
                                                          frequency_penalty=0.0))
    assert max(abs(want[k] - plain_unpenalized.get(k, 0.0)) for k in want) > 1e-2  # the penalties bite
    for seq in set(want) | set(got):
        assert abs(got.get(seq, 0.0) - want.get(seq, 0.0)) < 1e-6, seq


def stale_histories(tokens, draft, sampling):
    """A level that forgets the draft path: every row penalized as if after the committed tokens only."""
    rows = right_histories(tokens, draft, sampling)
    return rows[:1] * len(rows)


right_histories = speculative_module.draft_histories


@pytest.mark.parametrize("levels", ["ngram>full", "draft>full"])  # deterministic and sampled drafts
def test_exact_enumeration_fails_on_a_stale_penalty_history(levels, monkeypatch):
    """The top level penalizing every row as if after the committed tokens only (forgetting the
    draft path) changes the output distribution; a stale middle level would only cost acceptance."""
    want, _ = exact_answers("plain", PENALIZED)
    monkeypatch.setattr(speculative_module, "draft_histories", stale_histories)
    got, _ = exact_answers(levels, PENALIZED)
    assert max(abs(got.get(k, 0.0) - p) for k, p in want.items()) > 1e-3


@pytest.mark.parametrize("levels", SPECULATIVE)
def test_greedy_with_penalties_equals_plain_over_three_turns(levels):
    doc = random_ids(123, 128, 1)
    questions = [random_ids(n, 128, 10 + n) for n in (5, 9, 3)]
    sampling = SamplingConfig(max_new_tokens=14, repetition_penalty=1.5, frequency_penalty=0.5)
    _, plain = chat(tiny_engine("plain"), doc, questions, sampling)
    _, unpenalized = chat(tiny_engine("plain"), doc, questions)
    _, got = chat(tiny_engine(levels), doc, questions, sampling)
    assert got == plain and plain != unpenalized


def test_plain_repetition_penalty_over_the_whole_prompt_equals_hugging_face_generate():
    """penalty_start=0 counts the document and question too, as HF's processor counts input_ids."""
    doc, q = random_ids(60, 128, 3), random_ids(5, 128, 4)
    sampling = SamplingConfig(max_new_tokens=12, repetition_penalty=1.6, penalty_start=0)
    ours = [t for e in tiny_engine("plain").open(doc).ask(q, sampling) for t in e.tokens]
    prompt = torch.tensor([doc + q])  # with its mask given: HF would take the ids equal to pad_token_id for padding
    hf = tiny_hf("llama").generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                   min_new_tokens=12, do_sample=False, repetition_penalty=1.6, pad_token_id=0)
    assert hf[0, len(doc) + len(q):].tolist() == ours


class OnDevice(torch.Tensor):
    """Marks what a model returns as living on a GPU: every read of such a tensor from the host
    (and each op's result is one too) is recorded, as a device sync would be."""

    HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                  torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}
    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.HOST_READS:
            cls.reads.append(func.__name__)
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, OnDevice) else a for a in args]
            return func(*plain, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("sampling", [SamplingConfig(max_new_tokens=24),
                                      SamplingConfig(temperature=0.8, top_k=50, max_new_tokens=24, seed=2),
                                      SamplingConfig(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05,
                                                     max_new_tokens=24, seed=2)],
                         ids=["greedy", "sampled", "qwen-defaults"])
def test_a_check_syncs_the_device_once(monkeypatch, sampling):
    """Issue 54 row 9: a check synchronised the device three times for its clock and read q from
    it once per draft node (and once more for the residual's draw); now its one sync is the copy
    of q (and a sampled draft's r) to the host that verify reads. Counted on a CPU run: the
    model's logits are marked as on a device, and the clock's syncs are spied on."""
    from engine import device as device_module
    from engine.model import Transformer

    forward_packed = Transformer.forward_packed
    monkeypatch.setattr(Transformer, "forward_packed",
                        lambda self, segments: [t.as_subclass(OnDevice) for t in forward_packed(self, segments)])
    clock_reads = []  # the module of each caller of device.now, the clock that synchronises

    def perf_counter():
        clock_reads.append(sys._getframe(2).f_globals["__name__"])  # 0: here, 1: now, 2: its caller
        return time.perf_counter()

    monkeypatch.setattr(device_module, "time", SimpleNamespace(perf_counter=perf_counter))
    engine = tiny_engine("ngram>retrieval>full", gamma_bottom=3, gamma_middle=3)
    session = engine.open(random_ids(30, 128, 7) * 3)
    OnDevice.reads = []
    events = list(session.ask(random_ids(4, 128, 4), sampling))
    n_checks = sum(s.n_checks for s in events[-1].stats.levels)
    assert n_checks > len(events) > 3  # the middle level checked too
    assert OnDevice.reads == ["cpu"] * n_checks
    assert "engine.session" in clock_reads  # the spy sees the session's clock
    assert "engine.speculative" not in clock_reads  # twice a step, not per check
