"""The compiled CPU attention kernel (engine/csrc/attention_cpu.cpp): it builds wherever the CPU
has AVX2 (CI installs a compiler and ninja), equals float64 SDPA to float32 rounding for every
shape the engine gives it (GQA and MHA, one token, chains, chunk edges, batches,
cache views with spare slots, extreme scores), routes what it does not handle to SDPA unchanged,
and a float32 engine using it decodes as one that does not. Its RoPE is transformers' bit for bit
(float32 and bf16), its RMSNorm torch's to float32 rounding (in bf16, rounded where the model's
norm rounds), each row's the same whatever rows share the call."""

from __future__ import annotations

import pytest
import torch

from engine import attention
from engine.attention import FEW_ROWS, cpu_attention, cpu_kernel, pick_attention, sdpa_attention
from engine.config import SamplingConfig
from engine.model import Attention, RMSNorm
from tests.conftest import tiny_engine
from tests.engine.test_speculative import random_ids

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not HAS_AVX2, reason="the kernel needs AVX2")


def test_the_kernel_builds_where_the_cpu_has_avx2():
    assert (cpu_kernel() is not None) == HAS_AVX2
    want = attention.cpu_attention if HAS_AVX2 else sdpa_attention
    assert pick_attention(torch.device("cpu"), use_cpu_kernel=True) is want
    assert pick_attention(torch.device("cpu"), use_cpu_kernel=False) is sdpa_attention


def qkv(B, H, Hkv, T, S, D, spare=37, seed=0, scale=1.0):
    """float32 queries and a cache view [B, Hkv, S, D] of a buffer with `spare` unused slots."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2) * scale  # [B, H, T, D] as the model makes it
    k = torch.randn(B, Hkv, S + spare, D, generator=g)[:, :, :S]
    v = torch.randn(B, Hkv, S + spare, D, generator=g)[:, :, :S]
    return q, k, v


def chain(T):
    return torch.ones(T, T, dtype=torch.bool).tril() if T > 1 else None


@needs_kernel
@pytest.mark.parametrize(("H", "Hkv", "D"), [(14, 2, 64), (12, 2, 128), (9, 3, 64), (4, 4, 32), (4, 2, 16)])
# S straddles the kernel's 512-key chunks (attention_cpu.cpp kChunk): 511/513, and 1500 merges three
@pytest.mark.parametrize(("T", "S"), [(1, 1), (1, 511), (1, 513), (1, 1500), (2, 2), (4, 300), (9, 1025)])
def test_the_kernel_equals_float64_sdpa(H, Hkv, D, T, S):
    if (H // Hkv) * T > FEW_ROWS:
        pytest.skip("more rows than the kernel takes")
    for B in (1, 2):
        q, k, v = qkv(B, H, Hkv, T, S, D, seed=S + T)
        got = cpu_attention(q, k, v, chain(T))
        want = sdpa_attention(q.double(), k.double(), v.double(), chain(T))
        assert got.dtype == torch.float32 and got.shape == (B, H, T, D)
        assert torch.allclose(got.double(), want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_the_kernel_returns_the_log_sum_exp_and_survives_extreme_scores():
    q, k, v = qkv(1, 14, 2, 1, 700, 64, scale=40.0)  # scores in the hundreds: no overflow, one key dominates
    q_folded = q.reshape(1, 2, 7, 64).contiguous()
    out, lse = cpu_kernel().few_row_attention(q_folded, k, v)
    scores = q_folded.double() @ k.double().transpose(-1, -2) / 8.0  # [1, Hkv, 7, S]
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)
    assert torch.allclose(out.double(), torch.softmax(scores, -1) @ v.double(), atol=1e-5)
    assert torch.isfinite(out).all()


@needs_kernel
@pytest.mark.parametrize(("T", "S"), [(1, 1), (1, 1000), (4, 300), (9, 257)])
def test_a_bfloat16_cache_is_read_as_bfloat16_and_summed_in_float32(T, S, monkeypatch):
    """A bf16 engine's cache goes through the kernel: its float32 sums over the bf16 keys and
    values equal float64 SDPA over the same values, and the answer is that rounded to bf16."""
    q, k, v = (x.bfloat16() for x in qkv(1, 14, 2, T, S, 64, seed=S + T))
    kernel, calls = cpu_kernel(), []

    class Spy:
        def few_row_attention(self, *args):
            calls.append(args[1].dtype)
            return kernel.few_row_attention(*args)

    monkeypatch.setattr(attention, "cpu_kernel", lambda: Spy())
    got = cpu_attention(q, k, v, chain(T))
    want = sdpa_attention(q.double(), k.double(), v.double(), chain(T))
    assert calls == [torch.bfloat16] and got.dtype == torch.bfloat16 and got.shape == (1, 14, T, 64)
    assert torch.allclose(got.double(), want, atol=1e-2, rtol=8e-3)  # bf16 rounding of the answer
    q_folded = q.reshape(1, 2, 7 * T, 64).float().contiguous()
    out, lse = kernel.few_row_attention(q_folded, k[:, :, :S - T + 1], v[:, :, :S - T + 1])
    scores = q_folded.double() @ k[:, :, :S - T + 1].double().transpose(-1, -2) / 8.0
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), torch.softmax(scores, -1) @ v[:, :, :S - T + 1].double(), atol=2e-6, rtol=1e-5)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "S"), [(2, 2), (5, 9), (5, 514), (9, 1030), (4, 1024)])  # chains across chunk edges
def test_a_chain_check_gives_each_token_what_decoding_it_alone_gives(dtype, T, S):
    """Each row of a check's causal chain attends to the keys up to its own token inside the
    kernel, so its output is bit for bit that of decoding the token alone over the same cache:
    speculation commits plain decoding's tokens in bf16 too, not only up to rounding."""
    H, Hkv, D = 12, 2, 128
    q, k, v = (x.to(dtype) for x in qkv(1, H, Hkv, T, S, D, seed=T + S))
    got = cpu_attention(q, k, v, chain(T))
    for t in range(T):
        alone = cpu_attention(q[:, :, t:t + 1], k[:, :, :S - T + t + 1], v[:, :, :S - T + t + 1], None)
        assert torch.equal(got[:, :, t:t + 1], alone), f"token {t} of {T}"
    want = sdpa_attention(q.double(), k.double(), v.double(), chain(T))
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)  # bf16 answer
    assert torch.allclose(got.double(), want, **tol)


@needs_kernel
@pytest.mark.parametrize(("Hkv", "R", "D"), [(2, 6, 128), (2, 7, 64), (1, 30, 128), (3, 13, 64)])
@pytest.mark.parametrize("S", [1, 3, 6, 513, 1030])  # keys 4 (scores) and 2 (values) at a time; chunk edges
def test_bf16_queries_over_a_bf16_cache_take_exact_products_summed_in_float32(Hkv, R, D, S):
    """A bf16 model's attention in BF16 dot products (AVX512-BF16): the scores over the bf16 q
    and K, and P.V with each chunk's probabilities rounded to bf16 (as torch's CPU flash kernel
    and FlashAttention do). Products of bf16 values are exact, so the kernel equals float64
    attention over the same values with P so rounded, to float32 rounding; it stays within P's
    rounding (2^-8 of each weight) of exact attention; each row's output does not depend on the
    rows beside it or on keys it does not attend to."""
    kernel = cpu_kernel()
    if not kernel.uses_bf16_dots():
        pytest.skip("this CPU has no AVX512-BF16")
    q, k, v = qkv(1, Hkv * R, Hkv, 1, S, D, seed=S + R)
    q, k, v = q.reshape(1, Hkv, R, D).bfloat16().contiguous(), k.bfloat16(), v.bfloat16()
    scores = q.double() @ k.double().transpose(-1, -2) / D ** 0.5
    exact = torch.softmax(scores, -1)
    out, lse = kernel.few_row_attention(q, k, v)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), bf16_p_attention(scores, v.double()), atol=2e-5, rtol=1e-5)
    assert ((out.double() - exact @ v.double()).abs() <= 2 ** -8 * (exact @ v.double().abs()) + 2e-6).all()
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)
    try:
        kernel.set_bf16_dots(False)
        widened, _ = kernel.few_row_attention(q, k, v)  # the float32 path, on the same values
    finally:
        kernel.set_bf16_dots(True)
    assert torch.allclose(widened.double(), exact @ v.double(), atol=2e-6, rtol=1e-5)
    for r in (1, 5, R - 1):
        alone, _ = kernel.few_row_attention(q[:, :, r:r + 1].contiguous(), k, v)
        assert torch.equal(alone[:, :, 0], out[:, :, r])
    n = S // 2 + 1  # every row over its first n keys: what the cache's first n keys alone give
    fewer, _ = kernel.few_row_attention(q, k, v, torch.full((R,), n))
    assert torch.equal(fewer, kernel.few_row_attention(q, k[:, :, :n], v[:, :, :n])[0])


@needs_kernel
@pytest.mark.parametrize(("H", "Hkv", "D", "T", "S"),
                         [(12, 2, 128, 40, 1100), (14, 2, 64, 23, 23), (9, 3, 64, 70, 600)])
def test_a_bf16_prefill_chunk_takes_the_packed_path_exactly(H, Hkv, D, T, S):
    """A bf16 model's prefill chunk (more rows than FEW_ROWS) goes through the kernel's packed
    BF16-dots path where the CPU has it: each row stays within P's rounding (2^-8 of each weight)
    of exact attention over its own keys, and close to float64 attention with P so rounded per
    chunk; its output does not depend on the rows beside it (rows reversed: the same bits).
    Elsewhere (no AVX512-BF16) the chunk goes to SDPA unchanged."""
    q, k, v = (x.bfloat16() for x in qkv(1, H, Hkv, T, S, D, seed=T + S))
    G, R = H // Hkv, H // Hkv * T
    assert R > FEW_ROWS
    got = cpu_attention(q, k, v, chain(T))
    kernel = cpu_kernel()
    if not kernel.uses_bf16_dots():
        assert torch.equal(got, sdpa_attention(q, k, v, chain(T)))
        return
    q_folded = q.reshape(1, Hkv, R, D).contiguous()
    row_keys = (S - T + 1 + torch.arange(T)).repeat(G)
    out, lse = kernel.few_row_attention(q_folded, k, v, row_keys)
    assert torch.equal(got, out.reshape(1, H, T, D).bfloat16())
    scores = q_folded.double() @ k.double().transpose(-1, -2) / D ** 0.5  # [1, Hkv, R, S]
    for r in (0, 1, T - 1, T, R // 2, R - 2, R - 1):
        n = int(row_keys[r])
        s, vr = scores[:, :, r:r + 1, :n], v[:, :, :n].double()
        got_r, bound = out[:, :, r:r + 1].double(), torch.softmax(s, -1) @ vr.abs()
        assert ((got_r - torch.softmax(s, -1) @ vr).abs() <= 2 ** -8 * bound + 2e-6).all(), r  # P's rounding
        # float32 scores can round a p to the bf16 neighbour of float64's: 1/16 of that bound here
        assert ((got_r - bf16_p_attention(s, vr)).abs() <= 2 ** -12 * bound + 2e-6).all(), r
        assert torch.allclose(lse[:, :, r].double(), torch.logsumexp(s, -1)[..., 0], atol=1e-4, rtol=1e-5)
    flipped, _ = kernel.few_row_attention(q_folded.flip(2).contiguous(), k, v, row_keys.flip(0))
    assert torch.equal(flipped.flip(2), out)


def bf16_p_attention(scores: torch.Tensor, v: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """float64 attention as the kernel computes it over a bf16 cache: per chunk of `chunk` keys,
    p = exp(s - the chunk's max) rounded to bf16 for P.V, the chunks merged by their sums of p."""
    parts = []
    for s, vc in zip(scores.split(chunk, -1), v.split(chunk, -2)):
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        parts.append((p.float().bfloat16().double() @ vc, m, p.sum(-1, keepdim=True)))
    top = torch.stack([m for _, m, _ in parts]).amax(0)
    weights = [torch.exp(m - top) for _, m, _ in parts]
    return sum(w * o for w, (o, _, _) in zip(weights, parts)) / sum(w * s for w, (_, _, s) in zip(weights, parts))


def test_what_the_kernel_does_not_take_goes_to_sdpa_unchanged():
    cases = [qkv(1, 14, 2, FEW_ROWS // 7 + 1, 300, 64),  # too many rows: a prefill chunk
             qkv(1, 4, 2, 3, 100, 24)]  # a head dim without an instantiation
    q, k, v = qkv(1, 14, 2, 3, 100, 64)
    cases.append((q.double(), k.double(), v.double()))  # float64
    cases.append((q.half(), k.half(), v.half()))  # float16
    for q, k, v in cases:
        T = q.shape[2]
        assert torch.equal(cpu_attention(q, k, v, chain(T)), sdpa_attention(q, k, v, chain(T)))


@needs_kernel
@pytest.mark.parametrize("levels", ["ngram>retrieval>full", "selfspec>full"])
def test_a_float32_engine_on_the_kernel_decodes_as_on_sdpa(levels):
    """Same greedy answers with the kernel or without it, and speculation over it is lossless:
    every stack's answer equals plain decoding's on the same kernel."""
    doc, question = random_ids(300, 128, 3), random_ids(6, 128, 4)
    answers = {}
    for use_cpu_kernel in (True, False):
        for stack in ("plain", levels):
            engine = tiny_engine(stack, dtype="float32", use_cpu_kernel=use_cpu_kernel)
            attend = engine.target.model.layers[0].self_attn.attend
            assert attend is (cpu_attention if use_cpu_kernel else sdpa_attention)
            kernels = {m.kernel for m in engine.target.modules() if isinstance(m, RMSNorm | Attention)}
            assert kernels == {cpu_kernel() if use_cpu_kernel else None}  # norms and RoPE with it
            session = engine.open(doc)
            events = session.ask(question, SamplingConfig(max_new_tokens=24))
            answers[use_cpu_kernel, stack] = [t for e in events for t in e.tokens]
    assert len(answers[True, "plain"]) == 24
    assert len(set(map(tuple, answers.values()))) == 1, answers


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "Hkv", "D"), [(1, 12, 2, 128), (7, 9, 3, 64), (300, 4, 2, 16)])
def test_the_kernels_rope_is_transformers_bit_for_bit(T, H, Hkv, D, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(T)
    q, k = torch.randn(1, T, H, D, generator=g).to(dtype), torch.randn(1, T, Hkv, D, generator=g).to(dtype)
    angles = torch.randn(1, T, D // 2, generator=g) * 1000  # far positions
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = (emb.cos() * 1.2).to(dtype), (emb.sin() * 1.2).to(dtype)  # a YaRN-like attention scaling
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    cpu_kernel().rope_(q, k, cos, sin)  # in place
    assert torch.equal(q.transpose(1, 2), want_q) and torch.equal(k.transpose(1, 2), want_k)


@needs_kernel
@pytest.mark.parametrize("D", [64, 576, 1536])
def test_the_kernels_rms_norm_is_torchs_to_float32_rounding_and_each_rows_own(D):
    g = torch.Generator().manual_seed(D)
    x, w = torch.randn(3, 70, D, generator=g) * 5, torch.randn(D, generator=g)
    got = cpu_kernel().rms_norm(x, w, 1e-6)
    want = w.double() * torch.nn.functional.rms_norm(x.double(), (D,), eps=1e-6)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    for b, t in [(0, 0), (1, 33), (2, 69)]:  # a row alone (decoding) gives what it gives among many (prefill)
        assert torch.equal(cpu_kernel().rms_norm(x[b, t:t + 1].clone(), w, 1e-6)[0], got[b, t])


@needs_kernel
@pytest.mark.parametrize("D", [64, 1536])
def test_the_kernels_bf16_rms_norm_rounds_where_the_models_norm_does(D):
    """A bf16 model's norm (engine/model.py): the row in float32, rounded to bf16, times the bf16
    weight, rounded. Given the same float32 row, every bit is torch's; the row itself may differ from
    torch's in its last float32 bit, which moves a bf16 rounding at a near-tie (rarely)."""
    g = torch.Generator().manual_seed(D)
    x, w = (torch.randn(3, 70, D, generator=g) * 5).bfloat16(), torch.randn(D, generator=g).bfloat16()
    got = cpu_kernel().rms_norm(x, w, 1e-6)
    torchs = w * torch.nn.functional.rms_norm(x.float(), (D,), eps=1e-6).bfloat16()
    assert got.dtype == torch.bfloat16 and (got == torchs).float().mean() > 0.995
    torch.testing.assert_close(got.float(), torchs.float(), rtol=2 ** -6, atol=0)
    row = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    exact = w * row.float().bfloat16()  # the same rounding from the float64 row: all but near-ties
    assert (got == exact).float().mean() > 0.995
    for b, t in [(0, 0), (1, 33), (2, 69)]:
        assert torch.equal(cpu_kernel().rms_norm(x[b, t:t + 1].clone(), w, 1e-6)[0], got[b, t])


@needs_kernel
def test_a_bf16_model_takes_the_kernels_norms_and_rope_and_keeps_its_logits():
    """set_attention gives a bf16 model the kernel's norms and RoPE (RoPE bit for bit, the norm at
    rare near-ties a bf16 ulp off): its logits over a prompt and a continuation stay torch's."""
    from engine.kv.full import FullCache
    from tests.conftest import ours, tiny_hf

    model = ours(tiny_hf("llama", seed=5)).bfloat16()
    ids, c = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2)), model.config

    def logits():
        cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 64, torch.bfloat16, torch.device("cpu"))
        return torch.cat([model(ids[:, :33], torch.arange(33), cache),
                          model(ids[:, 33:], torch.arange(33, 40), cache)], 1)

    model.set_attention(cpu_attention)
    assert {m.kernel for m in model.modules() if isinstance(m, RMSNorm | Attention)} == {cpu_kernel()}
    got = logits()
    for m in model.modules():
        if isinstance(m, RMSNorm | Attention):
            m.kernel = None  # torch's ops, the same attention
    want = logits()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("capability, want", [((7, 5), "sdpa"), ((7, 0), "sdpa"), ((8, 0), "flash"), ((8, 9), "flash")])
def test_flash_attn_is_picked_only_on_gpus_it_runs_on(monkeypatch, capability, want):
    """Issue 54 row 6: flash-attn 2 needs sm80+; on a T4 (sm75) or V100 (sm70) that has it
    installed, importing it is not enough: its first prefill would fail. (CUDA is faked.)"""
    from engine import attention

    monkeypatch.setattr(attention, "has_flash_attn", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    picked = attention.pick_attention(torch.device("cuda", 0))
    assert picked is {"flash": attention.flash_attention, "sdpa": sdpa_attention}[want]
    assert attention.pick_attention(torch.device("cuda", 0), use_flash_attn=False) is sdpa_attention
