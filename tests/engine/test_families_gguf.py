"""GGUF files of every family, written here as llama.cpp's converter writes them (the gguf package's
writer, llama.cpp's tensor names from gguf's own TensorNameMap, its metadata keys, its q/k row order
for the "llama" architecture, Gemma's norms stored as 1 + w, Phi-3's fused linears): an F32 file
loads to transformers' logits; Q8_0 (gguf's quantizer), Q3_K, Q4_K and Q5_K (random blocks: gguf
cannot quantize K types) keep their blocks (engine/quant.py) and give the logits of the same model with
gguf's dequantized weights; greedy decoding over them equals plain decoding for every stack. Files
we cannot run are refused from their header (engine/families.py), a truncated one with a typed error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize

from engine.config import LEVEL_STACKS, EngineConfig, EngineError, UnsupportedModel
from engine.families import check_model
from engine.loading import load_model
from engine.quant import QuantLinear, cpu_quant_kernel
from engine.session import Engine
from tests.conftest import LONGROPE, WINDOW, tiny_hf
from tests.engine.test_families import chat, random_ids
from tests.engine.test_quant import random_blocks

pytestmark = pytest.mark.skipif(cpu_quant_kernel() is None, reason="engine/csrc/quant_cpu.cpp did not build here")

ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3, "mistral": MODEL_ARCH.LLAMA,
         "mistral-window": MODEL_ARCH.LLAMA, "gemma2": MODEL_ARCH.GEMMA2, "gemma3": MODEL_ARCH.GEMMA3,
         "phi3": MODEL_ARCH.PHI3, "phi3-longrope": MODEL_ARCH.PHI3, "llama3": MODEL_ARCH.LLAMA}
FAMILIES = ["qwen3", "mistral", "mistral-window", "gemma2", "gemma3", "phi3", "phi3-longrope", "llama", "llama3"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # Llama 3.1's


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BOOKCHAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def gguf_hf(family: str, seed: int = 0):
    """A tiny model whose linears take rows of 256 values (a K-quant block), with the settings
    llama.cpp writes or implies for its family: Gemma's query scale is head_dim's, Gemma 3's
    layers follow its pattern of 6 (two layers: both sliding)."""
    fields = dict(hidden_size=256, intermediate_size=256)
    if not family.startswith(("phi3", "llama")):
        fields["head_dim"] = 64
    if family.startswith("gemma"):
        fields["query_pre_attn_scalar"] = 64
    if family == "gemma3":
        fields["layer_types"] = ["sliding_attention"] * 2
    if family == "phi3-longrope":  # a factor per frequency of head_dim 64
        fields["rope_parameters"] = LONGROPE | {"long_factor": [1.0 + i / 16 for i in range(32)],
                                                "short_factor": [1.0 + i / 64 for i in range(32)]}
    if family == "llama3":
        return tiny_hf("llama", seed=seed, rope=LLAMA3_ROPE, **fields)
    return tiny_hf(family, seed=seed, **fields)


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for a llama3 RoPE."""
    base, factor, low, high = rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        divisors.append(1 if wavelen < old / high else factor if wavelen > old / low
                        else 1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row order of a q / k projection of its "llama" architecture (convert_hf_to_gguf)."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def unpermute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    return rows.reshape(n_heads, rows.shape[0] // n_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_metadata(writer: GGUFWriter, family: str, config) -> None:
    arch, head_dim = ARCHS[family], config.hidden_size // config.num_attention_heads
    writer.add_name("mistral-tiny" if family.startswith("mistral") else f"{family}-tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_file_type(1)
    if arch == MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    if "head_dim" in config.to_diff_dict() or family.startswith("gemma"):  # llama.cpp: when the config says
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if family == "gemma3":
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if family == "phi3-longrope":
        writer.add_rope_scaling_orig_ctx_len(LONGROPE["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(256 / 64) / np.log(64))))
        for kind in ("long", "short"):
            factors = np.array(config.rope_parameters[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if family == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config.rope_parameters, head_dim))
    writer.add_pad_token_id(0)
    writer.add_tokenizer_model("gpt2")
    tokens = [chr(0x100 + i) for i in range(config.vocab_size - 1)] + [chr(0x100) + chr(0x101)]  # one merge
    writer.add_token_list(tokens)
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_merges([f"{chr(0x100)} {chr(0x101)}"])


K_SCALES_AT = {"Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2)}  # where each block's float16 d (and dmin) lie


def k_blocks(qtype: str, n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    """Random blocks of a K type whose weights are about the size of a trained model's (test_quant's
    `random_blocks`, its float16 scales scaled down: Gemma 2's capped logits would all tie)."""
    n_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    blocks = random_blocks(qtype, n_rows, n_cols, seed).reshape(n_rows, -1, n_bytes)
    for at in K_SCALES_AT[qtype]:
        scale = blocks[..., at:at + 2].copy().view(np.float16) * np.float16(0.02)  # [rows, blocks, 1]
        blocks[..., at:at + 2] = scale.view(np.uint8)
    return blocks.reshape(n_rows, -1)


def write_gguf(hf, family: str, path: Path, qtype: str) -> dict[str, torch.Tensor]:
    """`hf` as a GGUF with its 2-D weights as `qtype` ("F32", "Q8_0" or a K type); returns the Hugging
    Face state dict of what the file holds, dequantized by gguf and transformed back (float64)."""
    arch, config = ARCHS[family], hf.config
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    writer = GGUFWriter(path, MODEL_ARCH_NAMES[arch])
    write_metadata(writer, family, config)
    held = {}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        n_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        if arch == MODEL_ARCH.LLAMA and n_heads:
            data = permute(data, n_heads)
        if family.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 2 and qtype != "F32":
            q = GGMLQuantizationType[qtype]
            blocks = quantize(data, q) if qtype == "Q8_0" else k_blocks(qtype, *data.shape, seed=len(held))
            writer.add_tensor(gguf_name, blocks, raw_dtype=q)
            data = dequantize(blocks, q).reshape(data.shape)
        else:
            writer.add_tensor(gguf_name, data)
        data = torch.from_numpy(data.astype(np.float64))
        held[name] = unpermute(data.numpy(), n_heads) if arch == MODEL_ARCH.LLAMA and n_heads else data
        if family.startswith("gemma") and name.endswith("norm.weight"):
            held[name] = held[name] - 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: torch.as_tensor(t) for name, t in held.items()}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    from engine.kv.full import FullCache

    c = model.config
    cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 128, model.dtype, torch.device("cpu"))
    return model(ids, torch.arange(ids.shape[1]), cache, n_logits=ids.shape[1]).double()


IDS = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(7))  # past WINDOW and LongRoPE's 64


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_loads_to_transformers_logits(family, tmp_path):
    hf = gguf_hf(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(hf, family, path, "F32")
    assert check_model(path) == hf.config.model_type
    model, _ = load_model(str(path), torch.float32, torch.device("cpu"))
    assert model.config.sliding_window == (WINDOW if family in ("mistral-window", "gemma2", "gemma3") else None)
    want = hf(IDS).logits
    assert torch.allclose(logits(model, IDS), want, atol=2e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q3_K", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_gguf_keeps_its_blocks_and_the_dequantized_models_logits(family, qtype, tmp_path):
    hf = gguf_hf(family)
    path = tmp_path / f"{family}-{qtype}.gguf"
    hf.load_state_dict(write_gguf(hf, family, path, qtype), strict=False)  # the weights the file holds
    model, _ = load_model(str(path), torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 7 * model.config.n_layers + 1  # Phi-3's fused blocks split whole
    want, got = hf(IDS).logits, logits(model, IDS)
    tol = 2e-4 * float(want.abs().max())
    assert torch.allclose(got, want, atol=tol, rtol=0)
    top2 = want.topk(2, dim=-1).values  # [1, T, 2]
    decisive = top2[..., 0] - top2[..., 1] > 4 * tol  # (soft-capped random weights tie often)
    assert decisive.sum() > 10 and torch.equal(got.argmax(-1)[decisive], want.argmax(-1)[decisive])


# every family in Q8_0 and Q4_K; Q3_K and Q5_K (the same kernel loops, other unpacking) in two
FAMILY_TYPES = [(f, q) for f in FAMILIES for q in ("Q8_0", "Q4_K")] + [("qwen3", "Q5_K"), ("gemma2", "Q3_K")]


@pytest.mark.parametrize("levels", [s for s in LEVEL_STACKS if s != "plain"])
@pytest.mark.parametrize(("family", "qtype"), FAMILY_TYPES)
def test_greedy_over_a_quantized_gguf_equals_plain_for_every_stack(family, levels, qtype, tmp_path):
    """Target and draft from GGUFs of the family, blocks kept (the middle level's int8 view too)."""
    from tests.conftest import tiny_engine

    models = []
    for seed in (0, 1):
        path = tmp_path / f"{family}-{seed}.gguf"
        write_gguf(gguf_hf(family, seed), family, path, qtype)
        models.append(load_model(str(path), torch.float32, torch.device("cpu"))[0])
    settings = tiny_engine("plain").config

    def engine(name: str) -> Engine:
        config = EngineConfig(target="tiny", draft="tiny-draft" if "draft" in name else None, levels=name,
                              device="cpu", dtype="float32", retrieval=settings.retrieval, prefill_chunk_tokens=7,
                              streaming_sink_tokens=2, streaming_window_tokens=12)
        return Engine(config, models[0], None, models[1] if "draft" in name else None)

    doc, questions = random_ids(123, 1), [random_ids(n, 10 + n) for n in (5, 9)]
    assert chat(engine(levels), doc, questions) == chat(engine("plain"), doc, questions)


# refusals

def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "granite.gguf"
    writer = GGUFWriter(path, "granite")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="'granite'.*Gemma 2"):
        check_model(path)
    with pytest.raises(UnsupportedModel, match="architecture 'granite'"):
        load_model(str(path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(("key", "adder", "value"), [
    ("rope.scaling.type", "add_rope_scaling_type", "yarn"),  # transformers' reader would drop it
    ("expert_count", "add_expert_count", 8),
])
def test_a_gguf_with_a_key_the_loader_does_not_handle_is_refused(key, adder, value, tmp_path):
    from gguf import RopeScalingType

    hf = gguf_hf("qwen3")
    path = tmp_path / "qwen3.gguf"
    original = GGUFWriter.add_file_type

    def with_key(self, file_type):
        original(self, file_type)
        getattr(self, adder)(RopeScalingType.YARN if adder == "add_rope_scaling_type" else value)

    GGUFWriter.add_file_type = with_key
    try:
        write_gguf(hf, "qwen3", path, "Q8_0")
    finally:
        GGUFWriter.add_file_type = original
    with pytest.raises(UnsupportedModel, match=rf"qwen3\.{key}"):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_a_truncated_gguf_is_a_typed_error(tmp_path):
    path = tmp_path / "qwen3.gguf"
    write_gguf(gguf_hf("qwen3"), "qwen3", path, "Q8_0")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(EngineError, match="truncated"):
        check_model(path)
    with pytest.raises(EngineError, match="truncated"):
        load_model(str(path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3-longrope"])
def test_the_dequantized_copy_of_a_gguf_keeps_what_transformers_reader_drops(family, tmp_path):
    """Off the blocks path (another device or dtype) a GGUF is converted by transformers into a bf16
    folder: with the config fields its reader leaves at their defaults set from the file (Qwen3's
    head_dim, Gemma 2's caps, Phi-3's LongRoPE factors), the logits are the F32 file's to bf16 rounding."""
    hf = gguf_hf(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(hf, family, path, "F32")
    model, _ = load_model(str(path), torch.float32, torch.device("cpu"), keep_gguf_blocks=False)
    assert model.config.head_dim == 64 and model.config.final_softcap == (30 if family == "gemma2" else None)
    want = hf(IDS).logits
    assert torch.allclose(logits(model, IDS), want, atol=0.05 * float(want.abs().max()), rtol=0)


def test_a_rope_freqs_tensor_of_no_llama_3_scaling_is_refused(tmp_path, monkeypatch):
    import tests.engine.test_families_gguf as this

    monkeypatch.setattr(this, "llama_cpp_rope_freqs", lambda rope, head_dim: np.linspace(1, 3, head_dim // 2,
                                                                                         dtype=np.float32))
    path = tmp_path / "llama3.gguf"
    write_gguf(gguf_hf("llama3"), "llama3", path, "Q8_0")
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        load_model(str(path), torch.float32, torch.device("cpu"))
