"""The outline of whole books (issue 56): time, batching gain, level stacks, and summary quality.

For each book (cut into parts as the app cuts it, app/outline.py; `--chapters N`: its first N):
1. the app's outline: `OutlineWorker` with the engine's configured stack and `--batch` summaries
   per round, then the book summary made from those chapter summaries; total time, time per
   chapter, and the summaries themselves;
2. decoding alone against batched, for each of `--stacks`: every chapter's prompt prefilled once
   (all but its last token), then the answers decoded from copies of those prefills, one chapter
   at a time and all in one `Batcher` (the batched runs of all stacks interleaved, `--rounds`
   times: the best round counts); answer tokens per second of the wall time (whether a batch's
   answers are the lone ones token for token is reported: sampled drafts may differ);
3. quality of each chapter summary, automatically: the chapter's most frequent character names
   (capitalized words seen mid-sentence at least 3 times, less titles and the like) the summary
   mentions, names in the summary the chapter never has (made up), and loops (a 4-word phrase more
   than 3 times, as benchmarks/quality.py counts them).

    python -m benchmarks.outline --books assets/persuasion.txt,PATH/austen_prideprejudice.txt --chapters 4
    python -m benchmarks.outline --model qwen2.5-coder-0.5b --chapters 0      # whole novels
    python -m benchmarks.outline --quick                                      # CI smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from app.documents import load_document
from app.outline import BOOK_PROMPT, CHAPTER_PROMPT, Prompter, SummaryCache, new_outline
from app.outline_worker import OutlineWorker
from benchmarks.cli import add_common_args
from benchmarks.longctx import machine
from benchmarks.quality import loops
from engine.batch import Batcher
from engine.config import EngineConfig
from engine.session import Engine
from tools.chat import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
# capitalized words that are not characters' names: titles, days, months, sentence words
NOT_NAMES = frozenset((
    "I", "Mr", "Mrs", "Miss", "Lady", "Sir", "Lord", "Captain", "Colonel", "Admiral", "Dr", "Madam", "God",
    "Heaven", "Chapter", "English", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December", "Christmas", "Michaelmas", "Oh", "Yes", "No", "The", "A", "An", "He", "She", "They", "It", "His",
    "Her", "This", "That", "Summary", "Book", "Part",
))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.outline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", default=str(ROOT / "assets" / "persuasion.txt"), help="comma-separated files")
    add_common_args(p, "outline")
    p.add_argument("--chapters", type=int, default=4, help="the first N parts of each book (0: all)")
    p.add_argument("--batch", type=int, default=4, help="summaries per round in the app's outline")
    p.add_argument("--stacks", default="plain,retrieval>full,ngram>full,ngram>retrieval>full",
                   help="compared in step 2")
    p.add_argument("--compare-chapters", type=int, default=4, help="chapters of each book in step 2 (0: none)")
    p.add_argument("--rounds", type=int, default=2, help="step 2's batched runs of every stack, interleaved")
    p.add_argument("--dtype", default="auto", help="auto (the engine's choice for this machine), bfloat16, float32")
    p.add_argument("--quick", action="store_true", help="CI smoke test: SmolLM2, 2 chapters, short answers")
    args = p.parse_args(argv)
    args.summary_tokens = 256
    if args.quick:
        args.model, args.chapters, args.compare_chapters, args.summary_tokens = "smollm2-135m", 2, 2, 16
        args.stacks, args.out, args.rounds = "plain,ngram>full", Path("/tmp/outline-quick.json"), 1
    args.books, args.stacks = args.books.split(","), args.stacks.split(",")
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


TITLES = frozenset(("Mr", "Mrs", "Miss", "Lady", "Sir", "Lord", "Captain", "Colonel", "Admiral", "Dr"))


def names(text: str) -> Counter:
    """Capitalized words after a lower-case word, a comma or a title ("Mr. Bennet"), not after a
    sentence's end: names, mostly (places too: Kellynch, Bath)."""
    found, tokens = Counter(), text.split()
    for before, token in zip(tokens, tokens[1:]):
        word = re.match(r"[\"'(]*([A-Z][a-z]+)", token)
        if word is None or word[1] in NOT_NAMES:
            continue
        is_title = before.rstrip(".") in TITLES
        if before[-1:].islower() or before[-1:] in (",", ";") or is_title:
            found[word[1]] += 1
    return found


def quality(chapter: str, summary: str, prompt: str, top: int = 5) -> dict:
    """Of the chapter's `top` most frequent names (3 times at least), those the summary has; the
    summary's names the chapter never has (nor the prompt: "the story from beginning to end")."""
    frequent = [w for w, n in names(chapter).most_common(top) if n >= 3]
    words = set(re.findall(r"[A-Za-z]+", chapter)) | {w.capitalize() for w in re.findall(r"[a-z]+", prompt.lower())}
    made_up = sorted({w for w in names(summary) if w not in words})
    return {"names": frequent, "n_recalled": sum(w in summary for w in frequent), "made_up": made_up,
            "loops": loops(summary)}


def app_outline(engine: Engine, prompter: Prompter, document, args) -> tuple[dict, list[str]]:
    """Step 1: the app's outline of the first `args.chapters` parts, timed; and the parts' texts."""
    worker = OutlineWorker(engine, prompter, SummaryCache(None), max_batch=args.batch)
    outline = new_outline(document, prompter, "bench", worker.sampling_id, engine.max_context, worker.cache,
                          summary_tokens=args.summary_tokens)
    rows = [t for t in outline.rows if t.state != "skipped"]
    outline.rows = rows[:args.chapters] if args.chapters else rows
    worker.start(outline, background=False)
    t0, n_done, per_chapter = time.perf_counter(), 0, []
    while worker.advance() != "idle":
        if (n := sum(t.state == "done" for t in outline.rows)) > n_done:
            n_done = n
            log(f"  {n}/{len(outline.rows)} chapters · {time.perf_counter() - t0:.0f} s")
    total_s = time.perf_counter() - t0
    for t in outline.rows:
        per_chapter.append({"label": t.label, "n_prompt_tokens": t.n_prompt_tokens,
                            "n_answer_tokens": t.n_answer_tokens, "summary": t.summary,
                            **quality(t.text, t.summary or "", CHAPTER_PROMPT)})
    book = outline.passes[-1][0] if outline.passes else None
    return {"n_chapters": len(outline.rows), "total_s": round(total_s, 1),
            "s_per_chapter": round(total_s / max(1, len(outline.rows)), 1), "batch": args.batch,
            "levels": engine.config.levels, "n_rounds": worker.n_rounds,
            "mean_batch": round(worker.batcher.n_segments / max(1, worker.batcher.n_forwards), 2),
            "n_passes": len(outline.passes), "book_summary": book and book.summary,
            "book_summary_quality": book and quality(document.text, book.summary or "", BOOK_PROMPT),
            "chapters": per_chapter}, [t.text for t in outline.rows]


def decode(engine: Engine, states, prompts, stack: str, batched: bool, sampling, stop_ids) -> tuple[float, list]:
    """(seconds, tokens) of the answers to `prompts` from copies of their prefills `states`, in
    `stack`: one chapter at a time, or all in one `Batcher`."""
    sessions = [engine.restore_state(state) for state in states]
    for s in sessions:
        s.set_levels(stack)
    t0 = time.perf_counter()
    if not batched:
        tokens = [[t for e in s.ask(ids[-1:], sampling, stop_ids=stop_ids) for t in e.tokens]
                  for s, ids in zip(sessions, prompts)]
        return time.perf_counter() - t0, tokens
    batcher = Batcher(max_active=len(sessions), background=False)
    streams = [batcher.ask(s, ids[-1:], sampling, stop_ids=stop_ids) for s, ids in zip(sessions, prompts)]
    while batcher.active or batcher.waiting:
        batcher.round()
    return time.perf_counter() - t0, [[t for e in stream for t in e.tokens] for stream in streams]


def compare(engine: Engine, prompter: Prompter, texts: list[str], args, sampling) -> dict:
    """Step 2: answer tokens/s decoding one chapter at a time against all in one batch, per stack;
    the batched runs (the app's way) of all stacks interleaved, `args.rounds` times, so that a
    change of the machine's load falls on every stack alike."""
    prompts = [prompter.prompt_ids(text, CHAPTER_PROMPT) for text in texts]
    t0 = time.perf_counter()
    states = [engine.open(ids[:-1]).state() for ids in prompts]
    log(f"  prefilled {len(prompts)} prompts ({sum(map(len, prompts)):,} tokens) in {time.perf_counter() - t0:.0f} s")
    sampling = replace(sampling, max_new_tokens=args.summary_tokens)
    runs = {stack: {"alone": [], "batched": []} for stack in args.stacks}
    for mode in ["alone"] + ["batched"] * args.rounds:
        for stack in args.stacks:
            seconds, tokens = decode(engine, states, prompts, stack, mode == "batched", sampling, prompter.stop_ids)
            n = sum(map(len, tokens))
            runs[stack][mode].append({"seconds": round(seconds, 1), "n_tokens": n,
                                      "tokens_per_s": round(n / seconds, 2), "tokens": tokens})
            log(f"  {stack:24s} {mode:8s} {n} tokens in {seconds:.1f} s: {n / seconds:.2f} tokens/s")
    out = {}
    for stack, run in runs.items():
        alone, batched = run["alone"][0], max(run["batched"], key=lambda r: r["tokens_per_s"])
        out[stack] = {"same_tokens": alone.pop("tokens") == batched["tokens"], "alone": alone,
                      "batched": {k: v for k, v in batched.items() if k != "tokens"},
                      "batched_tokens_per_s_every_round": [r["tokens_per_s"] for r in run["batched"]],
                      "batching_gain": round(batched["tokens_per_s"] / alone["tokens_per_s"], 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    hw = machine()
    engine = Engine.load(EngineConfig(target=args.model, dtype=args.dtype))
    prompter = Prompter(ChatFormat(engine.tokenizer, end_ids=engine.end_ids))
    sampling = replace(engine.default_sampling, seed=0)
    report = {"started": started, "machine": hw, "args": {k: str(v) for k, v in vars(args).items()},
              "model": args.model, "sampling": repr(sampling), "books": {}}
    for path in args.books:
        document = load_document(path)
        log(f"{document.title}: the app's outline ({args.chapters or 'all'} chapters, batch {args.batch})")
        outline, texts = app_outline(engine, prompter, document, args)
        result = {"outline": outline}
        if args.compare_chapters:
            result["stacks"] = compare(engine, prompter, texts[:args.compare_chapters], args, sampling)
        report["books"][document.title] = result
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**report, "load_avg_at_end": list(os.getloadavg())},
                                       indent=1, ensure_ascii=False))
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print("| book | chapters | total | per chapter | mean batch | names recalled | made-up names | loops |")
    print("|:--|--:|--:|--:|--:|--:|--:|--:|")
    for title, result in report["books"].items():
        o, rows = result["outline"], result["outline"]["chapters"]
        recalled, named = sum(r["n_recalled"] for r in rows), sum(len(r["names"]) for r in rows)
        made_up = sum(len(r["made_up"]) for r in rows)
        print(f"| {title} | {o['n_chapters']} | {o['total_s']:.0f} s | {o['s_per_chapter']:.0f} s | "
              f"{o['mean_batch']} | {recalled}/{named} | {made_up} | {sum(r['loops'] for r in rows)} |")
    for title, result in report["books"].items():
        for stack, row in result.get("stacks", {}).items():
            print(f"| {title} | {stack} | alone {row['alone']['tokens_per_s']} | batched "
                  f"{row['batched']['tokens_per_s']} tokens/s | ×{row['batching_gain']} | same: {row['same_tokens']} |")


if __name__ == "__main__":
    sys.exit(main())
