"""app/cpu.py: the metrics panel says when other programs take the engine's cores."""

import subprocess
import sys
import time
from types import SimpleNamespace

import app.cpu as cpu
from app.cpu import CpuWatch


class Clock:
    """Fake wall clock and CPU counters: `run(seconds, ours, others)` in cores busy."""

    def __init__(self, monkeypatch):
        self.wall, self.ours, self.system = 100.0, 5.0, 50.0
        monkeypatch.setattr(cpu.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(cpu.psutil, "cpu_times", lambda: SimpleNamespace(
            user=self.system, nice=0.0, system=0.0, idle=1e6, iowait=3.0, steal=0.0))
        monkeypatch.setattr(cpu.psutil, "Process", lambda: SimpleNamespace(
            cpu_times=lambda: SimpleNamespace(user=self.ours, system=0.0)))

    def run(self, seconds: float, ours: float, others: float):
        self.wall += seconds
        self.ours += ours * seconds
        self.system += (ours + others) * seconds


def test_the_note_appears_only_when_others_take_more_than_the_free_cores(monkeypatch):
    clock = Clock(monkeypatch)
    alone, one_free = CpuWatch(engine_threads=2, n_cores=2), CpuWatch(engine_threads=1, n_cores=2)
    clock.run(0.5, ours=2.0, others=0.9)
    assert alone.others() is None and alone.note() == ""  # too short to judge
    clock.run(1.5, ours=2.0, others=0.9)
    assert abs(alone.others() - 0.9) < 1e-9
    note = alone.note()
    assert "0.9 of this machine's 2 cores" in note and "--threads 1" in note
    assert one_free.note() == ""  # the engine left a core free, and others used less than it


def test_a_quiet_machine_gives_no_note(monkeypatch):
    clock = Clock(monkeypatch)
    watch = CpuWatch(engine_threads=2, n_cores=2)
    clock.run(3.0, ours=1.9, others=0.1)  # the desktop's own small noise
    assert watch.note() == ""


def test_a_real_busy_process_is_seen():
    watch = CpuWatch(engine_threads=2, n_cores=2)
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    busy.wait()
    time.sleep(0.1)
    others = watch.others()
    assert others is not None and others > 0.5, others  # one busy loop is about one core
    assert "⚠ Other programs" in watch.note()
