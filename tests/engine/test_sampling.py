"""The acceptance rule, exactly: hand-written cases, exact enumeration of every coin outcome,
and the TriForce counterexample (resampling a rejected middle token from q instead of the
residual biases sampled output)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import SamplingConfig
from engine.sampling import (
    Draft,
    GeneratorCoins,
    Verdict,
    acceptance,
    draft_histories,
    penalize,
    sampling_probs,
    token_probs,
    verify,
)
from tests.engine.enumerate import ScriptedCoins, exact_distribution

V = 3  # small enough to enumerate every outcome of three sampled levels


def toy(seed: int, sharpen: float = 1.0):
    """A toy 'model': a fixed random distribution over V tokens for every prefix."""
    cache: dict[tuple, torch.Tensor] = {}

    def dist(prefix: tuple) -> torch.Tensor:
        if prefix not in cache:
            g = torch.Generator().manual_seed(hash((seed,) + prefix) % 2**31)
            logits = torch.randn(V, generator=g, dtype=torch.float64) * 1.5 * sharpen
            cache[prefix] = logits.softmax(-1)
        return cache[prefix]

    return dist


def target_distribution(q, n_tokens: int) -> dict[tuple, float]:
    """P(x_1..x_n) = prod q(x_i | x_<i): what plain decoding samples."""
    out = {(): 1.0}
    for _ in range(n_tokens):
        out = {seq + (t,): p * float(q(seq)[t]) for seq, p in out.items() for t in range(V)}
    return out


def assert_same(got: dict, want: dict, tol: float = 1e-12):
    for key in set(got) | set(want):
        assert math.isclose(got.get(key, 0.0), want.get(key, 0.0), abs_tol=tol), key


# ---- sampling transforms ------------------------------------------------------------------

def test_greedy_is_one_hot_argmax():
    probs = sampling_probs(torch.tensor([0.1, 2.0, -1.0, 2.0]), temperature=0)
    assert probs.tolist() == [0, 1, 0, 0]  # ties: the first maximum, as torch.argmax


def test_top_k_and_top_p_follow_hf_order():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert sampling_probs(logits, 1.0, top_k=2).tolist() == pytest.approx([0.625, 0.375, 0])
    assert sampling_probs(logits, 1.0, top_p=0.5).tolist() == pytest.approx([1, 0, 0])  # 0.5 reaches p
    assert sampling_probs(logits, 1.0, top_p=0.6).tolist() == pytest.approx([0.625, 0.375, 0])
    hot = sampling_probs(logits, 0.5)
    assert hot.tolist() == pytest.approx((logits / 0.5).softmax(-1).tolist())


# ---- the rule for one proposal --------------------------------------------------------------

def test_acceptance_hand_cases():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
    r = torch.tensor([0.25, 0.6, 0.15, 0.0, 0.0], dtype=torch.float64)
    p, res = acceptance(q, 1, r)  # q/r = 0.5 for token 1; residual (q - r)+ = [.25, 0, .05]
    assert p == pytest.approx(0.5) and res.tolist() == pytest.approx([0.25 / 0.3, 0, 0.05 / 0.3, 0, 0])
    p, _ = acceptance(q, 0, r)  # q > r: always accepted
    assert p == 1.0
    p, res = acceptance(q, 0, None)  # deterministic: accept with q(x), else q without x
    assert p == 0.5 and res.tolist() == pytest.approx([0, 0.6, 0.4, 0, 0])


def test_greedy_verdicts():
    q = sampling_probs(torch.tensor([[0.0, 3, 1, 0, 0], [5, 0, 0, 0, 0], [0, 0, 0, 0, 9.0]]), 0)
    coins = GeneratorCoins(torch.Generator().manual_seed(0))
    v = verify(q, Draft([1, 0]), coins)  # both match the argmax: bonus = argmax of q[2]
    assert (v.n_accepted, v.token, v.n_tested) == (2, 4, 2)
    v = verify(q, Draft([1, 3]), coins)  # second mismatches: emit argmax q[1] = 0
    assert (v.n_accepted, v.token, v.n_tested) == (1, 0, 2)
    v = verify(q, Draft([2, 0]), coins)  # the first mismatches: the second is never tested
    assert (v.n_accepted, v.token, v.n_tested) == (0, 1, 1)
    assert verify(q, Draft([]), coins) == Verdict(0, 1, 0)  # no draft: plain decoding's token


# ---- exact enumeration -----------------------------------------------------------------------

def speculative_run(q, propose, n_tokens: int, gamma: int):
    """Rounds of propose -> verify until n_tokens are emitted (the top level of a stack)."""

    def run(coins: ScriptedCoins):
        out: tuple = ()
        while len(out) < n_tokens:
            draft = propose(out, gamma, coins)
            qs = torch.stack([q(out + tuple(draft.tokens[:i])) for i in range(len(draft) + 1)])
            v = verify(qs, draft, coins)
            out = out + tuple(draft.tokens[:v.n_accepted]) + (v.token,)
        return out[:n_tokens]

    return run


def sampled_drafter(r):
    def propose(prefix, gamma, coins):
        tokens, probs = [], []
        for _ in range(gamma):
            dist = r(prefix + tuple(tokens))
            tokens.append(coins.sample(dist))
            probs.append(dist)
        return Draft(tokens, torch.stack(probs))
    return propose


def deterministic_drafter(r):
    """r's greedy chain, proposed without its probabilities (as the n-gram database proposes)."""
    def propose(prefix, gamma, coins):
        tokens = []
        for _ in range(gamma):
            tokens.append(int(r(prefix + tuple(tokens)).argmax()))
        return Draft(tokens)
    return propose


@pytest.mark.parametrize(("gamma", "n_tokens"), [(1, 3), (2, 3), (3, 2)])
def test_sampled_chain_preserves_target_distribution(gamma, n_tokens):
    q, r = toy(0), toy(1)
    got, _ = exact_distribution(speculative_run(q, sampled_drafter(r), n_tokens, gamma))
    assert_same(got, target_distribution(q, n_tokens))


@pytest.mark.parametrize(("gamma", "n_tokens"), [(1, 3), (2, 3), (3, 2)])
def test_deterministic_chain_preserves_target_distribution(gamma, n_tokens):
    q, r = toy(0), toy(2)
    got, _ = exact_distribution(speculative_run(q, deterministic_drafter(r), n_tokens, gamma))
    assert_same(got, target_distribution(q, n_tokens))


def middle_level(q_mid, below, gamma_below: int, resample_from_q: bool = False):
    """A middle level as a drafter: checks `below`'s drafts with q_mid, passes up (tokens, q_mid).

    resample_from_q=True is the public TriForce code's rule (draw a rejected token from q_mid,
    not from the residual); it must fail the same test.
    """
    def propose(prefix, gamma, coins):
        out, qs = (), []
        while len(out) < gamma:
            draft = below(prefix + out, gamma_below, coins)
            q_nodes = torch.stack([q_mid(prefix + out + tuple(draft.tokens[:i])) for i in range(len(draft) + 1)])
            v = verify(q_nodes, draft, coins)
            if resample_from_q and v.n_accepted < len(draft):
                v.token = coins.sample(q_nodes[v.n_accepted])
            qs += list(q_nodes[:v.n_accepted + 1])
            out += tuple(draft.tokens[:v.n_accepted]) + (v.token,)
        return Draft(list(out[:gamma]), torch.stack(qs[:gamma]))
    return propose


@pytest.mark.parametrize("bottom", ["sampled", "deterministic"])
def test_two_stacked_levels_preserve_target_distribution(bottom):
    q_top, q_mid, r = toy(0), toy(3), toy(4)
    below = sampled_drafter(r) if bottom == "sampled" else deterministic_drafter(r)
    got, _ = exact_distribution(speculative_run(q_top, middle_level(q_mid, below, 2), 2, 2))
    assert_same(got, target_distribution(q_top, 2))


def test_triforce_resampling_from_q_is_biased():
    """Counterexample: the middle emits the wrong distribution, and the top cannot repair it,
    because it takes the middle's q as r. The residual rule passes the same check."""
    q_top, q_mid = toy(0), toy(3)
    r = toy(3, sharpen=3.0)  # a draft sharpened towards the middle's argmax: rejections matter
    want = target_distribution(q_top, 1)
    right, _ = exact_distribution(speculative_run(q_top, middle_level(q_mid, sampled_drafter(r), 2), 1, 2))
    wrong, _ = exact_distribution(
        speculative_run(q_top, middle_level(q_mid, sampled_drafter(r), 2, resample_from_q=True), 1, 2))
    assert_same(right, want)
    assert max(abs(wrong.get(k, 0) - p) for k, p in want.items()) > 1e-3


def test_penalties_equal_hugging_face_and_openai_processors():
    """Repetition as HF's RepetitionPenaltyLogitsProcessor, presence/frequency as OpenAI documents
    them (logit - presence * [count > 0] - frequency * count), min-p as HF's MinPLogitsWarper."""
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    histories = [[], [4, 4, 1], [7, 0, 7, 7, 2]]
    hf = torch.stack([RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([h]), row[None].clone())[0] if h else row
                      for h, row in zip(histories, logits)])
    assert torch.equal(penalize(logits, histories, repetition=1.3), hf)
    got = penalize(logits, histories, presence=0.5, frequency=0.25)
    want = logits.clone()
    want[1, 4] -= 0.5 + 0.25 * 2  # seen twice
    want[1, 1] -= 0.5 + 0.25
    want[2, 7] -= 0.5 + 0.25 * 3
    want[2, 0] -= 0.75
    want[2, 2] -= 0.75
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert penalize(logits, histories) is logits  # all off: untouched
    probs = sampling_probs(logits, 0.8, min_p=0.2)
    hf_probs = MinPLogitsWarper(0.2)(None, logits / 0.8).softmax(-1)
    assert torch.allclose(probs, hf_probs, rtol=0, atol=1e-12)


def test_each_check_row_counts_the_answer_so_far_and_the_draft_before_it():
    sampling = SamplingConfig(temperature=1.0, repetition_penalty=1.2, penalty_start=3)
    assert draft_histories([9, 9, 9, 1, 2], [5, 6, 7], sampling) == [[1, 2], [1, 2, 5], [1, 2, 5, 6], [1, 2, 5, 6, 7]]
    assert draft_histories([9, 9, 9, 1, 2], [5, 6, 7], SamplingConfig(temperature=1.0)) == []  # off: nothing to count


def dense_sampling_probs(logits, temperature, top_k, top_p, min_p):
    """The transforms with a full sort for top-p (sampling_probs sorts only the top tokens)."""
    logits = logits.double() / temperature
    if top_k > 0:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        kept = probs.sort(-1, descending=True).values
        before = kept.cumsum(-1) - kept  # mass of the tokens more probable than each
        threshold = kept.masked_fill(before >= top_p, float("inf")).amin(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.mark.parametrize("top_k,top_p,min_p", [(20, 1.0, 0.0), (20, 0.8, 0.0), (5, 0.95, 0.1), (50, 0.5, 0.05),
                                            (0, 0.8, 0.0), (0, 0.5, 0.05)])
def test_the_partial_sort_of_top_p_gives_the_full_sort_s_distribution(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(3, 5000, generator=g) * (3 if top_k else 0.5)  # top-k off: a nucleus past 256
    got = sampling_probs(logits, 0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    want = dense_sampling_probs(logits, 0.7, top_k, top_p, min_p)
    assert got.dtype == torch.float64 and torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


def test_a_tie_at_the_top_k_cut_keeps_every_tied_token():
    logits = torch.tensor([[4.0, 3.0, 2.0, 2.0, 1.0, 2.0]])  # the 3rd largest, 2.0, three times
    probs = sampling_probs(logits, 1.0, top_k=3)
    assert (probs > 0).tolist() == [[True, True, True, True, False, True]]
    assert torch.allclose(probs, dense_sampling_probs(logits, 1.0, 3, 1.0, 0.0), rtol=1e-12, atol=0)


# ---- top-k on the k largest only --------------------------------------------------------------

def full_top_k_probs(logits, temperature, top_k, top_p=1.0, min_p=0.0):
    """What sampling_probs computed before its top-k path: the cut as a mask over the whole
    vocabulary, then softmax, top-p and min-p over all of it (sampling_probs with top-k off)."""
    logits = logits.double() / temperature
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return sampling_probs(logits.masked_fill(logits < kth, float("-inf")), 1.0, 0, top_p, min_p)


def assert_same_probs(got, want):
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert torch.equal(got > 0, want > 0), "another set of tokens kept"
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


SETTINGS = [(0.7, 20, 0.8, 0.0), (0.7, 20, 1.0, 0.0), (1.0, 5, 0.95, 0.1), (1.3, 50, 0.5, 0.05), (0.7, 1, 0.8, 0.0)]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS)
def test_top_k_on_its_k_largest_gives_the_full_vocabulary_s_distribution(temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(top_k)
    for logits in (torch.randn(5, 151936, generator=g) * 3, torch.randn(7, 300, generator=g, dtype=torch.float64)):
        got = sampling_probs(logits, temperature, top_k, top_p, min_p)
        assert_same_probs(got, full_top_k_probs(logits, temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", SETTINGS + [(0.7, 20, 0.99, 0.0), (0.7, 20, 1.0, 0.3)])
def test_ties_at_the_k_th_value_are_kept_or_cut_together(temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 400, generator=g)
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    logits[0, :30] = kth[0]  # 30 tokens tied with the k-th, most of them beyond the k
    logits[1, -3:] = kth[1]  # two more beyond
    logits[2, :] = logits[2, 0]  # every token tied: all kept
    logits[3, :top_k + 5], logits[3, top_k + 5:] = logits[3, 0], float("-inf")  # k + 5 tied, the rest -inf
    logits[4, 10:] = float("-inf")  # top_k > 10: the k-th is -inf, and every -inf token is tied (at 0)
    # row 5: no tie
    got = sampling_probs(logits, temperature, top_k, top_p, min_p)
    assert_same_probs(got, full_top_k_probs(logits, temperature, top_k, top_p, min_p))
    if (top_p, min_p) == (1.0, 0.0):
        assert (got[0] > 0).sum() >= 30 and bool((got[2] > 0).all())


def test_a_tie_group_at_the_top_p_boundary_is_kept_whole():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.0]]).log1p()
    probs = full_top_k_probs(logits, 1.0, 5)
    for top_p in (float(probs[0, :2].sum()) - 1e-9, float(probs[0, :2].sum()) + 1e-9, 0.5, 0.9):
        got = sampling_probs(logits, 1.0, 5, top_p)  # the 2.0s: four in the k, and one beyond
        assert_same_probs(got, full_top_k_probs(logits, 1.0, 5, top_p))
        assert (got[0, 1:5] > 0).all() and got[0, 5] == 0  # the 1.0s: not tied with the k-th


def test_top_p_just_below_and_above_each_cumulative_mass():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2000, generator=g) * 2
    want = full_top_k_probs(logits, 0.7, 20)
    mass = want.sort(-1, descending=True).values.cumsum(-1)[:, :19]  # [4, 19]
    for top_p in {float(x) + d for x in mass.flatten() for d in (-1e-9, 1e-9) if float(x) + d < 1}:
        assert_same_probs(sampling_probs(logits, 0.7, 20, top_p), full_top_k_probs(logits, 0.7, 20, top_p))


def test_with_the_penalties_on_each_row_s_history():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 151936, generator=g) * 3
    sampling = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    histories = [[], [int(i) for i in logits[1].topk(30).indices], [7, 7, 8], [0] * 3, list(range(100))]
    got = token_probs(logits, histories, sampling)
    want = full_top_k_probs(penalize(logits, histories, 1.05), 0.7, 20, 0.8)
    assert_same_probs(got, want)
    strong = SamplingConfig(temperature=1.0, top_k=10, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3)
    assert_same_probs(token_probs(logits, histories, strong),
                      full_top_k_probs(penalize(logits, histories, 1.0, 0.5, 0.3), 1.0, 10, 1.0, 0.05))


def test_the_check_fails_on_a_wrong_kept_set():
    """A top-k that keeps exactly k tokens (drops the ties beyond the k-th, renormalised) differs
    from the full distribution only in its kept set: assert_same_probs must catch it."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 2.0, 1.0, 2.0]])
    top, idx = logits.topk(3, dim=-1)
    wrong = torch.zeros(1, 6, dtype=torch.float64).scatter_(-1, idx, top.double().softmax(-1))
    want = sampling_probs(logits, 1.0, top_k=3)
    with pytest.raises(AssertionError, match="another set of tokens kept"):
        assert_same_probs(wrong, want)
    assert_same_probs(want, full_top_k_probs(logits, 1.0, 3))


def test_top_k_reads_nothing_back_from_the_device():
    """On a GPU each host read is a sync (docs/STYLE.md section 3): the top-k path has none, with
    or without ties at its cut, top-p or min-p. Counted on CPU tensors marked as on a device."""
    from tests.engine.test_speculative import OnDevice

    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(5)) * 3
    logits[0, :40] = logits[0].max()  # 40 tied at the top: the 20th's ties beyond it
    OnDevice.reads = []
    for top_p, min_p in ((0.8, 0.0), (1.0, 0.05), (0.5, 0.1)):
        assert type(sampling_probs(logits.as_subclass(OnDevice), 0.7, 20, top_p, min_p)) is OnDevice
    assert OnDevice.reads == []
