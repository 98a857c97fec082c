"""The library on disk: atomic writes keep the last good file, books are stored once per text,
chats round-trip, and a prefill snapshot is used only when model, document and tokens match.

Snapshot tests run the real SmolLM2-135M (float32, one thread); they skip when it is not assembled.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from app.documents import Document, Section
from app.library import Library, atomic_write, read_json, text_sha256
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


def test_a_removed_book_leaves_the_list_and_the_disk_with_its_chats_and_snapshot(library):
    from app.reading import open_session
    from tests.conftest import tiny_engine
    from tests.engine.test_speculative import random_ids

    engine, doc_ids = tiny_engine("plain"), random_ids(40, 128, 23)
    book_id, _, _, _ = open_session(library, engine, BOOK, doc_ids)
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
