"""The wait for an answer's first token with and without re-reading, side by side (issue 55).

The same prefilled book as `benchmarks.quality` (Persuasion with its pass keys, the app's system
message; `--snapshots` shares its prefill), then each factual question asked twice in a row, once
plainly and once re-reading its sources, in alternating order, so a change in the machine's load
falls on both alike. Each wait is what a reader sees: the sources scored over the whole book, the
question (and its passages) prefilled, the first check. One token is generated; the chat is
cleared after each question.

    python -m benchmarks.first_token --context 8192 --snapshots /tmp/q55snap
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

from app.session import BookSession
from benchmarks.cli import add_common_args
from benchmarks.quality import BOOK, NEEDLES, PROMPTS, book_session, context, open_book, questions
from engine.config import EngineConfig, SamplingConfig
from engine.session import Engine
from tools.chat import ChatFormat


def first_token_s(book: BookSession, question: str, reread: bool) -> tuple[float, int]:
    """(seconds to the first token, tokens of the prompt the model read)."""
    started = time.perf_counter()
    for _ in book.ask(question, SamplingConfig(max_new_tokens=1), reread=reread):
        break
    waited = time.perf_counter() - started
    turn = book.turns[-1]
    book.clear()
    return waited, turn.answer_start - turn.start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_token", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "first_token")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--questions", type=int, default=10, help="the first N factual questions")
    p.add_argument("--snapshots", type=Path, default=None, help="as benchmarks.quality's")
    p.add_argument("--passages-first", action="store_true", help="re-read with the passages before the question")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(target=args.model))
    rng = random.Random(0)  # the pass keys benchmarks.quality draws first: its snapshot serves
    keys = {door: str(rng.randint(10000, 99999)) for door, _ in NEEDLES}
    chat = ChatFormat(engine.tokenizer, system=PROMPTS["current"].system, end_ids=engine.end_ids)
    book_ids = engine.tokenizer(BOOK.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    doc_ids, text = context(chat, book_ids, args.context, keys)
    session = open_book(engine, args.model, doc_ids, args.snapshots)
    book = book_session(engine, chat, text, doc_ids, session)
    book.passages_first = args.passages_first
    asked = [q for kind, q, _ in questions(text, keys) if kind in ("fact", "held-out")][:args.questions]
    first_token_s(book, asked[0], False)  # warm-up: the neutral question's scoring is cached per book
    rows = []
    for i, question in enumerate(asked):
        order = (False, True) if i % 2 == 0 else (True, False)
        row = {"question": question}
        for reread in order:
            seconds, n_prompt = first_token_s(book, question, reread)
            row["reread" if reread else "plain"] = {"s": round(seconds, 2), "prompt_tokens": n_prompt}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {how: {"median_s": statistics.median(r[how]["s"] for r in rows),
                     "mean_prompt_tokens": statistics.mean(r[how]["prompt_tokens"] for r in rows)}
               for how in ("plain", "reread")}
    summary["ratio"] = round(summary["reread"]["median_s"] / summary["plain"]["median_s"], 2)
    report = {"context": len(doc_ids), "model": args.model, "threads": args.threads,
              "passages_first": args.passages_first, "load_avg_at_start": psutil.getloadavg(),
              "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(f"{len(doc_ids):,} tokens, {len(rows)} questions: first token "
          f"{summary['plain']['median_s']:.2f} s plainly, {summary['reread']['median_s']:.2f} s re-reading "
          f"(median; x{summary['ratio']}); prompt {summary['plain']['mean_prompt_tokens']:.0f} vs "
          f"{summary['reread']['mean_prompt_tokens']:.0f} tokens")
    return report


if __name__ == "__main__":
    main()
