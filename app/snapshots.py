"""Prefill snapshots: stored with what they depend on, verified before use.

A snapshot (engine `Session.save`) holds a document's KV cache; it is valid only for the same
weights and the same tokens, and only if the file is intact. Its record (kept in the book's
meta.json and inside the file) names the model (id, shapes, dtype), the sha256 of the model's
weight files, the document's sha256 and token count; meta.json adds the sha256 of the snapshot
file itself. `load_snapshot` checks the record, the file's hash, then shapes and tokens before
the cache is used. Any mismatch (another or an edited model, a tampered, truncated or swapped
file) gives None: a new prefill, never answers from a wrong cache.
Weight-file hashes are cached by (path, size, mtime) in a JSON file, so a model is hashed once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.storage import fsync_file, fsync_folder, write_json

if TYPE_CHECKING:  # torch and the engine load on first use: `Library` alone stays light to import
    from engine.session import Engine, Session

SNAPSHOT = "snapshot.pt"
PARTIAL = "partial.pt"  # the reading so far of a book whose prefill was stopped (app/reading.py)
_STALE_TMP_S = 3600.0  # a snapshot still being written after an hour was orphaned by a crash


def model_fingerprint(engine: Engine) -> str:
    """The model's name and the shapes and dtype its KV cache has."""
    c = engine.target.config
    return f"{engine.config.target}|L{c.n_layers}|d{c.dim}|kv{c.n_kv_heads}x{c.head_dim}|V{c.vocab_size}|{engine.dtype}"


def weights_sha256(engine: Engine, cache_path: Path) -> str:
    """sha256 over the model's weight files ("file:<hex>"), or over its tensors ("tensors:<hex>")
    for a model built in memory (tests) or whose files cannot be found."""
    from engine import models
    from engine.config import EngineError
    from engine.files import file_sha256
    from engine.models import resolve_model
    from engine.quant import is_quantized

    source = engine.config.target
    if is_quantized(engine.target):  # the GGUF's blocks (engine/quant.py): the file is the identity
        if source in models.PACKAGED_MODELS:
            return "gguf:" + models.PACKAGED_MODELS[source].sha256
        files = [Path(source).expanduser()]
    else:
        try:
            folder = resolve_model(source)
        except (EngineError, OSError, ValueError):
            folder = None
        files = sorted(folder.glob("*.safetensors")) if folder is not None else []
    if not files:
        return "tensors:" + _tensors_sha256(engine)
    cache = _read_cache(cache_path)
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        cache[key] = cache.get(key) or file_sha256(path)
        digest.update(f"{path.name}:{cache[key]}\n".encode())
    with contextlib.suppress(OSError):  # a full disk only costs hashing again next time
        write_json(cache_path, cache)
    return "file:" + digest.hexdigest()


def save_snapshot(folder: Path, session: Session, record: dict, name: str = SNAPSHOT) -> dict:
    """Write the snapshot atomically; returns `record` plus the file's sha256 (for meta.json)."""
    from engine.files import file_sha256

    _remove_stale_temp_files(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".snapshot.", suffix=".tmp")
    os.close(fd)
    try:
        session.save(tmp, meta=record)
        sha = file_sha256(tmp)
        fsync_file(tmp)  # the data is on disk before the rename makes it the snapshot
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(folder)
    return {**record, "sha256": sha}


def load_snapshot(folder: Path, engine: Engine, saved: dict | None, expected: dict, doc_ids: list[int],
                  name: str = SNAPSHOT, n_total: int | None = None, shared_start: bool = False) -> Session | None:
    """The session in `folder`'s snapshot when `saved` (its meta.json record) matches `expected`,
    the file's sha256 matches the record, and its cache holds exactly `doc_ids` (`shared_start`:
    the whole prefill chunks it shares with the start of `doc_ids`, another document); else None."""
    from engine.files import file_sha256

    path = folder / name
    if not saved or {k: saved.get(k) for k in expected} != expected or not path.is_file():
        return None
    if file_sha256(path) != saved.get("sha256"):
        return None  # tampered, truncated, or replaced after its record was written
    try:
        session = engine.restore(path, n_total, doc_ids if shared_start else None)  # every rank its heads
    except Exception:  # torch/zip raise many types for damaged files (ValueError: no shared chunk)
        return None
    c, k = engine.target.config, session.full.k
    is_same_shape = (k.shape[0], k.shape[2], k.shape[4], k.dtype) == (c.n_layers, c.n_kv_heads, c.head_dim,
                                                                      engine.dtype)
    n = session.full.length if shared_start else len(doc_ids)
    is_same_text = session.tokens == doc_ids[:n] and session.full.length == n
    return session if is_same_shape and is_same_text else None


def _tensors_sha256(engine: Engine) -> str:
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(engine.target.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        tensor = tensor.detach().to_dense() if tensor.is_mkldnn else tensor.detach()  # bf16 weights packed for oneDNN
        digest.update(tensor.cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _read_cache(path: Path) -> dict[str, str]:
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in cache.items() if isinstance(v, str)} if isinstance(cache, dict) else {}


def _remove_stale_temp_files(folder: Path) -> None:
    for stale in folder.glob(".snapshot.*.tmp"):
        try:
            if time.time() - stale.stat().st_mtime > _STALE_TMP_S:
                stale.unlink()
        except OSError:
            pass
