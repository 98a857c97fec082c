"""Compiling an engine/csrc kernel with torch's JIT extension builder, without hanging or rebuilding.

torch builds in one folder per extension name, guarded by an empty `lock` file that a build killed
midway leaves behind (every later start then waits forever), and rebuilds a folder shared by
checkouts whose build commands differ. So `load_extension` builds in a folder named by a hash of the
whole build command; serialises builders with an flock (released however its holder dies), whose
holder removes a dead build's `lock`; and raises `BuildBusy` after `wait_s` so that the caller runs
its exact fallback instead of hanging. `engine.device.build_cpu_extension` is its one caller.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WAIT_S = 180.0  # a first build takes minutes on a busy 2-core CPU; past this, this start runs the fallback
_POLL_S = 0.2


class BuildBusy(RuntimeError):
    """Another live process has held the build lock for longer than we wait."""


def build_dir(name: str, source: Path, cflags: list[str]) -> Path:
    """The folder of this exact build: `<torch extensions root>/<name>-<hash of the command>`."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    digest = hashlib.sha256(source.read_bytes())
    for part in (*cflags, *cpp_extension.include_paths(), torch.__version__, sys.version, sys.platform):
        digest.update(b"\0" + part.encode())
    return Path(root) / f"{name}-{digest.hexdigest()[:12]}"


def load_extension(name: str, source: Path, cflags: list[str], wait_s: float = WAIT_S):
    """The compiled module (built now, or found from an earlier start); raises BuildBusy after
    `wait_s` when a live process is building it, or what torch raises when the build fails."""
    from torch.utils import cpp_extension

    folder = build_dir(name, source, cflags)
    folder.mkdir(parents=True, exist_ok=True)
    with _builder_lock(folder / "builder.lock", name, wait_s):
        stale = folder / "lock"  # torch's baton: nobody builds here but us, so a dead build left it
        if stale.exists():
            log.warning("removing %s, left by a build of %s that was interrupted; building again", stale, name)
            stale.unlink(missing_ok=True)
        if not any(folder.glob(f"{name}*.so")):  # a first start: say what it waits for, and how long
            log.warning("compiling %s, once (a C++ build: minutes on a 2-core CPU; scripts/setup.sh does it "
                        "ahead); later starts load it from %s", name, folder)
        copy = folder / f"{name}.cpp"  # a fixed path: the build command is the same from any checkout
        if not copy.is_file() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)
        return cpp_extension.load(name, [str(copy)], extra_cflags=cflags, build_directory=str(folder))


@contextlib.contextmanager
def _builder_lock(path: Path, name: str, wait_s: float) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no flock; torch's own baton is all there is
        yield
        return
    with open(path, "a+") as file:
        deadline, has_said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "?"  # the PID the holder wrote
                if time.monotonic() >= deadline:
                    raise BuildBusy(f"process {holder} has been building {name} for more than {wait_s:.0f} s "
                                    f"(lock {path})") from None
                if not has_said:
                    log.warning("waiting up to %.0f s for process %s, which is building %s", wait_s, holder, name)
                    has_said = True
                time.sleep(_POLL_S)
        file.truncate(0)  # "a+": the write below goes to the end, now 0
        file.write(str(os.getpid()))
        file.flush()
        yield  # closing the file releases the lock, however the block ends
