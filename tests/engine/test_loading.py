"""Model resolution, GGUF conversion cache, weight loading, tokenizer checks, packaged models
(their assembly: tests/tools/test_models.py).

Fast tests use tiny models and fake GGUF files in tmp_path. Tests on the real packaged
models skip when `python -m tools.models` has not assembled them; the GGUF conversion of the
real SmolLM2 file is marked slow (about 25 s).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine import loading, models
from engine.config import EngineConfig, ModelConfig, ModelNotFound, SamplingConfig, TokenizerMismatch
from engine.files import cache_root, is_complete
from engine.loading import check_same_tokenizer, load_hf_config, load_state_dict, load_tokenizer
from engine.models import convert_gguf, packaged_model_dir, resolve_model
from tests.conftest import packaged_or_skip

REAL_CACHE = cache_root()  # read before any test points BOOKCHAT_CACHE at tmp_path


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BOOKCHAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny_llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def word_tokenizer(words: list[str], eos: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {word: idx for idx, word in enumerate(words)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=words[0])),
                                   eos_token=eos)


def fake_saver(calls: list[Path]):
    """Stands in for transformers' GGUF dequantisation: writes a config and records the call."""

    def save(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"source": gguf_path.read_text()}))

    return save


# resolve_model


def test_resolve_returns_a_local_folder_as_is(tmp_path, no_network):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("source", ["./no-such-folder", "dir/missing.gguf", "/no/such/model"])
def test_resolve_missing_path_raises_model_not_found(source, no_network):
    with pytest.raises(ModelNotFound, match="No model file or folder"):
        resolve_model(source)


@pytest.mark.parametrize("source", ["two words", "no-such-packaged-model"])
def test_resolve_unknown_name_lists_the_choices(source, no_network):
    with pytest.raises(ModelNotFound, match="packaged models: smollm2-135m"):
        resolve_model(source)


def test_resolve_folder_with_one_gguf_converts_it(tmp_path, cache, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(models, "_save_hf_folder", fake_saver(calls))
    (tmp_path / "model.Q4.gguf").write_text("weights")
    folder = resolve_model(str(tmp_path))
    assert folder.parent == cache / "models" and (folder / "config.json").is_file()
    assert calls == [tmp_path / "model.Q4.gguf"]


@pytest.mark.timeout(30)
def test_offline_hub_id_not_on_disk_raises_model_not_found(tmp_path, monkeypatch, no_network):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        resolve_model("bookchat-tests/no-such-model")


@pytest.mark.timeout(30)
def test_unreachable_hub_raises_model_not_found(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # refused
    with pytest.raises(ModelNotFound, match="Could not download"):
        resolve_model("bookchat-tests/no-such-model")


# GGUF conversion cache (transformers replaced by a fake saver)


def test_gguf_conversion_runs_once_per_content(tmp_path, cache, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(models, "_save_hf_folder", fake_saver(calls))
    gguf = tmp_path / "m.gguf"
    gguf.write_text("version 1")
    first = convert_gguf(gguf)
    assert convert_gguf(gguf) == first and len(calls) == 1  # cached
    gguf.write_text("version 2")  # same name and size, new content: a new folder
    second = convert_gguf(gguf)
    assert second != first and len(calls) == 2
    assert json.loads((second / "config.json").read_text()) == {"source": "version 2"}


def test_interrupted_conversion_is_redone(tmp_path, cache, monkeypatch):
    gguf, out_dir = tmp_path / "m.gguf", cache / "models" / "m"
    gguf.write_text("weights")
    out_dir.mkdir(parents=True)
    (out_dir / "model.safetensors").write_text("half written")  # no completion marker

    def crash(gguf_path: Path, tmp_dir: Path) -> None:
        tmp_dir.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_save_hf_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, out_dir=out_dir)
    assert [p.name for p in out_dir.parent.iterdir()] == ["m"]  # no temporary folder left
    calls: list[Path] = []
    monkeypatch.setattr(models, "_save_hf_folder", fake_saver(calls))
    assert convert_gguf(gguf, out_dir=out_dir) == out_dir and len(calls) == 1
    assert not (out_dir / "model.safetensors").exists()


@pytest.mark.slow
def test_real_smollm2_gguf_converts_to_a_working_folder(cache, no_network):
    gguf = models.gguf_path("smollm2-135m", REAL_CACHE)
    if not gguf.is_file():
        pytest.skip(f"{gguf} is absent: run `python -m tools.models --only smollm2-135m`")
    started = time.perf_counter()
    folder = resolve_model(str(gguf))
    print(f"converted in {time.perf_counter() - started:.1f} s")
    assert folder.parent == cache / "models" and is_complete(folder)
    tokenizer = load_tokenizer(folder)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.chat_template
    state = load_state_dict(folder, torch.float32)
    assert "model.layers.29.self_attn.q_proj.weight" in state and "lm_head.weight" not in state  # tied
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # 3 KV heads x 64
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1]:])


# weights and configs


@pytest.mark.parametrize("tie", [True, False])
def test_load_state_dict_reads_shards_with_hf_names(tmp_path, tie, no_network):
    model = tiny_llama(tie)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    state = load_state_dict(tmp_path, torch.float64)
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert state.keys() == expected.keys()
    assert "model.layers.1.self_attn.q_proj.weight" in state
    for name, tensor in state.items():
        assert tensor.dtype == torch.float64
        assert torch.equal(tensor, expected[name].double()), name
    assert load_hf_config(tmp_path).tie_word_embeddings == tie


def test_load_state_dict_without_safetensors_raises(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="safetensors"):
        load_state_dict(tmp_path, torch.float32)


# tokenizers


def test_same_tokenizer_passes():
    check_same_tokenizer(word_tokenizer(["a", "b", "<eos>"], "<eos>"),
                         word_tokenizer(["a", "b", "<eos>"], "<eos>"), "target", "draft")


def test_different_vocabularies_raise_with_first_difference():
    target, draft = word_tokenizer(["a", "b", "c", "<eos>"]), word_tokenizer(["a", "b", "d"])
    with pytest.raises(TokenizerMismatch, match=r"4 vs 3 tokens.*id 2: 'c' vs 'd'"):
        check_same_tokenizer(target, draft, "big", "small")


def test_different_special_tokens_raise():
    target, draft = word_tokenizer(["a", "b", "<eos>"], "<eos>"), word_tokenizer(["a", "b", "<eos>"])
    with pytest.raises(TokenizerMismatch, match="special tokens differ.*<eos>"):
        check_same_tokenizer(target, draft, "target", "draft")


def test_real_qwen_pair_shares_a_tokenizer_and_smollm2_does_not(no_network):
    qwen_small = load_tokenizer(packaged_or_skip("qwen2.5-coder-0.5b"))
    qwen_big = load_tokenizer(packaged_or_skip("qwen2.5-coder-1.5b"))
    check_same_tokenizer(qwen_big, qwen_small, "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    smol = load_tokenizer(packaged_or_skip("smollm2-135m"))
    with pytest.raises(TokenizerMismatch, match="151,936 vs 49,152"):
        check_same_tokenizer(qwen_big, smol, "qwen2.5-coder-1.5b", "smollm2-135m")


# packaged models


def test_packaged_model_dir_without_assembly_is_none(tmp_path):
    assert packaged_model_dir("smollm2-135m", convert=False, root=tmp_path) is None


def test_a_packaged_model_not_assembled_says_how_to_assemble_it(cache):
    with pytest.raises(ModelNotFound, match=r"not assembled yet: run `python -m tools.models --only smollm2-135m`"):
        resolve_model("smollm2-135m")


@pytest.mark.parametrize("name", list(models.PACKAGED_MODELS))
def test_packaged_model_resolves_offline_and_loads(name, no_network):
    model_dir = packaged_or_skip(name)
    assert resolve_model(name) == model_dir
    config = ModelConfig.from_hf(load_hf_config(model_dir))
    state = load_state_dict(model_dir, torch.bfloat16)
    assert state["model.embed_tokens.weight"].shape == (config.vocab_size, config.dim)
    assert sum(k.endswith("q_proj.weight") for k in state) == config.n_layers
    assert ("lm_head.weight" in state) != config.has_tied_embeddings


def test_yarn_extension_is_qwens_rope_scaling_and_matches_transformers():
    """`extend_context` gives the config Qwen documents for 128K (yarn, factor 4 over the native
    context); our decoder built from it equals transformers' YaRN model, and differs from native."""
    import torch

    from engine.loading import extend_context
    from tests.conftest import ours, tiny_hf

    hf = tiny_hf("qwen2", seed=3, max_positions=64)
    native = ours(hf)
    extend_context(hf.config, 4.0)
    assert hf.config.max_position_embeddings == 256
    assert {k: hf.config.rope_parameters[k] for k in ("rope_type", "factor", "original_max_position_embeddings")} \
        == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    reference = tiny_hf("qwen2", seed=3, max_positions=256, rope=dict(hf.config.rope_parameters))
    extended = ours(hf)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(200)
    want = reference(ids).logits
    from engine.kv.full import FullCache

    def logits(model):
        c = model.config
        cache = FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 200, torch.float64, torch.device("cpu"))
        return model(ids, pos, cache)

    assert torch.allclose(logits(extended), want, atol=1e-10, rtol=0)
    assert not torch.allclose(logits(native), want, atol=1e-3)


def test_a_draft_no_stack_uses_yet_is_loaded_at_the_first_that_does(monkeypatch, no_network):
    """On a CPU, whose default stacks do not draft with the draft model, `Engine.load` checks its
    tokenizer and defers its weights (the 1.5B's 0.5B: 0.8 GB of RSS) to the first stack that
    drafts with it, once; a draft of another tokenizer is still refused at load."""
    from engine.session import Engine
    from tests.engine.test_speculative import random_ids

    packaged_or_skip("smollm2-135m")
    loads, load_model = [], loading.load_model

    def counted(source, *args, **kwargs):
        loads.append(source)
        return load_model(source, *args, **kwargs)
    monkeypatch.setattr(loading, "load_model", counted)
    engine = Engine.load(EngineConfig(target="smollm2-135m", draft="smollm2-135m", levels="ngram>full",
                                      device="cpu", dtype="float32"))
    assert loads == ["smollm2-135m"] and engine.has_draft
    session = engine.open(random_ids(100, 1000, 1))
    question, sampling = random_ids(5, 1000, 2), SamplingConfig(max_new_tokens=12)
    plain = [t for e in session.ask(question, sampling) for t in e.tokens]
    session.truncate(100)
    session.set_levels("draft>full")
    assert loads == ["smollm2-135m"] * 2 and engine.draft is not None
    assert [t for e in session.ask(question, sampling) for t in e.tokens] == plain
    session.set_levels("plain")
    session.set_levels("draft>retrieval>full")
    assert len(loads) == 2  # once
    packaged_or_skip("qwen2.5-coder-0.5b")
    with pytest.raises(TokenizerMismatch):
        Engine.load(EngineConfig(target="qwen2.5-coder-0.5b", draft="smollm2-135m", levels="ngram>full",
                                 device="cpu", dtype="float32"))
