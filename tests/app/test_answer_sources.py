"""Sources kept with every answer (app/session.py + app/sources.py) on the real SmolLM2-135M: they
are passages of the book at their stored places, the answer is the one asked without them, the
re-read prompt is answered exactly as the target answers that prompt, the context budget drops
passages before it would cut the answer, and the sources go out with the export and come back
with the chat. float32, one thread, 6-token answers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from app.documents import Document, Section
from app.library import chat_export_json, chat_markdown
from app.session import BookSession, open_book, prepare
from app.sources import REREAD_HEADER, Source, with_passages
from engine.config import SamplingConfig
from tests.conftest import packaged_or_skip

PERSUASION = Path(__file__).resolve().parents[2] / "assets" / "persuasion.txt"
GREEDY = SamplingConfig(max_new_tokens=6)
QUESTION = "Which book does Sir Walter Elliot like to read?"


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.session import Engine

    packaged_or_skip("smollm2-135m")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.load(EngineConfig(target="smollm2-135m", dtype="float32", levels="ngram>full",
                                   prefill_chunk_tokens=128))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chat(engine):
    from tools.chat import ChatFormat

    return ChatFormat(engine.tokenizer)


@pytest.fixture(scope="module")
def document() -> Document:
    text = PERSUASION.read_text(encoding="utf-8")[:2400].strip()
    pages = [Section(str(i + 1), start, "page") for i, start in enumerate(range(0, len(text), 800))]
    return Document("Persuasion", text, "txt", pages)


@pytest.fixture
def book(engine, chat, document) -> BookSession:
    return open_book(engine, chat, prepare(engine, chat, document), None)[0]


def plain_answer(engine, book: BookSession, q_ids: list[int]) -> list[int]:
    """The target's own answer to `q_ids` after the book, on a session that never scored anything."""
    session = engine.open(book.doc_ids)
    return [t for e in session.ask(q_ids, GREEDY, stop_ids=book.chat.stop_ids) for t in e.tokens]


def test_sources_are_passages_of_the_book_and_leave_the_answer_unchanged(engine, book):
    *_, last = book.ask(QUESTION, GREEDY)
    turn = book.turns[-1]
    assert 1 <= len(turn.sources) <= 3 and not turn.reread
    for stored in turn.sources:
        source = Source.from_json(stored)
        assert " ".join(book.document.text[source.start_char:source.end_char].split()) == source.text
        assert source.label.startswith("p") and 0 < source.share <= 1
    shares = [s["share"] for s in turn.sources]
    assert shares == sorted(shares, reverse=True)
    q_ids = book.chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    assert turn.ids[:turn.answer_start - turn.start] == q_ids  # the prompt is the question alone
    assert turn.ids[turn.answer_start - turn.start:] == plain_answer(engine, book, q_ids)
    assert "**Sources:** [1] p" in book.messages()[-1]["content"]


def test_reread_quotes_the_sources_after_the_question_and_decodes_that_prompt_exactly(engine, book):
    list(book.ask(QUESTION, GREEDY, reread=True))
    turn = book.turns[-1]
    assert turn.reread and turn.sources
    sources = [Source.from_json(s) for s in turn.sources]
    q_ids = book.chat.question_ids(with_passages(QUESTION, sources), is_first=True, previous_answer_ended=False)
    assert turn.ids[:turn.answer_start - turn.start] == q_ids
    prompt = engine.tokenizer.decode(q_ids)
    assert f"{QUESTION}\n\n{REREAD_HEADER}\n[1] ({sources[0].label}) \"{sources[0].text}\"" in prompt
    assert turn.ids[turn.answer_start - turn.start:] == plain_answer(engine, book, q_ids)
    list(book.ask("And his estate?", GREEDY, reread=True))  # a later turn: earlier passages stay in the chat
    assert book.turns[-1].start == turn.end and book.turns[-1].reread


def test_passages_that_would_leave_no_room_for_the_answer_are_dropped(engine, book):
    cancel = threading.Event()
    room = engine.max_context - book.session.length - 40  # the question fits, its passages do not
    for _ in book.ask(QUESTION, SamplingConfig(max_new_tokens=room), cancel, reread=True):
        cancel.set()  # one step is enough to see the prompt
    turn = book.turns[-1]
    assert not turn.reread and turn.sources == []
    q_ids = book.chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    assert turn.ids[:turn.answer_start - turn.start] == q_ids


def test_a_chat_that_filled_the_context_says_so_and_keeps_the_chat(engine, book, monkeypatch):
    from app.session import ChatFull
    from engine.session import Engine

    list(book.ask(QUESTION, GREEDY, reread=True))  # the passages stay in the conversation
    n_held, turns = book.session.length, list(book.turns)
    monkeypatch.setattr(Engine, "max_context", property(lambda self: n_held + 5))
    with pytest.raises(ChatFull, match="New chat") as error:
        list(book.ask("And which county?", GREEDY, reread=True))
    assert (error.value.n_book, error.value.n_chat) == (book.doc_len, n_held - book.doc_len)
    assert book.session.length == n_held and book.turns == turns  # nothing lost, nothing half-asked


def test_sources_are_exported_and_come_back_with_the_chat(engine, chat, document, book):
    list(book.ask(QUESTION, GREEDY, reread=True))
    saved = book.to_json()
    markdown, exported = chat_markdown(saved), json.loads(chat_export_json(saved))
    first = saved["turns"][0]["sources"][0]
    assert "Sources (quoted after the question: re-read before answering):" in markdown
    assert f"1. {first['label']}" in markdown and first["text"] in markdown
    assert exported["turns"][0]["sources"] == saved["turns"][0]["sources"]
    again = open_book(engine, chat, prepare(engine, chat, document), None)[0]
    again.load_chat(json.loads(json.dumps(saved)))
    assert again.turns[0].sources == saved["turns"][0]["sources"] and again.turns[0].reread
    assert again.messages() == book.messages()


def test_a_chat_saved_before_sources_still_opens(engine, chat, document, book):
    list(book.ask(QUESTION, GREEDY))
    saved = book.to_json()
    for turn in saved["turns"]:
        for key in ("sources", "quotes", "reread"):
            del turn[key]
    book.load_chat(saved)
    assert book.turns[0].sources == [] and "Sources" not in book.messages()[-1]["content"]
    assert "Sources" not in chat_markdown(book.to_json())
