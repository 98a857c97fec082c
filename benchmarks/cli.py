"""The flags every benchmark shares, each with one meaning and one default: `--model` (the app's
default model, EngineConfig.target), `--threads` (torch's CPU threads: 2, the cores of the machines
we measure on) and `--out` (the JSON report, benchmarks/results/NAME.json)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import EngineConfig

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2


def add_common_args(p: argparse.ArgumentParser, name: str, model: bool = True, threads: bool = True,
                    out: bool = True) -> None:
    """`--model`, `--threads` (unless the benchmark's own means something else) and `--out`."""
    if model:
        p.add_argument("--model", default=EngineConfig.target, help="a packaged name, a folder or a .gguf")
    if threads:
        p.add_argument("--threads", type=int, default=THREADS, help="torch's CPU threads")
    if out:
        p.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="the JSON report")
