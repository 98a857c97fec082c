"""Opening a book (app/reading.py `open_session`): its snapshot, else a reading in parts that is
kept when it stops and read on from there, or started from the chunks it shares with another book's
reading; the KV is that of one uninterrupted reading, bit for bit. The library (app/library.py) is
the store the reading calls, never the other way round.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from app import reading
from app.documents import Document
from app.library import Library, model_fingerprint, text_sha256
from app.reading import ReadingStopped, open_session
from tests.app.test_library import BOOK
from tests.conftest import tiny_engine
from tests.engine.test_speculative import random_ids

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def library(tmp_path):
    return Library(tmp_path / "lib")


def test_the_library_is_a_store_that_never_calls_the_reading_workflow():
    """app/reading.py calls the library; the library imports nothing of it (no import inside a
    method either) and has no workflow of its own."""
    tree = ast.parse((ROOT / "app" / "library.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {"app.reading", "app.session", "app.ui"} & imported
    assert not hasattr(Library, "open_session")


def test_a_stopped_reading_is_kept_and_the_next_opening_reads_on_from_it(library, monkeypatch):
    """A long book is read in parts; a Stop keeps what was read (listed as "…% read"), and the next
    opening reads on from there to the KV of one uninterrupted read, then keeps only the snapshot."""
    monkeypatch.setattr(reading, "READ_PART_TOKENS", 16)  # two chunks of 7 a part
    engine, doc_ids = tiny_engine("ngram>retrieval>full"), random_ids(60, 128, 21)
    book_id, cancel, seen = text_sha256(BOOK.text)[:16], threading.Event(), []

    def stop_in_the_third_part(done, total):  # after its first chunk
        seen.append(done)
        if done >= 35:
            cancel.set()
    with pytest.raises(ReadingStopped, match=r"Stopped after reading 58% of the book \(35 of 60 tokens\)"):
        open_session(library, engine, BOOK, doc_ids, stop_in_the_third_part, cancel)
    assert seen == [7, 14, 21, 28, 35]  # the whole book's progress, part after part
    assert library.n_read(book_id) == 35 and library.choices(None)[0] == [("58% read · A Short Book", book_id)]
    assert library.n_read(book_id, "another model") == 0
    assert library.choices(None, "another model")[0] == [("A Short Book", book_id)]  # it would read from 0

    resumed, seen = [], []
    _, session, restored, note = open_session(library, engine, BOOK, doc_ids, lambda done, total: seen.append(done),
                                              None, lambda *args: resumed.append(args))
    assert resumed == [(35, None)] and seen == [42, 49, 56, 60] and not restored and note is None
    whole = engine.open(doc_ids)
    assert session.tokens == doc_ids and torch.equal(session.full.k[..., :60, :], whole.full.k[..., :60, :])
    assert library.n_read(book_id) == 0 and not (library.book_dir(book_id) / "partial.pt").exists()
    assert library.choices(None)[0] == [("A Short Book", book_id)]
    assert open_session(library, engine, BOOK, doc_ids)[2]  # now the whole snapshot restores


def test_a_reading_that_crashes_keeps_its_last_save_and_one_by_another_model_is_not_read_on(library, monkeypatch):
    monkeypatch.setattr(reading, "READ_PART_TOKENS", 16)
    monkeypatch.setattr(reading, "SAVE_READING_EVERY_S", 0.0)  # saved after every part
    engine, doc_ids = tiny_engine("plain"), random_ids(60, 128, 22)
    book_id = text_sha256(BOOK.text)[:16]

    def crash(done, total):
        if done == 35:
            assert library.n_read(book_id) == 28  # saved after the last part (a kill would keep this)
            raise MemoryError("out of memory")
    with pytest.raises(MemoryError):
        open_session(library, engine, BOOK, doc_ids, crash)
    assert library.n_read(book_id) == 35  # every chunk read, the failed part's first one too
    def disk_full(*args):
        raise OSError(28, "No space left on device")
    cancel = threading.Event()
    monkeypatch.setattr(library, "save_reading", disk_full)
    with pytest.raises(ReadingStopped, match=r"\(42 of 60 tokens\)\. The disk took only its first 35 tokens"):
        open_session(library, engine, BOOK, doc_ids, lambda done, total: done >= 42 and cancel.set(), cancel)
    monkeypatch.undo()
    assert library.n_read(book_id) == 35

    other = tiny_engine("plain", seed=5)  # other weights: its reading starts again
    resumed = []
    open_session(library, other, BOOK, doc_ids, on_resume=lambda *args: resumed.append(args))
    assert resumed == []


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_book_that_begins_as_one_read_before_reads_only_the_rest(library, dtype):
    """Its first 16K tokens read, then its first 32K (here 40 of 60 tokens in chunks of 7): the
    whole chunks the two share come from the first reading's snapshot, the rest is read, and the
    KV is that of one reading, bit for bit. Another model, or a text that begins otherwise, reads all."""
    engine, doc_ids = tiny_engine("ngram>retrieval>full", dtype=dtype), random_ids(60, 128, 23)
    opening = "It was a truth universally acknowledged. " * 60  # 2,400 characters both texts begin with
    first = Document("Emma (first part)", opening + "Chapter 2. Morning came.", "txt")
    longer = Document("Emma", opening + "Chapter 2. Morning came, and with it the rain.", "txt")
    open_session(library, engine, first, doc_ids[:40])
    assert library.read_before(longer.text, model_fingerprint(engine), 7).title == "Emma (first part)"

    resumed, seen = [], []
    _, session, restored, _ = open_session(library, engine, longer, doc_ids, lambda done, total: seen.append(done),
                                           None, lambda *args: resumed.append(args))
    whole = engine.open(doc_ids)
    assert resumed == [(35, "Emma (first part)")] and seen == [42, 49, 56, 60] and not restored
    assert session.tokens == doc_ids and session.full.capacity == whole.full.capacity
    assert torch.equal(session.full.k[..., :60, :], whole.full.k[..., :60, :])
    assert torch.equal(session.full.v[..., :60, :], whole.full.v[..., :60, :])
    assert open_session(library, engine, longer, doc_ids)[2]  # and it has a snapshot of its own

    resumed.clear()
    open_session(library, tiny_engine("ngram>retrieval>full", seed=5, dtype=dtype), longer, doc_ids,
                 on_resume=lambda *args: resumed.append(args))
    other = Document("Persuasion", "Sir Walter Elliot, of Kellynch Hall. " * 70, "txt")
    open_session(library, engine, other, doc_ids[:40] + random_ids(10, 128, 24),
                 on_resume=lambda *a: resumed.append(a))
    assert resumed == []  # another model's reading, a text that begins otherwise: read from the start
