"""A long book's reading stopped and taken up again, against one uninterrupted reading.

The app reads a book in parts (app/reading.py `Reading`), keeps what was read when the reading
stops, and reads on from there at the next opening. This times both ways on the same text, in one
process, and checks what the reader relies on: the KV cache and a greedy answer are the same.
  1. a warm-up prefill (kernels built, caches touched);
  2. a stopped reading: app/reading.py `open_session` with Cancel set after `--stop-at` tokens, which
     saves the reading so far (partial.pt), then a second opening that restores it and reads on;
  3. one uninterrupted `Engine.open` of the same tokens;
  4. the same greedy answer from both sessions; their KV compared bit for bit;
  5. more of a book: its first `--stop-at` tokens read as a book of their own (the part a reader
     kept first), then the whole text, which starts from the chunks the two share; KV compared.
Then the cost of what a long book adds: `stack.reset` (each part commits its tokens) and saving
the reading, over random caches of each `--save-sizes` length (no prefill needed).

    python -m benchmarks.reading --tokens 9000 --stop-at 5000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from app.documents import Document
from app.library import Library
from app.reading import ReadingStopped, open_session
from benchmarks.cli import add_common_args
from benchmarks.kernels import random_full_cache
from engine.config import EngineConfig, SamplingConfig
from engine.files import file_sha256
from engine.session import Engine, Session
from tools.chat import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Who is Sir Walter Elliot, and why must he leave Kellynch Hall?"


def stopped_and_read_on(engine: Engine, doc: Document, doc_ids: list[int], stop_at: int, root: Path) -> dict:
    library, cancel = Library(root), threading.Event()
    t0 = time.perf_counter()
    try:
        open_session(library, engine, doc, doc_ids, lambda done, total: done >= stop_at and cancel.set(), cancel)
        raise RuntimeError("the reading was not stopped: --stop-at beyond the book?")
    except ReadingStopped as stopped:
        n_read = stopped.n_read
    t1 = time.perf_counter()
    _, session, _, _ = open_session(library, engine, doc, doc_ids)
    return {"session": session, "n_read": n_read, "stopped_s": t1 - t0, "read_on_s": time.perf_counter() - t1}


def more_of_the_book(engine: Engine, doc: Document, doc_ids: list[int], first: int, root: Path) -> dict:
    library, shared = Library(root), []
    part = Document("Persuasion (first part)", doc.text[:len(doc.text) * first // len(doc_ids)], "txt", [])
    t0 = time.perf_counter()
    open_session(library, engine, part, doc_ids[:first])
    t1 = time.perf_counter()
    _, session, _, _ = open_session(library, engine, doc, doc_ids, on_resume=lambda n, source: shared.append(n))
    return {"session": session, "n_shared": shared[0] if shared else 0, "first_s": t1 - t0,
            "more_s": time.perf_counter() - t1}


def kv_equal(a: Session, b: Session, n: int) -> bool:
    return bool(torch.equal(a.full.k[..., :n, :], b.full.k[..., :n, :])
                and torch.equal(a.full.v[..., :n, :], b.full.v[..., :n, :]))


def greedy(session: Session, question_ids: list[int], stop_ids: set[int]) -> list[int]:
    events = session.ask(question_ids, SamplingConfig(max_new_tokens=48), stop_ids=stop_ids)
    return [t for event in events for t in event.tokens]


def long_book_costs(engine: Engine, n_tokens: int) -> dict:
    """Seconds of one part's `stack.reset` and of one save of the reading (file and hash) at n_tokens."""
    c = engine.target.config
    session = Session(engine, random_full_cache(c, n_tokens, n_tokens + 2048, engine.dtype))
    session.query_log.queries = [torch.randn(1, c.n_heads, 16, c.head_dim, dtype=engine.dtype)
                                 for _ in range(c.n_layers)]
    ids = torch.randint(0, c.vocab_size, (n_tokens,)).tolist()
    t0 = time.perf_counter()
    session.stack.reset(ids)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "partial.pt"
        session.save(path)
        t2 = time.perf_counter()
        file_sha256(path)
        return {"tokens": n_tokens, "reset_s": t1 - t0, "save_s": t2 - t1, "sha256_s": time.perf_counter() - t2,
                "gb": path.stat().st_size / 1e9}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reading", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "reading")
    p.add_argument("--tokens", type=int, default=9000)
    p.add_argument("--stop-at", type=int, default=5000)
    p.add_argument("--save-sizes", default="32000,112000", help="random caches whose save is timed ('' : none)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(target=args.model, draft="none"))
    chat = ChatFormat(engine.tokenizer)
    text = (ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:args.tokens * 6]
    doc_ids = chat.document_ids(text)[:args.tokens]
    doc = Document("Persuasion", text, "txt", [])
    question = chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    engine.open(doc_ids[:512])  # warm-up
    with tempfile.TemporaryDirectory() as root:
        parted = stopped_and_read_on(engine, doc, doc_ids, args.stop_at, Path(root))
    with tempfile.TemporaryDirectory() as root:
        more = more_of_the_book(engine, doc, doc_ids, args.stop_at, Path(root))
    t0 = time.perf_counter()
    whole = engine.open(doc_ids)
    whole_s, n = time.perf_counter() - t0, len(doc_ids)
    a, c, b = parted.pop("session"), more.pop("session"), whole
    row = {"model": args.model, "dtype": str(engine.dtype), "threads": args.threads, "tokens": n, **parted,
           "whole_s": whole_s, "kv_equal": kv_equal(a, b, n),
           "answers_equal": greedy(a, question, chat.stop_ids) == greedy(b, question, chat.stop_ids)}
    more["kv_equal"] = kv_equal(c, b, n)
    costs = [long_book_costs(engine, int(s)) for s in args.save_sizes.split(",") if s]
    print(f"| model | tokens | whole read s | stopped at | stopped reading s | read on s | parts / whole | KV equal "
          f"| answer equal |\n|---|---:|---:|---:|---:|---:|---:|---|---|\n| {args.model} | {n:,} | {whole_s:.1f} "
          f"| {row['n_read']:,} | {row['stopped_s']:.1f} | {row['read_on_s']:.1f} "
          f"| {(row['stopped_s'] + row['read_on_s']) / whole_s:.3f} | {row['kv_equal']} | {row['answers_equal']} |")
    print(f"\n| first part read s | then the whole: shared tokens | read s | read / whole | KV equal |\n"
          f"|---:|---:|---:|---:|---|\n| {more['first_s']:.1f} | {more['n_shared']:,} | {more['more_s']:.1f} "
          f"| {more['more_s'] / whole_s:.3f} | {more['kv_equal']} |")
    if costs:
        print("\n| cache tokens | stack.reset s | save s | sha256 s | file GB |\n|---:|---:|---:|---:|---:|")
        for c in costs:
            print(f"| {c['tokens']:,} | {c['reset_s']:.2f} | {c['save_s']:.2f} | {c['sha256_s']:.2f} | {c['gb']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"reading": row, "more_of_the_book": more, "long_book_costs": costs}, indent=1))


if __name__ == "__main__":
    main()
