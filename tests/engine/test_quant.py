"""GGUF blocks kept as in the file (engine/quant.py, engine/csrc/quant_cpu.cpp): each block type
unpacks to exactly gguf's numpy dequantize; the linear equals float32 x @ deq(W).T up to
summation order; a row's output does not depend on the rows beside it, bit for bit; on the real
SmolLM2 file, greedy decoding with the blocks equals the dequantized float32 model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.quant import KERNEL_TYPES, QuantEmbedding, QuantLinear, cpu_quant_kernel

pytestmark = pytest.mark.skipif(cpu_quant_kernel() is None, reason="engine/csrc/quant_cpu.cpp did not build here")
TYPES = sorted(KERNEL_TYPES.values())


def random_blocks(name: str, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """[n_rows, row bytes] uint8 blocks of type `name`: gguf's own quantization where it has one
    (Q4_0, Q4_1, Q5_0, Q8_0), else random bytes with finite float16 scales (Q4_K, Q6_K)."""
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    try:
        return quantize(weights, qtype)
    except NotImplementedError:
        pass
    n_values, n_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_rows, n_cols // n_values, n_bytes), dtype=np.uint8)
    scale_at = {"Q4_K": [0, 2], "Q6_K": [208]}[name]  # d (and dmin): float16, some subnormal
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
def test_blocks_unpack_to_exactly_ggufs_dequantize(name):
    linear, reference = layer(name)
    assert torch.isfinite(reference).all()
    assert torch.equal(linear.dequantized(), reference)  # bit for bit, subnormal scales included


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_rows", [1, 2, 3, 5, 16, QuantLinear.KERNEL_MAX_ROWS + 3])  # the last: BLAS path
def test_linear_equals_float32_product_with_dequantized_weights(name, n_rows):
    linear, reference = layer(name, bias=True)
    x = torch.randn(n_rows, 512)
    exact = x.double() @ reference.double().T + linear.bias.double()
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (n_rows, 40)
    # float32 sums of 512 products in any order: within a few ulps of the largest partial sums
    bound = 1e-5 * (x.double().abs() @ reference.double().abs().T).max()
    assert (got.double() - exact).abs().max() <= bound


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(name):
    linear, _ = layer(name, n_rows=24)
    x = torch.randn(QuantLinear.KERNEL_MAX_ROWS, 512)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    for n in (2, 3, 4, 7, 9, QuantLinear.KERNEL_MAX_ROWS):
        assert torch.equal(linear(x[:n]), alone[:n]), f"{n} rows in one call"


def test_embedding_rows_are_the_dequantized_table():
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


@pytest.mark.slow  # ~60 s on 2 busy cores: two loads of the file and two engines
def test_smollm2_greedy_with_blocks_equals_dequantized_float32_model():
    from engine.chat import ChatFormat
    from engine.config import EngineConfig, SamplingConfig
    from engine.engine import Engine
    from engine.loading import load_model
    from engine.models import gguf_path

    if not gguf_path("smollm2-135m").is_file():
        pytest.skip("smollm2-135m is not assembled: run `python -m engine.models --only smollm2-135m`")
    model, tokenizer = load_model("smollm2-135m", torch.float32, torch.device("cpu"))
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8  # 4.5 bits a weight, as in the file
    from gguf import GGUFReader  # the file's blocks, read by gguf, dequantized by numpy

    tensor = next(t for t in GGUFReader(gguf_path("smollm2-135m")).tensors if t.name == "blk.3.ffn_down.weight")
    assert torch.equal(model.model.layers[3].mlp.down_proj.dequantized(),
                       torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)))
    reference, _ = load_model("smollm2-135m", torch.float32, torch.device("cpu"))
    dequantized_copy(reference)
    config = EngineConfig(target="smollm2-135m", levels="plain", device="cpu", dtype="float32")
    chat = ChatFormat(tokenizer)
    prompt = chat.document_ids("Anne Elliot lived at Kellynch Hall with her father, Sir Walter, and her sister.")
    question = chat.question_ids("Where did Anne live?", True, False)
    answers = []
    for target in (model, reference):
        session = Engine(config, target, tokenizer).open(prompt)
        events = session.ask(question, SamplingConfig(max_new_tokens=24), stop_ids=chat.stop_ids)
        answers.append([t for e in events for t in e.tokens])
    assert len(answers[0]) >= 8 and answers[0] == answers[1]
