"""The outline (app/outline.py, app/outline_worker.py): splitting a book into parts, the cache key,
the book-summary passes, the Markdown export, and the worker on a tiny random model with the real
batcher: batched summaries equal lone ones, a stop resumes from the cache, a reader goes first.

A character "tokenizer" (one id per character) stands in for the model's: the tiny model's
vocabulary has no tokenizer, and what is tested is the bookkeeping around the ids.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.documents import Document, Section
from app.outline import (
    BOOK_PROMPT,
    CHAPTER_PROMPT,
    GROUP_PROMPT,
    Outline,
    SummaryCache,
    Task,
    new_outline,
    next_pass,
    outline_markdown,
    reduce_groups,
    split_book,
    summary_key,
)
from app.outline_worker import OutlineWorker
from engine.batch import Batcher
from engine.config import SamplingConfig
from tests.conftest import tiny_engine

VOCAB = 128


class CharPrompter:
    """One id per character (fake tokenizer); the instruction's first letters stand for its prompt."""

    stop_ids: set[int] = set()

    def n_tokens(self, text: str) -> int:
        return len(text)

    def prompt_ids(self, text: str, instruction: str) -> list[int]:
        return [1] + [ord(ch) % VOCAB for ch in text + "|" + instruction[:8]]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def chaptered(bodies: list[str], titles: list[str] | None = None) -> Document:
    """A document of chapters with these bodies ('' makes an empty chapter: two titles at one offset)."""
    text, sections = "", []
    for i, body in enumerate(bodies):
        sections.append(Section(titles[i] if titles else f"Chapter {i + 1}", len(text), "chapter"))
        text += body
    return Document("Book", text, "txt", sections)


def words(n: int, seed: int = 0) -> str:
    return " ".join(f"w{(seed * 7 + i) % 13:02d}" for i in range(n)) + "\n\n"


# ---- splitting ------------------------------------------------------------------------------
def test_a_book_without_chapters_is_cut_in_fixed_parts_labelled_by_position():
    text = words(400)  # 1,602 characters = tokens here
    parts = split_book(Document("Book", text, "txt"), len, max_part_tokens=10_000, part_tokens=500)
    assert [p.label.split(" (")[0] for p in parts] == ["Part 1 of 4", "Part 2 of 4", "Part 3 of 4", "Part 4 of 4"]
    assert parts[0].label.endswith("(0–24%)") and parts[-1].label.endswith("–100%)")
    assert parts[0].start_char == 0 and parts[-1].end_char == len(text)
    assert all(a.end_char == b.start_char for a, b in zip(parts, parts[1:]))  # nothing lost, nothing twice
    assert all(text[p.end_char - 1] == " " for p in parts[:-1])  # cut between words


def test_an_empty_chapter_and_a_toc_entry_past_the_text_stay_in_the_outline_with_a_note():
    document = chaptered([words(50), "", words(50, 1)])  # chapter 2 is empty: chapter 3 starts where it does
    document = replace(document, sections=document.sections + [Section("Chapter 9", len(document.text) + 50,
                                                                       "chapter")])
    parts = split_book(document, len, max_part_tokens=10_000)
    assert [(p.label, p.note) for p in parts] == [("Chapter 1", ""), ("Chapter 2", "empty"), ("Chapter 3", ""),
                                                  ("Chapter 9", "the table of contents points past the text")]
    assert document.text[parts[2].start_char:parts[2].end_char] == words(50, 1)  # not chapter 2's text too


def test_a_chapter_of_a_title_page_only_stays_in_the_outline_unsummarized():
    title_page = "Pride and Prejudice\n\nPRIDE AND PREJUDICE\n\nBy Jane Austen\n\n"  # the EPUB's first section
    document = chaptered([title_page, words(50)], titles=["Pride and Prejudice", "Chapter 1"])
    parts = split_book(document, len, max_part_tokens=10_000)
    assert [(p.label, p.note) for p in parts] == [
        ("Pride and Prejudice", "a title or heading only: nothing to summarize"), ("Chapter 1", "")]


def test_a_chapter_longer_than_the_context_is_split_in_parts_that_fit():
    document = chaptered([words(30), words(300), words(30)])
    parts = split_book(document, len, max_part_tokens=500)
    assert [p.label for p in parts] == ["Chapter 1", "Chapter 2 (part 1 of 3)", "Chapter 2 (part 2 of 3)",
                                        "Chapter 2 (part 3 of 3)", "Chapter 3"]
    assert all(p.end_char - p.start_char <= 500 for p in parts)
    assert "".join(document.text[p.start_char:p.end_char] for p in parts) == document.text


def test_front_matter_is_summarized_only_when_it_is_more_than_a_title_page():
    short = chaptered([words(50)])
    short = replace(short, text="Contents\n\n" + short.text, sections=[Section("Chapter 1", 10, "chapter")])
    assert [p.label for p in split_book(short, len, 10_000)] == ["Chapter 1"]
    long = replace(short, text=words(100) + short.text[10:], sections=[Section("Chapter 1", 400, "chapter")])
    assert [p.label for p in split_book(long, len, 10_000)] == ["Before Chapter 1", "Chapter 1"]


# ---- cache key, passes, export ---------------------------------------------------------------
def test_the_cache_key_changes_with_the_model_the_prompt_and_the_text():
    key = summary_key("m", "p", "t")
    assert key == summary_key("m", "p", "t")
    assert len({key, summary_key("m2", "p", "t"), summary_key("m", "p2", "t"), summary_key("m", "p", "t2")}) == 4
    assert summary_key("a|b", "c", "") != summary_key("a", "b|c", "")  # no ambiguity at the joins


def test_a_cached_summary_fills_the_outline_of_that_model_only(tmp_path):
    document, prompter = chaptered([words(20), words(20, 1)]), CharPrompter()
    first = new_outline(document, prompter, "model-a", "greedy", 4096, SummaryCache(tmp_path))
    SummaryCache(tmp_path).put(first.rows[0].key, {"summary": "Anne walks."})
    again = new_outline(document, prompter, "model-a", "greedy", 4096, SummaryCache(tmp_path))  # reopened
    assert [(t.state, t.summary) for t in again.rows] == [("cached", "Anne walks."), ("waiting", None)]
    other = new_outline(document, prompter, "model-b", "greedy", 4096, SummaryCache(tmp_path))
    assert [t.state for t in other.rows] == ["waiting", "waiting"]
    settings = new_outline(document, prompter, "model-a", "seed 1", 4096, SummaryCache(tmp_path))
    assert settings.rows[0].state == "waiting"


def test_reduce_groups_packs_consecutive_summaries_that_fit():
    fits = lambda group: sum(len(t) for t in group) <= 10  # noqa: E731
    assert reduce_groups(["aaaa", "bbbb", "cc", "dddd"], fits) == [[0, 1, 2], [3]]
    assert reduce_groups(["a", "b"], fits) == [[0, 1]]  # all fit: the last pass
    assert reduce_groups(["a" * 20, "b"], fits) == [[0], [1]]  # too long alone: a group of one


def test_the_book_summary_takes_another_pass_when_the_chapter_summaries_exceed_the_context():
    prompter = CharPrompter()
    rows = [Task(f"Chapter {i}", "", CHAPTER_PROMPT, 8, summary="x" * 40, state="done") for i in range(6)]
    outline = Outline("Book", "m", "s", rows, summary_tokens=8, book_summary_tokens=8)
    groups = next_pass(outline, prompter, max_context=130, cache=SummaryCache(None))
    assert [t.instruction for t in groups] == [GROUP_PROMPT] * 3 and groups[0].label == "Chapter 0 – Chapter 1"
    for task in groups:
        task.summary, task.state = "y" * 10, "done"
    outline.passes.append(groups)
    final = next_pass(outline, prompter, max_context=130, cache=SummaryCache(None))
    assert [(t.label, t.instruction) for t in final] == [("Book summary", BOOK_PROMPT)]
    assert final[0].text.startswith("Chapter 0 – Chapter 1: yyy")


def test_markdown_export_has_the_book_summary_labelled_and_every_row():
    rows = [Task("Chapter 1", "", CHAPTER_PROMPT, 8, summary="Anne walks.", state="done"),
            Task("Chapter 2", "", CHAPTER_PROMPT, 8, state="skipped", note="empty"),
            Task("Chapter 3", "", CHAPTER_PROMPT, 8)]
    outline = Outline("Persuasion", "m", "s", rows)
    outline.passes.append([Task("Book summary", "", BOOK_PROMPT, 8, summary="A story.", state="done")])
    text = outline_markdown(outline)
    assert text.startswith("# Persuasion\n\n## Book summary\n\n*Made from the chapter summaries.*\n\nA story.")
    assert "### Chapter 1\n\nAnne walks." in text and "### Chapter 2\n\n*(empty)*" in text
    assert "### Chapter 3\n\n*(not summarized yet)*" in text


# ---- the worker on a tiny model with the real batcher ---------------------------------------
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=0.9, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("ngram>full")


@pytest.fixture(scope="module")
def plain_engine():
    """For sampled answers compared token for token: no drafter, so no draft lengths tuned on timings
    (a sampled answer is exact in distribution with any stack, the same tokens only with the same drafts)."""
    return tiny_engine("plain")


def book() -> Document:
    return chaptered([words(24, i) for i in range(5)] + [""])  # 5 chapters of 96 tokens, one empty


def outline_of(engine, cache, sampling, document=None) -> tuple[OutlineWorker, Outline]:
    worker = OutlineWorker(engine, CharPrompter(), cache, sampling=sampling, max_batch=3)
    outline = new_outline(document or book(), CharPrompter(), "tiny", worker.sampling_id, engine.max_context,
                          cache, summary_tokens=6, book_summary_tokens=6)
    worker.start(outline, background=False)
    return worker, outline


def run_out(worker: OutlineWorker, max_rounds: int = 10_000) -> None:
    for _ in range(max_rounds):
        if worker.advance() == "idle":
            return
    raise AssertionError("the outline did not end")


def alone(engine, text: str, instruction: str, sampling: SamplingConfig, n_new: int) -> str:
    """The summary of one prompt decoded by itself, with no batch and no worker (the oracle)."""
    ids = CharPrompter().prompt_ids(text, instruction)
    session = engine.open(ids[:1])
    tokens = [t for e in session.ask(ids[1:], replace(sampling, max_new_tokens=n_new)) for t in e.tokens]
    return CharPrompter().decode(tokens)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_summaries_equal_each_chapter_summarized_alone(engine, plain_engine, sampling):
    engine = engine if sampling is GREEDY else plain_engine
    worker, outline = outline_of(engine, SummaryCache(None), sampling)
    run_out(worker)
    assert worker.batcher.n_segments > worker.batcher.n_forwards  # several chapters shared forwards
    assert [t.state for t in outline.rows] == ["done"] * 5 + ["skipped"]
    for task in outline.rows[:5]:
        assert task.summary == alone(engine, task.text, CHAPTER_PROMPT, sampling, 6)
        assert task.n_answer_tokens == 6
    assert outline.is_complete and outline.passes[-1][0].label == "Book summary"
    final = outline.passes[-1][0]
    assert outline.book_summary == alone(engine, final.text, BOOK_PROMPT, sampling, 6)


def test_a_stopped_outline_resumes_from_the_cache_and_ends_as_an_uninterrupted_one(plain_engine, tmp_path):
    engine = plain_engine
    whole_worker, whole = outline_of(engine, SummaryCache(None), SAMPLED)
    run_out(whole_worker)
    worker, outline = outline_of(engine, SummaryCache(tmp_path), SAMPLED)
    while sum(t.state == "done" for t in outline.rows) < 3:  # the first batch is done
        assert worker.advance() == "ran"
    assert worker.advance() == "ran"  # the next two started: their prompts part read
    assert [t.state for t in outline.rows[3:5]] == ["running"] * 2
    worker.cancel(outline)
    run_out(worker)
    assert outline.stopped == "cancelled" and not outline.is_complete
    assert [t.state for t in outline.rows] == ["done"] * 3 + ["waiting"] * 2 + ["skipped"]  # the app stops here
    worker, reopened = outline_of(engine, SummaryCache(tmp_path), SAMPLED)  # a new app over the same library
    assert [t.state for t in reopened.rows] == ["cached"] * 3 + ["waiting"] * 2 + ["skipped"]
    run_out(worker)
    assert [t.summary for t in reopened.rows] == [t.summary for t in whole.rows]
    assert reopened.book_summary == whole.book_summary


def test_a_question_goes_first_and_the_outline_resumes_where_it_paused(engine):
    whole_worker, whole = outline_of(engine, SummaryCache(None), GREEDY)
    run_out(whole_worker)
    readers = Batcher(background=False)  # the app's batcher, driven by hand: deterministic
    worker, outline = outline_of(engine, SummaryCache(None), GREEDY)
    worker.is_busy = lambda: bool(readers.active or readers.waiting)
    for _ in range(3):  # the outline is under way: prompts half read
        assert worker.advance() == "ran"
    n_forwards = worker.batcher.n_forwards
    question = CharPrompter().prompt_ids("Who is Anne?", "answer")
    answer = readers.ask(engine.open(question[:1]), question[1:], replace(GREEDY, max_new_tokens=8))
    n_reader_rounds = 0
    while readers.active or readers.waiting:
        assert worker.advance() == "busy"  # not one outline forward while the question is answered
        readers.round()
        n_reader_rounds += 1
    assert worker.batcher.n_forwards == n_forwards and worker.n_paused == n_reader_rounds > 1
    tokens = [t for event in answer for t in event.tokens]
    assert CharPrompter().decode(tokens) == alone(engine, "Who is Anne?", "answer", GREEDY, 8)
    run_out(worker)  # resumed: every summary as if it had never paused
    assert [t.summary for t in outline.rows] == [t.summary for t in whole.rows]
    assert outline.book_summary == whole.book_summary


def test_the_eta_comes_from_the_rate_measured_here(engine, tmp_path):
    worker, outline = outline_of(engine, SummaryCache(tmp_path), GREEDY)
    assert worker.seconds_left(outline) is None  # nothing measured for this model yet
    while not any(t.state == "done" for t in outline.rows):
        worker.advance()
    rate = SummaryCache(tmp_path).rate("tiny")  # kept for the next book
    assert rate is not None and rate > 0
    left = worker.seconds_left(outline)
    assert 0 < left <= rate * sum(t.n_prompt_tokens for t in outline.rows if t.state in ("waiting", "running"))
