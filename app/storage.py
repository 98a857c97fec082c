"""Files that a crash, a kill or a full disk never leave half-written, and messages for when
the disk refuses a write.

Every write goes to a temporary file in the same folder, is flushed to disk, then replaces the
target with `os.replace` (atomic on POSIX and Windows); the folder is synced so the rename itself
survives a power cut. A reader therefore sees the old file or the new one, never a mix. A failed
write (ENOSPC, read-only folder) raises OSError and leaves the old file and no temporary file.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def remove_temp_files(root: Path) -> int:
    """Delete the `.*.tmp` files a killed writer left under `root` (its folder and two levels
    down: book folders and their chats); returns how many. Call before anything writes there."""
    n_removed = 0
    for pattern in (".*.tmp", "*/.*.tmp", "*/*/.*.tmp"):
        for stale in root.glob(pattern):
            try:
                stale.unlink()
                n_removed += 1
            except OSError:
                pass
    return n_removed


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file written by someone else (e.g. torch.save) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8"))


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def write_failure(error: OSError) -> str:
    """Why a write failed, in words: 'the disk is full', 'the library folder is read-only' ..."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "the library folder is not writable"
    return error.strerror or str(error)


def fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # Windows cannot open folders; its rename is durable enough
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
