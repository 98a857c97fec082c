"""The families the engine runs, exactly, and every other checkpoint refused (issue 53): tiny random
Qwen3, Mistral (with and without a sliding window), Gemma 2 and 3, Phi-3 (with LongRoPE) in float64
give transformers' logits over a chunked KV cache past the sliding window, checks included,
and greedy decoding equal to plain decoding for every level stack; Granite, OLMo 2, Qwen3-MoE and a
Qwen3 with a field we do not implement get `UnsupportedModel` before any weight is read
(engine/families.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import loading
from engine.config import LEVEL_STACKS, SamplingConfig, UnsupportedModel
from engine.families import check_model
from engine.kv.full import FullCache
from tests.conftest import WINDOW, ours, tiny_engine, tiny_hf
from tests.engine.test_loading import word_tokenizer

NEW_FAMILIES = ["qwen3", "mistral", "mistral-window", "gemma2", "gemma3", "phi3", "phi3-longrope"]
SPECULATIVE = [s for s in LEVEL_STACKS if s != "plain"]


def cache_for(model, capacity: int = 16) -> FullCache:
    c = model.config
    return FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, capacity, torch.float64, torch.device("cpu"))


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_chunked_forward_past_the_window_matches_transformers(family):
    hf = tiny_hf(family, seed=3)
    model = ours(hf)
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))  # > WINDOW, > LongRoPE's 64
    want = hf(ids).logits
    cache = cache_for(model)
    got = [model(ids[:, a:b], torch.arange(a, b), cache) for a, b in [(0, 37), (37, 100), (100, 101), (101, 150)]]
    assert torch.allclose(torch.cat(got, 1), want, atol=1e-10, rtol=0)


def test_the_switches_are_the_familys():
    """What makes each family's forward its own is read from its config (ModelConfig.from_hf)."""
    configs = {family: ours(tiny_hf(family)).config for family in NEW_FAMILIES}
    assert configs["qwen3"].has_qk_norm and not configs["qwen3"].is_gemma
    assert configs["mistral"].sliding_window is None and configs["mistral-window"].sliding_layers == (True, True)
    gemma2, gemma3 = configs["gemma2"], configs["gemma3"]
    assert gemma2.is_gemma and gemma2.attn_softcap == 50 and gemma2.final_softcap == 30 and not gemma2.has_qk_norm
    assert gemma3.has_qk_norm and gemma3.has_local_rope and gemma3.attn_softcap is None
    assert gemma2.sliding_layers == gemma3.sliding_layers == (True, False) and gemma3.sliding_window == WINDOW
    assert gemma2.query_scale == 24 ** -0.5
    assert ours(tiny_hf("phi3-longrope")).model.rotary_emb.rope_type == "longrope"


@pytest.mark.parametrize("family", ["mistral-window", "gemma2", "gemma3"])
def test_a_check_past_the_window_matches_transformers(family):
    """A check's sliding layers see, for each drafted token, the window before its own position."""
    hf = tiny_hf(family, seed=4)
    model = ours(hf)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = cache_for(model, 64)
    model(ids, torch.arange(40), cache)
    check = model(torch.tensor([[5, 7, 8]]), torch.arange(40, 43), cache)
    want = hf(torch.cat([ids, torch.tensor([[5, 7, 8]])], 1)).logits[:, -3:]
    assert torch.allclose(check, want, atol=1e-10, rtol=0)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chat(engine, doc, questions):
    session = engine.open(doc)
    return [[t for event in session.ask(q, SamplingConfig(max_new_tokens=14)) for t in event.tokens]
            for q in questions]


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("levels", SPECULATIVE)
def test_greedy_equals_plain_for_every_stack_past_the_window(levels, family):
    doc = random_ids(123, 1)  # past WINDOW; not a multiple of the prefill chunk (7) nor of retrieval chunks (4)
    questions = [random_ids(n, 10 + n) for n in (5, 9, 3)]
    plain = chat(tiny_engine("plain", family), doc, questions)
    assert chat(tiny_engine(levels, family), doc, questions) == plain
    hf, context = tiny_hf(family), doc + questions[0]
    for t in plain[0]:  # transformers' forward without a cache, argmax
        assert int(hf(torch.tensor([context])).logits[0, -1].argmax()) == t
        context.append(t)


# refusals: a checkpoint saved as a reader would have it (config, safetensors, tokenizer)

def save_folder(hf, folder: Path, config_edits: dict | None = None, extra_tensors: dict | None = None) -> Path:
    hf.save_pretrained(folder)
    word_tokenizer([f"w{i}" for i in range(128)]).save_pretrained(folder)
    if config_edits:
        config = json.loads((folder / "config.json").read_text()) | config_edits
        (folder / "config.json").write_text(json.dumps(config))
    if extra_tensors:
        save_file(extra_tensors, folder / "extra.safetensors")
    return folder


@pytest.fixture
def no_weights_read(monkeypatch):
    """Reading any weight fails the test: a refusal must come from the headers."""
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(loading, "load_state_dict", refuse)


def other_family(name: str):
    import transformers

    torch.manual_seed(0)
    shapes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    config_class, model_class, extra = {
        "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32}),
    }[name]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**shapes, **extra))


@pytest.mark.parametrize("name", ["granite", "olmo2", "qwen3_moe"])
def test_other_architectures_are_refused_before_any_weight_is_read(name, tmp_path, no_weights_read):
    folder = save_folder(other_family(name), tmp_path / name)
    with pytest.raises(UnsupportedModel, match=rf"'{name}'.*architecture.*families that run: .*Qwen3 \(dense\)"):
        loading.load_model(str(folder), torch.float32, torch.device("cpu"))
    with pytest.raises(UnsupportedModel, match=rf"'{name}'"):
        check_model(folder)  # what the model picker asks of a folder (app/model_files.py)


@pytest.mark.parametrize(("edits", "field"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 10000.0}}, "RoPE type 'mrope'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}, "partial"),
    ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
    ({"residual_multiplier": 0.2}, "residual_multiplier"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
])
def test_a_qwen3_with_a_field_we_do_not_implement_is_refused(edits, field, tmp_path, no_weights_read):
    folder = save_folder(tiny_hf("qwen3"), tmp_path / "qwen3", config_edits=edits)
    with pytest.raises(UnsupportedModel, match=field):
        loading.load_model(str(folder), torch.float32, torch.device("cpu"))


def test_a_tensor_that_would_go_unused_is_refused(tmp_path, no_weights_read):
    extra = {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}  # a Qwen3 tensor in a Llama folder
    folder = save_folder(tiny_hf("llama"), tmp_path / "llama", extra_tensors=extra)
    with pytest.raises(UnsupportedModel, match=r"q_norm.weight would go unused"):
        loading.load_model(str(folder), torch.float32, torch.device("cpu"))


def test_a_folder_without_a_tokenizer_is_refused(tmp_path, no_weights_read):
    folder = tmp_path / "bare"
    tiny_hf("qwen3").save_pretrained(folder)
    with pytest.raises(UnsupportedModel, match="no tokenizer"):
        loading.load_model(str(folder), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_saved_folder_loads_to_transformers_logits(family, tmp_path):
    """The loader's path (config check, names checked from the headers, Phi-3's linears split,
    the rotary module remade on the device) gives the model the parity tests check."""
    hf = tiny_hf(family, seed=2)
    folder = save_folder(hf, tmp_path / family)
    assert check_model(folder) == hf.config.model_type
    model, tokenizer = loading.load_model(str(folder), torch.float64, torch.device("cpu"))
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(5))
    got = model(ids, torch.arange(90), cache_for(model, 96), n_logits=90)
    assert torch.allclose(got, hf(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("family", ["mistral-window", "gemma2", "gemma3"])
@pytest.mark.parametrize("levels", ["selfspec>full", "ngram+draft>full", "draft>retrieval>full"])
def test_bf16_greedy_equals_plain_past_the_window_with_the_cpu_kernels(levels, family):
    """In bf16 a check's rows must round as decoding's do: a windowed (or soft-capped) layer's
    check runs each row over its own keys (model.Attention._attend), not one masked call."""
    doc, questions = random_ids(123, 1), [random_ids(n, 10 + n) for n in (5, 9, 3)]
    plain = chat(tiny_engine("plain", family, dtype="bfloat16"), doc, questions)
    assert chat(tiny_engine(levels, family, dtype="bfloat16"), doc, questions) == plain
