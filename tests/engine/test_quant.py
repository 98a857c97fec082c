"""GGUF blocks kept as in the file (engine/quant.py, engine/csrc/quant_cpu.cpp): each block type
unpacks to exactly gguf's numpy dequantize; the linear equals float32 x @ deq(W).T up to
float32 rounding in its summation order (AVX2 Q4_K: each sub-block's scale applied to its sum);
a row's output does not depend on the rows beside it, bit for bit, in float32 and bf16 models;
packaged GGUFs keep their blocks in bf16 and with YaRN; on the real files, greedy decoding with
the blocks equals the dequantized float32 model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.quant import KERNEL_TYPES, QuantEmbedding, QuantLinear, cpu_quant_kernel

pytestmark = pytest.mark.skipif(cpu_quant_kernel() is None, reason="engine/csrc/quant_cpu.cpp did not build here")
TYPES = sorted(KERNEL_TYPES.values())


ISAS = {"avx2": 0, "avx512": 1, "avx512-bf16": 2}


@pytest.fixture(params=list(ISAS))
def isa(request):
    """Each kernel path in turn: AVX2 (every CPU it builds on), AVX-512 where the CPU has it, and
    AVX-512 with BF16 dot products for bf16 activations where it has AVX512-BF16."""
    kernel = cpu_quant_kernel()
    kernel.set_isa(-1)
    if request.param != "avx2" and not kernel.uses_avx512():
        pytest.skip("this CPU has no AVX-512 (F, BW, VL, DQ)")
    if request.param == "avx512-bf16" and not kernel.uses_bf16_dots():
        pytest.skip("this CPU has no AVX512-BF16")
    kernel.set_isa(ISAS[request.param])
    yield request.param
    kernel.set_isa(-1)


BF16_DOT_TYPES = ("Q4_K", "Q6_K")  # bf16 activations of these run BF16 dot products on "avx512-bf16"
INTERLEAVED_TYPES = ("Q5_0", *BF16_DOT_TYPES)  # and a bf16 QuantLinear of these, from interleaved rows


def random_blocks(name: str, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """[n_rows, row bytes] uint8 blocks of type `name`: gguf's own quantization where it has one
    (Q4_0, Q4_1, Q5_0, Q8_0), else random bytes with finite float16 scales (the K-quants)."""
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    try:
        return quantize(weights, qtype)
    except NotImplementedError:
        pass
    n_values, n_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_rows, n_cols // n_values, n_bytes), dtype=np.uint8)
    # d (and dmin): float16, some subnormal
    scale_at = {"Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[name]
    scales = (rng.standard_normal((n_rows, n_cols // n_values, len(scale_at))) * 1e-2).astype(np.float16)
    scales[0, 0] = np.float16(3e-7)  # a subnormal float16 scale
    for i, offset in enumerate(scale_at):
        blocks[..., offset:offset + 2] = scales[..., i:i + 1].view(np.uint8)
    return blocks.reshape(n_rows, -1)


def layer(name: str, n_rows: int = 40, n_cols: int = 512, bias: bool = False) -> tuple[QuantLinear, torch.Tensor]:
    """A QuantLinear of random blocks and its weights dequantized by gguf (numpy), [out, in]."""
    blocks = random_blocks(name, n_rows, n_cols)
    qtype = int(GGMLQuantizationType[name])
    reference = torch.from_numpy(dequantize(blocks, GGMLQuantizationType(qtype)).reshape(n_rows, n_cols))
    b = torch.randn(n_rows) if bias else None
    return QuantLinear(torch.from_numpy(blocks), qtype, n_cols, b, cpu_quant_kernel()), reference


@pytest.mark.parametrize("name", TYPES)
def test_blocks_unpack_to_exactly_ggufs_dequantize(name, isa):
    linear, reference = layer(name)
    assert torch.isfinite(reference).all()
    assert torch.equal(linear.dequantized(), reference)  # bit for bit, subnormal scales included


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_rows", [1, 2, 3, 5, 16, 25, QuantLinear.KERNEL_MAX_ROWS + 3])  # the last: BLAS path
def test_linear_equals_float32_product_with_dequantized_weights(name, n_rows, isa):
    linear, reference = layer(name, bias=True)
    x = torch.randn(n_rows, 512)
    exact = x.double() @ reference.double().T + linear.bias.double()
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (n_rows, 40)
    # float32 sums of 512 products in any order: within a few ulps of the largest partial sums
    bound = 1e-5 * (x.double().abs() @ reference.double().abs().T).max()
    assert (got.double() - exact).abs().max() <= bound


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(name, isa):
    # 25 weight rows: AVX2 above 6 rows multiplies 3 unpacked weight rows at a time, and one alone;
    # 768 columns: its passes over 512 columns at a time end with a shorter one
    linear, _ = layer(name, n_rows=25, n_cols=768)
    x = torch.randn(QuantLinear.KERNEL_MAX_ROWS, 768)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    # chunks of rows unpacked together: AVX2 3, AVX-512 8 (17, 25: uneven chunks, a check of 1 + 3 x 8)
    for n in (2, 3, 4, 5, 6, 7, 8, 9, 17, 25, QuantLinear.KERNEL_MAX_ROWS):
        assert torch.equal(linear(x[:n]), alone[:n]), f"{n} rows in one call"


def test_embedding_rows_are_the_dequantized_table(isa):
    blocks = random_blocks("Q8_0", 50, 64)
    table = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(50, 64))
    embedding = QuantEmbedding(torch.from_numpy(blocks), int(GGMLQuantizationType.Q8_0), 64, cpu_quant_kernel())
    ids = torch.tensor([[3, 0, 49, 3]])
    assert torch.equal(embedding(ids), table[ids])


def test_wrong_row_bytes_is_a_clear_error():
    blocks = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    with pytest.raises(RuntimeError, match="bytes of this type"):
        cpu_quant_kernel().quant_linear(torch.randn(1, 96), blocks, int(GGMLQuantizationType.Q8_0))


def dequantized_copy(model: nn.Module) -> nn.Module:
    """`model` with every QuantLinear / QuantEmbedding replaced by its float32 dequantized weights:
    the model in the file, in float32, through torch's own layers."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = nn.Parameter(module.dequantized(), requires_grad=False)
            plain.bias = module.bias
            model.set_submodule(name, plain)
        elif isinstance(module, QuantEmbedding):
            table = torch.empty(module.weight.shape[0], module.dim)
            module.kernel.dequantize(module.weight, module.qtype, table)
            model.set_submodule(name, nn.Embedding.from_pretrained(table))
    return model


def greedy_answer(model, tokenizer, n_tokens: int = 24) -> list[int]:
    from engine.config import EngineConfig, SamplingConfig
    from engine.session import Engine
    from tools.chat import ChatFormat

    config = EngineConfig(target="unused", levels="plain", device="cpu", dtype="float32")
    chat = ChatFormat(tokenizer)
    prompt = chat.document_ids("Anne Elliot lived at Kellynch Hall with her father, Sir Walter, and her sister.")
    question = chat.question_ids("Where did Anne live?", True, False)
    session = Engine(config, model, tokenizer).open(prompt)
    events = session.ask(question, SamplingConfig(max_new_tokens=n_tokens), stop_ids=chat.stop_ids)
    return [t for e in events for t in e.tokens]


@pytest.mark.slow  # 1-4 min on 2 busy cores: two loads of the file, every tensor dequantized twice
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_file_greedy_with_blocks_equals_dequantized_float32_model(name):
    """Every quantized tensor of the packaged file (SmolLM2: Q4_1, Q8_0; Qwen 0.5B: Q5_0, Q4_K,
    Q6_K, Q8_0) unpacks to gguf's dequantize bit for bit, and greedy decoding with the blocks
    equals greedy decoding with float32 `nn.Linear`s of those dequantized weights."""
    from gguf import GGUFReader

    from engine.loading import load_model
    from engine.models import gguf_path

    if not gguf_path(name).is_file():
        pytest.skip(f"{name} is not assembled: run `python -m tools.models --only {name}`")
    model, tokenizer = load_model(name, torch.float32, torch.device("cpu"))
    modules = dict(model.named_modules())
    n_checked = 0
    for tensor in GGUFReader(gguf_path(name)).tensors:
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name or tensor.tensor_type.name not in TYPES:
            continue  # q / k rows are reordered for Llama (checked through the greedy answer)
        layer_idx = tensor.name.split(".")[1]
        kind = {"token_embd": "model.embed_tokens", "output": "lm_head"}.get(tensor.name.split(".")[0]) or \
            f"model.layers.{layer_idx}." + {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                                           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                                           "ffn_down": "mlp.down_proj"}[tensor.name.split(".")[2]]
        module = modules[kind]
        got = module.dequantized() if isinstance(module, QuantLinear) else None
        if got is not None:
            assert torch.equal(got, torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))), tensor.name
            n_checked += 1
    assert n_checked >= 5 * model.config.n_layers
    answer = greedy_answer(model, tokenizer)
    reference, _ = load_model(name, torch.float32, torch.device("cpu"))
    assert len(answer) >= 8 and answer == greedy_answer(dequantized_copy(reference), tokenizer)


@pytest.mark.parametrize("name", TYPES)
def test_bf16_activations_return_bf16_and_rows_stay_independent(name, isa):
    """A bf16 model's QuantLinear: the kernel's float32 sum plus the float32 bias, rounded once to
    bf16; each row's output independent of the rows beside it. Without BF16 dot products the sum
    is the float32 path's on the widened activations, bit for bit."""
    linear, _ = layer(name, n_rows=24, bias=True)
    x = torch.randn(QuantLinear.KERNEL_MAX_ROWS, 512).bfloat16()
    got = linear(x)
    assert got.dtype == torch.bfloat16
    float32_sums = cpu_quant_kernel().quant_linear(x, linear.weight, linear.qtype,  # no bias, float32 out
                                                   interleaved=linear.interleaved(x.dtype))
    assert torch.equal(got, (float32_sums + linear.bias).bfloat16())  # the kernel's epilogue: torch's ops
    if not (isa == "avx512-bf16" and name in INTERLEAVED_TYPES):
        assert torch.equal(got, linear(x.float()).bfloat16())
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    for n in (2, 5, 7, 8, 9, 17, QuantLinear.KERNEL_MAX_ROWS):
        assert torch.equal(linear(x[:n]), alone[:n]), f"{n} rows in one call"


@pytest.mark.parametrize("name", BF16_DOT_TYPES)
@pytest.mark.parametrize("n_rows", [1, 2, 5, 9, 25, QuantLinear.KERNEL_MAX_ROWS])
@pytest.mark.parametrize("n_cols", [512, 768])
def test_bf16_dots_are_exact_products_summed_in_float32(name, n_rows, n_cols):
    """The BF16 dot products (bf16 codes times bf16 activations, scaled once per group): within the
    float32 path's bound of the exact float64 product with gguf's dequantized weights."""
    kernel = cpu_quant_kernel()
    kernel.set_isa(-1)
    if not kernel.uses_bf16_dots():
        pytest.skip("this CPU has no AVX512-BF16")
    linear, reference = layer(name, n_cols=n_cols)
    x = torch.randn(n_rows, n_cols).bfloat16()
    exact = x.double() @ reference.double().T
    got = kernel.quant_linear(x, linear.weight, linear.qtype)
    assert got.dtype == torch.float32 and got.shape == (n_rows, 40)
    bound = 1e-5 * (x.double().abs() @ reference.double().abs().T).max()
    assert (got.double() - exact).abs().max() <= bound
    assert not torch.equal(got, kernel.quant_linear(x.float(), linear.weight, linear.qtype))  # another path


@pytest.mark.parametrize("name", INTERLEAVED_TYPES)
@pytest.mark.parametrize("n_rows", [1, 2, 5, 6, 7, 13, QuantLinear.KERNEL_MAX_ROWS])
def test_interleaved_blocks_are_exact_products_and_each_rows_own(name, n_rows):
    """Q5_0, Q4_K and Q6_K with 16 weight rows interleaved (a bf16 model's decoding on AVX512-BF16):
    within the float32 bound of the exact product, rows of x independent, 40 weight rows (the last
    group padded), another summation order than the row-major loop. A QuantLinear takes it for bf16."""
    kernel = cpu_quant_kernel()
    kernel.set_isa(-1)
    if not kernel.uses_bf16_dots():
        pytest.skip("this CPU has no AVX512-BF16")
    linear, reference = layer(name, n_cols=768, bias=True)
    interleaved = kernel.interleave(linear.weight, linear.qtype, 768)
    assert interleaved.shape == (3, linear.weight.shape[1] * 16)  # 40 rows: 3 groups of 16
    x = torch.randn(n_rows, 768).bfloat16()
    got = kernel.quant_linear(x, linear.weight, linear.qtype, interleaved=interleaved)
    exact = x.double() @ reference.double().T
    bound = 1e-5 * (x.double().abs() @ reference.double().abs().T).max()
    assert got.shape == (n_rows, 40) and (got.double() - exact).abs().max() <= bound
    alone = torch.cat([kernel.quant_linear(x[i:i + 1], linear.weight, linear.qtype, interleaved=interleaved)
                       for i in range(n_rows)])
    assert torch.equal(got, alone)
    assert not torch.equal(got, kernel.quant_linear(x, linear.weight, linear.qtype))  # another path
    assert linear.interleaved(torch.bfloat16) is linear.interleaved(torch.bfloat16)  # made once
    assert torch.equal(linear.interleaved(torch.bfloat16), interleaved)
    assert torch.equal(linear(x), (got + linear.bias).bfloat16())
    assert linear.interleaved(torch.float32) is None  # float32 rows keep the file's loop
    with pytest.raises(RuntimeError, match="interleave"):
        kernel.quant_linear(x, linear.weight, linear.qtype, interleaved=interleaved[:2])


@pytest.mark.parametrize("name", TYPES)
def test_bf16_tiles_are_ggufs_weights_rounded_as_torch_rounds_them(name, isa):
    """A bf16 prefill's tiles come from the kernel straight in bf16 (no float32 copy): gguf's
    dequantized weights rounded to nearest even, bit for bit what `.to(torch.bfloat16)` gives."""
    linear, reference = layer(name, n_rows=40, n_cols=512)
    tile = cpu_quant_kernel().dequantize(linear.weight, linear.qtype, torch.empty(40, 512, dtype=torch.bfloat16))
    assert torch.equal(tile.view(torch.int16), reference.bfloat16().view(torch.int16))


def test_the_kernels_bf16_rounding_is_torchs_on_ties_and_nan():
    """The rounding behind those tiles (quant_cpu.cpp `to_bf16`), through Q8_0 blocks whose
    float16 scale is 1 (weights = the int8 codes) or NaN (a NaN stays one), and scales that put
    products halfway between two bf16 values: torch's own rounding, to nearest even."""
    kernel = cpu_quant_kernel()
    blocks = np.zeros((2, 34), dtype=np.uint8)  # Q8_0: a float16 scale, 32 int8 codes
    blocks[0, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    blocks[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    blocks[1, :2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    tile = kernel.dequantize(torch.from_numpy(blocks), 8, torch.empty(2, 32, dtype=torch.bfloat16))
    wide = kernel.dequantize(torch.from_numpy(blocks), 8, torch.empty(2, 32))
    assert torch.equal(tile[0].view(torch.int16), wide[0].bfloat16().view(torch.int16))
    assert torch.isnan(tile[1]).all()  # (torch's own NaN bits differ between its scalar and vector paths)
    # ties: float16 scales whose products with odd codes land halfway between two bf16 values
    scales = (np.float16(1.0) + np.float16(2.0 ** -9) * np.arange(1, 9, dtype=np.float16)).astype(np.float16)
    ties = np.zeros((8, 34), dtype=np.uint8)
    ties[:, :2] = scales.view(np.uint8).reshape(8, 2)
    ties[:, 2:] = np.arange(-96, 128, 7, dtype=np.int8)[:32].view(np.uint8)
    tile = kernel.dequantize(torch.from_numpy(ties), 8, torch.empty(8, 32, dtype=torch.bfloat16))
    wide = kernel.dequantize(torch.from_numpy(ties), 8, torch.empty(8, 32))
    halfway = (wide.view(torch.int32) & 0xFFFF) == 0x8000
    assert halfway.sum() == 8 and ((wide.view(torch.int32) >> 16) & 1)[halfway].sum() == 4  # ties up and down
    assert torch.equal(tile.view(torch.int16), wide.bfloat16().view(torch.int16))


@pytest.mark.parametrize("name", ["Q5_0", "Q6_K"])
def test_bf16_prefill_chunks_multiply_bf16_tiles(name):
    """More rows than the kernel takes: weights dequantized to bf16 tiles, a bf16 GEMM; close to
    the float32 product at bf16's precision, and the LM head's `out_dtype` keeps float32."""
    linear, reference = layer(name, n_rows=40, bias=True)
    linear.BLOCK_ROWS = 16  # several tiles
    x = torch.randn(QuantLinear.KERNEL_MAX_ROWS + 5, 512).bfloat16()
    exact = x.double() @ reference.double().T + linear.bias.double()
    got = linear(x)
    assert got.dtype == torch.bfloat16
    bound = 2e-2 * (x.double().abs() @ reference.double().abs().T).max()  # bf16 weights and sums
    assert (got.double() - exact).abs().max() <= bound
    linear.out_dtype = torch.float32
    assert linear(x).dtype == torch.float32 and linear(x[:3]).dtype == torch.float32


def test_a_bf16_gguf_decodes_from_interleaved_copies_and_maps_the_files_blocks():
    """On a CPU with BF16 dot products, loading a bf16 model makes the Q5_0, Q4_K and Q6_K linears'
    interleaved copies, and leaves those linears' blocks in the file's order as pages of the .gguf
    (mapped, not a second copy in memory); blocks of other types (Q8_0) are copied."""
    from engine.loading import load_quantized_model
    from engine.models import gguf_path

    kernel = cpu_quant_kernel()
    kernel.set_isa(-1)
    if not kernel.uses_bf16_dots():
        pytest.skip("this CPU has no AVX512-BF16")
    path = gguf_path("qwen2.5-coder-0.5b")
    if not path.is_file():
        pytest.skip("qwen2.5-coder-0.5b is not assembled")
    model, _ = load_quantized_model(path, dtype=torch.bfloat16)
    spans = [tuple(int(a, 16) for a in line.split()[0].split("-"))
             for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path))]
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for linear in linears:
        mapped = any(lo <= linear.weight.data_ptr() < hi for lo, hi in spans)
        interleaves = linear.qtype in (6, 12, 14)
        assert mapped == interleaves and (linear._interleaved is not None) == interleaves, linear
    assert {m.qtype for m in linears} == {6, 8, 12, 14}  # Q8_0 copied; Q5_0, Q4_K, Q6_K mapped


def test_a_packaged_gguf_keeps_its_blocks_in_bf16_and_with_yarn():
    """load_model's choice: the file's blocks in float32 and bfloat16 (the `auto` dtype where the
    CPU has AVX512-BF16 or AMX), YaRN applied to the blocks model's config; the norms take the
    model's dtype; `keep_gguf_blocks=False` is the way back to the dequantized copy."""
    from engine.loading import load_model
    from engine.models import gguf_path, packaged_model_dir
    from engine.quant import is_quantized

    name = "smollm2-135m"
    if not gguf_path(name).is_file():
        pytest.skip(f"{name} is not assembled: run `python -m tools.models --only {name}`")
    native, _ = load_model(name, torch.float32, torch.device("cpu"))
    model, _ = load_model(name, torch.bfloat16, torch.device("cpu"), yarn_factor=4)
    assert is_quantized(model) and model.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert model.config.max_positions == 4 * native.config.max_positions
    rope = model.model.rotary_emb
    assert rope.rope_type == "yarn" and not torch.equal(rope.inv_freq, native.model.rotary_emb.inv_freq)
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.out_dtype == torch.float32  # logits
    if packaged_model_dir(name, convert=False) is not None:
        plain, _ = load_model(name, torch.bfloat16, torch.device("cpu"), keep_gguf_blocks=False)
        assert not is_quantized(plain)


def test_a_first_load_says_it_reads_the_tokenizer_once_and_a_later_load_says_nothing(tmp_path, monkeypatch, caplog):
    """The header folder (transformers' GGUF reader: config and tokenizer) is one-time work at the
    first start unless scripts/setup.sh did it: it is said in the log, once."""
    import logging

    from engine.loading import gguf_header_dir
    from engine.models import PACKAGED_MODELS, gguf_path

    path = gguf_path("smollm2-135m")
    if not path.is_file():
        pytest.skip("smollm2-135m is not assembled")
    monkeypatch.setenv("BOOKCHAT_CACHE", str(tmp_path))  # a fresh cache: the header is not there yet
    with caplog.at_level(logging.WARNING, logger="engine.quant"):
        first = gguf_header_dir(path, PACKAGED_MODELS["smollm2-135m"].sha256)
    assert f"reading the tokenizer and config of {path.name} with transformers, once" in caplog.text
    assert str(first) in caplog.text and first.is_relative_to(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.quant"):
        assert gguf_header_dir(path, PACKAGED_MODELS["smollm2-135m"].sha256) == first
    assert "reading the tokenizer" not in caplog.text
