"""Forward parity with Hugging Face transformers: logits of our decoder, run in chunks over a
KV cache, equal transformers' for tiny Llama / Qwen2 configs in float64 (GQA, qkv bias, tied
and untied embeddings, llama3 / yarn / linear RoPE scaling)."""

from __future__ import annotations

import pytest
import torch

from engine import layouts
from engine.kv.full import FullCache
from tests.conftest import ours, tiny_hf

ROPES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize(("family", "tie"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)])
def test_chunked_forward_matches_transformers(family, tie, rope):
    hf = tiny_hf(family, seed=3, rope=ROPES[rope], tie=tie)
    model = ours(hf)
    if family == "qwen2":
        assert model.config.has_qkv_bias and model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.config.n_kv_heads < model.config.n_heads  # GQA
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    want = hf(ids).logits
    c = model.config
    cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 16, torch.float64, torch.device("cpu"))
    got = []
    for start, end in [(0, 37), (37, 100), (100, 101), (101, 150)]:  # uneven chunks, growth
        got.append(model(ids[:, start:end], torch.arange(start, end), cache))
    assert torch.allclose(torch.cat(got, 1), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize(("family", "tie", "dtype"), [("llama", False, torch.float32), ("qwen2", True, torch.float32),
                                                     ("qwen2", True, torch.bfloat16)])
def test_packed_linears_keep_logits_names_and_the_embedding(family, tie, dtype):
    """oneDNN-packed linears (engine/device.py: float32 on CPU, bf16 with AVX512-BF16) change
    the layout only: same parameter names and shapes, the embedding keeps its own rows (a tied
    LM head gets a packed copy), logits equal the unpacked model's to rounding, across chunks."""
    from engine.device import can_pack_linear_weights
    from engine.layouts import PackedLinear

    if not can_pack_linear_weights(dtype):
        pytest.skip(f"this torch cannot prepack {dtype} linears with oneDNN here")
    model = ours(tiny_hf(family, seed=5, tie=tie)).to(dtype)
    names = {k: v.shape for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    c = model.config

    def logits():
        cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 64, dtype, torch.device("cpu"))
        return torch.cat([model(ids[:, :33], torch.arange(33), cache),
                          model(ids[:, 33:], torch.arange(33, 40), cache)], 1)

    want = logits()
    embedding = model.model.embed_tokens.weight
    layouts.lay_out_linears(model, "packed")
    assert {k: v.shape for k, v in model.state_dict().items()} == names
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 7 * c.n_layers + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.model.embed_tokens.weight is embedding and model.lm_head.weight.is_mkldnn
    got = logits()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the sums may differ
    assert got.shape == want.shape and torch.allclose(got, want, atol=tol, rtol=tol)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9



def test_bf16_linear_kernel_is_float32_arithmetic_over_bf16_weights():
    """engine/csrc/linear_cpu.cpp: x w^T with each bf16 weight widened, summed in float32; every
    tile shape and remainder (1-9 rows, groups of weight rows not a multiple of the tile), and
    each output row bitwise independent of how many rows share the call."""
    from engine.device import cpu_linear_kernel

    kernel = cpu_linear_kernel()
    if kernel is None:
        pytest.skip("the CPU linear kernel does not build here")
    g = torch.Generator().manual_seed(0)
    for M, K, N in [(1, 2, 8), (1, 64, 24), (2, 48, 16), (3, 896, 40), (4, 32, 200), (5, 32, 64), (6, 18, 8),
                    (7, 896, 96), (9, 160, 200), (1, 4864, 72), (16, 64, 1544)]:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
        blocked = kernel.block_weight(w)
        assert blocked.shape == (N // 8, K // 2, 8, 2) and torch.equal(blocked.permute(0, 2, 1, 3).reshape(N, K), w)
        got = kernel.bf16_linear(x, blocked)
        want = x.double() @ w.double().t()
        assert got.dtype == torch.float32 and got.shape == (M, N)
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5), (M, K, N)
        for m in range(M):
            assert torch.equal(kernel.bf16_linear(x[m:m + 1].contiguous(), blocked)[0], got[m])
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel.block_weight(torch.randn(12, 24).bfloat16())


@pytest.mark.parametrize(("family", "tie"), [("llama", False), ("qwen2", True)])
def test_bf16_stored_linears_keep_logits_and_names(family, tie):
    """A float32 model whose weights are all bf16 values (a bf16 checkpoint) stores its linears
    as bf16 (engine/device.py "bf16-stored"): same parameter names, the embedding's rows in bf16
    too, and logits equal the float32 model's to float32 rounding, through the kernel (decoding,
    checks) and through BLAS (a chunk of more rows than the kernel takes)."""
    from engine.device import cpu_linear_kernel
    from engine.layouts import Bf16Linear

    if cpu_linear_kernel() is None:
        pytest.skip("the CPU linear kernel does not build here")
    model = ours(tiny_hf(family, seed=5, tie=tie)).float()
    assert not layouts.linear_weights_fit_bf16(model)  # random float32 weights: bf16 would round them
    with pytest.raises(AssertionError, match="bf16 would round"):
        layouts.lay_out_linears(model, "bf16-stored")
    model = model.bfloat16().float()  # a bf16 checkpoint loaded as float32
    assert layouts.linear_weights_fit_bf16(model)
    names = set(model.state_dict())
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    c = model.config

    def logits():
        cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 64, torch.float32, torch.device("cpu"))
        return torch.cat([model(ids[:, :150], torch.arange(150), cache, n_logits=150),  # > 128 rows: BLAS
                          model(ids[:, 150:159], torch.arange(150, 159), cache),  # a check: the kernel
                          model(ids[:, 159:], torch.arange(159, 160), cache)], 1)

    want = logits()
    layouts.lay_out_linears(model, "bf16-stored")
    assert set(model.state_dict()) == names
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Bf16Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.dtype == torch.float32 and model.model.norm.weight.dtype == torch.float32
    got = logits()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_the_query_log_keeps_only_its_queries_not_the_chunks():
    """A prefill chunk's queries are freed after each layer; the log keeps copies of its last M
    (issue 54 row 3: a view kept every layer's whole chunk of queries alive, unplanned). Measured:
    the bytes of the storage behind each logged tensor, against the planner's count."""
    from engine.config import RetrievalConfig
    from engine.memory import query_log_bytes
    from engine.model import QueryLog

    model = ours(tiny_hf("llama"))
    c, M = model.config, RetrievalConfig().n_score_queries
    log = QueryLog(c.n_layers, M)
    cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 512, torch.float64, torch.device("cpu"))
    model(torch.randint(0, 128, (1, 512)), torch.arange(512), cache, query_log=log)  # one 512-token chunk
    held = sum(q.untyped_storage().nbytes() for q in log.queries)
    assert all(q.shape == (1, c.n_heads, M, c.head_dim) for q in log.queries)
    assert held == query_log_bytes(c, M, 8) == c.n_layers * c.n_heads * M * c.head_dim * 8  # not 512 queries


def test_queries_are_not_rescaled_without_a_query_scale_of_the_model():
    """head_dim ** -0.5 * head_dim ** 0.5 is 1 + 2e-16 at 128: computed so, every layer of every
    model multiplied its queries once more (its cost: benchmarks/RESULTS.md section 9)."""
    from engine.config import ModelConfig
    from engine.model import Attention

    shapes = dict(n_layers=1, dim=256, n_heads=2, n_kv_heads=1, head_dim=128, intermediate=8, vocab_size=8,
                  rms_eps=1e-6, has_qkv_bias=False, has_tied_embeddings=False, max_positions=64)
    assert Attention(ModelConfig(**shapes)).q_factor == 1.0
    gemma = Attention(ModelConfig(**shapes, is_gemma=True, query_scale=256 ** -0.5))
    assert gemma.q_factor == pytest.approx((128 / 256) ** 0.5) and gemma.scale == 256 ** -0.5
