"""Find a model on disk and read its tokenizer, Hugging Face config and weights.

`resolve_model` turns what a user typed (a local folder, a `.gguf` file, a packaged model name,
a hub id) into one local Hugging Face folder: config.json, *.safetensors, tokenizer files with
the model's chat template. A GGUF is dequantised by transformers once and cached as safetensors.
A model already on disk never touches the network. This module does not build our decoder
(engine/model.py does) and does not assemble the packaged models (engine/models.py does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import EngineError, ModelConfig, ModelNotFound, TokenizerMismatch
from engine.families import check_hf_config, check_tensor_names, fix_gguf_config, refuse_unsupported

COMPLETE_MARKER = ".bookchat-complete"  # written last: a folder without it is half-converted
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def cache_root() -> Path:
    """`$BOOKCHAT_CACHE`, else ~/.cache/bookchat; wheels, GGUFs and converted models live here."""
    return Path(os.environ.get("BOOKCHAT_CACHE") or Path.home() / ".cache" / "bookchat")


def resolve_model(source: str) -> Path:
    """A local Hugging Face folder for `source`; raises ModelNotFound with what to do."""
    from engine import models  # lazy: models.py converts through this module

    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        return _local_folder(path)
    if source in models.PACKAGED_MODELS:
        return models.packaged_model_dir(source, assemble=True)
    if source.endswith(".gguf") or source.startswith(("/", ".", "~")):
        raise ModelNotFound(f"No model file or folder at {path}: check the path.")
    if HUB_ID.match(source):
        return _hub_snapshot(source)
    raise ModelNotFound(
        f"No model {source!r}: give a local Hugging Face folder, a .gguf file, a hub id "
        f"(org/name) or one of the packaged models: {', '.join(models.PACKAGED_MODELS)}."
    )


def _local_folder(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0])
    raise ModelNotFound(
        f"{path} is not a Hugging Face model folder (no config.json) and does not hold exactly "
        f"one .gguf file (found {len(ggufs)}); point at the folder or at the .gguf itself."
    )


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if is_offline_mode():
        raise ModelNotFound(
            f"{repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it "
            f"on a connected machine, or pass a local folder or .gguf file instead."
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        raise ModelNotFound(
            f"Could not download {repo_id!r} from the Hugging Face hub ({error.__class__.__name__}"
            f"): check the id and the network, or pass a local folder or .gguf file instead."
        ) from error


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, streamed (a model file takes a while: check it once, at assembly)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def complete_folder(out_dir: Path, marker: dict) -> Iterator[Path]:
    """Write into a scratch folder beside `out_dir`; on success it is marked complete (`marker`, which
    the block may add to) and replaces `out_dir`: no half-written folder ever looks whole."""
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        yield tmp_dir
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)  # a stale, unmarked attempt
    os.replace(tmp_dir, out_dir)


def convert_gguf(gguf_path: Path, out_dir: Path | None = None, sha256: str | None = None) -> Path:
    """Dequantise a GGUF once into a bfloat16 safetensors folder; later calls return the cache.

    The default folder is keyed by the file's full sha256, so an edited file converts again.
    Pass `sha256` when it is already known (engine/models.py verified it) to skip hashing.
    """
    gguf_path = Path(gguf_path).resolve()
    sha256 = sha256 or file_sha256(gguf_path)
    if out_dir is None:
        out_dir = cache_root() / "models" / f"{gguf_path.stem}-{sha256[:16]}"
    if is_complete(out_dir):
        return out_dir
    started, marker = time.perf_counter(), {"gguf": str(gguf_path), "sha256": sha256}
    with complete_folder(out_dir, marker) as tmp_dir:
        _save_hf_folder(gguf_path, tmp_dir)
        marker["convert_s"] = round(time.perf_counter() - started, 1)
    return out_dir


def _save_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = gguf_path.parent, gguf_path.name
    refuse_unsupported(gguf_path)  # before transformers reads (and drops) what it does not know
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)  # a local file: no network
        config = AutoConfig.from_pretrained(where, gguf_file=name, local_files_only=True)
        fix_gguf_config(config, GGUFReader(gguf_path))  # what transformers' reader leaves at the defaults
        check_hf_config(config)
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, config=config, dtype=torch.bfloat16, local_files_only=True
        )
    except (ValueError, KeyError, OSError) as error:
        raise EngineError(f"transformers could not read {gguf_path} as a GGUF model: {error}") from error
    # The weights are plain dequantised tensors now; these two stop save_pretrained refusing them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def generation_defaults(source: str, model_dir: Path) -> tuple[dict, set[int]]:
    """(SamplingConfig fields, end token ids): the settings the model was tuned to be sampled with,
    from the folder's generation_config.json, completed for a packaged model by the settings its
    GGUF dropped (engine/models.py). Without `do_sample` the model decodes greedily, as Hugging
    Face's `generate` would; no file means greedy and no extra end tokens."""
    from engine import models

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


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_state_dict(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> tensors cast to `dtype`, from one or several shards.

    `lm_head.weight` is absent when the embeddings are tied.
    """
    state: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(Path(model_dir)):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                state[name] = f.get_tensor(name).to(dtype)
    return state


def safetensors_names(model_dir: Path) -> list[str]:
    """The tensor names of a folder's weights, from the files' headers (no weight is read)."""
    names = []
    for shard in _safetensors_files(Path(model_dir)):
        with safe_open(shard, framework="pt") as f:
            names.extend(f.keys())
    return names


def parameter_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters()}


def split_fused(state: dict, cfg: ModelConfig) -> dict:
    """Phi-3's fused qkv_proj and gate_up_proj as the q/k/v and gate/up linears our model has (a
    value is a tensor, a (tensor, ggml type) pair or None): rows split, so a GGUF's blocks split
    whole. Other checkpoints pass through."""
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    parts = {"self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), [q_rows, kv_rows, kv_rows]),
             "mlp.gate_up_proj": (("gate_proj", "up_proj"), [cfg.intermediate] * 2)}
    out = {}
    for name, value in state.items():
        module, _, what = name.rpartition(".")
        fused = next((f for f in parts if module.endswith(f)), None)
        if fused is None:
            out[name] = value
            continue
        names, rows = parts[fused]
        tensor, qtype = value if isinstance(value, tuple) else (value, None)
        pieces = tensor.split(rows) if tensor is not None else [None] * len(rows)
        for sub, piece in zip(names, pieces):
            key = f"{module.removesuffix(fused.split('.')[1])}{sub}.{what}"
            out[key] = piece if not isinstance(value, tuple) else (piece, qtype)
    return out


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


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Raise TokenizerMismatch unless both models map text to the same ids.

    Speculation compares token ids across levels, so the vocabularies and the special tokens
    must be identical; chat templates may differ (the target's builds the prompt).
    """
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    target_special, draft_special = _special_tokens(target_tok), _special_tokens(draft_tok)
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


def _special_tokens(tokenizer) -> set[tuple[str, int]]:
    """(token, id) of every special token: the named ones and the added special ones."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return {(token, tokenizer.convert_tokens_to_ids(token)) for token in tokens}


def extend_context(hf_config, yarn_factor: float) -> None:
    """YaRN RoPE scaling by `yarn_factor` over the native context, as Qwen documents for its 2.5
    models (`rope_scaling: {type: yarn, factor: 4, original_max_position_embeddings: 32768}`);
    transformers' rotary module computes it."""
    if yarn_factor == 1:
        return
    native = hf_config.max_position_embeddings
    hf_config.rope_parameters = {**hf_config.rope_parameters, "rope_type": "yarn", "factor": float(yarn_factor),
                                 "original_max_position_embeddings": native}
    hf_config.max_position_embeddings = int(native * yarn_factor)


def load_tokenizer_of(source: str, dtype: torch.dtype, device: torch.device):
    """The tokenizer `load_model(source, dtype, device)` returns, without the weights."""
    gguf = _gguf_to_keep_quantized(source, dtype, device)
    if gguf is None:
        return load_tokenizer(resolve_model(source))
    from engine.quant import gguf_header_dir

    path, sha256 = gguf
    return load_tokenizer(gguf_header_dir(path, sha256 or file_sha256(path)))


def load_model(source: str, dtype: torch.dtype, device: torch.device, yarn_factor: float = 1.0,
               keep_gguf_blocks: bool = True):
    """(our Transformer with the weights of `source`, its tokenizer), weights on `device`.

    A GGUF (a .gguf path or a packaged model) loaded on a CPU in float32 or bfloat16 keeps its
    quantized linears as the file's blocks (engine/quant.py: they multiply in float32 and return
    `dtype`) unless `keep_gguf_blocks` is False; otherwise the decoder is built on the meta
    device (`meta_model`) and takes the loaded tensors as they are (no second copy).
    """
    gguf = _gguf_to_keep_quantized(source, dtype, device) if keep_gguf_blocks else None
    if gguf is not None:
        from engine.quant import load_quantized_model

        return load_quantized_model(*gguf, dtype=dtype, yarn_factor=yarn_factor)
    model_dir = resolve_model(source)
    refuse_unsupported(model_dir)  # from the headers: config, tokenizer, weight files
    model, hf_config = meta_model(model_dir, yarn_factor)
    check_tensor_names(f"The model in {model_dir}", set(split_fused(dict.fromkeys(safetensors_names(model_dir)),
                                                                    model.config)), parameter_names(model))
    state = {k: v.to(device) for k, v in split_fused(load_state_dict(model_dir, dtype), model.config).items()}
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.has_tied_embeddings:  # `assign` untied them; a file's own lm_head copy is dropped here
        model.lm_head.weight = model.model.embed_tokens.weight
    return finish_model(model, hf_config, device, model_dir), load_tokenizer(model_dir)


def meta_model(folder: Path, yarn_factor: float = 1.0):
    """(our Transformer for the config in `folder`, on the meta device: no memory, no random
    initialisation; the caller assigns its weights, then calls `finish_model`), the HF config."""
    from engine.model import Transformer

    hf_config = load_hf_config(folder)
    check_hf_config(hf_config)
    extend_context(hf_config, yarn_factor)
    with torch.device("meta"):
        return Transformer(ModelConfig.from_hf(hf_config), hf_config), hf_config


def finish_model(model, hf_config, device: torch.device, origin: Path):
    """The RoPE buffers made for real on `device`; a weight still on meta is one `origin` lacks."""
    from engine.model import rotary_embedding

    with torch.device(device):
        model.model.rotary_emb = rotary_embedding(hf_config)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise EngineError(f"{origin} lacks weights for {', '.join(missing[:5])}")
    return model.eval()


def _gguf_to_keep_quantized(source: str, dtype: torch.dtype, device: torch.device) -> tuple[Path, str | None] | None:
    """(the .gguf of `source`, its sha256 if known) when engine/quant.py can keep its blocks:
    float32 or bfloat16 (the `auto` dtype of CPUs with AVX512-BF16 or AMX) on a CPU where its
    kernel built; None for every other checkpoint, dtype and device."""
    from engine import models
    from engine.quant import cpu_quant_kernel

    path = Path(source).expanduser()
    is_file = path.is_file() and path.suffix == ".gguf"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (is_file or source in models.PACKAGED_MODELS) or cpu_quant_kernel() is None:  # built only for a GGUF
        return None
    if is_file:
        return path.resolve(), None
    model = models.PACKAGED_MODELS[source]
    return models.assemble_gguf(model, cache_root()), model.sha256
