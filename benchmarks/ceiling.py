"""What the hierarchy can pay on this machine: the costs the draft-length tuners weigh, measured
over random caches, and the best speed-up over plain decoding they allow at each acceptance.

For each context S: the top level's step (one token over S keys, the exact linears) and its
checks of 1 + g drafted tokens (a chain); for each retrieval budget B: a middle-level step (the
target's int8-activation view, `quant.quick_view`, over B keys; the exact weights when the model
has no quick path). Then, as `GammaTuner` models it, with per-token acceptance a and g drafts per
check: tokens per check (1 - a^(g+1)) / (1 - a), time g * middle + check(g); the table gives the
best g's speed-up over the top step at a = 0.7, 0.8, 0.9 and 1.0 (1.0: a ceiling no text reaches).
Costs do not depend on the cache's values, so no prefill is needed: 112K tokens take seconds.
A context's step and checks are timed interleaved after a warm-up, best of `--repeats`.

    python -m benchmarks.ceiling --model qwen2.5-coder-1.5b --contexts 32000,112000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from benchmarks.cli import add_common_args
from benchmarks.kernels import engine_model, ours_step, random_full_cache, side_by_side
from engine import quant
from engine.device import pick_dtype

ROOT = Path(__file__).resolve().parent.parent
GAMMAS, ACCEPTANCES = (1, 2, 4), (0.7, 0.8, 0.9, 1.0)


def best_ms(fns: dict, repeats: int) -> dict:
    """The fastest call of each function, interleaved after a warm-up (`kernels.side_by_side`)."""
    return {name: r["min_ms"] for name, r in side_by_side(fns, repeats).items()}


def speedup(top_ms: float, check_ms: dict[int, float], middle_ms: float, a: float) -> tuple[float, int]:
    """(best speed-up over the top step, its g) at acceptance a: GammaTuner's expected rate."""
    def rate(g: int) -> float:
        tokens = g + 1 if a >= 1 else (1 - a ** (g + 1)) / (1 - a)
        return tokens / (g * middle_ms + check_ms[g])
    g = max(check_ms, key=rate)
    return rate(g) * top_ms, g


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "ceiling")
    p.add_argument("--contexts", default="8192,32000,112000")
    p.add_argument("--budgets", default="1024,4096", help="retrieval budgets of the middle level (keys)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = pick_dtype("auto", torch.device("cpu"))
    model, _ = engine_model(args.model, dtype)
    middle = quant.quick_view(model)  # Engine.drafting: the levels below the top
    cfg = model.config
    report = {"command": "python -m benchmarks.ceiling " + " ".join(sys.argv[1:] if argv is None else argv),
              "dtype": str(dtype).removeprefix("torch."), "threads": args.threads,
              "load_avg_at_start": list(os.getloadavg()), "middle_ms": {}, "contexts": {}}
    for B in (int(b) for b in args.budgets.split(",")):
        report["middle_ms"][B] = best_ms({B: ours_step(middle, random_full_cache(cfg, B, B + 1, dtype), B)},
                                         args.repeats)[B]
    rows = []
    for S in (int(s) for s in args.contexts.split(",")):
        cache = random_full_cache(cfg, S, S + max(GAMMAS) + 1, dtype)
        checks = best_ms({g: ours_step(model, cache, S, g) for g in (0, *GAMMAS)},
                         args.repeats)
        top = checks.pop(0)
        del cache
        report["contexts"][S] = {"top_ms": top, "check_ms": checks}
        for B, m in report["middle_ms"].items():
            ups = {a: speedup(top, checks, m, a) for a in ACCEPTANCES}
            report["contexts"][S][f"speedup_budget_{B}"] = {str(a): up for a, up in ups.items()}
            rows.append(f"| {S:,} | {top:.1f} | " + " | ".join(f"{checks[g] / top:.2f}" for g in GAMMAS)
                        + f" | {B:,}: {m:.1f} ({m / top:.2f}) | "
                        + " | ".join(f"{up:.2f}× (g={g})" for up, g in ups.values()) + " |")
    head = ("| context | top step ms | " + " | ".join(f"check 1+{g} (steps)" for g in GAMMAS)
            + " | middle step ms (steps) | " + " | ".join(f"a = {a}" for a in ACCEPTANCES) + " |")
    table = "\n".join([head, "|" + "---|" * (head.count("|") - 1), *rows])
    print(table)
    report["table"] = table
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
