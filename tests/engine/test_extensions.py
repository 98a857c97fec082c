"""Building the compiled kernels (engine/extensions.py through engine.device.build_cpu_extension):
a build lock left by a killed build is removed and the build runs; a live builder is waited for
with a message and a time limit, then the fallback runs; the same source from another checkout
finds the same build; a first build says so, a later load says nothing. A tiny pybind11 module
stands in for the kernels (quick to build).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import extensions
from engine.device import build_cpu_extension

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the kernels are built only on CPUs with AVX2")
SOURCE = """#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # what build_cpu_extension passes
HOLD_LOCK = """
import fcntl, os, sys, time
file = open(sys.argv[1], "a+")
fcntl.flock(file, fcntl.LOCK_EX)
file.seek(0); file.truncate(); file.write(str(os.getpid())); file.flush()
open(sys.argv[2], "w").close()  # torch's baton, as a build in progress has it
print("holding", flush=True)
time.sleep(120)
"""


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    path = tmp_path / "checkout-a" / "tiny.cpp"
    path.parent.mkdir()
    path.write_text(SOURCE)
    return path


def build_in_thread(name: str, source: Path, wait_s: float, limit_s: float):
    """build_cpu_extension in a thread: (finished within limit_s, its result, seconds taken)."""
    result: list = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(build_cpu_extension(name, source, "the fallback",
                                                                               wait_s)), daemon=True)
    thread.start()
    thread.join(limit_s)
    return not thread.is_alive(), (result or [None])[0], time.monotonic() - started


def test_a_build_lock_left_by_a_killed_build_is_removed_and_the_kernel_is_built(source, caplog):
    name = "bookchat_test_stale"
    folder = extensions.build_dir(name, source, FLAGS)
    folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / "builder.lock").write_text(dead.stdout.strip())  # its builder died: no one holds the flock
    (folder / "lock").touch()  # torch's baton, which torch alone would wait on forever
    with caplog.at_level(logging.WARNING):
        finished, module, _ = build_in_thread(name, source, wait_s=5.0, limit_s=240.0)
    assert finished, "the start hung on the stale build lock"
    assert module is not None and module.add(2, 3) == 5
    assert not (folder / "lock").exists()
    assert f"removing {folder / 'lock'}, left by a build of {name} that was interrupted" in caplog.text


def test_a_live_builder_is_waited_for_with_a_message_and_a_limit_then_the_fallback_runs(source, caplog):
    name = "bookchat_test_busy"
    folder = extensions.build_dir(name, source, FLAGS)
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder / "builder.lock"), str(folder / "lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        with caplog.at_level(logging.WARNING):
            finished, module, seconds = build_in_thread(name, source, wait_s=1.0, limit_s=30.0)
        assert finished and module is None and 1.0 <= seconds < 10.0
        assert f"waiting up to 1 s for process {holder.pid}, which is building {name}" in caplog.text
        assert (f"process {holder.pid} has been building {name} for more than 1 s "
                f"(lock {folder / 'builder.lock'}): the fallback, the exact fallback, for this run") in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_the_same_source_from_another_checkout_finds_the_same_build(source, tmp_path):
    name = "bookchat_test_cache"
    other = tmp_path / "checkout-b" / "tiny.cpp"  # another worktree, its own path, the same text
    other.parent.mkdir()
    shutil.copy(source, other)
    assert extensions.build_dir(name, source, FLAGS) == extensions.build_dir(name, other, FLAGS)
    first = build_cpu_extension(name, source, "the fallback")
    folder = extensions.build_dir(name, source, FLAGS)
    library = next(folder.glob(f"{name}*.so"))
    built_ns, ninja = library.stat().st_mtime_ns, (folder / "build.ninja").read_text()
    second = build_cpu_extension(name, other, "the fallback")
    assert first is not None and second is not None and second.add(1, 1) == 2
    assert library.stat().st_mtime_ns == built_ns  # not rebuilt
    assert (folder / "build.ninja").read_text() == ninja and str(tmp_path / "checkout") not in ninja
    other.write_text(SOURCE.replace("a + b", "b + a"))
    assert extensions.build_dir(name, other, FLAGS) != folder  # a changed kernel builds beside it


def test_a_first_build_says_what_it_does_and_a_later_load_says_nothing(source, caplog):
    name = "bookchat_test_say"
    with caplog.at_level(logging.WARNING):
        assert build_cpu_extension(name, source, "the fallback").add(2, 2) == 4
    assert f"compiling {name}, once (a C++ build: minutes on a 2-core CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert build_cpu_extension(name, source, "the fallback") is not None
    assert "compiling" not in caplog.text
