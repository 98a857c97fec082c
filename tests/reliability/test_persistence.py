"""Persistence that loses nothing: a process killed (SIGKILL) while it writes a chat leaves the last
good version readable; a prefill snapshot that was tampered with, truncated, swapped, or made by
other weights is never used (a new prefill gives the same answers a fresh one does); a full disk
is reported in the UI while the book and chat keep working, and nothing half-written is left.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from app.documents import Document
from app.library import Library, read_json
from app.session import open_book, prepare
from app.tokens import PlainChatFormat
from engine.config import SamplingConfig
from tests.reliability.conftest import LEVELS, ROOT, book_text, last, load_engine, make_app, request, run, write_book

GREEDY = SamplingConfig(max_new_tokens=12)
WRITER = """
import sys, time
from app.library import Library
library, n_chars = Library(sys.argv[1]), int(sys.argv[2])
for version in range(1, 10**6):
    print("start", version, flush=True)
    answer = str(version) * (n_chars // len(str(version)))
    library.save_chat("00000000000000aa", {"id": "chat1", "title": "Kill test", "version": version,
                                          "updated": time.time(), "turns": [{"question": "q", "answer": answer}]})
    print("done", version, flush=True)
"""


def test_a_chat_write_killed_midway_leaves_the_last_good_version(tmp_path):
    """Five SIGKILLs at random moments of a loop of 2 MB chat writes; after each, the chat on disk is
    a whole version no older than the last acknowledged one, and no temporary file is listed."""
    library, rng, n_mid_write = Library(tmp_path / "lib"), random.Random(5), 0
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(library.root), str(2_000_000)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        target, lines = rng.randint(2, 6), []
        while not lines or lines[-1] != f"start {target}\n":  # some writes completed, one begun
            lines.append(proc.stdout.readline())
        time.sleep(rng.uniform(0.0, 0.01))
        os.kill(proc.pid, signal.SIGKILL)
        lines += proc.stdout.read().splitlines()
        proc.wait()
        done = [int(line.split()[1]) for line in lines if line.startswith("done")]
        n_mid_write += lines[-1].startswith("start")  # killed between "start" and "done"
        chat = library.load_chat("00000000000000aa", "chat1")
        assert chat is not None, "the kill left an unreadable chat"
        assert chat["version"] in (done[-1], done[-1] + 1)  # the last acknowledged write, or the one in flight
        assert chat["turns"][0]["answer"] == str(chat["version"]) * (2_000_000 // len(str(chat["version"])))
        assert [c["id"] for c in library.chats("00000000000000aa")] == ["chat1"]
    assert n_mid_write >= 3, "the kills did not land while a chat was being written"


# ---- snapshots -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat(engine):
    return PlainChatFormat(engine.tokenizer)


@pytest.fixture(scope="module")
def document():
    return Document("Persuasion", book_text(3000), "txt")


def answer(engine, chat, document, library) -> tuple[str, bool]:
    book, restored = open_book(engine, chat, prepare(engine, chat, document), library)
    return list(book.ask("Who is Sir Walter Elliot?", GREEDY))[-1].answer, restored


def flip_cache_bytes(path: Path) -> None:
    """Overwrite numbers inside the saved K tensor, keeping the file a valid torch zip."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)  # the largest record: K or V
    n_name, n_extra = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + n_name + n_extra
    for i in range(start + 64, start + info.file_size - 4, 997):
        data[i:i + 4] = struct.pack("<f", 7.0)
    path.write_bytes(data)


def tamper(kind: str, library: Library, book_id: str, other_id: str) -> None:
    folder, meta = library.book_dir(book_id), library.meta(book_id)
    snapshot = folder / "snapshot.pt"
    if kind == "flipped-cache-bytes":
        before = torch.load(snapshot, weights_only=True)["cache"]
        flip_cache_bytes(snapshot)
        after = torch.load(snapshot, weights_only=True)["cache"]  # torch reads it without complaint ...
        assert not all(torch.equal(before[k], after[k]) for k in before)  # ... and the cache is wrong
    elif kind == "truncated":
        snapshot.write_bytes(snapshot.read_bytes()[: snapshot.stat().st_size // 2])
    elif kind == "other-model-hash":
        meta["snapshot"]["model_sha256"] = "file:" + "0" * 64
        (folder / "meta.json").write_text(json.dumps(meta))
    elif kind == "other-document-hash":
        meta["snapshot"]["doc_sha256"] = meta["doc_sha256"] = "f" * 64
        (folder / "meta.json").write_text(json.dumps(meta))
    elif kind == "swapped-with-rehashed-record":  # another book's valid snapshot, its hash written in
        shutil.copy(library.book_dir(other_id) / "snapshot.pt", snapshot)
        meta["snapshot"]["sha256"] = library.meta(other_id)["snapshot"]["sha256"]
        (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("kind", ["flipped-cache-bytes", "truncated", "other-model-hash", "other-document-hash",
                                  "swapped-with-rehashed-record"])
def test_a_tampered_snapshot_means_a_new_prefill_and_the_same_answer(engine, chat, document, tmp_path, kind):
    library = Library(tmp_path / "lib")
    other = Document("Other", book_text(3000, start=20_000), "txt")
    fresh, _ = answer(engine, chat, document, library)  # prefilled, snapshotted
    answer(engine, chat, other, library)
    again, restored = answer(engine, chat, document, library)
    assert restored and again == fresh  # the intact snapshot is used, and answers the same
    (book_id, other_id) = (library.add_book(d, "m", 0) for d in (document, other))
    tamper(kind, library, book_id, other_id)
    n_prefills = engine.n_prefills
    after, restored = answer(engine, chat, document, library)
    assert not restored and engine.n_prefills == n_prefills + 1 and after == fresh
    _, restored = answer(engine, chat, document, library)
    assert restored, "the new prefill was not snapshotted again"


def test_a_model_file_edited_in_place_invalidates_its_snapshots(tiny_model_dir, document, tmp_path):
    """Same folder, same name and shapes, one weight changed: the file hash tells them apart."""
    from safetensors.torch import load_file, save_file

    folder, library = tmp_path / "model", Library(tmp_path / "lib")
    shutil.copytree(tiny_model_dir, folder)
    first = load_engine(folder)
    chat = PlainChatFormat(first.tokenizer)
    _, restored = answer(first, chat, document, library)
    assert not restored and answer(first, chat, document, library)[1]
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 3.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    edited = load_engine(folder)
    assert library.model_identity(edited)["model"] == library.model_identity(first)["model"]  # name and shapes
    after, restored = answer(edited, chat, document, library)
    assert not restored, "a snapshot of other weights was used"
    fresh, _ = answer(edited, chat, document, None)
    assert after == fresh


# ---- a full disk ------------------------------------------------------------------------------------

def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_reported_and_the_book_and_chat_keep_working(engine, tmp_path, monkeypatch):
    from engine.session import Session

    app = make_app(engine, tmp_path / "lib")
    req = request("full-disk")
    assert "Ready" in last(app, run(app.load_book(str(write_book(tmp_path)), "", req)), "status")
    run(app.ask("Who is Sir Walter?", [], 0.0, 1.0, 6, 0, LEVELS, req))
    book = app.users["full-disk"].book
    chat_file = app.library.book_dir(book.book_id) / "chats" / f"{book.chat_id}.json"
    saved = chat_file.read_bytes()

    monkeypatch.setattr(os, "fsync", disk_full)  # every atomic write fails while flushing
    monkeypatch.setattr(Session, "save", lambda self, path, meta=None: Path(path).write_bytes(b"half") or
                        disk_full())  # a snapshot that runs out of room half-way
    metrics = last(app, run(app.ask("Where is Kellynch Hall?", [], 0.0, 1.0, 6, 0, LEVELS, req)), "metrics")
    assert "⚠ This chat could not be saved (the disk is full). It stays open here" in metrics, metrics
    assert "done" in metrics and len(book.turns) == 2 and chat_file.read_bytes() == saved  # the last good file

    other = write_book(tmp_path, "other.txt", start=30_000)
    status = last(app, run(app.load_book(str(other), "", req)), "status")
    assert "Ready: ask a question." in status, status
    assert ("⚠ The book could not be saved to the library (the disk is full). It is open and answers normally; "
            "next time it is read again.") in status
    assert "done" in last(app, run(app.ask("Who is Anne?", [], 0.0, 1.0, 6, 0, LEVELS, req)), "metrics")
    assert not list(app.library.root.rglob("*.tmp")) and not list(app.library.root.rglob("snapshot.pt"))[1:]

    monkeypatch.undo()  # room again: the next answer saves the chat, and the book joins the library
    metrics = last(app, run(app.ask("Who is Mary?", [], 0.0, 1.0, 6, 0, LEVELS, req)), "metrics")
    assert "could not be saved" not in metrics
    second = app.users["full-disk"].book
    assert read_json(app.library.book_dir(second.book_id) / "chats" / f"{second.chat_id}.json")["turns"]
    assert second.book_id in [b["id"] for b in app.library.books()]


# ---- what a kill leaves behind -----------------------------------------------------------------------

def test_temp_files_left_by_a_kill_are_removed_when_the_library_opens(tmp_path):
    """A kill mid-write leaves `.<name>.<random>.tmp` (JSON) and `.snapshot.<random>.tmp` (up to
    hundreds of MB); the next start removes them, however fresh, and keeps every real file."""
    root, book = tmp_path / "lib", tmp_path / "lib" / "00000000000000aa"
    (book / "chats").mkdir(parents=True)
    real = {root / "model-hashes.json": b"{}", book / "meta.json": b'{"title": "T"}',
            book / "snapshot.pt": b"snapshot", book / "chats" / "chat1.json": b'{"id": "chat1"}'}
    left = [root / ".model-hashes.json.k2j3.tmp", book / ".meta.json.x81q.tmp", book / ".snapshot.ab12.tmp",
            book / "chats" / ".chat1.json.9zz1.tmp"]
    for path, data in [*real.items(), *((p, b"half") for p in left)]:
        path.write_bytes(data)
    Library(root)
    assert sorted(p for p in root.rglob("*") if p.is_file()) == sorted(real)
    assert all(path.read_bytes() == data for path, data in real.items())


def test_a_snapshot_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    from app import snapshots

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        real_replace(src, dst)

    class Session:  # what save_snapshot uses of an engine Session
        def save(self, path, meta):
            Path(path).write_bytes(json.dumps(meta).encode() * 1000)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    snapshots.save_snapshot(tmp_path, Session(), {"n_tokens": 3})
    renamed = next(src for kind, src in events if kind == "replace")
    assert Path(renamed).name.startswith(".snapshot.")
    assert events.index(("fsync", renamed)) < events.index(("replace", renamed))  # data first, then the name
    assert events[-1] == ("fsync", str(tmp_path))  # and the folder, so the rename itself survives
    assert (tmp_path / "snapshot.pt").is_file() and not list(tmp_path.glob(".*.tmp"))
