"""Which checkpoints the forward (engine/model.py) runs exactly, read from headers only.

`check_model(path)` raises, for a Hugging Face folder or a .gguf, the `UnsupportedModel` loading
would raise, without reading a weight. The rules loading applies: every config field that changes
the forward is one the model handles (`check_hf_config`: MoE, multipliers and other fields off the
family's defaults are refused), and every tensor has a parameter to go to (`check_tensor_names`;
a GGUF's names: `gguf_tensor_name`).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from engine.config import FAMILY_NAMES, EngineError, ModelNotFound, UnsupportedModel

GEMMAS = ("gemma2", "gemma3_text")
# llama.cpp's general.architecture -> model_type (Mistral files say "llama")
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")  # transformers' init functions
LAYER_TYPES = ("full_attention", "sliding_attention")
# fields the forward reads (ModelConfig.from_hf, the rotary module); their values are checked below
READ_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
               "rope_parameters", "layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_act",
               "hidden_activation", "attention_bias", "mlp_bias", "attn_logit_softcapping",
               "final_logit_softcapping", "use_bidirectional_attention", "original_max_position_embeddings"}
# fields that do not touch an inference forward, or only feed `layer_types`
IGNORED_FIELDS = {"initializer_range", "use_cache", "attention_dropout", "resid_pdrop", "embd_pdrop", "pad_token_id",
                  "bos_token_id", "eos_token_id", "pretraining_tp", "use_sliding_window", "max_window_layers",
                  "_sliding_window_pattern", "sliding_window_pattern", "torch_dtype", "dtype"}
# a field of another family that changes the forward, found in a config of ours: never ignored
FOREIGN_FIELD = re.compile(r"softcap|multiplier|expert|moe|logit_scale|clip_qkv|quantization_config")


def check_hf_config(hf) -> None:
    """Raise UnsupportedModel unless every field of `hf` that changes the forward is one
    engine/model.py handles; the message names the field."""
    from transformers import PretrainedConfig

    family = hf.model_type
    what = f"A {family!r} model ({', '.join(getattr(hf, 'architectures', None) or [family])})"
    if family not in FAMILY_NAMES:
        raise UnsupportedModel(what, f"its architecture {family!r} is not one the engine's forward implements")
    defaults, base = type(hf)().to_dict(), set(PretrainedConfig().to_dict())
    for field, value in hf.to_dict().items():
        why = _unhandled(hf, field, value)
        if why is None and field not in READ_FIELDS | IGNORED_FIELDS | base:
            is_foreign = field not in defaults and FOREIGN_FIELD.search(field)
            if is_foreign or (field in defaults and value != defaults[field]):
                why = f"its config field {field}={value!r} changes the forward in a way the engine does not implement"
        if why:
            raise UnsupportedModel(what, why)


def _unhandled(hf, field: str, value) -> str | None:
    """Why the value of a field the forward reads is one it cannot run, or None."""
    family = hf.model_type
    if field in ("hidden_act", "hidden_activation") and value != ("gelu_pytorch_tanh" if family in GEMMAS else "silu"):
        return f"its activation {field}={value!r} is not the family's"
    if field == "mlp_bias" and value or field == "attention_bias" and value and family != "qwen2":
        return f"{field}=True (biases on the output projections) is not implemented"
    if field == "use_bidirectional_attention" and value:
        return "bidirectional attention (an encoder) is not a decoder the engine runs"
    if field == "layer_types" and not set(value) <= set(LAYER_TYPES):
        return f"its layer types {sorted(set(value) - set(LAYER_TYPES))} are not implemented"
    if field == "layer_types" and "sliding_attention" in value and not getattr(hf, "sliding_window", None):
        return "it has sliding-window layers without a window size"
    if field in ("attn_logit_softcapping", "final_logit_softcapping") and value and family != "gemma2":
        return f"{field} is implemented for Gemma 2 only"
    if field == "rope_parameters":
        params = value.values() if family == "gemma3_text" else [value]
        for rope in params:
            if rope.get("rope_type", "default") not in ROPE_TYPES:
                return f"its RoPE type {rope.get('rope_type')!r} is not one of {', '.join(ROPE_TYPES)}"
            if rope.get("partial_rotary_factor", 1.0) != 1.0:
                return f"partial RoPE (partial_rotary_factor={rope['partial_rotary_factor']}) is not implemented"
    return None


def check_tensor_names(what: str, file_names: set[str], model_names: set[str]) -> None:
    """Raise UnsupportedModel when a tensor of the file has no parameter to go to (it would go
    unused: the model would run without it), or a parameter no tensor."""
    unused, missing = sorted(file_names - model_names - {"lm_head.weight"}), sorted(model_names - file_names)
    if unused:
        raise UnsupportedModel(what, f"its tensors {', '.join(unused[:4])} would go unused")
    if missing:
        raise UnsupportedModel(what, f"it lacks the tensors {', '.join(missing[:4])}")


def check_model(path: str | Path) -> str:
    """The family (model_type) of a Hugging Face folder or a .gguf, or the module's UnsupportedModel;
    ModelNotFound for a path that is no model at all, EngineError for a GGUF that cannot be parsed."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        try:
            reader = GGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError) as error:
            raise EngineError(f"{path} is not a readable GGUF file ({error}): it may be truncated; "
                              "download it again.") from error
        return check_gguf(path, reader)
    if path.is_dir() and (path / "config.json").is_file():
        return _check_folder(path)
    raise ModelNotFound(f"{path} is neither a .gguf file nor a Hugging Face folder with a config.json.")


def _check_folder(path: Path) -> str:
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:  # an architecture transformers does not know
        family = json.loads((path / "config.json").read_text()).get("model_type", "unknown")
        why = str(error).split("\n")[0]
        raise UnsupportedModel(f"A {family!r} model", f"transformers cannot read its config ({why})") from error
    check_hf_config(hf)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise UnsupportedModel(f"{path}", "the folder has no tokenizer (tokenizer.json or tokenizer.model)")
    if not any(path.glob("*.safetensors")):
        raise UnsupportedModel(f"{path}", "the folder has no *.safetensors weights")
    return hf.model_type


def gguf_fields(reader) -> dict:
    """A GGUF's metadata, {key: value}; arrays (vocabularies, merges: large, never needed here) are None."""
    from gguf import GGUFValueType

    return {name: None if field.types and field.types[0] == GGUFValueType.ARRAY else field.contents()
            for name, field in reader.fields.items()}


# {arch}.* metadata the loader understands (transformers maps them into the config, or they name
# what the tensors show); any other key of the architecture may change the forward: refused
GGUF_KNOWN_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
                   "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                   "rope.freq_base", "rope.dimension_count", "attention.key_length", "attention.value_length",
                   "attention.sliding_window", "attention.sliding_window_pattern", "attn_logit_softcapping",
                   "final_logit_softcapping", "rope.freq_base_swa", "rope.scaling.original_context_length",
                   "rope.scaling.attn_factor"}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}  # llama.cpp's 27B: queries scaled by dim / heads, not head_dim


def fix_gguf_config(hf, reader) -> None:
    """Set the config fields transformers' GGUF reader leaves at the class defaults from the file's
    own keys and tensors, by llama.cpp's rules (its forward is what the file was made for)."""
    fields = gguf_fields(reader)
    arch, family = fields["general.architecture"], hf.model_type
    keys = {name.removeprefix(f"{arch}."): value for name, value in fields.items()
            if name.startswith(f"{arch}.") and value is not None}  # the architecture's own keys
    if "attention.key_length" in keys:  # transformers maps it for Gemma only
        if keys.get("attention.value_length", keys["attention.key_length"]) != keys["attention.key_length"]:
            raise UnsupportedModel(f"A GGUF of architecture {arch!r}", "its keys and values differ in length")
        hf.head_dim = keys["attention.key_length"]
    if family in ("llama", "mistral", "phi3"):  # transformers names a Mistral only if general.name is "mistral"
        hf.sliding_window = keys.get("attention.sliding_window") or None  # llama.cpp: no key, no window
    if family in GEMMAS:
        is_27b = hf.num_hidden_layers == GEMMA_27B_LAYERS[family]
        hf.query_pre_attn_scalar = hf.hidden_size // hf.num_attention_heads if is_27b else hf.head_dim
        pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
        if pattern is not None and pattern.types[-1].name == "BOOL":
            hf.layer_types = ["sliding_attention" if swa else "full_attention" for swa in pattern.contents()]
    if family == "gemma2":
        hf.attn_logit_softcapping = keys.get("attn_logit_softcapping", 50.0)
        hf.final_logit_softcapping = keys.get("final_logit_softcapping", 30.0)
    _fix_gguf_rope(hf, keys, {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_")})


def _fix_gguf_rope(hf, keys: dict, rope_tensors: dict[str, list[float]]) -> None:
    """The RoPE of a GGUF's keys and tensors: Gemma 3's local base, Phi-3's LongRoPE factors,
    Llama 3's scaling (stored as per-frequency divisors, `rope_freqs`)."""
    family = hf.model_type
    if family == "gemma3_text" and "rope.freq_base_swa" in keys:
        hf.rope_parameters["sliding_attention"]["rope_theta"] = keys["rope.freq_base_swa"]
    if family == "phi3" and "rope_factors_long.weight" in rope_tensors:
        original = keys.get("rope.scaling.original_context_length")
        hf.rope_parameters = {**hf.rope_parameters, "rope_type": "longrope",
                              "long_factor": rope_tensors["rope_factors_long.weight"],
                              "short_factor": rope_tensors["rope_factors_short.weight"],
                              "original_max_position_embeddings": original}
        if "rope.scaling.attn_factor" in keys:
            hf.rope_parameters["attention_factor"] = keys["rope.scaling.attn_factor"]
        hf.original_max_position_embeddings = original
    if family in ("llama", "mistral") and "rope_freqs.weight" in rope_tensors:
        hf.rope_parameters = _llama3_rope(hf, rope_tensors["rope_freqs.weight"])


# the released Llama 3.x RoPE scalings: (factor, low_freq_factor, high_freq_factor, original context)
LLAMA3_ROPES = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192))


def _llama3_rope(hf, divisors: list[float]) -> dict:
    """The llama3 rope_parameters whose frequencies are the base ones over `divisors`."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    base = 1.0 / hf.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [D/2]
    want = base / torch.tensor(divisors, dtype=torch.float64)
    for factor, low, high, original in LLAMA3_ROPES:
        candidate = copy.copy(hf)
        candidate.rope_parameters = {**hf.rope_parameters, "rope_type": "llama3", "factor": factor,
                                     "low_freq_factor": low, "high_freq_factor": high,
                                     "original_max_position_embeddings": original}
        got, _ = ROPE_INIT_FUNCTIONS["llama3"](candidate, "cpu")
        if got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=0):
            return candidate.rope_parameters
    raise UnsupportedModel("A GGUF of architecture 'llama'", "its rope_freqs tensor is none of Llama 3's RoPE scalings")


def check_gguf(path: Path, reader) -> str:
    """The family (model_type) of the GGUF `reader` holds, or UnsupportedModel for one the loader would
    run wrong: an architecture, a metadata key or a tensor the forward does not implement, or a block
    type gguf cannot dequantize."""
    from gguf.quants import _type_traits

    fields = gguf_fields(reader)
    arch = str(fields.get("general.architecture", "unknown"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"A GGUF of architecture {arch!r}", "its architecture is not one the engine implements")
    is_mistral = arch == "llama" and "mistral" in str(fields.get("general.name", "")).lower()
    family = "mistral" if is_mistral else GGUF_ARCHITECTURES[arch]
    what = f"The GGUF {path.name} ({family})"
    for key in fields:
        if key.startswith(f"{arch}.") and key.removeprefix(f"{arch}.") not in GGUF_KNOWN_KEYS:
            raise UnsupportedModel(what, f"its metadata {key}={fields[key]!r} is not one the loader handles")
    for t in reader.tensors:
        if gguf_tensor_name(t.name, family) is None and t.name not in ROPE_FACTOR_TENSORS.get(arch, ()):
            raise UnsupportedModel(what, f"its tensor {t.name} would go unused")
    types = {t.tensor_type for t in reader.tensors}
    unreadable = sorted(q.name for q in types if q.name not in ("F32", "F16", "BF16") and q not in _type_traits)
    if unreadable:
        raise UnsupportedModel(what, f"its block types {', '.join(unreadable)} cannot be dequantized by gguf")
    return family


_LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# llama.cpp's names a family adds or names differently: q/k norms, Gemma's four norms a layer, Phi-3's fused linears
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_FAMILY_MODULES = {"qwen3": _QK_NORMS, "gemma2": _GEMMA_NORMS, "gemma3_text": _GEMMA_NORMS | _QK_NORMS,
                   "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
# RoPE scalings llama.cpp stores as tensors, read into the config (`fix_gguf_config`)
ROPE_FACTOR_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight"),  # LongRoPE
                       "llama": ("rope_freqs.weight",)}  # Llama 3.x


def gguf_tensor_name(gguf_name: str, family: str) -> str | None:
    """Our (Hugging Face) parameter name of a tensor of a GGUF of `family` (a model_type), or None
    for a tensor the model has no parameter for (`check_gguf` refuses such a file)."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    _, layer, kind, what = parts
    module = (_LAYER_MODULES | _FAMILY_MODULES.get(family, {})).get(kind)
    return None if module is None else f"model.layers.{layer}.{module}.{what}"
