"""Threads under contention (issue 22, item 4): how OpenMP's threads wait at barriers, measured on
the real decoding step while the rest of the machine is quiet, lightly busy or has a core busy.

Each waiting policy runs in its own process (the OpenMP runtime reads its environment once):
the model (plain decoding, this CPU's defaults) reads the first `--context` tokens of
assets/persuasion.txt once, then decodes `--new-tokens` greedy tokens per measurement, with:
- nothing else running ("quiet");
- a process busy 15% of each 100 ms ("15% of a core": a browser streaming the answer, on 2 cores);
- a process spinning ("one core busy": a build, a video).
`--rounds` alternates the three. Median ms per token. Policies: libgomp's own default (spin about
300,000 times, then sleep), `GOMP_SPINCOUNT=3000` (spin briefly; app.py's default) and
`OMP_WAIT_POLICY=PASSIVE` (sleep at once).

    python -m benchmarks.threads --model qwen2.5-coder-1.5b --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.cli import add_common_args

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"libgomp default (spin, then sleep)": {},
            "GOMP_SPINCOUNT=3000 (app.py)": {"GOMP_SPINCOUNT": "3000"},
            "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}
LIGHT = ("import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 0.015: pass\n"
         "    time.sleep(0.085)\n")
LOADS = {"quiet": None, "15% of a core": LIGHT, "one core busy": "while True: pass"}


def child(model: str, threads: int, context: int, new_tokens: int, rounds: int) -> dict:
    import torch

    from engine import Engine, EngineConfig, SamplingConfig

    torch.set_num_threads(threads)
    engine = Engine.load(EngineConfig(target=model, levels="plain"))
    doc = engine.tokenizer((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:8 * context])["input_ids"]
    session = engine.open(doc[:context])
    question = engine.tokenizer("\n\nSummarize this in two paragraphs.")["input_ids"]
    sampling = SamplingConfig(max_new_tokens=new_tokens)

    def ms_per_token() -> float:  # the engine's mean TBT: from the first token to the last
        *_, last = session.ask(question, sampling)
        session.truncate(context)
        return last.stats.tbt_ms_mean

    ms = {name: [] for name in LOADS}
    for _ in range(rounds):
        for name, code in LOADS.items():
            load = code and subprocess.Popen([sys.executable, "-c", code])
            try:
                ms[name].append(ms_per_token())
            finally:
                if load:
                    load.kill()
    return {name: {"median_ms": statistics.median(v), "all_ms": v} for name, v in ms.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "threads")
    p.add_argument("--context", type=int, default=2048, help="tokens of the book read before decoding")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.threads, args.context, args.new_tokens, args.rounds)))
        return 0
    report = {"command": "python -m benchmarks.threads " + " ".join(sys.argv[1:] if argv is None else argv),
              "load_avg_before": list(os.getloadavg()), "results": {}}
    inherited = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for policy, env in POLICIES.items():
        done = subprocess.run([sys.executable, "-m", "benchmarks.threads", "--child", "--model", args.model,
                               "--threads", str(args.threads), "--context", str(args.context),
                               "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)],
                              capture_output=True, text=True, check=True, cwd=ROOT, env={**inherited, **env})
        report["results"][policy] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'policy':<38}" + "".join(f"{load:>16}" for load in LOADS))
    for policy, by_load in report["results"].items():
        print(f"{policy:<38}" + "".join(f"{by_load[load]['median_ms']:>13.1f} ms" for load in LOADS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
