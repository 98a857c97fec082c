"""The same answers from two checkouts of the engine, interleaved: is a change within noise?

A refactoring must not slow decoding (issue 26), and a shared host moves more than that between runs, so
the old and the new code are measured side by side, alternating, each round a fresh process per
checkout (`--trees OLD,NEW`, e.g. a `git worktree` of the old commit). Every process restores
the same prefill snapshot (made once, by the first checkout, with `Session.save`), then answers
the benchmark's question greedily with each `--stacks` entry (`peers.answer`: decode ms/token,
first event excluded). The table gives each checkout's median over the rounds, the ratio new/old,
and whether both gave the same tokens.

    git worktree add /tmp/old HEAD~3
    python -m benchmarks.ab --trees /tmp/old,. --context 8192 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.cli import add_common_args

ROOT = Path(__file__).resolve().parent.parent


def child(args) -> None:
    """One checkout's answers (its own `engine` first on sys.path), as JSON on stdout."""
    here = Path(__file__).resolve().parent  # run as a file: benchmarks/ would shadow packages (kernels)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch

    from benchmarks.longctx import BOOK, book_doc_ids
    from benchmarks.peers import QUESTION, answer
    from engine.config import EngineConfig
    from engine.session import Engine
    try:
        from tools.chat import ChatFormat
    except ImportError:  # a checkout from before the chat prompts moved out of engine/ (issue 57)
        from engine.chat import ChatFormat

    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(target=args.model))
    chat = ChatFormat(engine.tokenizer, end_ids=engine.end_ids)
    book_ids = chat._user_text(BOOK.read_text(encoding="utf-8-sig").strip())  # as benchmarks/peers.py
    doc_ids = book_doc_ids(chat, book_ids, args.context)
    if args.snapshot.exists():
        session = engine.restore(args.snapshot)
        if session.tokens != doc_ids:  # another context, model or book: not this run's prefill
            sys.exit(f"{args.snapshot} holds another prefill than --model {args.model} --context {args.context}")
    else:
        session = engine.open(doc_ids)
        session.save(args.snapshot)
    q_ids = chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    runs = {stack: answer(engine, session, q_ids, session.length, args.new_tokens, stack, stop_ids=chat.stop_ids)
            for stack in args.stacks.split(",")}
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process: load, restore, answers
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    anon_gb = int(status.get("RssAnon", "0 kB").split()[0]) / 2**20  # its own memory now, without mapped files
    print(json.dumps({"levels_auto": engine.config.levels, "runs": runs, "peak_rss_gb": peak_rss_gb,
                      "anon_gb": anon_gb}))


def table(trees: list[str], results: dict) -> str:
    stacks = list(results[trees[0]][0]["runs"])
    rows = [f"| stack | {trees[0]} ms/token | {trees[1]} ms/token | new/old time | same tokens |",
            "|---|---:|---:|---:|---|"]
    for stack in stacks:
        ms = [statistics.median(r["runs"][stack]["ms_per_token"] for r in results[t]) for t in trees]
        same = all(r["runs"][stack]["tokens"] == results[trees[0]][0]["runs"][stack]["tokens"]
                   for t in trees for r in results[t])
        rows.append(f"| {stack} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.3f} | {same} |")
    rss = [statistics.median(r.get("peak_rss_gb", float("nan")) for r in results[t]) for t in trees]
    rows.append(f"| peak RSS, GB | {rss[0]:.2f} | {rss[1]:.2f} | {rss[1] / rss[0]:.3f} | |")
    anon = [statistics.median(r.get("anon_gb", float("nan")) for r in results[t]) for t in trees]
    rows.append(f"| anonymous memory at the end, GB | {anon[0]:.2f} | {anon[1]:.2f} | {anon[1] / anon[0]:.3f} | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", default="", help="OLD,NEW: two checkouts of this repository")
    add_common_args(p, "ab")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--stacks", default="plain,retrieval>full", help="retrieval>full: the CPU default")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--snapshot", type=Path, default=None, help="default: /tmp/ab_MODEL_CONTEXT.pt")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.snapshot = args.snapshot or Path(f"/tmp/ab_{args.model}_{args.context}.pt")
    if args.child:
        child(args)
        return 0
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    assert len(trees) == 2, "--trees OLD,NEW"
    results: dict[str, list] = {t: [] for t in trees}
    for i in range(args.rounds):
        for tree in trees if i % 2 == 0 else trees[::-1]:  # alternate who goes first
            load = os.getloadavg()[0]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model,
                   "--context", str(args.context), "--stacks", args.stacks, "--new-tokens", str(args.new_tokens),
                   "--threads", str(args.threads), "--snapshot", str(args.snapshot)]
            env = os.environ | {"PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{tree}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            result = json.loads(done.stdout.strip().splitlines()[-1]) | {"load_before": load}
            results[tree].append(result)
            print(f"round {i} {tree}: " + ", ".join(f"{s} {r['ms_per_token']:.1f} ms" for s, r in
                                                   result["runs"].items()) + f" (load {load:.1f})", file=sys.stderr)
    print(table(trees, results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
