"""Shared fixtures: tiny random models of every family the engine runs (float64, seeded) and the
engine around them."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, RetrievalConfig
from engine.model import Transformer
from engine.session import Engine

torch.set_num_threads(1)  # tiny models: one thread is faster, and immune to a busy second core
XDIST = "PYTEST_XDIST_WORKER" in os.environ  # scripts/test.sh runs one worker per core
if XDIST:  # so do the processes tests start (the app, gloo ranks): spinning OpenMP threads on busy cores
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _same_draws_in_any_order():
    """Each test starts from the same global torch seed, whichever worker runs it after whichever
    test: an unseeded draw is the same in every run (a bound checked on it cannot flake)."""
    torch.manual_seed(0)


def packaged_or_skip(name: str):
    """The packaged model's folder; the test skips when it is not assembled (a checkout before setup)."""
    from engine.models import packaged_model_dir

    model_dir = packaged_model_dir(name, convert=False)
    if model_dir is None:
        pytest.skip(f"{name} is not assembled: run `python -m tools.models --only {name}`")
    return model_dir


WINDOW = 24  # the sliding window of the tiny windowed models: a 123-token book runs past it
SLIDING_FULL = ["sliding_attention", "full_attention"]  # Gemma's interleaving, in two layers
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "long_factor": [1.0 + i / 4 for i in range(8)], "short_factor": [1.0 + i / 16 for i in range(8)]}
# family -> (transformers' config and model classes, config fields beyond the shapes)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": None}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW,
                                                     "query_pre_attn_scalar": 24, "layer_types": SLIDING_FULL}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW,
                                                         "query_pre_attn_scalar": 24, "layer_types": SLIDING_FULL}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {"rope_parameters": LONGROPE, "max_position_embeddings": 256,
                                                        "original_max_position_embeddings": 64}),
}


def tiny_hf(family: str = "llama", seed: int = 0, vocab: int = 128, n_layers: int = 2, rope=None,
            tie: bool | None = None, max_positions: int = 4096, **fields):
    """A Hugging Face model of `family` (a FAMILIES key) with random weights: hidden 64, 4 query /
    2 KV heads, float64; `fields` override its config."""
    import transformers

    torch.manual_seed(seed)
    config_name, model_name, extra = FAMILIES[family]
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  tie_word_embeddings=(family in ("qwen2", "gemma2", "gemma3")) if tie is None else tie,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None) | extra | fields
    if rope is not None:
        kwargs["rope_parameters"] = rope
    config = getattr(transformers, config_name)(**kwargs)
    hf = getattr(transformers, model_name)(config).double().eval()
    with torch.no_grad():  # larger weights than the default init: peaked, varied distributions
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return hf


def ours(hf) -> Transformer:
    from engine.loading import split_fused  # Phi-3's fused linears, as loading splits them

    model = Transformer(ModelConfig.from_hf(hf.config), hf.config).double()
    model.load_state_dict(split_fused(hf.state_dict(), model.config), strict=False)
    return model.eval()


def tiny_engine(levels: str, family: str = "llama", seed: int = 0, vocab: int = 128, **overrides) -> Engine:
    dtype = overrides.pop("dtype", "float64")
    target = ours(tiny_hf(family, seed, vocab)).to(getattr(torch, dtype))
    sharpen_draft = overrides.pop("sharpen_draft", False)
    draft = ours(tiny_hf(family, seed + 1, vocab)) if "draft" in levels else None
    if sharpen_draft:  # the target itself, sharpened towards its argmax (docs/ALGORITHM.md section 1)
        draft = ours(tiny_hf(family, seed, vocab))
        draft.lm_head.weight.data = draft.lm_head.weight.data.clone() * 3
    draft = draft and draft.to(getattr(torch, dtype))
    if overrides.pop("bf16_weights", False):  # as a bf16 checkpoint loaded in `dtype`
        target, draft = (m and m.bfloat16().to(getattr(torch, dtype)) for m in (target, draft))
    retrieval = overrides.pop("retrieval", RetrievalConfig(budget_tokens=64, sink_tokens=4, window_tokens=16,
                                                            chunk_tokens=4, n_score_queries=4,
                                                            rebuild_every_tokens=16))
    settings = dict(prefill_chunk_tokens=7, streaming_sink_tokens=2, streaming_window_tokens=12) | overrides
    config = EngineConfig(target="tiny", draft="tiny-draft" if draft else None, levels=levels,
                          device="cpu", dtype=dtype, retrieval=retrieval, **settings)
    return Engine(config, target, None, draft)


@pytest.fixture
def tiny_pair():
    hf = tiny_hf("llama")
    return hf, ours(hf)
