"""What a sampled token costs outside the model (issue 57 item 8): `sampling_probs` before its
top-k path (the cut as a mask over the whole vocabulary, then softmax, top-p and min-p over all
of it) and now (the same transforms on the k largest, ties at the cut counted), side by side.

The model's own settings (SamplingConfig: T 0.7, top-k 20, top-p 0.8, repetition penalty 1.05,
min-p 0) on LM-like logits (`benchmarks.kernels`'s: a long bf16-rounded tail under a few strong
candidates), one row (a plain step) and five (a check); the penalties are applied once, before,
and timed beside the two as the cost both share. In one process, each `--threads` in turn, the
two alternating (which goes first alternates too), `--repeats` times: median ms per call.

    python -m benchmarks.sampling_cost --threads 1 2 --repeats 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import psutil
import torch

from benchmarks.cli import add_common_args
from engine.config import SamplingConfig
from engine.sampling import penalize, sampling_probs

DEFAULTS = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


def before(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`sampling_probs` as it was before its top-k path, for top_k > 0."""
    logits = logits.double() / temperature
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    # then softmax, top-p and min-p over the whole vocabulary: today's path with top-k off (T 1 divides exactly)
    return sampling_probs(logits.masked_fill(logits < kth, float("-inf")), 1.0, 0, top_p, min_p)


def lm_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).bfloat16().float()
    logits[:, :64] += 12 * torch.rand(rows, 64, generator=gen)
    return logits


def timed_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def measure(logits: torch.Tensor, sampling: SamplingConfig, repeats: int) -> dict:
    """Median ms of the penalties, then `before` and `sampling_probs` alternating, on the same rows."""
    histories = [torch.randint(logits.shape[-1], (200,), generator=torch.Generator().manual_seed(i)).tolist()
                 for i in range(logits.shape[0])]
    args = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    penalized = penalize(logits, histories, sampling.repetition_penalty)
    fns = {"before_ms": lambda: before(penalized, *args), "after_ms": lambda: sampling_probs(penalized, *args)}
    want, got = fns["before_ms"](), fns["after_ms"]()  # also the warm-up
    times: dict[str, list[float]] = {"penalize_ms": [], "before_ms": [], "after_ms": []}
    for i in range(repeats):
        times["penalize_ms"].append(timed_ms(lambda: penalize(logits, histories, sampling.repetition_penalty)))
        for name in (("before_ms", "after_ms") if i % 2 == 0 else ("after_ms", "before_ms")):
            times[name].append(timed_ms(fns[name]))
    row = {name: round(statistics.median(t), 4) for name, t in times.items()}
    row["same_kept_set"] = bool(torch.equal(got > 0, want > 0))
    row["max_abs_diff"] = float((got - want).abs().max())
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampling_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "sampling_cost", model=False, threads=False)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch's CPU threads, each in turn")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5], help="logits rows per call")
    p.add_argument("--vocab", type=int, default=151_936, help="the default model's (Qwen2.5)")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    gen, threads_before, rows = torch.Generator().manual_seed(0), torch.get_num_threads(), []
    logits = {n: lm_logits(n, args.vocab, gen) for n in args.rows}
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for n in args.rows:
                rows.append({"threads": threads, "rows": n, **measure(logits[n], DEFAULTS, args.repeats)})
    finally:
        torch.set_num_threads(threads_before)
    report = {"vocab": args.vocab, "repeats": args.repeats, "sampling": DEFAULTS.__dict__,
              "load_avg_at_end": psutil.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(f"V = {args.vocab:,}, median of {args.repeats}, load average {report['load_avg_at_end'][0]:.2f}")
    print("threads  rows  penalize ms  before ms  after ms  before/after  same kept set")
    for r in rows:
        print(f"{r['threads']:>7}  {r['rows']:>4}  {r['penalize_ms']:>11.3f}  {r['before_ms']:>9.3f}  "
              f"{r['after_ms']:>8.3f}  {r['before_ms'] / r['after_ms']:>12.1f}  {r['same_kept_set']}")
    return report


if __name__ == "__main__":
    main()
