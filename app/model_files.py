"""What a model file or folder holds, read from its metadata only: never a weight.

`inspect_model(path)` reads a .gguf's header (the `gguf` package's GGUFReader maps the file and
parses its key-values and tensor table; the tensor data stays on disk) or a Hugging Face folder's
config.json, safetensors headers and tokenizer files, and returns a `ModelInfo`: family, bytes,
quantization, native context, and what stops it loading: in the files (cut short, no tokenizer,
blocks the `gguf` package cannot read) or in the engine's verdict (engine/families.py
`check_model`: a family or a config field it does not run). `blockers(info, machine)` adds what
this machine says (weights that do not fit). A tokenizer is
summed up as `vocab_key`: a hash of its vocabulary and special tokens, what
engine/loading.py `check_same_tokenizer` compares, so two models with equal keys give the same ids.
Nothing here touches the network. Which folders are searched is app/catalog.py's business.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from app.speeds import disk_size
from engine.config import EngineError, UnsupportedModel

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")
GGUF_CONTROL = 3  # llama.cpp's token type of a special token (tokenizer.ggml.token_type)


class NotRunnable(EngineError):
    """A model the picker can tell will not load here, from its files alone: the reason says why."""


@dataclass(frozen=True)
class ModelInfo:
    path: str
    kind: str  # "gguf" or "folder"
    name: str  # general.name of a GGUF, else the file's or folder's name
    family: str  # the engine's model_type ("qwen3", "gemma3_text"), else the files' architecture; "" unknown
    n_bytes: int  # on disk
    quantization: str  # "Q4_K_M", "BF16", "AWQ" ...; "" unknown
    n_context: int  # native context in tokens; 0 unknown
    n_params: int  # weights, elements
    # GGUF: ggml type name -> [elements, bytes] of its tensors (what loading them costs)
    tensor_types: dict[str, list[int]] = field(default_factory=dict)
    vocab_key: str = ""  # hash of the vocabulary and special tokens; "" when there is no tokenizer
    problem: str = ""  # why it cannot load, from its files or the engine's verdict, a clause ("" none)

    @property
    def family_name(self) -> str:
        from engine.families import FAMILY_NAMES

        return FAMILY_NAMES.get(self.family, self.family or "?")


@dataclass(frozen=True)
class Machine:
    """What a model needs of this machine: the engine's device, dtype and GGUF kernel."""

    device_type: str  # "cpu" or "cuda"
    memory_bytes: int  # RAM on a CPU, the GPU's free memory otherwise
    dtype_bytes: int  # bytes of a weight the engine computes in (4: float32, 2: bfloat16)
    kernel_types: frozenset[str] = frozenset()  # ggml types kept as the file's blocks (engine/quant.py)


def vocab_key(vocab: dict[str, int], special: set[tuple[str, int]]) -> str:
    """Equal for two tokenizers exactly when their vocabularies and special tokens are."""
    text = json.dumps([sorted(vocab.items()), sorted(special)], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def inspect_model(path: str | Path) -> ModelInfo:
    """The `ModelInfo` of a .gguf file or a Hugging Face folder; a broken one gets a `problem`."""
    path = Path(path)
    if not path.is_dir():
        return _inspect_gguf(path)  # the engine's rules for a GGUF are applied to the same parse
    info = _inspect_folder(path)
    return info if info.problem else _replace(info, **_engine_verdict(path))


def _engine_verdict(path: Path) -> dict:
    """A folder's family as the engine names it, or why the engine refuses it: engine/families.py
    `check_model`."""
    from engine.families import check_model

    try:
        return {"family": check_model(path)}
    except UnsupportedModel as refusal:
        return {"problem": refusal.why}
    except EngineError as error:
        return {"problem": str(error).rstrip(".")}


# ---- GGUF ---------------------------------------------------------------------------------------
def _inspect_gguf(path: Path) -> ModelInfo:
    from gguf import GGUFReader

    n_bytes = path.stat().st_size if path.exists() else 0
    empty = ModelInfo(str(path), "gguf", path.stem, "", n_bytes, "", 0, 0)
    if not path.exists():
        return _replace(empty, problem="its file is missing")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        reader = GGUFReader(path)
    except OSError as error:
        return _replace(empty, problem=f"the file cannot be read ({error.strerror or error})")
    except (ValueError, IndexError, KeyError, TypeError):  # GGUFReader's ways of failing on a short file
        if magic != b"GGUF":
            return _replace(empty, problem="it is not a GGUF file")
        return _replace(empty, problem="the file is cut short or damaged (an interrupted download?)")
    from engine.families import gguf_fields

    fields = gguf_fields(reader)
    arch = str(fields.get("general.architecture", ""))
    types: dict[str, list[int]] = {}
    for tensor in reader.tensors:
        counts = types.setdefault(tensor.tensor_type.name, [0, 0])
        counts[0] += int(tensor.n_elements)
        counts[1] += int(tensor.n_bytes)
    info = ModelInfo(
        str(path), "gguf", str(fields.get("general.name") or path.stem), arch, n_bytes,
        _file_type(fields.get("general.file_type"), types), int(fields.get(f"{arch}.context_length") or 0),
        sum(n for n, _ in types.values()), types, _gguf_vocab_key(reader, fields), _gguf_problem(reader, types))
    return info if info.problem else _replace(info, **_gguf_verdict(path, reader))


def _gguf_verdict(path: Path, reader) -> dict:
    """The engine's family of a GGUF and why it refuses it ("" it runs): engine/families.py's rules."""
    from engine.families import check_gguf

    try:
        return {"family": check_gguf(path, reader)}
    except UnsupportedModel as refusal:
        return {"problem": refusal.why}


def _file_type(file_type, types: dict[str, list[int]]) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):  # no or an unknown general.file_type: its most used block type
        return max(types, key=lambda t: types[t][1]) if types else ""


def _gguf_vocab_key(reader, fields: dict) -> str:
    if "tokenizer.ggml.tokens" not in reader.fields:
        return ""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    kinds = reader.fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in reader.fields \
        else []
    special = {(tokens[i], i) for i, kind in enumerate(kinds) if kind == GGUF_CONTROL}
    for name in ("bos", "eos", "unknown", "padding"):  # the named ones, as a Hugging Face tokenizer lists them
        token_idx = fields.get(f"tokenizer.ggml.{name}_token_id")
        if token_idx is not None and 0 <= int(token_idx) < len(tokens):
            special.add((tokens[int(token_idx)], int(token_idx)))
    return vocab_key({token: idx for idx, token in enumerate(tokens)}, special)


def _gguf_problem(reader, types: dict[str, list[int]]) -> str:
    if "tokenizer.ggml.tokens" not in reader.fields:
        return "it has no tokenizer in its metadata"
    if not types:
        return "it holds no tensors"
    unreadable = [name for name in types if not _can_dequantize(name)]
    if unreadable:
        return f"its {', '.join(unreadable)} blocks are a type the gguf package cannot read"
    return ""


def _can_dequantize(type_name: str) -> bool:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    if type_name in FLOAT_TYPES:
        return True
    qtype = GGMLQuantizationType[type_name]
    if qtype not in GGML_QUANT_SIZES:
        return False
    try:  # one block of zeros: the type is known when it dequantizes
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


# ---- Hugging Face folders -----------------------------------------------------------------------
def _inspect_folder(path: Path) -> ModelInfo:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return ModelInfo(str(path), "folder", path.name, "", 0, "", 0, 0,
                         problem=f"its config.json cannot be read ({error.__class__.__name__})")
    text = config.get("text_config") or config  # a multimodal config keeps the language model's inside
    family = str(config.get("model_type", ""))
    shards = sorted(path.glob("*.safetensors"))
    n_bytes = sum(s.stat().st_size for s in shards)
    n_params, problem = _safetensors_params(shards)
    if not shards:
        has_bin = any(path.glob("*.bin"))
        problem = "it holds PyTorch .bin weights, and the engine reads only safetensors" if has_bin \
            else "it holds no *.safetensors weights"
    if not problem and not any((path / name).is_file() for name in TOKENIZER_FILES):
        problem = "it has no tokenizer files (tokenizer.json or tokenizer.model)"
    quant = config.get("quantization_config") or {}
    if quant:
        method = quant.get("quant_method", "pre")
        problem = problem or f"its weights are {method}-quantized, which the engine does not read"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "")
    quantization = str(quant.get("quant_method", "")).upper() or {"bfloat16": "BF16", "float16": "F16",
                                                                   "float32": "F32"}.get(dtype, dtype)
    info = ModelInfo(str(path), "folder", path.name, family, n_bytes, quantization,
                     int(text.get("max_position_embeddings") or 0), n_params, problem=problem)
    return info if problem else _replace(info, **_folder_tokenizer(path))


def _safetensors_params(shards: list[Path]) -> tuple[int, str]:
    """(weights counted from the safetensors headers, the problem); reads no tensor data."""
    from safetensors import SafetensorError, safe_open

    n_params = 0
    for shard in shards:
        try:
            with safe_open(shard, framework="np") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    n = 1
                    for size in f.get_slice(name).get_shape():
                        n *= size
                    n_params += n
        except (SafetensorError, OSError):
            return 0, f"{shard.name} is cut short or damaged (an interrupted download?)"
    return n_params, ""


def _folder_tokenizer(path: Path) -> dict:
    from transformers import AutoTokenizer

    from engine.loading import special_tokens

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {"problem": f"its tokenizer cannot be read ({error.__class__.__name__})"}
    # what engine/loading.py `check_same_tokenizer` compares
    return {"vocab_key": vocab_key(tokenizer.get_vocab(), special_tokens(tokenizer))}


def _replace(info: ModelInfo, **changes) -> ModelInfo:
    from dataclasses import replace

    return replace(info, **changes)


# ---- what this machine and engine say -----------------------------------------------------------
def weight_bytes(info: ModelInfo, machine: Machine) -> int:
    """Bytes its weights take in memory: a GGUF's kernel types as the file's blocks, the rest
    dequantized to the engine's dtype (engine/quant.py; on a GPU every type is)."""
    if info.kind == "folder":
        return info.n_params * machine.dtype_bytes
    return sum(n_bytes if name in machine.kernel_types else n * machine.dtype_bytes
               for name, (n, n_bytes) in info.tensor_types.items())


def dequantized_types(info: ModelInfo, machine: Machine) -> list[str]:
    """Its quantized block types this engine dequantizes at load rather than keep as they are."""
    return [name for name in info.tensor_types if name not in FLOAT_TYPES and name not in machine.kernel_types]


def blockers(info: ModelInfo, machine: Machine) -> str:
    """Why it will not run here, a clause ("" when it will): its files, the engine, memory."""
    if info.problem:
        return info.problem
    need = weight_bytes(info, machine)
    if need > 0.9 * machine.memory_bytes:  # the KV cache and the activations need the rest
        return f"its weights take {disk_size(need)} in memory and this machine has {disk_size(machine.memory_bytes)}"
    return ""


