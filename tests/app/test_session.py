"""One open book (app/session.py) on the real SmolLM2-135M: fit messages and the user's choices
when a book is too long, token -> page mapping, streamed answers with exact turn boundaries,
regenerate / edit / stop / clear rolling the cache back, autosave, and reopening from a snapshot.

float32 and one thread keep it exact and quick on 2 shared cores; answers are 8 tokens; the
retrieval level (slow at this tiny context) runs in one test only.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from app.documents import Document, Section
from app.library import Library
from app.session import (
    BookSession,
    keep_first,
    open_book,
    pick_chapters,
    prepare,
)
from engine.config import SamplingConfig
from tests.conftest import packaged_or_skip

PERSUASION = Path(__file__).resolve().parents[2] / "assets" / "persuasion.txt"
GREEDY = SamplingConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig, RetrievalConfig
    from engine.session import Engine

    packaged_or_skip("smollm2-135m")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: two spinning OpenMP threads are many times slower
    retrieval = RetrievalConfig(budget_tokens=96, sink_tokens=16, window_tokens=32, chunk_tokens=16)
    yield Engine.load(EngineConfig(target="smollm2-135m", dtype="float32", levels="ngram>full",
                                   retrieval=retrieval, prefill_chunk_tokens=128))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chat(engine):
    from tools.chat import ChatFormat

    return ChatFormat(engine.tokenizer)


@pytest.fixture(scope="module")
def document() -> Document:
    text = PERSUASION.read_text(encoding="utf-8")[:1200].strip()
    pages = [Section(str(i + 1), start, "page") for i, start in enumerate(range(0, len(text), 400))]
    return Document("Persuasion", text, "txt", pages)


@pytest.fixture
def book(engine, chat, document) -> BookSession:
    return open_book(engine, chat, prepare(engine, chat, document), None)[0]


def answer(updates) -> tuple[str, list]:
    updates = list(updates)
    return updates[-1].answer, updates


def test_fit_message_counts_tokens_against_the_budget(engine, chat, document):
    prepared = prepare(engine, chat, document)
    n = len(prepared.doc_ids)
    assert prepared.fits and prepared.fit_message() == f"{n:,} tokens of {engine.max_context - 1024:,} — fits"
    short = prepare(engine, chat, document, max_tokens=100)
    assert not short.fits and short.fit_message() == f"{n:,} tokens of 100 — too long by {n - 100:,}"


def test_keep_first_cuts_at_the_chosen_number_of_tokens(engine, chat, document):
    prepared = prepare(engine, chat, document, max_tokens=100)
    cut = keep_first(prepared, 80)
    assert document.text.startswith(cut.text) and len(cut.text) < len(document.text)
    n_overhead = len(chat.document_ids("x")) - 1
    assert 78 <= len(prepare(engine, chat, cut).doc_ids) - n_overhead <= 82
    assert cut.sections == [s for s in document.sections if s.start_char < len(cut.text)]


def test_pick_chapters_keeps_their_text_and_sections_in_book_order():
    text = "Chapter 1\n\nAnne walks.\n\nChapter 2\n\nWentworth returns.\n\nChapter 3\n\nThey marry."
    starts = [text.index(f"Chapter {i}") for i in (1, 2, 3)]
    doc = Document("P", text, "txt", [Section(f"Chapter {i + 1}", s, "chapter") for i, s in enumerate(starts)])
    picked = pick_chapters(doc, [doc.sections[2], doc.sections[0]])
    assert picked.text == "Chapter 1\n\nAnne walks.\n\nChapter 3\n\nThey marry."
    assert [s.title for s in picked.sections] == ["Chapter 1", "Chapter 3"]
    a, b = picked.span(picked.sections[1])
    assert picked.text[a:b] == "Chapter 3\n\nThey marry." and picked.title == "P (Chapter 3, Chapter 1)"


def test_token_positions_map_to_the_characters_they_came_from(engine, chat, document):
    prepared = prepare(engine, chat, document)
    ids, tokens = prepared.doc_ids, prepared.tokens
    for pos in range(tokens.shift + 5, len(ids) - 10, 37):
        piece = engine.tokenizer.decode([ids[pos]]).strip()
        at = tokens.char(pos)
        assert document.text[at:at + 40].lstrip().startswith(piece), (pos, piece, document.text[at:at + 40])


def test_answer_streams_and_records_exact_turn_boundaries(engine, book):
    book.session.set_levels("ngram>retrieval>full")  # the level whose reading the UI shows
    text, updates = answer(book.ask("Who is Sir Walter Elliot?", GREEDY))
    (turn,) = book.turns
    assert len(updates) >= 2 and updates[-1].finish_reason in ("stop", "length") and text == turn.answer
    assert turn.start == book.doc_len < turn.answer_start < turn.end == book.session.length
    assert turn.ids == book.session.tokens[turn.start:turn.end]
    assert engine.tokenizer.decode(turn.ids[turn.answer_start - turn.start:], skip_special_tokens=True).strip() == text
    assert any(u.reading for u in updates)  # the retrieval level reports what it reads


def test_second_question_reuses_the_prefilled_book(engine, book):
    n_prefills = engine.n_prefills
    answer(book.ask("Who is Sir Walter Elliot?", GREEDY))
    answer(book.ask("Where is Kellynch Hall?", GREEDY))
    first, second = book.turns
    assert engine.n_prefills == n_prefills and second.start == first.end
    assert [m["role"] for m in book.messages()] == ["user", "assistant"] * 2


def test_regenerate_rolls_back_and_greedy_gives_the_same_answer(book):
    first, _ = answer(book.ask("Who is Anne?", GREEDY))
    length = book.session.length
    again, _ = answer(book.edit_last(None, GREEDY))  # regenerate
    assert again == first and len(book.turns) == 1 and book.session.length == length


def test_edit_last_replaces_the_question_and_clear_starts_a_new_chat(book):
    answer(book.ask("Who is Anne?", GREEDY))
    old_chat = book.chat_id
    answer(book.edit_last("Who is Mary?", GREEDY))
    assert [t.question for t in book.turns] == ["Who is Mary?"] and book.turns[0].start == book.doc_len
    book.clear()
    assert book.turns == [] and book.session.length == book.doc_len and book.chat_id != old_chat


def test_stop_keeps_the_partial_answer_and_the_book_answers_again(book):
    cancel = threading.Event()
    updates = []
    for update in book.ask("Tell me everything about the Elliot family.", SamplingConfig(max_new_tokens=60),
                           cancel=cancel):
        updates.append(update)
        cancel.set()
    (turn,) = book.turns
    assert updates[-1].finish_reason == "cancelled" and turn.finish_reason == "cancelled"
    assert turn.end == book.session.length and "*(stopped)*" in book.messages()[-1]["content"]
    cancel.clear()
    answer(book.ask("Who is Anne?", GREEDY))
    assert book.turns[1].start == turn.end


def test_a_caller_going_away_mid_answer_keeps_the_turn_and_frees_the_session(book):
    updates = book.ask("Tell me everything about the Elliot family.", SamplingConfig(max_new_tokens=60))
    next(updates)
    updates.close()  # what Gradio does when the browser tab closes during an answer
    (turn,) = book.turns
    assert turn.finish_reason == "cancelled" and turn.end == book.session.length
    assert not book.session.lock.locked()
    answer(book.ask("Who is Anne?", GREEDY))
    assert book.turns[1].start == turn.end


def test_cancel_before_the_question_is_in_leaves_the_session_as_it_was(book):
    cancel = threading.Event()
    cancel.set()
    updates = list(book.ask("Who is Anne?", GREEDY, cancel=cancel))  # stopped while the question is read
    assert [u.finish_reason for u in updates] == ["cancelled"] and updates[0].answer == ""
    assert book.turns == [] and book.session.length == book.doc_len
    fresh, _ = answer(book.ask("Who is Anne?", GREEDY))
    assert fresh


def test_passages_label_document_ranges_and_skip_the_chat_window(book):
    shift = book.tokens.shift
    ranges = [(shift, shift + 30, 0.7), (book.doc_len + 2, book.doc_len + 9, 0.3)]
    (passage,) = book.passages(ranges)
    assert passage.label == "p. 1" and passage.share == 0.7 and passage.snippet.startswith("Persuasion")
    assert book.passages(None) is None


def test_chat_autosaves_and_reopens_from_the_snapshot(engine, chat, document, tmp_path):
    library = Library(tmp_path)
    book, restored = open_book(engine, chat, prepare(engine, chat, document), library)
    answer(book.ask("Who is Sir Walter Elliot?", GREEDY))
    n_prefills = engine.n_prefills
    again, restored = open_book(engine, chat, prepare(engine, chat, document), library)
    assert restored and engine.n_prefills == n_prefills and again.session.length == again.doc_len
    (summary,) = library.chats(again.book_id)
    again.load_chat(library.load_chat(again.book_id, summary["id"]))
    assert again.messages() == book.messages() and again.session.tokens == book.session.tokens
    answer(again.ask("Where is Kellynch Hall?", GREEDY))
    assert again.turns[1].start == book.turns[0].end and library.chats(again.book_id)[0]["n_turns"] == 2


def test_exports_hold_every_turn(book):
    from app.library import chat_export_json, chat_markdown

    answer(book.ask("Who is Anne?", GREEDY))
    md, js = chat_markdown(book.to_json()), chat_export_json(book.to_json())
    assert md.startswith("# Persuasion") and "**You:** Who is Anne?" in md and book.turns[0].answer in md
    assert '"question": "Who is Anne?"' in js and '"ids"' not in js
