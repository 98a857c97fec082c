"""Answer quality of the models we ship, on a book (issue 21): a benchmark, not a test.

Each context is the first N tokens of Persuasion (assets/persuasion.txt), wrapped as the app wraps
a book (tools/chat.py, with its system message), with three pass keys hidden at 10%, 50% and
90% of its depth ("The pass key of the red door is 52817."). One prefill per model and context
answers everything: factual questions with key-word answers (only those whose key words occur
in the kept text count), the three pass keys (a multi-needle variant of the passkey test: one
prefill instead of one per depth), and one summary that is scored only for looping. After each
answer the session is truncated back to the book, so every question sees the same context.
Scoring is automatic: an answer is right when it holds every key word (case-insensitive) and does
not loop; it loops when a 4-word phrase occurs more than 3 times. Settings: `greedy` (temperature
0, no penalties) and `default` (the model's own generation settings, Engine.default_sampling).
Answers do not depend on the level stack (lossless), so the default stack runs and its speed is
reported beside the scores. Facts come in two sets scored apart: FACTS, whose misses were read while
choosing the prompt, and HELD_OUT, written afterwards. `--prompts` compares prompt variants (PROMPTS:
a system message, prefilled once with the book, and a fixed instruction after each question) with
the same seeds; `--snapshots DIR` keeps each prefill so another seed or variant skips it.

    python -m benchmarks.quality --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --contexts 8192,31744
    python -m benchmarks.quality --models qwen2.5-coder-1.5b --contexts 65536 --yarn 4
    python -m benchmarks.quality --models qwen2.5-coder-1.5b --contexts 8192 --settings default \
        --prompts current,from-book,quote,reader --snapshots /tmp/prefills --seed 1
    python -m benchmarks.quality --quick                      # CI smoke test: SmolLM2, ~1K tokens
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch

from app.documents import Document
from app.session import BookSession, Prepared
from app.tokens import TokenMap
from benchmarks.cli import add_common_args
from benchmarks.passages import PassageIndex, with_passages
from engine.config import EngineConfig, SamplingConfig
from engine.session import Engine
from tools.chat import BOOK_SYSTEM, ChatFormat

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "assets" / "persuasion.txt"
ONE_SENTENCE = " Answer in one short sentence."
# (question, key words that must all appear); a question counts only when its key words are in the
# context. A key may list spellings that all count, "fifty-four|54", the book's own first (the one
# looked for in the context). FACTS is the first set, whose misses were read while choosing the
# prompt; HELD_OUT was written afterwards from the first ~8K tokens of the book and is scored apart,
# so a prompt that only fits FACTS shows.
FACTS = (
    ("What is the name of Sir Walter Elliot's estate?", ("Kellynch",)),
    ("Which book does Sir Walter Elliot like to read?", ("Baronetage",)),
    ("In which county is Sir Walter Elliot's estate?", ("Somerset",)),
    ("What is the name of Sir Walter Elliot's eldest daughter?", ("Elizabeth",)),
    ("What is the family name of the man Mary Elliot married?", ("Musgrove",)),
    ("Which friend of the late Lady Elliot is especially fond of Anne?", ("Russell",)),
    ("What is the name of the lawyer who advises Sir Walter about letting his house?", ("Shepherd",)),
    ("What is the name of Mr Shepherd's widowed daughter?", ("Clay|Penelope",)),  # Mrs Penelope Clay
    ("To which city does Sir Walter move to spend less?", ("Bath",)),
    ("What is the first name of the cousin who will inherit Sir Walter's title?", ("William",)),
    ("Who rents Kellynch Hall from Sir Walter?", ("Croft",)),
    ("What is the name of the naval officer Anne was engaged to years before?", ("Wentworth",)),
    ("What are the names of the two Musgrove sisters?", ("Louisa", "Henrietta")),
    ("What is the name of Captain Wentworth's naval friend who lives at Lyme?", ("Harville",)),
)
HELD_OUT = (
    ("In which year was Sir Walter Elliot born?", ("1760",)),
    ("In which year was Anne Elliot born?", ("1787",)),
    ("What is the name of Sir Walter Elliot's youngest daughter?", ("Mary",)),
    ("How old is Sir Walter Elliot?", ("fifty-four|54",)),
    ("How old is Elizabeth Elliot?", ("twenty-nine|29|nine-and-twenty",)),
    ("Where does the Musgrove family live?", ("Uppercross",)),
    ("In which county was the Elliot family first settled?", ("Cheshire",)),
    ("What was the surname of Lady Elliot's father?", ("Stevenson",)),
    ("How many years ago did Lady Elliot die?", ("thirteen|13",)),
    ("In how many years would Lady Russell's plan clear Sir Walter of debt?", ("seven|7",)),
    ("Which city did Sir Walter first think of moving to, before Bath was chosen?", ("London",)),
    ("How many miles is Bath from Kellynch?", ("fifty|50",)),
    ("Where will Anne spend the warm months with Lady Russell?", ("Lodge",)),
    ("What is Mr Shepherd's first name?", ("John",)),
    ("Which admiral did Sir Walter meet in town and find wretched-looking?", ("Baldwin",)),
    ("Which friend told Sir Walter the admiral's real age?", ("Morley",)),
    ("Which lord, whose father was a country curate, did Sir Walter have to give place to?", ("Ives",)),
    ("In which year did Mary Elliot marry?", ("1810",)),
    ("What yearly custom towards Anne did Elizabeth propose to give up to save money?", ("present",)),
)
NEEDLES = (("red", 0.1), ("green", 0.5), ("blue", 0.9))  # (door, depth as a fraction of the book)
SUMMARY = "Summarize the first chapter in one paragraph."
SETTINGS = ("greedy", "default")
NEW_TOKENS = {"fact": 48, "held-out": 48, "passkey": 16, "summary": 160}


@dataclass(frozen=True)
class Prompt:
    """A prompt variant: the system message (prefilled with the book) and a fixed instruction the
    app would append to every question (after the question, so the book is still prefilled once)."""
    system: str
    question_suffix: str = ""
    fact_tokens: int = 48  # answer budget of a factual question (a quote first needs more)
    passages: str | None = None  # "after" / "before" the question: the book's best passages for it quoted
    reread: bool = False  # the app's "re-read before answering": its sources (attention) quoted after it
    passages_first: bool = False  # ... quoted before the question instead


# The variants compared for issue 21 (RESULTS.md); `current` is what the app sends.
PROMPTS = {
    "current": Prompt(BOOK_SYSTEM),
    "from-book": Prompt(BOOK_SYSTEM, " Use the names and facts the book gives."),
    "quote": Prompt(BOOK_SYSTEM, " First quote the sentence of the book that answers it, then answer.", 128),
    "reader": Prompt("You are a helpful assistant. The user gives you a book, then asks about it. Find the "
                     "passage of the book that answers the question and answer with the names and facts it "
                     "gives, in the book's own words. If the book does not say, say that it does not."),
    "passages": Prompt(BOOK_SYSTEM, passages="after"),
    "passages-first": Prompt(BOOK_SYSTEM, passages="before"),
    "reread": Prompt(BOOK_SYSTEM, reread=True),
    "reread-first": Prompt(BOOK_SYSTEM, reread=True, passages_first=True),
}


def loops(text: str, n_words: int = 4, max_repeats: int = 3) -> bool:
    """True when some `n_words`-word phrase occurs more than `max_repeats` times."""
    words = re.findall(r"[\w']+", text.lower())
    grams = Counter(tuple(words[i:i + n_words]) for i in range(len(words) - n_words + 1))
    return any(n > max_repeats for n in grams.values())


def has_key(text: str, key: str) -> bool:
    """True when `text` holds the key word or one of its spellings ("fifty-four|54"), any case."""
    return any(spelling.lower() in text.lower() for spelling in key.split("|"))


def is_right(answer: str, keys: tuple[str, ...]) -> bool:
    return all(has_key(answer, k) for k in keys) and not loops(answer)


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
    """(kind, question, key words): the answerable facts of both sets, the pass keys, the summary."""
    facts = [(kind, q + ONE_SENTENCE, k) for kind, qs in (("fact", FACTS), ("held-out", HELD_OUT))
             for q, k in qs if all(w.split("|")[0] in text for w in k)]
    doors = [("passkey", f"What is the pass key of the {d} door? Answer with the number only.", (keys[d],))
             for d, _ in NEEDLES]
    return facts + doors + [("summary", SUMMARY, ())]


def sampling_for(setting: str, engine: Engine, kind: str, seed: int, prompt: Prompt) -> SamplingConfig:
    base = SamplingConfig() if setting == "greedy" else engine.default_sampling
    n_new = prompt.fact_tokens if kind in ("fact", "held-out") else NEW_TOKENS[kind]
    return replace(base, max_new_tokens=n_new, seed=seed)


def open_book(engine: Engine, name: str, doc_ids: list[int], snapshots: Path | None):
    """The prefilled session of `doc_ids`, from a snapshot in `snapshots` (keyed by the model and a
    hash of the ids, so a new system message never reuses one) or prefilled and saved there."""
    if snapshots is None:
        return engine.open(doc_ids)
    digest = hashlib.sha256(json.dumps(doc_ids).encode()).hexdigest()[:16]
    path = snapshots / f"{name}-{len(doc_ids)}-{digest}.pt"
    if path.exists():
        session = engine.restore(path)
        if session.tokens == doc_ids:
            return session
    session = engine.open(doc_ids)
    snapshots.mkdir(parents=True, exist_ok=True)
    session.save(path)
    return session


def book_session(engine: Engine, chat: ChatFormat, text: str, doc_ids: list[int], session) -> BookSession:
    """The prefilled book as the app holds it, so questions are asked as the app asks them."""
    prepared = Prepared(Document("Persuasion", text, "txt"), doc_ids, TokenMap(engine.tokenizer, text, len(doc_ids)),
                        engine.max_context)
    return BookSession(engine, chat, prepared, session, "benchmark")


def answer(book: BookSession, question: str, sampling: SamplingConfig, reread: bool) -> tuple[str, dict]:
    """One question asked as the app asks it (sources found first; quoted after it with `reread`),
    then the chat cleared, so the next question sees the book alone again."""
    tokens, stats, t0, first_s = 0, None, time.perf_counter(), None
    for update in book.ask(question, sampling, reread=reread):
        first_s = first_s or (time.perf_counter() - t0 if update.answer else None)
        stats = update.stats
    turn = book.turns[-1]
    tokens, text = turn.end - turn.answer_start, turn.answer
    book.clear()
    return text, {"tokens": tokens, "question_tokens": turn.answer_start - turn.start,
                  "seconds": round(time.perf_counter() - t0, 2),
                  "tbt_ms": round(stats.tbt_ms_mean, 1) if stats else None,
                  # the wait for the first token as a reader sees it (scoring the sources included),
                  # and the engine's part of it (the prompt's prefill and the first check)
                  "first_token_s": round(first_s or 0.0, 2), "ttft_s": round(stats.ttft_s, 2) if stats else None,
                  "sources": turn.sources, "reread": turn.reread, "quotes": turn.quotes}


def run_model(args, name: str, report: dict, save) -> None:
    config = EngineConfig(target=name, draft=args.draft, levels=args.levels, dtype=args.dtype, yarn_factor=args.yarn)
    engine = Engine.load(config)
    book_ids = engine.tokenizer(BOOK.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    rng = random.Random(0)  # the same pass keys for every --seed, so a prefill snapshot serves them all
    for n_ctx in args.contexts:
        keys = {door: str(rng.randint(10000, 99999)) for door, _ in NEEDLES}
        systems = list(dict.fromkeys(PROMPTS[p].system for p in args.prompts))  # one prefill per system message
        for system in systems:
            chat = ChatFormat(engine.tokenizer, system=system, end_ids=engine.end_ids)
            doc_ids, text = context(chat, book_ids, n_ctx, keys)
            log(f"{name} {n_ctx:,}: prefill {len(doc_ids):,} tokens (levels {config.levels})")
            t0 = time.perf_counter()
            session = open_book(engine, name, doc_ids, args.snapshots)
            prefill_s = time.perf_counter() - t0
            book = book_session(engine, chat, text, doc_ids, session)
            for prompt_name in [p for p in args.prompts if PROMPTS[p].system == system]:
                for setting in args.settings:
                    rows = ask_all(args, engine, book, questions(text, keys), setting, prompt_name, text)
                    report["runs"].append({"model": name, "draft": config.draft, "levels": config.levels,
                                           "yarn": args.yarn, "context": len(doc_ids), "setting": setting,
                                           "prompt": prompt_name, "seed": args.seed,
                                           "prefill_s": round(prefill_s, 1), "rows": rows,
                                           "peak_rss_mib": round(psutil.Process().memory_info().rss / 2**20)})
                    save()
            del session, book


def ask_all(args, engine, book_session: BookSession, asked, setting: str, prompt_name: str, book: str) -> list[dict]:
    """Every question of `asked` on the prefilled book, with the prompt variant's suffix."""
    prompt, rows = PROMPTS[prompt_name], []
    index = PassageIndex(book) if prompt.passages else None  # once per book, not per question
    book_session.passages_first = prompt.passages_first
    for i, (kind, question, keywords) in enumerate(asked):
        sampling = sampling_for(setting, engine, kind, args.seed + i, prompt)
        asked_text = question + prompt.question_suffix
        if index is not None:
            found = index.find(question.removesuffix(ONE_SENTENCE))
            asked_text = with_passages(asked_text, found, first=prompt.passages == "before")
        text_out, timing = answer(book_session, asked_text, sampling, prompt.reread)
        row = {"kind": kind, "question": question, "keys": keywords, "answer": text_out,
               "right": is_right(text_out, keywords) if keywords else None, "loops": loops(text_out), **timing,
               "source_hit": source_hit(timing["sources"], keywords) if keywords else None}
        rows.append(row)
        log(f"  {prompt_name:9} {setting:7} {kind:8} {'ok ' if row['right'] else '-- ' if keywords else '   '}"
            f"{'LOOP ' if row['loops'] else ''}{text_out[:100]!r}")
    return rows


def source_hit(sources: list[dict], keys: tuple[str, ...], top: int = 3) -> bool:
    """Whether one of the first `top` sources holds every key word (source recall)."""
    return any(all(has_key(s["text"], k) for k in keys) for s in sources[:top])


def score(rows: list[dict], kind: str) -> str:
    """"right/asked (percent)" of the questions of one kind."""
    asked = [r for r in rows if r["kind"] == kind]
    n_right = sum(r["right"] for r in asked)
    return f"{n_right}/{len(asked)} ({100 * n_right / max(len(asked), 1):.0f}%)"


def summary(run: dict) -> dict:
    keys = [r for r in run["rows"] if r["kind"] == "passkey"]
    tbts = [r["tbt_ms"] for r in run["rows"] if r["tbt_ms"]]
    facts = [r for r in run["rows"] if r["kind"] in ("fact", "held-out")]
    asked = [r for r in run["rows"] if r.get("source_hit") is not None]
    quotes = [q for r in run["rows"] for q in r.get("quotes", [])]
    waits = [r["first_token_s"] for r in run["rows"] if r.get("first_token_s")]
    return {"facts": score(run["rows"], "fact"), "held_out": score(run["rows"], "held-out"),
            "source_recall": f"{sum(r['source_hit'] for r in asked)}/{len(asked)}",
            "quotes_real": f"{sum(q['start_char'] >= 0 for q in quotes)}/{len(quotes)}",
            "first_token_s": sum(waits) / len(waits) if waits else 0.0,
            "passkeys": " ".join("✓" if r["right"] else "✗" for r in keys),
            "loops": sum(r["loops"] for r in run["rows"]), "answers": len(run["rows"]),
            "fact_tokens": sum(r["tokens"] for r in facts) / max(len(facts), 1),
            "tbt_ms": sum(tbts) / len(tbts) if tbts else None}


def markdown(report: dict) -> str:
    lines = ["| model | levels | YaRN | context | setting | prompt | seed | facts right | held-out facts right "
             "| pass keys 10/50/90% | looping answers | mean fact answer tokens | mean TBT ms | prefill s "
             "| source recall (top 3) | quotes in the book | mean s to first token |",
             "|---|---|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        s = summary(run)
        lines.append(f"| {run['model']} | `{run['levels']}` | {run['yarn']:g} | {run['context']:,} | {run['setting']} "
                     f"| {run['prompt']} | {run['seed']} | {s['facts']} | {s['held_out']} | {s['passkeys']} "
                     f"| {s['loops']}/{s['answers']} | {s['fact_tokens']:.1f} | {s['tbt_ms'] or 0:.0f} "
                     f"| {run['prefill_s']:.0f} | {s['source_recall']} | {s['quotes_real']} "
                     f"| {s['first_token_s']:.1f} |")
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
    add_common_args(p, "quality", model=False)
    p.add_argument("--seed", type=int, default=0, help="question i samples with seed + i")
    p.add_argument("--prompts", default="current", help=f"comma-separated prompt variants: {', '.join(PROMPTS)}")
    p.add_argument("--snapshots", type=Path, default=None,
                   help="folder of prefill snapshots, reused when the model and the prompt ids are the same")
    p.add_argument("--quick", action="store_true", help="CI smoke test: SmolLM2, ~1K tokens, greedy")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.contexts, args.settings, args.dtype = "smollm2-135m", "1024", "greedy", "float32"
    args.models, args.settings, args.prompts = args.models.split(","), args.settings.split(","), args.prompts.split(",")
    if set(args.prompts) - set(PROMPTS):
        p.error(f"--prompts: choose from {', '.join(PROMPTS)}")
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
