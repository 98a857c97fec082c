"""Several readers at once (issue 6): total throughput and per-user TBT, batched vs sequential.

One process, one run. For each context length, `--sessions` (up to the largest count) documents are
cut from different parts of the sample book, wrapped as the app wraps them, and prefilled ONCE each
(then saved; every run restores copies). For each level stack:
- alone: every session answers its question by itself, one after another (the sequential
  engine: what a queue of users gets today). For n users, "sequential" is the first n of these.
- batched: n sessions answer at once through engine/batch.py, driven round by round here.
Throughput = answer tokens of all n sessions / wall time from the first question to the last
token. Per-user TBT = a session's decode time per token (first emission excluded), averaged over
the n sessions; in sequential mode each user waits for the ones before, which this figure omits
(it is the lone user's TBT). Greedy answers are checked token for token against the lone runs.

    python -m benchmarks.batch --contexts 4096,8192 --sessions 1,2,4,8
    python -m benchmarks.batch --quick          # CI smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch

from benchmarks.cli import add_common_args
from benchmarks.longctx import BOOK, machine, timing
from engine.batch import Batcher
from engine.config import EngineConfig, SamplingConfig
from engine.session import Engine
from tools.chat import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("Summarize the story so far in one paragraph.",
             "Who are the main characters so far, and how are they related?",
             "Describe the setting of this part of the book.",
             "What happens in the last scene of this passage?")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "batch")
    p.add_argument("--contexts", default="4096,8192", help="comma-separated token counts")
    p.add_argument("--sessions", default="1,2,4,8", help="comma-separated concurrent session counts")
    p.add_argument("--stacks", default="plain,ngram>full,ngram>retrieval>full")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quick", action="store_true", help="CI smoke test: SmolLM2, 512-token contexts, 8 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.contexts, args.sessions, args.new_tokens = "smollm2-135m", "512", "1,2", 8
        args.stacks = "plain,ngram>retrieval>full"
    args.contexts = [int(n) for n in args.contexts.split(",")]
    args.sessions = sorted(int(n) for n in args.sessions.split(","))
    args.stacks = args.stacks.split(",")
    return args


def documents(chat: ChatFormat, book_ids: list[int], n_ctx: int, n_docs: int) -> list[list[int]]:
    """`n_docs` documents of about `n_ctx` tokens from evenly spaced parts of the book."""
    overhead = len(chat.document_ids("x")) - 1
    n_text = n_ctx - overhead
    stride = max(1, (len(book_ids) - n_text) // max(1, n_docs - 1)) if len(book_ids) > n_text else 0
    docs = []
    for i in range(n_docs):
        start = min(i * stride, max(0, len(book_ids) - n_text))
        docs.append(chat.document_ids(chat.tokenizer.decode(book_ids[start:start + n_text])))
    return docs


def run_alone(engine, path, levels, q_ids, sampling, stop_ids) -> dict:
    session = engine.restore(path)
    session.set_levels(levels)
    events, tokens = [], []
    t0 = time.perf_counter()
    for event in session.ask(q_ids, sampling, stop_ids=stop_ids):
        events.append((time.perf_counter(), len(event.tokens)))
        tokens += event.tokens
    return {**timing(t0, events), "tokens": tokens, "t_start": t0}


def run_batched(engine, paths, levels, q_ids, sampling, stop_ids) -> dict:
    sessions = [engine.restore(p) for p in paths]
    for s in sessions:
        s.set_levels(levels)
    batcher = Batcher(max_active=len(sessions), background=False)
    t0 = time.perf_counter()
    jobs = [batcher.submit(s.answer_steps(q, sampling, stop_ids=stop_ids)) for s, q in zip(sessions, q_ids)]
    events = [[] for _ in jobs]
    tokens = [[] for _ in jobs]
    while batcher.active or batcher.waiting:
        batcher.round()
        t = time.perf_counter()
        for i, job in enumerate(jobs):
            while not job.out.empty():
                item = job.out.get_nowait()
                if isinstance(item, Exception):
                    raise item
                if hasattr(item, "tokens"):
                    events[i].append((t, len(item.tokens)))
                    tokens[i] += item.tokens
    t_end = time.perf_counter()
    users = [{**timing(t0, e), "tokens": tok} for e, tok in zip(events, tokens)]
    return {"users": users, "wall_s": t_end - t0, "n_rounds": batcher.n_rounds,
            "mean_segments_per_forward": batcher.n_segments / max(batcher.n_forwards, 1)}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def run_context(args, engine, chat, book_ids, n_ctx, tmp: Path, report, save):
    n_max = max(args.sessions)
    docs = documents(chat, book_ids, n_ctx, n_max)
    paths, prefill_s = [], 0.0
    for i, doc in enumerate(docs):
        t = time.perf_counter()
        session = engine.open(doc)
        prefill_s += time.perf_counter() - t
        paths.append(tmp / f"ctx{n_ctx}-doc{i}.pt")
        session.save(paths[-1])
        del session
    q_ids = [chat.question_ids(QUESTIONS[i % len(QUESTIONS)], True, False) for i in range(n_max)]
    stop_ids = chat.stop_ids
    sampling = SamplingConfig(temperature=args.temperature, top_p=0.9 if args.temperature else 1.0,
                              max_new_tokens=args.new_tokens)
    ctx = {"n_ctx": n_ctx, "doc_tokens": [len(d) for d in docs],
           "prefill_tokens_per_s": sum(map(len, docs)) / prefill_s, "stacks": []}
    report["contexts"].append(ctx)
    log(f"context {n_ctx}: {n_max} documents prefilled at {ctx['prefill_tokens_per_s']:.0f} tokens/s")
    for levels in args.stacks:
        lone = [run_alone(engine, p, levels, q, replace(sampling, seed=i), stop_ids)
                for i, (p, q) in enumerate(zip(paths, q_ids))]
        row = {"levels": levels, "alone": [{k: v for k, v in r.items() if k != "t_start"} for r in lone], "runs": []}
        ctx["stacks"].append(row)
        for n in args.sessions:
            b = run_batched(engine, paths[:n], levels, q_ids[:n],
                            sampling, stop_ids) if n > 1 else None
            seq_tokens = sum(r["n_tokens"] for r in lone[:n])
            seq_wall = sum(r["total_s"] for r in lone[:n])
            run = {"n_sessions": n, "sequential_tokens_per_s": seq_tokens / seq_wall,
                   "lone_tbt_ms": mean(r["tbt_ms_mean"] for r in lone[:n])}
            if b is not None:
                b_tokens = sum(u["n_tokens"] for u in b["users"])
                run.update({"batched_tokens_per_s": b_tokens / b["wall_s"],
                            "batched_user_tbt_ms": mean(u["tbt_ms_mean"] for u in b["users"]),
                            "mean_segments_per_forward": b["mean_segments_per_forward"],
                            "n_rounds": b["n_rounds"], "users": b["users"]})
                run["throughput_ratio"] = run["batched_tokens_per_s"] / run["sequential_tokens_per_s"]
                run["tbt_ratio"] = run["batched_user_tbt_ms"] / run["lone_tbt_ms"]
                if not args.temperature:
                    run["greedy_equal"] = all(u["tokens"] == r["tokens"] for u, r in zip(b["users"], lone))
            row["runs"].append(run)
            log(one_line(n_ctx, levels, run))
            save()


def one_line(n_ctx, levels, r) -> str:
    base = (f"{n_ctx:>6} {levels:<22} n={r['n_sessions']}  sequential {r['sequential_tokens_per_s']:6.2f} tok/s"
            f"  lone TBT {r['lone_tbt_ms']:7.1f} ms")
    if "batched_tokens_per_s" not in r:
        return base
    return (base + f"  | batched {r['batched_tokens_per_s']:6.2f} tok/s ({r['throughput_ratio']:.2f}x)"
            f"  user TBT {r['batched_user_tbt_ms']:7.1f} ms ({r['tbt_ratio']:.2f}x)"
            f"  seg/fwd {r['mean_segments_per_forward']:.1f}  equal {r.get('greedy_equal', '-')}")


def markdown(report) -> str:
    lines = ["| context | stack | users | sequential tok/s | batched tok/s | throughput × | lone TBT ms | "
             "batched user TBT ms | TBT × | segments/forward | greedy = alone |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for ctx in report["contexts"]:
        for row in ctx["stacks"]:
            for r in row["runs"]:
                def f(key, spec, r=r):
                    return format(r[key], spec) if r.get(key) is not None else "–"
                lines.append(f"| {ctx['n_ctx']:,} | `{row['levels']}` | {r['n_sessions']} | "
                             f"{f('sequential_tokens_per_s', '.2f')} | {f('batched_tokens_per_s', '.2f')} | "
                             f"{f('throughput_ratio', '.2f')} | {f('lone_tbt_ms', '.1f')} | "
                             f"{f('batched_user_tbt_ms', '.1f')} | {f('tbt_ratio', '.2f')} | "
                             f"{f('mean_segments_per_forward', '.1f')} | {r.get('greedy_equal', '–')} |")
    return "\n".join(lines) + "\n"


def log(message: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(target=args.model, levels="ngram>retrieval>full", dtype=args.dtype))
    chat = ChatFormat(engine.tokenizer)
    book_ids = chat._user_text(BOOK.read_text(encoding="utf-8-sig").strip())
    report = {"command": "python -m benchmarks.batch " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
              "settings": {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                           "new_tokens": args.new_tokens, "temperature": args.temperature,
                           "questions": QUESTIONS}, "contexts": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))

    with tempfile.TemporaryDirectory() as tmp:
        for n_ctx in args.contexts:
            run_context(args, engine, chat, book_ids, n_ctx, Path(tmp), report, save)
    report["max_rss_mib"] = psutil.Process().memory_info().rss / 2**20
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
