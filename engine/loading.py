"""Read a model into our Transformer (engine/model.py), with its tokenizer; finding it is engine/models.py's.

`load_model` is the one entry: a GGUF on a CPU where engine/quant.py's kernel built keeps the file's
blocks (`load_quantized_model`); every other checkpoint is the safetensors folder `resolve_model`
gives, built on the meta device and handed the loaded tensors. Also here: the sampling settings a
model was tuned with, and the check that two tokenizers agree.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from engine import models
from engine.config import EngineError, ModelConfig, ModelNotFound, TokenizerMismatch
from engine.families import ROPE_FACTOR_TENSORS, check_hf_config, check_model, check_tensor_names, gguf_tensor_name
from engine.files import cache_root, complete_folder, file_sha256, is_complete
from engine.model import Transformer, rotary_embedding
from engine.quant import INTERLEAVED_TYPES, KERNEL_TYPES, QuantEmbedding, QuantLinear, cpu_quant_kernel

log = logging.getLogger(__name__)


def load_model(source: str, dtype: torch.dtype, device: torch.device, yarn_factor: float = 1.0,
               keep_gguf_blocks: bool = True):
    """(our Transformer with the weights of `source` on `device`, its tokenizer), as the module
    docstring says; `keep_gguf_blocks=False` loads a GGUF dequantized instead."""
    gguf = _gguf_to_keep_quantized(source, dtype, device) if keep_gguf_blocks else None
    if gguf is not None:
        return load_quantized_model(*gguf, dtype=dtype, yarn_factor=yarn_factor)
    model_dir = models.resolve_model(source)
    check_model(model_dir)  # from the headers: config, tokenizer, weight files
    model, hf_config = meta_model(model_dir, yarn_factor)
    file_names = split_fused(dict.fromkeys(safetensors_names(model_dir)), model.config)
    check_tensor_names(f"The model in {model_dir}", set(file_names), parameter_names(model))
    state = split_fused(load_state_dict(model_dir, dtype), model.config)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    return finish_model(model, hf_config, device), load_tokenizer(model_dir)


def load_tokenizer_of(source: str, dtype: torch.dtype, device: torch.device):
    """The tokenizer `load_model(source, dtype, device)` returns, without the weights."""
    gguf = _gguf_to_keep_quantized(source, dtype, device)
    if gguf is None:
        return load_tokenizer(models.resolve_model(source))
    return load_tokenizer(gguf_header_dir(*gguf))


def _gguf_to_keep_quantized(source: str, dtype: torch.dtype, device: torch.device) -> tuple[Path, str | None] | None:
    """(the .gguf of `source`, its sha256 if known) when engine/quant.py can keep its blocks: float32
    or bfloat16 on a CPU where its kernel built; None for every other checkpoint, dtype and device."""
    path = Path(source).expanduser()
    is_file = path.is_file() and path.suffix == ".gguf"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (is_file or source in models.PACKAGED_MODELS) or cpu_quant_kernel() is None:  # built only for a GGUF
        return None
    if is_file:
        return path.resolve(), None
    return models.packaged_gguf(source), models.PACKAGED_MODELS[source].sha256


def load_hf_config(model_dir: Path):
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_state_dict(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> tensors cast to `dtype`, from one or several shards."""
    state: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(Path(model_dir)):
        with safe_open(shard, framework="pt") as f:
            state |= {name: f.get_tensor(name).to(dtype) for name in f.keys()}  # noqa: SIM118 (not iterable)
    return state


def safetensors_names(model_dir: Path) -> list[str]:
    """The tensor names of a folder's weights, from the files' headers (no weight is read)."""
    names = []
    for shard in _safetensors_files(Path(model_dir)):
        with safe_open(shard, framework="pt") as f:
            names.extend(f.keys())
    return names


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / shard for shard in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(
            f"{model_dir} holds no *.safetensors weights; convert the model to safetensors "
            f"(transformers save_pretrained) or pass its .gguf file."
        )
    return files


def parameter_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters()}


def split_fused(state: dict, cfg: ModelConfig) -> dict:
    """Phi-3's fused qkv_proj and gate_up_proj as our q/k/v and gate/up linears, split by rows (so a
    GGUF's blocks split whole); a value is a tensor, a (tensor, ggml type) pair or None."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    parts = {"qkv_proj": {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows},
             "gate_up_proj": {"gate_proj": cfg.intermediate, "up_proj": cfg.intermediate}}
    out = {}
    for name, value in state.items():
        module, _, what = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf not in parts:
            out[name] = value
            continue
        rows = parts[leaf]  # {our linear: its rows}
        tensor, qtype = value if isinstance(value, tuple) else (value, None)
        pieces = tensor.split(list(rows.values())) if tensor is not None else [None] * len(rows)
        for sub, piece in zip(rows, pieces):
            out[f"{parent}.{sub}.{what}"] = (piece, qtype) if isinstance(value, tuple) else piece
    return out


def extend_context(hf_config, yarn_factor: float) -> None:
    """YaRN RoPE scaling by `yarn_factor` over the native context, as Qwen documents for its 2.5
    models; transformers' rotary module computes it."""
    if yarn_factor == 1:
        return
    native = hf_config.max_position_embeddings
    hf_config.rope_parameters = {**hf_config.rope_parameters, "rope_type": "yarn", "factor": float(yarn_factor),
                                 "original_max_position_embeddings": native}
    hf_config.max_position_embeddings = int(native * yarn_factor)


def meta_model(folder: Path, yarn_factor: float = 1.0):
    """(our Transformer for the config in `folder` on the meta device, its HF config); the caller
    assigns the weights, then calls `finish_model`."""
    hf_config = load_hf_config(folder)
    check_hf_config(hf_config)
    extend_context(hf_config, yarn_factor)
    with torch.device("meta"):
        return Transformer(ModelConfig.from_hf(hf_config), hf_config), hf_config


def finish_model(model, hf_config, device: torch.device):
    """The RoPE buffers made for real on `device`, once every weight is assigned; a tied LM head
    shares the embedding's table again (`assign` untied them; a file's own lm_head copy is dropped),
    unless either keeps GGUF blocks."""
    is_plain = not isinstance(model.lm_head, QuantLinear) and not isinstance(model.model.embed_tokens, QuantEmbedding)
    if model.config.has_tied_embeddings and is_plain:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.device(device):
        model.model.rotary_emb = rotary_embedding(hf_config)
    assert not any(p.is_meta for p in model.parameters()), "a weight check_tensor_names expects is unassigned"
    return model.eval()


def gguf_header_dir(gguf_path: Path, sha256: str | None = None) -> Path:
    """A small folder read once from the GGUF, cached under its sha256 (hashed here unless given):
    the HF config and tokenizer (by transformers) and `tensors.json`, where each tensor's bytes lie,
    so later loads only map the file."""
    sha256 = sha256 or file_sha256(gguf_path)
    out_dir = cache_root() / "models" / f"{gguf_path.stem}-{sha256[:16]}-header"
    if is_complete(out_dir) and (out_dir / "tensors.json").is_file():
        return out_dir
    log.warning("reading the tokenizer and config of %s with transformers, once (a minute or so; "
                "scripts/setup.sh does it ahead); later loads read them from %s", gguf_path.name, out_dir)
    config, tokenizer, reader = models.read_gguf_header(gguf_path)
    tensors = [{"name": t.name, "type": int(t.tensor_type), "offset": int(t.data_offset),
                "n_bytes": int(t.n_bytes), "shape": list(t.data.shape), "dtype": t.data.dtype.str}
               for t in reader.tensors]
    with complete_folder(out_dir, {"gguf": str(gguf_path), "sha256": sha256}) as tmp_dir:
        config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / "tensors.json").write_text(json.dumps(tensors) + "\n")
    return out_dir


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a Llama q / k projection (its RoPE pairs interleaved), as
    transformers does; rows move whole, so the blocks of a quantized row are untouched."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_gguf_tensors(gguf_path: Path, header: Path, family: str, cfg: ModelConfig,
                      mapped_types: tuple[int, ...] = ()) -> dict[str, tuple[torch.Tensor, int | None]]:
    """{our name: (tensor, ggml type or None)}: the kernel's types as the file's blocks [rows, row
    bytes] uint8, copied, or for `mapped_types` left as pages of the file (copy-on-write: no second
    copy); everything else dequantized to float32 by gguf."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    file = np.memmap(gguf_path, dtype=np.uint8, mode="c")
    is_llama = family in ("llama", "mistral")  # llama.cpp permutes q / k rows of its "llama" architecture only
    tensors = {}
    for t in json.loads((header / "tensors.json").read_text()):
        if t["name"] in ROPE_FACTOR_TENSORS.get("llama" if is_llama else family, ()):  # read into the config
            continue
        name, qtype = gguf_tensor_name(t["name"], family), t["type"]
        if name is None:
            raise EngineError(f"unexpected tensor {t['name']!r} in a {family} GGUF")
        data = file[t["offset"]:t["offset"] + t["n_bytes"]].view(np.dtype(t["dtype"])).reshape(t["shape"])
        keeps_blocks = qtype in KERNEL_TYPES
        if not keeps_blocks:
            data = dequantize(data, GGMLQuantizationType(qtype)).astype(np.float32)
        if is_llama and ".self_attn.q_proj." in name:
            data = _unpermute_rows(data, cfg.n_heads)
        elif is_llama and ".self_attn.k_proj." in name:
            data = _unpermute_rows(data, cfg.n_kv_heads)
        elif family.startswith("gemma") and name.endswith("norm.weight"):
            data = data - 1  # llama.cpp stores Gemma's norms as 1 + w, as its forward multiplies
        mapped = keeps_blocks and qtype in mapped_types and isinstance(data, np.memmap)
        tensors[name] = (torch.from_numpy(data if mapped else np.array(data)), qtype if keeps_blocks else None)
    return tensors


def load_quantized_model(gguf_path: Path, sha256: str | None = None, dtype: torch.dtype = torch.float32,
                         yarn_factor: float = 1.0):
    """(our Transformer on CPU with the GGUF's linears as `QuantLinear`, tokenizer). `dtype` (float32
    or bfloat16) is that of activations, norms and KV cache; the linears multiply in float32. The LM
    head returns float32 logits, as its kernel computes them (bf16 logits would make ties)."""
    kernel = cpu_quant_kernel()
    header = gguf_header_dir(gguf_path, sha256)
    model, hf_config = meta_model(header, yarn_factor)
    cfg = model.config
    # a bf16 model on a CPU with BF16 dot products decodes Q5_0, Q4_K and Q6_K from interleaved copies
    # made here; their blocks in the file's order (for prefill, int8 drafts) stay pages of the file
    interleaves = dtype == torch.bfloat16 and kernel.uses_bf16_dots()
    mapped_types = INTERLEAVED_TYPES if interleaves else ()
    tensors = split_fused(read_gguf_tensors(gguf_path, header, hf_config.model_type, cfg, mapped_types), cfg)
    check_tensor_names(f"The GGUF {gguf_path.name}", set(tensors), parameter_names(model))
    plain = _place_quantized(model, tensors, cfg.dim, kernel)
    model.load_state_dict({name: t.to(dtype) for name, t in plain.items()}, strict=False, assign=True)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.interleaved(dtype)  # now, not at the first call (a no-op unless `interleaves`)
    return finish_model(model, hf_config, torch.device("cpu")), load_tokenizer(header)


def _place_quantized(model: nn.Module, tensors: dict, dim: int, kernel) -> dict[str, torch.Tensor]:
    """Set each weight that keeps its blocks into the meta `model` as a `QuantEmbedding` or
    `QuantLinear` (with its bias); return the other modules' tensors, for `load_state_dict`."""
    if "lm_head.weight" not in tensors:  # tied: the LM head reads the embedding's blocks
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    quantized = [name.removesuffix(".weight") for name, (_, qtype) in tensors.items()
                 if qtype is not None and name.endswith(".weight")]
    for module_name in quantized:
        blocks, qtype = tensors[f"{module_name}.weight"]
        if module_name == "model.embed_tokens":
            model.model.embed_tokens = QuantEmbedding(blocks, qtype, dim, kernel)
        else:
            bias = tensors.get(f"{module_name}.bias", (None, None))[0]
            out_dtype = torch.float32 if module_name == "lm_head" else None
            model.set_submodule(module_name, QuantLinear(blocks, qtype, model.get_submodule(module_name).in_features,
                                                        bias, kernel, out_dtype))
    return {name: t for name, (t, _) in tensors.items() if name.rsplit(".", 1)[0] not in quantized}


def generation_defaults(source: str, model_dir: Path) -> tuple[dict, set[int]]:
    """(SamplingConfig fields, end token ids): the settings the model was tuned to be sampled with,
    from the folder's generation_config.json, completed for a packaged model by what its GGUF
    dropped. Without `do_sample` (or a file) it decodes greedily, as Hugging Face's `generate` would."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    packaged = models.PACKAGED_MODELS.get(source)
    if packaged is not None and packaged.generation:
        config |= packaged.generation
    end_ids = config.get("eos_token_id")
    end_ids = set(end_ids if isinstance(end_ids, list) else [end_ids] if end_ids is not None else [])
    if not config.get("do_sample"):
        return {"temperature": 0.0}, end_ids
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the same in SamplingConfig
    return {name: config[name] for name in names if config.get(name) is not None}, end_ids


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Raise TokenizerMismatch unless both models map text to the same ids: speculation compares ids
    across levels. Chat templates may differ (the target's builds the prompt)."""
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    target_special, draft_special = special_tokens(target_tok), special_tokens(draft_tok)
    if target_vocab != draft_vocab:
        why = (f"vocabularies differ ({len(target_vocab):,} vs {len(draft_vocab):,} tokens; "
               f"{_first_difference(target_vocab, draft_vocab)})")
    elif target_special != draft_special:
        why = (f"special tokens differ (only in target: {sorted(target_special - draft_special)}, "
               f"only in draft: {sorted(draft_special - target_special)})")
    else:
        return
    raise TokenizerMismatch(f"The draft {draft_name!r} cannot draft for {target_name!r}: their {why}. "
                            "Pick a draft of the same family.")


def _first_difference(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str:
    target_by_id = {idx: tok for tok, idx in target_vocab.items()}
    draft_by_id = {idx: tok for tok, idx in draft_vocab.items()}
    for token_idx in sorted(target_by_id.keys() | draft_by_id.keys()):
        target_token, draft_token = target_by_id.get(token_idx), draft_by_id.get(token_idx)
        if target_token != draft_token:
            return f"first differing id {token_idx}: {target_token!r} vs {draft_token!r}"
    return "same ids, but some tokens map to several ids"


def special_tokens(tokenizer) -> set[tuple[str, int]]:
    """(token, id) of every special token: the named ones and the added special ones."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return {(token, tokenizer.convert_tokens_to_ids(token)) for token in tokens}
