"""The outline of a book of any length: each chapter summarized from its own text (issue 56).

`split_book` cuts a Document into parts (its chapters, a chapter longer than the context in
parts, a book without chapters in fixed-size parts labelled by position). Each part is summarized
in a short prompt of its own (its own prefill, never the book's KV cache), and a book summary is
made from the chapter summaries (`reduce_groups`: one more pass for each time they exceed the
context). `SummaryCache` keeps every summary on disk as it is made, keyed by model, prompt and
text. `Outline` is one book's rows and passes; `OutlineWorker` (app/outline_worker.py) runs them.
Nothing here decides when to run or draws the page.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.documents import Document, chapters
from app.storage import read_json, write_json
from tools.chat import ChatFormat, plain_text

CHAPTER_PROMPT = ("Summarize this part of the book in one paragraph of at most 120 words: what happens, and "
                  "who takes part. Use the characters' names as the book spells them.")
GROUP_PROMPT = ("These are summaries of consecutive chapters of a book, in order. Summarize them together in "
                "one paragraph of at most 150 words.")
BOOK_PROMPT = ("These are summaries of a book's chapters, in order. Write a summary of the whole book from "
               "them in three paragraphs: the story from beginning to end, and its main characters.")
PART_TOKENS = 4096  # a book without chapters: parts about as long as a novel's chapter
MIN_FRONT_TOKENS = 256  # text before the first chapter shorter than this is a title page or contents
# a chapter of fewer words is a heading or a title page (an EPUB's "Pride and Prejudice / By Jane
# Austen" section): summarized, a model writes the plot it remembers, not the text's
MIN_CHAPTER_WORDS = 20
SUMMARY_TOKENS = 256  # the most tokens one summary may take (a prompt's room for its answer)
BOOK_SUMMARY_TOKENS = 512


@dataclass(frozen=True)
class Part:
    """A piece of the book summarized on its own: a chapter, a part of one, or a fixed-size part."""

    label: str  # "Chapter 3", "Chapter 3 (part 2 of 3)", "Part 4 of 12 (25–33%)"
    start_char: int
    end_char: int
    note: str = ""  # why it is not summarized ("empty"), or "" when it is


class Prompter:
    """Text -> prompt ids and answer ids -> text, in the model's own chat template (tools/chat.py)."""

    def __init__(self, chat: ChatFormat):
        self.chat, self.tokenizer = chat, chat.tokenizer
        self.stop_ids = chat.stop_ids

    def n_tokens(self, text: str) -> int:
        return len(plain_text(self.tokenizer).ids(text))

    def prompt_ids(self, text: str, instruction: str) -> list[int]:
        """The text as a document, then the instruction as its first question."""
        return self.chat.document_ids(text) + self.chat.question_ids(instruction, is_first=True,
                                                                     previous_answer_ended=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


def split_book(document: Document, n_tokens: Callable[[str], int], max_part_tokens: int,
               part_tokens: int = PART_TOKENS) -> list[Part]:
    """The book's parts in order: its chapters (app.documents.chapters, as the picker of a too-long
    book shows them), each cut in equal parts when longer than `max_part_tokens`; without chapters,
    parts of about `part_tokens` labelled by position. An empty chapter, one of a heading's few
    words, or one the table of contents points past the text with, stays in the list with a note,
    so the outline says so."""
    text, found = document.text, sorted(chapters(document), key=lambda s: s.start_char)
    if not found:
        n = max(1, math.ceil(n_tokens(text) / part_tokens))
        cuts = _cuts(text, 0, len(text), n)
        return [Part(_position_label(i, len(cuts), a, b, len(text)), a, b) for i, (a, b) in enumerate(cuts)]
    parts: list[Part] = []
    front_end = min(found[0].start_char, len(text))
    if text[:front_end].strip() and n_tokens(text[:front_end]) >= MIN_FRONT_TOKENS:
        parts += _chapter_parts(f"Before {found[0].title}", text, 0, front_end, n_tokens, max_part_tokens)
    for i, section in enumerate(found):
        start = section.start_char
        end = found[i + 1].start_char if i + 1 < len(found) else len(text)
        if start > len(text):
            parts.append(Part(section.title, len(text), len(text), "the table of contents points past the text"))
        elif not text[start:end].strip() or end <= start:
            parts.append(Part(section.title, start, start, "empty"))
        elif len(text[start:end].split()) < MIN_CHAPTER_WORDS:
            parts.append(Part(section.title, start, end, "a title or heading only: nothing to summarize"))
        else:
            parts += _chapter_parts(section.title, text, start, end, n_tokens, max_part_tokens)
    return parts


def _chapter_parts(title: str, text: str, start: int, end: int, n_tokens: Callable[[str], int],
                   max_part_tokens: int) -> list[Part]:
    n = math.ceil(n_tokens(text[start:end]) / max_part_tokens)
    while True:  # equal characters are not equal tokens: cut finer until every part fits
        cuts = _cuts(text, start, end, n)
        if n >= end - start or all(n_tokens(text[a:b]) <= max_part_tokens for a, b in cuts):
            break
        n += 1
    if len(cuts) == 1:
        return [Part(title, start, end)]
    return [Part(f"{title} (part {i + 1} of {len(cuts)})", a, b) for i, (a, b) in enumerate(cuts)]


def _cuts(text: str, start: int, end: int, n: int) -> list[tuple[int, int]]:
    """[start, end) in `n` spans of about equal length, each cut after the nearest paragraph break
    (else line break, else space) before its share's end."""
    bounds = [start]
    for i in range(1, n):
        target = start + (end - start) * i // n
        window = text[bounds[-1] + 1:target]
        cut = max((window.rfind(sep) + len(sep) for sep in ("\n\n", "\n", " ") if sep in window), default=-1)
        bounds.append(bounds[-1] + 1 + cut if cut > 0 else target)
    bounds.append(end)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _position_label(i: int, n: int, a: int, b: int, n_chars: int) -> str:
    return f"Part {i + 1} of {n} ({100 * a // max(1, n_chars)}–{100 * b // max(1, n_chars)}%)"


def reduce_groups(texts: list[str], fits: Callable[[list[str]], bool]) -> list[list[int]]:
    """Consecutive texts packed greedily into groups whose prompt `fits` the context: one group when
    all fit together (then it is the last pass). A text that fits only alone is a group of one."""
    groups: list[list[int]] = []
    for i in range(len(texts)):
        if groups and fits([texts[j] for j in groups[-1]] + [texts[i]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def summary_key(model: str, prompt: str, text: str) -> str:
    """What a summary depends on: the model (its fingerprint), the prompt (instruction and sampling
    settings) and the text summarized."""
    return hashlib.sha256(json.dumps([model, prompt, text], ensure_ascii=False).encode("utf-8")).hexdigest()


class SummaryCache:
    """One small JSON file per summary under `root/summaries`, written atomically as each is done, so
    a stopped app loses only the summaries in progress and a reopened book costs nothing. Without a
    root (tests, a library-less app) it lives in memory."""

    def __init__(self, root: str | Path | None):
        self.folder = None if root is None else Path(root) / "summaries"
        self.memory: dict[str, dict] = {}  # read or written this run
        self.rates: dict[str, float] = (read_json(self.folder / "rates.json") or {}) if self.folder else {}

    def get(self, key: str) -> dict | None:
        if key not in self.memory and self.folder is not None:
            found = read_json(self.folder / f"{key}.json")
            if found is not None and isinstance(found.get("summary"), str):
                self.memory[key] = found
        return self.memory.get(key)

    def put(self, key: str, record: dict) -> None:
        """Keep `record` ({"summary", ...}); a disk that refuses it costs only the file."""
        self.memory[key] = record
        self._write(f"{key}.json", record)

    def rate(self, model: str) -> float | None:
        """Seconds of outline work per prompt token measured here for `model` (None: never)."""
        value = self.rates.get(model)
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def set_rate(self, model: str, s_per_token: float) -> None:
        self.rates[model] = s_per_token
        self._write("rates.json", self.rates)

    def _write(self, name: str, obj: dict) -> None:
        if self.folder is not None:
            with contextlib.suppress(OSError):  # e.g. a full disk: the outline goes on in memory
                write_json(self.folder / name, obj)


@dataclass
class Task:
    """One summary to make: of a part, a group of chapter summaries, or the whole book."""

    label: str
    text: str
    instruction: str
    max_new_tokens: int
    key: str = ""
    summary: str | None = None
    state: str = "waiting"  # waiting, running, done, cached, skipped, failed
    note: str = ""  # for the reader: why it was skipped or failed
    n_prompt_tokens: int = 0
    n_answer_tokens: int = 0

    @property
    def is_done(self) -> bool:
        return self.state in ("done", "cached", "skipped", "failed")


@dataclass
class Outline:
    """One book's outline: a task per part, then the passes that make the book summary from them."""

    title: str
    model: str  # the model_fingerprint the summaries are made (and cached) with
    sampling_id: str  # the sampling settings, part of every cache key
    rows: list[Task]
    passes: list[list[Task]] = field(default_factory=list)  # book-summary passes; the last holds one task
    summary_tokens: int = SUMMARY_TOKENS  # the most tokens of a part's (or a group's) summary
    book_summary_tokens: int = BOOK_SUMMARY_TOKENS
    stopped: str = ""  # why the outline stopped before the end ("" while it runs or once complete)
    version: int = 0  # bumped at every change the page shows

    @property
    def book_summary(self) -> str | None:
        last = self.passes[-1] if self.passes else []
        return last[0].summary if len(last) == 1 and last[0].is_done and self._is_final(last) else None

    def _is_final(self, tasks: list[Task]) -> bool:
        return len(tasks) == 1 and tasks[0].instruction == BOOK_PROMPT

    @property
    def is_complete(self) -> bool:
        return all(t.is_done for t in self.rows) and bool(self.passes) and self._is_final(self.passes[-1]) \
            and self.passes[-1][0].is_done

    def counts(self) -> tuple[int, int]:
        """(rows done, rows to summarize at all)."""
        to_do = [t for t in self.rows if t.state != "skipped"]
        return sum(t.is_done for t in to_do), len(to_do)


def new_outline(document: Document, prompter: Prompter, model: str, sampling_id: str, max_context: int,
                cache: SummaryCache, part_tokens: int = PART_TOKENS, summary_tokens: int = SUMMARY_TOKENS,
                book_summary_tokens: int = BOOK_SUMMARY_TOKENS) -> Outline:
    """The outline of `document` with every part already in `cache` filled in."""
    overhead = len(prompter.prompt_ids("", CHAPTER_PROMPT)) + summary_tokens
    parts = split_book(document, prompter.n_tokens, max(256, max_context - overhead), part_tokens)
    rows = []
    for part in parts:
        task = Task(part.label, document.text[part.start_char:part.end_char].strip(), CHAPTER_PROMPT,
                    summary_tokens)
        if part.note:
            task.state, task.note = "skipped", part.note
        else:
            task.n_prompt_tokens = prompter.n_tokens(task.text) + overhead - summary_tokens
        rows.append(fill_from_cache(task, cache, model, sampling_id))
    return Outline(document.title, model, sampling_id, rows, summary_tokens=summary_tokens,
                   book_summary_tokens=book_summary_tokens)


def fill_from_cache(task: Task, cache: SummaryCache, model: str, sampling_id: str) -> Task:
    task.key = summary_key(model, f"{task.instruction}\n{task.max_new_tokens}\n{sampling_id}", task.text)
    if task.state == "waiting" and (found := cache.get(task.key)) is not None:
        task.summary, task.state = found["summary"], "cached"
        task.n_prompt_tokens, task.n_answer_tokens = found.get("n_prompt_tokens", 0), found.get("n_answer_tokens", 0)
    return task


def next_pass(outline: Outline, prompter: Prompter, max_context: int, cache: SummaryCache) -> list[Task]:
    """The next book-summary pass once the one before (or the chapters) is done: the chapter (or
    group) summaries in groups that fit, each summarized; one group: the book summary itself."""
    before = outline.passes[-1] if outline.passes else [t for t in outline.rows if t.summary]
    texts = [f"{t.label}: {t.summary}" for t in before if t.summary]
    if not texts:
        return []
    room = max_context - outline.book_summary_tokens

    def fits(group: list[str]) -> bool:
        return len(prompter.prompt_ids("\n\n".join(group), BOOK_PROMPT)) <= room
    groups = reduce_groups(texts, fits)
    if len(groups) == 1:
        tasks = [Task("Book summary", "\n\n".join(texts), BOOK_PROMPT, outline.book_summary_tokens)]
    else:
        labels = [t.label for t in before if t.summary]  # a group's label: its first and last chapters
        tasks = [Task(f"{labels[g[0]].split(' – ')[0]} – {labels[g[-1]].split(' – ')[-1]}",
                      "\n\n".join(texts[i] for i in g), GROUP_PROMPT, outline.summary_tokens) for g in groups]
    return [fill_from_cache(t, cache, outline.model, outline.sampling_id) for t in tasks]


def outline_markdown(outline: Outline) -> str:
    """The outline and the book summary as a Markdown document (the export)."""
    lines = [f"# {outline.title}", ""]
    if outline.book_summary:
        lines += ["## Book summary", "", "*Made from the chapter summaries.*", "", outline.book_summary, ""]
    lines += ["## Outline", ""]
    for task in outline.rows:
        body = task.summary if task.summary else f"*({task.note or 'not summarized yet'})*"
        lines += [f"### {task.label}", "", body, ""]
    if outline.stopped:
        lines += [f"*The outline stopped: {outline.stopped}*", ""]
    return "\n".join(lines)

