"""Threads under contention (issue 22, item 4): one decoding step's linears with 1 thread, 2
threads, and 2 threads with OpenMP told not to spin (OMP_WAIT_POLICY=PASSIVE), while other
processes keep the cores busy.

Each configuration runs in its own process (the OpenMP runtime reads its environment once): every
linear of Qwen-0.5B's shapes (random weights; the time does not depend on them) in this CPU's
default layout (engine/device.py: bf16 oneDNN-packed on AVX512-BF16, float32 packed elsewhere),
T = 1 row, `--repeats` times; `--busy N` starts N spinning Python processes for the duration
(the machine's own load adds to them: it is recorded). Median and min ms per step.

    python -m benchmarks.threads --busy 1 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"1 thread": (1, {}), "2 threads": (2, {}),
           "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"})}
SHAPES = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)]  # [out, in]


def child(threads: int, repeats: int) -> dict:
    import torch

    from engine.device import can_pack_linear_weights, pick_dtype
    from engine.layouts import PackedLinear

    torch.set_num_threads(threads)
    dtype = pick_dtype("auto", torch.device("cpu"))
    linears = [torch.nn.Linear(i, o, bias=False, dtype=dtype).requires_grad_(False) for o, i in SHAPES * 24]
    linears.append(torch.nn.Linear(896, 151_936, bias=False, dtype=dtype).requires_grad_(False))
    if can_pack_linear_weights(dtype):
        linears = [PackedLinear(m) for m in linears]
    x = {n: torch.randn(1, n, dtype=dtype) for n in (896, 4864)}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for m in linears:
                m(x[m.in_features])
            times.append(1000 * (time.perf_counter() - t0))
    times = times[1:]  # the first call builds oneDNN primitives
    return {"median_ms": statistics.median(times), "min_ms": min(times), "dtype": str(dtype)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", type=int, default=1, help="spinning processes started for the measurement")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "threads.json")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return 0
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    report = {"command": "python -m benchmarks.threads " + " ".join(sys.argv[1:] if argv is None else argv),
              "busy_processes": args.busy, "results": {}}
    try:
        for name, (threads, env) in CONFIGS.items():
            load = list(os.getloadavg())
            done = subprocess.run([sys.executable, "-m", "benchmarks.threads", "--child", str(threads),
                                   "--repeats", str(args.repeats)], capture_output=True, text=True, check=True,
                                  cwd=ROOT, env={**os.environ, **env})
            report["results"][name] = {**json.loads(done.stdout.strip().splitlines()[-1]), "load_avg_before": load}
            print(f"{name}: {json.dumps(report['results'][name], default=lambda v: round(v, 2))}", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
