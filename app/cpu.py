"""Is the machine contended? CPU time other programs take while an answer streams.

On 2 cores, one other busy process can make a 2-thread decode several times slower (OpenMP
threads wait for the one that lost its core: benchmarks/RESULTS.md, "Threads under contention").
The reader then sees a slow answer and blames the engine. `CpuWatch` measures, over the answer,
the cores the rest of the machine kept busy (system CPU time minus this process's, steal
included: a virtual machine's host taking the core counts too), and `note` says so in the
metrics panel when that is more than the cores the engine leaves free.
"""

from __future__ import annotations

import time

import psutil
import torch

MIN_SECONDS = 1.0  # shorter windows are noise
SLACK = 0.25  # cores others may take beyond the free ones before the panel says so


def busy_seconds(times) -> float:
    """CPU seconds spent busy in a psutil cpu_times record (guest time is inside user already)."""
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


class CpuWatch:
    """Started when an answer starts; `others()` is the mean number of cores other processes used."""

    def __init__(self, engine_threads: int | None = None, n_cores: int | None = None):
        self.engine_threads = engine_threads or torch.get_num_threads()  # the engine runs in this process
        self.n_cores = n_cores or psutil.cpu_count() or 1
        self.process = psutil.Process()
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float]:  # (wall, system busy, this process busy)
        ours = self.process.cpu_times()
        return time.monotonic(), busy_seconds(psutil.cpu_times()), ours.user + ours.system

    def others(self) -> float | None:
        """Cores other programs kept busy since the start, or None before MIN_SECONDS."""
        wall, system, ours = self._sample()
        elapsed = wall - self.start[0]
        if elapsed < MIN_SECONDS:
            return None
        return max(0.0, ((system - self.start[1]) - (ours - self.start[2])) / elapsed)

    def note(self) -> str:
        """A warning for the metrics panel, or "" when the engine had the cores it asked for."""
        others = self.others()
        free = max(0, self.n_cores - self.engine_threads)
        if others is None or others <= free + SLACK:
            return ""
        return (f"⚠ Other programs kept {others:.1f} of this machine's {self.n_cores} cores busy during this "
                f"answer, so tokens came slower than this machine can give them. Close them, or start "
                f"the app with `--threads {max(1, self.n_cores - round(others))}`.")


def cpu_note(watch: CpuWatch | None) -> str:
    return watch.note() if watch is not None else ""
