"""Answer quality of the models we ship, on a book (issue 21): a benchmark, not a test.

Each context is the first N tokens of Persuasion (assets/persuasion.txt), wrapped as the app wraps
a book (engine/chat.py, with its system message), with three pass keys hidden at 10%, 50% and
90% of its depth ("The pass key of the red door is 52817."). One prefill per model and context
answers everything: factual questions with key-word answers (only those whose key words occur
in the kept text count), the three pass keys (a multi-needle variant of the passkey test: one
prefill instead of one per depth), and one summary that is scored only for looping. After each
answer the session is truncated back to the book, so every question sees the same context.
Scoring is automatic: an answer is right when it holds every key word (case-insensitive) and does
not loop; it loops when a 4-word phrase occurs more than 3 times. Settings: `greedy` (temperature
0, no penalties) and `default` (the model's own generation settings, Engine.default_sampling).
Answers do not depend on the level stack (lossless), so the default stack runs and its speed is
reported beside the scores.

    python -m benchmarks.quality --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --contexts 8192,31744
    python -m benchmarks.quality --models qwen2.5-coder-1.5b --contexts 65536 --yarn 4
    python -m benchmarks.quality --quick                      # CI smoke test: SmolLM2, ~1K tokens
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch

from engine.chat import ChatFormat
from engine.config import EngineConfig, SamplingConfig
from engine.session import Engine

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "assets" / "persuasion.txt"
ONE_SENTENCE = " Answer in one short sentence."
# (question, key words that must all appear); a question counts only when its key words are in the context
FACTS = (
    ("What is the name of Sir Walter Elliot's estate?", ("Kellynch",)),
    ("Which book does Sir Walter Elliot like to read?", ("Baronetage",)),
    ("In which county is Sir Walter Elliot's estate?", ("Somerset",)),
    ("What is the name of Sir Walter Elliot's eldest daughter?", ("Elizabeth",)),
    ("What is the family name of the man Mary Elliot married?", ("Musgrove",)),
    ("Which friend of the late Lady Elliot is especially fond of Anne?", ("Russell",)),
    ("What is the name of the lawyer who advises Sir Walter about letting his house?", ("Shepherd",)),
    ("What is the name of Mr Shepherd's widowed daughter?", ("Clay",)),
    ("To which city does Sir Walter move to spend less?", ("Bath",)),
    ("What is the first name of the cousin who will inherit Sir Walter's title?", ("William",)),
    ("Who rents Kellynch Hall from Sir Walter?", ("Croft",)),
    ("What is the name of the naval officer Anne was engaged to years before?", ("Wentworth",)),
    ("What are the names of the two Musgrove sisters?", ("Louisa", "Henrietta")),
    ("What is the name of Captain Wentworth's naval friend who lives at Lyme?", ("Harville",)),
)
NEEDLES = (("red", 0.1), ("green", 0.5), ("blue", 0.9))  # (door, depth as a fraction of the book)
SUMMARY = "Summarize the first chapter in one paragraph."
SETTINGS = ("greedy", "default")
NEW_TOKENS = {"fact": 48, "passkey": 16, "summary": 160}


def loops(text: str, n_words: int = 4, max_repeats: int = 3) -> bool:
    """True when some `n_words`-word phrase occurs more than `max_repeats` times."""
    words = re.findall(r"[\w']+", text.lower())
    grams = Counter(tuple(words[i:i + n_words]) for i in range(len(words) - n_words + 1))
    return any(n > max_repeats for n in grams.values())


def is_right(answer: str, keys: tuple[str, ...]) -> bool:
    return all(k.lower() in answer.lower() for k in keys) and not loops(answer)


def with_needles(text: str, keys: dict[str, str]) -> str:
    """The text with one pass-key sentence per door, each at the paragraph break nearest its depth."""
    breaks = [m.end() for m in re.finditer(r"\n\s*\n", text)] or [len(text)]
    inserts = []
    for door, depth in NEEDLES:
        at = min(breaks, key=lambda b: abs(b - depth * len(text)))
        inserts.append((at, f"The pass key of the {door} door is {keys[door]}. Remember it.\n\n"))
    for at, sentence in sorted(inserts, reverse=True):
        text = text[:at] + sentence + text[at:]
    return text


def context(chat: ChatFormat, book_ids: list[int], n_tokens: int, keys: dict[str, str]) -> tuple[list[int], str]:
    """(document ids about `n_tokens` long, the book text they hold) with the pass keys inside."""
    overhead = len(chat.document_ids(with_needles("x", keys)))
    text = with_needles(chat.tokenizer.decode(book_ids[: n_tokens - overhead]), keys)
    return chat.document_ids(text), text


def questions(text: str, keys: dict[str, str]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, question, key words): the answerable facts, the pass keys, the summary."""
    facts = [("fact", q + ONE_SENTENCE, k) for q, k in FACTS if all(w in text for w in k)]
    doors = [("passkey", f"What is the pass key of the {d} door? Answer with the number only.", (keys[d],))
             for d, _ in NEEDLES]
    return facts + doors + [("summary", SUMMARY, ())]


def sampling_for(setting: str, engine: Engine, kind: str, seed: int) -> SamplingConfig:
    base = SamplingConfig() if setting == "greedy" else engine.default_sampling
    return replace(base, max_new_tokens=NEW_TOKENS[kind], seed=seed)


def answer(session, chat: ChatFormat, question: str, sampling: SamplingConfig) -> tuple[str, dict]:
    q_ids = chat.question_ids(question, is_first=True, previous_answer_ended=False)
    n_doc, tokens, stats, t0 = session.length, [], None, time.perf_counter()
    for event in session.ask(q_ids, sampling, stop_ids=chat.stop_ids):
        tokens += event.tokens
        stats = event.stats
    session.truncate(n_doc)
    text = chat.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return text, {"tokens": len(tokens), "seconds": round(time.perf_counter() - t0, 2),
                  "tbt_ms": round(stats.tbt_ms_mean, 1) if stats else None}


def run_model(args, name: str, report: dict, save) -> None:
    config = EngineConfig(target=name, draft=args.draft, levels=args.levels, dtype=args.dtype, yarn_factor=args.yarn)
    engine = Engine.load(config)
    chat = ChatFormat(engine.tokenizer, end_ids=engine.end_ids)
    book_ids = engine.tokenizer(BOOK.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    rng = random.Random(args.seed)
    for n_ctx in args.contexts:
        keys = {door: str(rng.randint(10000, 99999)) for door, _ in NEEDLES}
        doc_ids, text = context(chat, book_ids, n_ctx, keys)
        log(f"{name} {n_ctx:,}: prefill {len(doc_ids):,} tokens (levels {config.levels})")
        t0 = time.perf_counter()
        session = engine.open(doc_ids)
        prefill_s = time.perf_counter() - t0
        for setting in args.settings:
            rows = []
            for i, (kind, question, keywords) in enumerate(questions(text, keys)):
                text_out, timing = answer(session, chat, question, sampling_for(setting, engine, kind, args.seed + i))
                row = {"kind": kind, "question": question, "keys": keywords, "answer": text_out,
                       "right": is_right(text_out, keywords) if keywords else None, "loops": loops(text_out),
                       **timing}
                rows.append(row)
                log(f"  {setting:7} {kind:7} {'ok ' if row['right'] else '-- ' if keywords else '   '}"
                    f"{'LOOP ' if row['loops'] else ''}{text_out[:100]!r}")
            report["runs"].append({"model": name, "draft": config.draft, "levels": config.levels,
                                   "yarn": args.yarn, "context": len(doc_ids), "setting": setting,
                                   "prefill_s": round(prefill_s, 1), "rows": rows,
                                   "peak_rss_mib": round(psutil.Process().memory_info().rss / 2**20)})
            save()
        del session


def summary(run: dict) -> dict:
    facts = [r for r in run["rows"] if r["kind"] == "fact"]
    keys = [r for r in run["rows"] if r["kind"] == "passkey"]
    tbts = [r["tbt_ms"] for r in run["rows"] if r["tbt_ms"]]
    return {"facts": f"{sum(r['right'] for r in facts)}/{len(facts)}",
            "facts_pct": 100 * sum(r["right"] for r in facts) / max(len(facts), 1),
            "passkeys": " ".join("✓" if r["right"] else "✗" for r in keys),
            "loops": sum(r["loops"] for r in run["rows"]), "answers": len(run["rows"]),
            "tbt_ms": sum(tbts) / len(tbts) if tbts else None}


def markdown(report: dict) -> str:
    lines = ["| model | levels | YaRN | context | setting | facts right | pass keys 10/50/90% | looping answers "
             "| mean TBT ms | prefill s |", "|---|---|---:|---:|---|---:|---|---:|---:|---:|"]
    for run in report["runs"]:
        s = summary(run)
        lines.append(f"| {run['model']} | `{run['levels']}` | {run['yarn']:g} | {run['context']:,} | {run['setting']} "
                     f"| {s['facts']} ({s['facts_pct']:.0f}%) | {s['passkeys']} | {s['loops']}/{s['answers']} | "
                     f"{s['tbt_ms'] or 0:.0f} | {run['prefill_s']:.0f} |")
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    p.add_argument("--draft", default="auto", help="auto: the paired draft of each model")
    p.add_argument("--levels", default="auto")
    p.add_argument("--contexts", default="8192,31744",  # 31,744: a question and its answer still fit in 32K
                   help="comma-separated token counts")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--yarn", type=float, default=1.0, help="YaRN factor (4: 131,072 tokens for Qwen2.5)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality.json")
    p.add_argument("--quick", action="store_true", help="CI smoke test: SmolLM2, ~1K tokens, greedy")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.contexts, args.settings, args.dtype = "smollm2-135m", "1024", "greedy", "float32"
    args.models, args.settings = args.models.split(","), args.settings.split(",")
    args.contexts = [int(n) for n in args.contexts.split(",")]
    if set(args.settings) - set(SETTINGS):
        p.error(f"--settings: choose from {', '.join(SETTINGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "argv": sys.argv[1:] if argv is None else argv,
              "threads": args.threads, "load_avg_at_start": psutil.getloadavg(), "runs": []}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(markdown(report) + "\n")

    for name in args.models:
        run_model(args, name, report, save)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
