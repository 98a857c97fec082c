"""The library on disk: atomic writes keep the last good file, books are stored once per text,
chats round-trip, and a prefill snapshot is used only when model, document and tokens match.

Snapshot tests run the real SmolLM2-135M (float32, one thread); they skip when it is not assembled.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from app.documents import Document, Section
from app.library import Library, atomic_write, model_fingerprint, read_json, text_sha256
from engine import models
from tests.conftest import packaged_or_skip

BOOK = Document("A Short Book", "Chapter 1\n\nIt was a dark night.\n\nChapter 2\n\nMorning came.", "txt",
                [Section("Chapter 1", 0, "chapter"), Section("Chapter 2", 33, "chapter")])


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.session import Engine

    packaged_or_skip("smollm2-135m")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: two spinning OpenMP threads are many times slower
    yield Engine.load(EngineConfig(target="smollm2-135m", dtype="float32", levels="ngram>full"))
    torch.set_num_threads(threads)


@pytest.fixture
def library(tmp_path):
    return Library(tmp_path / "lib")


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "chat.json"
    atomic_write(path, b'{"v": 1}')

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, b'{"v": 2}')
    assert read_json(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]  # no temp file left behind


def test_read_json_treats_a_torn_file_as_missing(tmp_path):
    (tmp_path / "torn.json").write_text('{"turns": [1, 2')
    assert read_json(tmp_path / "torn.json") is None and read_json(tmp_path / "absent.json") is None


def test_a_book_is_stored_once_per_text_and_its_document_round_trips(library):
    first = library.add_book(BOOK, "model-a", 40)
    again = library.add_book(BOOK, "model-b", 41)
    assert first == again == text_sha256(BOOK.text)[:16]
    (meta,) = library.books()
    assert meta["title"] == "A Short Book" and meta["model"] == "model-b" and meta["n_tokens"] == 41
    restored = library.document(first)
    assert restored == BOOK and restored.label_range(40, 45) == "Chapter 2"


def test_books_are_listed_most_recently_opened_first(library):
    a = library.add_book(BOOK, "m", 1)
    b = library.add_book(Document("Other", "Different text.", "txt"), "m", 1)
    assert [m["id"] for m in library.books()] == [b, a]
    library.touch(a)
    assert [m["id"] for m in library.books()] == [a, b]


def test_chats_round_trip_and_bad_files_or_ids_are_ignored(library):
    book_id = library.add_book(BOOK, "m", 1)
    chat = {"id": "abc123", "title": "Who?", "updated": 2.0, "turns": [{"question": "Who?"}]}
    library.save_chat(book_id, chat)
    library.save_chat(book_id, {"id": "def456", "title": "Old", "updated": 1.0, "turns": [{}]})
    library.save_chat(book_id, {"id": "empty1", "title": "Empty", "updated": 3.0, "turns": []})
    (library.book_dir(book_id) / "chats" / "torn.json").write_text("{")
    assert [c["id"] for c in library.chats(book_id)] == ["abc123", "def456"]
    assert library.load_chat(book_id, "abc123") == chat
    assert library.load_chat(book_id, "../meta") is None
    with pytest.raises(ValueError):
        library.save_chat(book_id, {"id": "../../escape"})
    with pytest.raises(ValueError):
        library.book_dir("../etc")


def test_snapshot_restores_only_for_the_same_model_document_and_tokens(library, engine):
    doc_ids = engine.tokenizer("It was a dark and stormy night; the rain fell in torrents.")["input_ids"]
    identity, sha = library.model_identity(engine), text_sha256(BOOK.text)
    # the weights' hash, not just the name: the GGUF file's, whose blocks the engine reads
    assert identity["model_sha256"] == "gguf:" + models.PACKAGED_MODELS["smollm2-135m"].sha256
    book_id = library.add_book(BOOK, identity["model"], len(doc_ids))
    session = engine.open(doc_ids)
    library.save_snapshot(book_id, session, identity, sha)
    n_prefills = engine.n_prefills

    restored = library.restore_snapshot(book_id, engine, identity, sha, doc_ids)
    assert restored is not None and restored.tokens == doc_ids and engine.n_prefills == n_prefills
    assert torch.equal(restored.full.k[:, :, :, :len(doc_ids)], session.full.k[:, :, :, :len(doc_ids)])
    assert library.restore_snapshot(book_id, engine, {**identity, "model": "another-model"}, sha, doc_ids) is None
    assert library.restore_snapshot(book_id, engine, {**identity, "model_sha256": "file:0"}, sha, doc_ids) is None
    assert library.restore_snapshot(book_id, engine, identity, text_sha256("another text"), doc_ids) is None
    assert library.restore_snapshot(book_id, engine, identity, sha, doc_ids[:-1]) is None
    assert library.restore_snapshot(book_id, engine, identity, sha, doc_ids[:-1] + [doc_ids[0]]) is None
    saved = json.loads((library.book_dir(book_id) / "meta.json").read_text())["snapshot"]
    assert saved["model"] == identity["model"] and saved["model_sha256"] == identity["model_sha256"]


def test_the_weights_identity_of_a_gguf_read_as_blocks_needs_no_converted_copy(engine, monkeypatch, tmp_path):
    """A first start on a CPU assembles the GGUF only (setup.sh --no-convert): saving a book must
    not convert it after all (4.6 GB for the default pair) just to hash the weights."""
    from app.snapshots import weights_sha256

    def no_conversion(source):
        raise AssertionError(f"converted {source} to hash it")

    monkeypatch.setattr(models, "resolve_model", no_conversion)
    assert weights_sha256(engine, tmp_path / "hashes.json") == "gguf:" + models.PACKAGED_MODELS["smollm2-135m"].sha256


def test_a_truncated_snapshot_means_a_new_prefill_not_an_error(library, engine):
    doc_ids = engine.tokenizer("Call me Ishmael. Some years ago, never mind how long.")["input_ids"]
    identity, sha = library.model_identity(engine), text_sha256(BOOK.text)
    book_id = library.add_book(BOOK, identity["model"], len(doc_ids))
    library.save_snapshot(book_id, engine.open(doc_ids), identity, sha)
    path = library.book_dir(book_id) / "snapshot.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert library.restore_snapshot(book_id, engine, identity, sha, doc_ids) is None


def test_a_stopped_reading_is_kept_and_the_next_opening_reads_on_from_it(library, monkeypatch):
    """A long book is read in parts; a Stop keeps what was read (listed as "…% read"), and the next
    opening reads on from there to the KV of one uninterrupted read, then keeps only the snapshot."""
    from app import reading
    from app.reading import ReadingStopped
    from tests.conftest import tiny_engine
    from tests.engine.test_speculative import random_ids

    monkeypatch.setattr(reading, "READ_PART_TOKENS", 16)  # two chunks of 7 a part
    engine, doc_ids = tiny_engine("ngram>retrieval>full"), random_ids(60, 128, 21)
    book_id, cancel, seen = text_sha256(BOOK.text)[:16], threading.Event(), []

    def stop_in_the_third_part(done, total):  # after its first chunk
        seen.append(done)
        if done >= 35:
            cancel.set()
    with pytest.raises(ReadingStopped, match=r"Stopped after reading 58% of the book \(35 of 60 tokens\)"):
        library.open_session(engine, BOOK, doc_ids, stop_in_the_third_part, cancel)
    assert seen == [7, 14, 21, 28, 35]  # the whole book's progress, part after part
    assert library.n_read(book_id) == 35 and library.choices(None)[0] == [("58% read · A Short Book", book_id)]
    assert library.n_read(book_id, "another model") == 0
    assert library.choices(None, "another model")[0] == [("A Short Book", book_id)]  # it would read from 0

    resumed, seen = [], []
    _, session, restored, note = library.open_session(engine, BOOK, doc_ids, lambda done, total: seen.append(done),
                                                      None, lambda *args: resumed.append(args))
    assert resumed == [(35, None)] and seen == [42, 49, 56, 60] and not restored and note is None
    whole = engine.open(doc_ids)
    assert session.tokens == doc_ids and torch.equal(session.full.k[..., :60, :], whole.full.k[..., :60, :])
    assert library.n_read(book_id) == 0 and not (library.book_dir(book_id) / "partial.pt").exists()
    assert library.choices(None)[0] == [("A Short Book", book_id)]
    assert library.open_session(engine, BOOK, doc_ids)[2]  # now the whole snapshot restores


def test_a_reading_that_crashes_keeps_its_last_save_and_one_by_another_model_is_not_read_on(library, monkeypatch):
    from app import reading
    from tests.conftest import tiny_engine
    from tests.engine.test_speculative import random_ids

    monkeypatch.setattr(reading, "READ_PART_TOKENS", 16)
    monkeypatch.setattr(reading, "SAVE_READING_EVERY_S", 0.0)  # saved after every part
    engine, doc_ids = tiny_engine("plain"), random_ids(60, 128, 22)
    book_id = text_sha256(BOOK.text)[:16]

    def crash(done, total):
        if done == 35:
            assert library.n_read(book_id) == 28  # saved after the last part (a kill would keep this)
            raise MemoryError("out of memory")
    with pytest.raises(MemoryError):
        library.open_session(engine, BOOK, doc_ids, crash)
    assert library.n_read(book_id) == 35  # every chunk read, the failed part's first one too
    def disk_full(*args):
        raise OSError(28, "No space left on device")
    cancel = threading.Event()
    monkeypatch.setattr(library, "save_reading", disk_full)
    with pytest.raises(reading.ReadingStopped, match=r"\(42 of 60 tokens\)\. The disk took only its first 35 tokens"):
        library.open_session(engine, BOOK, doc_ids, lambda done, total: done >= 42 and cancel.set(), cancel)
    monkeypatch.undo()
    assert library.n_read(book_id) == 35

    other = tiny_engine("plain", seed=5)  # other weights: its reading starts again
    resumed = []
    library.open_session(other, BOOK, doc_ids, on_resume=lambda *args: resumed.append(args))
    assert resumed == []


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_book_that_begins_as_one_read_before_reads_only_the_rest(library, dtype):
    """Its first 16K tokens read, then its first 32K (here 40 of 60 tokens in chunks of 7): the
    whole chunks the two share come from the first reading's snapshot, the rest is read, and the
    KV is that of one reading, bit for bit. Another model, or a text that begins otherwise, reads all."""
    from tests.conftest import tiny_engine
    from tests.engine.test_speculative import random_ids

    engine, doc_ids = tiny_engine("ngram>retrieval>full", dtype=dtype), random_ids(60, 128, 23)
    opening = "It was a truth universally acknowledged. " * 60  # 2,400 characters both texts begin with
    first = Document("Emma (first part)", opening + "Chapter 2. Morning came.", "txt")
    longer = Document("Emma", opening + "Chapter 2. Morning came, and with it the rain.", "txt")
    library.open_session(engine, first, doc_ids[:40])
    assert library.read_before(longer.text, model_fingerprint(engine), 7).title == "Emma (first part)"

    resumed, seen = [], []
    _, session, restored, _ = library.open_session(engine, longer, doc_ids, lambda done, total: seen.append(done),
                                                   None, lambda *args: resumed.append(args))
    whole = engine.open(doc_ids)
    assert resumed == [(35, "Emma (first part)")] and seen == [42, 49, 56, 60] and not restored
    assert session.tokens == doc_ids and session.full.capacity == whole.full.capacity
    assert torch.equal(session.full.k[..., :60, :], whole.full.k[..., :60, :])
    assert torch.equal(session.full.v[..., :60, :], whole.full.v[..., :60, :])
    assert library.open_session(engine, longer, doc_ids)[2]  # and it has a snapshot of its own

    resumed.clear()
    library.open_session(tiny_engine("ngram>retrieval>full", seed=5, dtype=dtype), longer, doc_ids,
                         on_resume=lambda *args: resumed.append(args))
    other = Document("Persuasion", "Sir Walter Elliot, of Kellynch Hall. " * 70, "txt")
    library.open_session(engine, other, doc_ids[:40] + random_ids(10, 128, 24), on_resume=lambda *a: resumed.append(a))
    assert resumed == []  # another model's reading, a text that begins otherwise: read from the start


def test_a_removed_book_leaves_the_list_and_the_disk_with_its_chats_and_snapshot(library):
    from tests.conftest import tiny_engine
    from tests.engine.test_speculative import random_ids

    engine, doc_ids = tiny_engine("plain"), random_ids(40, 128, 23)
    book_id, _, _, _ = library.open_session(engine, BOOK, doc_ids)
    library.save_chat(book_id, {"id": "c1", "turns": [{"question": "q"}]})
    other = library.add_book(Document("Another", "Other text.", "txt"), "m", 3)
    folder = library.book_dir(book_id)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert (folder / "snapshot.pt").is_file() and library.book_bytes(book_id) == size > 0
    assert library.remove_book(book_id) == size
    assert not folder.exists() and [b["id"] for b in library.books()] == [other]
    assert not list(library.root.glob(".*"))  # nothing left behind
    (library.root / f".{book_id}.removed").mkdir()  # a removal a kill cut short
    assert not list(Library(library.root).root.glob(".*"))
