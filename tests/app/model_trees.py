"""Builders of the model files and folders readers have: tiny real GGUFs (the `gguf` package's
writer, llama.cpp's metadata keys), Hugging Face folders (config.json, safetensors, a real
tokenizer), and the trees the Hugging Face cache, LM Studio and Ollama keep them in."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

TOKENS = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz"]  # ids 0..28; 1 and 2 are special


def write_gguf(path: Path, arch: str = "llama", n_context: int = 4096, qtype: str = "Q8_0", dim: int = 64,
               tokens: list[str] = TOKENS, has_tokenizer: bool = True, name: str | None = None) -> Path:
    """A GGUF of `arch` whose tensors are `dim`-wide rows in `qtype` blocks (one Q8_1 tensor is raw
    zeros: a type gguf cannot quantize or dequantize)."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name or path.stem)
    writer.add_context_length(n_context)
    writer.add_block_count(1)
    if hasattr(gguf.LlamaFileType, f"MOSTLY_{qtype}"):
        writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    if has_tokenizer:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in ("<s>", "</s>") else 2 if t == "<unk>" else 1 for t in tokens])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((len(tokens), dim * 4)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "Q8_1":
        n_weights, n_bytes = gguf.GGML_QUANT_SIZES[kind]
        blocks = np.zeros((len(tokens), dim * 4 // n_weights * n_bytes), np.uint8)
        writer.add_tensor("token_embd.weight", blocks, raw_dtype=kind)
    else:
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(dim * 4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_tokenizer(tokens: list[str] = TOKENS):
    """A real fast tokenizer over `tokens` (one per letter), `<s>` and `</s>` special."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def write_folder(path: Path, model_type: str = "llama", n_context: int = 4096, n_params: int = 29 * 256,
                 tokens: list[str] | None = TOKENS, config: dict | None = None) -> Path:
    """A Hugging Face folder: config.json, one bf16 safetensors file of `n_params` weights, the tokenizer."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    body = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": n_context,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 29, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(body | (config or {})))
    save_file({"model.embed_tokens.weight": torch.zeros(n_params // 64, 64, dtype=torch.bfloat16)},
              str(path / "model.safetensors"))
    if tokens is not None:
        tiny_tokenizer(tokens).save_pretrained(path)
    return path


def truncate(path: Path, n_bytes: int) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:n_bytes])
    return path


def hf_cache_repo(hub: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """The snapshot folder of `repo_id` in a Hugging Face cache (refs/main names it)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def ollama_model(models: Path, name: str, tag: str, gguf_file: Path) -> Path:
    """Put `gguf_file` into an Ollama models folder as name:tag (blob + manifest); returns the blob."""
    digest = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    gguf_file.replace(blob)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
               "size": blob.stat().st_size},
              {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00", "size": 10}]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob
