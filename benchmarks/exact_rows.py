"""Every exact linear of a GGUF model (engine/csrc/quant_cpu.cpp `quant_linear`) at 1 to 9 rows:
what a check of T tokens costs in the linears. To compare two versions of the kernel, run it in
each checkout, alternately, on the same core (the build cache is keyed by the source's hash):

    taskset -c 0 .venv/bin/python -m benchmarks.exact_rows --model qwen2.5-coder-1.5b --repeats 3

Prints a table and writes JSON (min ms over the repeats, 1 thread)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.kernels import ROOT, load_model
from engine.quant import QuantLinear

ROWS = (1, 2, 3, 4, 5, 6, 8, 9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "exact_rows.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model(args.model, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not linears:
        print(f"{args.model} did not load as GGUF blocks")
        return 1
    ms = {}
    with torch.inference_mode():
        for T in ROWS:
            x = {n: torch.randn(T, n) for n in {m.in_features for m in linears}}
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                for m in linears:
                    m(x[m.in_features])
                times.append(time.perf_counter() - t)
            ms[T] = 1e3 * min(times)
    print("| rows | ms | vs 1 row |\n|---:|---:|---:|")
    for T, v in ms.items():
        print(f"| {T} | {v:.1f} | {v / ms[1]:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "threads": 1, "min_ms": ms}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
