"""Command line: `python -m tools generate --file book.txt --question "..." [--levels ...]`,
`python -m tools selftest`. A caller of the engine, as the OpenAI-compatible API is (`python -m api`).

Reads a text file as the document, prefills it once, answers each --question in turn (a chat),
streams the answer to the terminal and prints per-level statistics after each answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine import parallel
from engine.config import EngineError
from engine.session import Engine, Stats
from tools.chat import ChatFormat
from tools.flags import add_engine_args, add_sampling_args, apply_threads, engine_config, sampling_from_args
from tools.models import assemble_missing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer questions about a text file")
    add_engine_args(g)
    g.add_argument("--file", required=True, help="the document (UTF-8 text)")
    g.add_argument("--max-doc-tokens", type=int, help="keep only the first N tokens")
    g.add_argument("--question", action="append", required=True, help="repeat for a multi-turn chat")
    add_sampling_args(g)
    t = sub.add_parser("selftest", help="compare each GPU path with its reference here (a few minutes)")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    t.add_argument("--out", default="bookchat-selftest.json", help="the report to attach to a bug report")
    t.add_argument("--only", action="append", help="run only this check (repeat)")
    t.add_argument("--small", action="store_true", help="the real model at short lengths (a CPU dry run, seconds)")
    return p.parse_args(argv)


def format_stats(stats: Stats) -> str:
    lines = [f"{stats.n_tokens} tokens, TTFT {stats.ttft_s:.2f} s, TBT {stats.tbt_ms_mean:.1f} ms "
             f"({stats.tokens_per_s:.1f} tokens/s)"]
    for s in stats.levels:
        lines.append(f"  {s.name:>9}: {s.n_checks} checks, acceptance {s.acceptance:.2f} "
                     f"({s.n_accepted}/{s.n_tested}), {s.tokens_per_check:.2f} tokens/check, {s.time_s:.2f} s")
    return "\n".join(lines)


def selftest(args: argparse.Namespace) -> int:
    import json

    from engine.device import pick_device
    from tools import selftest

    device = pick_device(args.device)
    print(f"self-test on {device} (a tiny random model; nothing is downloaded) …", file=sys.stderr)
    sizes = selftest.Sizes.small() if args.small else selftest.Sizes()
    results = selftest.run_checks(device, args.only, sizes)
    print("\n".join(selftest.table(results)))
    report = selftest.report(results, device)
    Path(args.out).write_text(json.dumps(report, indent=2), encoding="utf-8")
    skipped = [r.name for r in results if r.status == "skipped"]
    if skipped:
        print(f"not checked here: {', '.join(skipped)}", file=sys.stderr)
    print(f"report written to {args.out}", file=sys.stderr)
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "selftest":
        return selftest(args)
    apply_threads(args)
    try:
        config = engine_config(args)
        assemble_missing([config.target, config.draft], lambda message: print(message, file=sys.stderr))
        engine = Engine.load(config)
        sampling = sampling_from_args(args, engine.default_sampling)
        chat = ChatFormat(engine.tokenizer, end_ids=engine.end_ids)
        doc_ids = chat.document_ids(Path(args.file).read_text(encoding="utf-8-sig"))[: args.max_doc_tokens]
        t0 = time.perf_counter()
        session = engine.open(doc_ids, on_progress=lambda done, total: print(
            f"\rprefill {done:,}/{total:,} tokens", end="", file=sys.stderr, flush=True))
        print(f"\nprefilled {len(doc_ids):,} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        ended = False
        for i, question in enumerate(args.question):
            q_ids = chat.question_ids(question, is_first=i == 0, previous_answer_ended=ended)
            answer: list[int] = []
            printed = ""
            for event in session.ask(q_ids, sampling, stop_ids=chat.stop_ids):
                answer += event.tokens
                text = engine.tokenizer.decode(answer, skip_special_tokens=True)
                print(text[len(printed):], end="", flush=True)
                printed = text
            ended = event.finish_reason == "stop"
            print("\n" + format_stats(event.stats), file=sys.stderr)
        if isinstance(engine, parallel.Leader):  # stop the other ranks (torchrun waits for them)
            engine.close()
    except (EngineError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
