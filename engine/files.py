"""Files the engine writes under its cache folder: converted models, a GGUF's header folder.

A folder is written beside its place and moved there whole, marked complete last, so a stop halfway
never leaves one that looks whole. Standard library only: engine/models.py and engine/loading.py use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

COMPLETE_MARKER = ".bookchat-complete"  # written last: a folder without it is half-written


def cache_root() -> Path:
    """`$BOOKCHAT_CACHE`, else ~/.cache/bookchat; wheels, GGUFs and converted models live here."""
    return Path(os.environ.get("BOOKCHAT_CACHE") or Path.home() / ".cache" / "bookchat")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, streamed (a model file takes a while: check it once, at assembly)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def complete_folder(out_dir: Path, marker: dict) -> Iterator[Path]:
    """Write into a scratch folder beside `out_dir`; on success it is marked complete (`marker`) and
    replaces `out_dir`."""
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
