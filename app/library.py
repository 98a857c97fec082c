"""Books and their chats on disk, written so that a crash never leaves a half-written file.

    <root>/<book_id>/meta.json              title, doc_sha256, model, n_tokens, created, opened, head, snapshot
    <root>/<book_id>/document.json          the Document (text + sections): a book reopens without its file
    <root>/<book_id>/chats/<chat_id>.json   messages, token boundaries and token ids of every turn (export: .md / .json)
    <root>/<book_id>/snapshot.pt            the prefill snapshot (engine `Session.save`)
    <root>/<book_id>/partial.pt             the reading so far of a book whose prefill stopped
    <root>/model-hashes.json                sha256 of model weight files, by path, size and mtime

`book_id` is the start of the sha256 of the prefilled text, so the same text is one book. Every
write is atomic (app/storage.py): a kill or a full disk leaves the last good file. A snapshot is
used only when the model (id, shapes, weight-file hash), the document hash, the file's own hash
and its tokens all match (app/snapshots.py); anything else means a new prefill, never wrong
answers. A long book is read in parts, and a reading that stops (Stop, a closed tab, a crash) is
kept: the next opening of the book reads on from there.
This module is the store: what to restore, read and save when a book opens is app/reading.py's
`open_session`, which calls it (never the other way round). It knows nothing of Gradio and does
not tokenise (app/session.py does).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.documents import Document, Section
from app.snapshots import PARTIAL, SNAPSHOT, load_snapshot, model_fingerprint, save_snapshot, weights_sha256
from app.sources import export_lines
from app.storage import atomic_write, read_json, remove_temp_files, write_json

if TYPE_CHECKING:
    from engine.session import Engine, Session

__all__ = ["Library", "atomic_write", "book_id_of", "chat_export_json", "chat_markdown", "default_root",
           "model_fingerprint", "read_json", "text_sha256", "write_export", "write_json"]


def default_root() -> Path:
    """$BOOKCHAT_LIBRARY, else ~/.local/share/bookchat."""
    return Path(os.environ.get("BOOKCHAT_LIBRARY") or Path.home() / ".local" / "share" / "bookchat")


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def book_id_of(text: str) -> str:
    """The library's id of a text (as `add_book` names it): the start of its sha256."""
    return text_sha256(text)[:16]


def chat_markdown(chat: dict) -> str:
    """A chat (`BookSession.to_json()`) as Markdown for people."""
    lines = [f"# {chat.get('book', 'Chat')}", "", f"Exported {time.strftime('%Y-%m-%d %H:%M')}", ""]
    for turn in chat["turns"]:
        lines += [f"**You:** {turn['question']}", "", turn["answer"], "", *export_lines(turn)]
    return "\n".join(lines)


def chat_export_json(chat: dict) -> str:
    """A chat as JSON for programs: messages, turns and their token boundaries, without token ids."""
    turns = [{k: v for k, v in turn.items() if k != "ids"} for turn in chat["turns"]]
    return json.dumps({**chat, "turns": turns}, ensure_ascii=False, indent=1)


def write_export(chat: dict, fmt: str) -> Path:
    """The chat in a new temporary file named after the book, for a download button."""
    slug = re.sub(r"[^\w-]+", "-", str(chat.get("book", "")).lower()).strip("-")[:40] or "chat"
    path = Path(tempfile.mkdtemp(prefix="bookchat-export-")) / f"{slug}-chat.{'json' if fmt == 'json' else 'md'}"
    path.write_text(chat_export_json(chat) if fmt == "json" else chat_markdown(chat), encoding="utf-8")
    return path


def document_to_json(document: Document) -> dict:
    return {"title": document.title, "text": document.text, "source_format": document.source_format,
            "sections": [[s.title, s.start_char, s.kind] for s in document.sections]}


def document_from_json(obj: dict) -> Document:
    sections = [Section(title, int(start), kind) for title, start, kind in obj.get("sections", [])]
    return Document(obj["title"], obj["text"], obj["source_format"], sections)


MIN_SHARED_CHARS = 2_000  # about a prefill chunk of text: less is not worth a snapshot's load


@dataclass(frozen=True)
class SharedStart:
    """Another book's reading that a text starts as (`Library.read_before`)."""

    book_id: str
    name: str  # SNAPSHOT or PARTIAL
    record: dict  # its meta.json record
    title: str
    n_chars: int  # characters the two texts share from the start


class Library:
    """The books a user has read, one folder each under `root`."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        remove_temp_files(self.root)  # left by a kill mid-write (a snapshot's can be hundreds of MB)
        for removed in self.root.glob(".*.removed"):  # a book whose removal a kill cut short
            shutil.rmtree(removed, ignore_errors=True)
        self._identities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> model_identity

    def book_dir(self, book_id: str) -> Path:
        if not book_id or not all(c in "0123456789abcdef" for c in book_id):
            raise ValueError(f"not a book id: {book_id!r}")
        return self.root / book_id

    def add_book(self, document: Document, model: str, n_tokens: int) -> str:
        """Store a book (once per text) and return its id; an existing book is marked opened."""
        sha = text_sha256(document.text)
        book_id = sha[:16]
        folder = self.book_dir(book_id)
        meta = read_json(folder / "meta.json") or {"title": document.title, "doc_sha256": sha,
                                                   "created": time.time()}
        if read_json(folder / "document.json") is None:
            write_json(folder / "document.json", document_to_json(document))
        meta.update(model=model, n_tokens=n_tokens, opened=time.time(), head=_head(document.text))
        write_json(folder / "meta.json", meta)
        return book_id

    def touch(self, book_id: str) -> None:
        meta = self.meta(book_id)
        if meta is not None:
            meta["opened"] = time.time()
            write_json(self.book_dir(book_id) / "meta.json", meta)

    def book_bytes(self, book_id: str) -> int:
        """Disk space the book takes: its text, chats, snapshot and saved reading."""
        return sum(p.stat().st_size for p in self.book_dir(book_id).rglob("*") if p.is_file())

    def remove_book(self, book_id: str) -> int:
        """Delete the book with its chats, snapshot and saved reading; returns the bytes freed. It
        leaves the list at once (a rename), so a kill mid-deletion leaves no half book."""
        folder, n_bytes = self.book_dir(book_id), self.book_bytes(book_id)
        removed = self.root / f".{book_id}.removed"
        os.replace(folder, removed)
        shutil.rmtree(removed, ignore_errors=True)
        return n_bytes

    def meta(self, book_id: str) -> dict | None:
        return read_json(self.book_dir(book_id) / "meta.json")

    def books(self) -> list[dict]:
        """Every readable book's meta (with its `id`), the most recently opened first."""
        found = []
        for folder in self.root.iterdir():
            meta = read_json(folder / "meta.json") if folder.is_dir() else None
            if meta and "title" in meta:
                found.append({**meta, "id": folder.name})
        return sorted(found, key=lambda m: -float(m.get("opened", m.get("created", 0))))

    def choices(self, book_id: str | None, model: str | None = None
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(label, id) pairs for pickers: every book (how much a stopped reading by `model`, a
        `model_fingerprint`, kept), and the chats of `book_id`."""
        books = [(_label(b, model), b["id"]) for b in self.books()]
        chats = [(f"{c['title']} ({c['n_turns']} turn{'s' * (c['n_turns'] != 1)})", c["id"])
                 for c in self.chats(book_id)] if book_id else []
        return books, chats

    def document(self, book_id: str) -> Document | None:
        obj = read_json(self.book_dir(book_id) / "document.json")
        try:
            return document_from_json(obj) if obj else None
        except (KeyError, TypeError, ValueError):
            return None

    def chats(self, book_id: str) -> list[dict]:
        """Summaries (id, title, updated, n_turns) of a book's chats, the newest first."""
        folder = self.book_dir(book_id) / "chats"
        summaries = []
        for path in folder.glob("*.json") if folder.is_dir() else []:
            chat = read_json(path)
            if chat and chat.get("turns"):
                summaries.append({"id": path.stem, "title": chat.get("title") or path.stem,
                                  "updated": chat.get("updated", 0), "n_turns": len(chat["turns"])})
        return sorted(summaries, key=lambda c: -float(c["updated"]))

    def load_chat(self, book_id: str, chat_id: str) -> dict | None:
        if not chat_id.isalnum():
            return None
        return read_json(self.book_dir(book_id) / "chats" / f"{chat_id}.json")

    def save_chat(self, book_id: str, chat: dict) -> None:
        """Write one chat (a dict with `id`); raises OSError (e.g. disk full), the old file stays."""
        if not str(chat["id"]).isalnum():
            raise ValueError(f"not a chat id: {chat['id']!r}")
        write_json(self.book_dir(book_id) / "chats" / f"{chat['id']}.json", chat)

    def model_identity(self, engine: Engine) -> dict:
        """What a snapshot depends on besides the text: model id/shapes/dtype and weight-file hash."""
        if engine not in self._identities:
            self._identities[engine] = {"model": model_fingerprint(engine),
                                        "model_sha256": weights_sha256(engine, self.root / "model-hashes.json")}
        return self._identities[engine]

    def save_snapshot(self, book_id: str, session: Session, identity: dict, doc_sha256: str) -> None:
        """Store the prefill snapshot of a freshly prefilled session (document tokens only)."""
        folder, meta = self.book_dir(book_id), self.meta(book_id) or {}
        record = {**identity, "doc_sha256": doc_sha256, "n_tokens": session.length,
                  "chunk_tokens": session.engine.prefill_chunk_tokens}  # another text may start from it
        write_json(folder / "meta.json", {**meta, "snapshot": save_snapshot(folder, session, record)})

    def restore_snapshot(self, book_id: str, engine: Engine, identity: dict, doc_sha256: str,
                         doc_ids: list[int]) -> Session | None:
        """The saved prefill of this text (`doc_sha256`, `doc_ids`) by this model (`identity`), or None
        when there is none or anything does not match."""
        expected = {**identity, "doc_sha256": doc_sha256, "n_tokens": len(doc_ids)}
        saved = (self.meta(book_id) or {}).get("snapshot")
        return load_snapshot(self.book_dir(book_id), engine, saved, expected, doc_ids)

    def save_reading(self, book_id: str, session: Session, identity: dict, doc_sha256: str, n_doc_tokens: int,
                     chunk_tokens: int) -> None:
        """Store a stopped reading: the session holds the book's first tokens, read in chunks of
        `chunk_tokens` (a reading goes on only with the same chunks: the same forwards)."""
        folder, meta = self.book_dir(book_id), self.meta(book_id) or {}
        record = {**identity, "doc_sha256": doc_sha256, "n_doc_tokens": n_doc_tokens, "chunk_tokens": chunk_tokens,
                  "n_tokens": session.length}
        write_json(folder / "meta.json", {**meta, "partial": save_snapshot(folder, session, record, PARTIAL)})

    def restore_reading(self, book_id: str, engine: Engine, identity: dict, doc_sha256: str,
                        doc_ids: list[int]) -> Session | None:
        """The stopped reading of this text by this model, to read on from; None when there is none
        or anything does not match (then the reading starts again)."""
        saved, chunk = (self.meta(book_id) or {}).get("partial") or {}, engine.prefill_chunk_tokens
        n = saved.get("n_tokens")
        if not (isinstance(n, int) and 0 < n < len(doc_ids) and n % chunk == 0):
            return None
        expected = {**identity, "doc_sha256": doc_sha256, "n_doc_tokens": len(doc_ids), "chunk_tokens": chunk,
                    "n_tokens": n}
        return load_snapshot(self.book_dir(book_id), engine, saved, expected, doc_ids[:n], PARTIAL, len(doc_ids))

    def read_before(self, text: str, model: str, chunk_tokens: int, among: set[str] | None = None
                    ) -> SharedStart | None:
        """The reading by `model` (a `model_fingerprint`), in chunks of `chunk_tokens`, of another
        book (of `among`, a private library's, if given) whose text begins as `text` does, sharing
        the most: the first 16K tokens of a book read before its first 32K, chapters 1-6 before 1-12,
        or the other way round."""
        best, book_id, head = None, book_id_of(text), _head(text)
        for meta in self.books():
            for key, name in (("snapshot", SNAPSHOT), ("partial", PARTIAL)):
                record = meta.get(key) or {}
                if (meta["id"] == book_id or meta.get("head") != head or (among is not None and meta["id"] not in among)
                        or record.get("model") != model or record.get("chunk_tokens") != chunk_tokens):
                    continue  # the head: only a text that begins alike is loaded to compare
                other = self.document(meta["id"])
                n_chars = len(os.path.commonprefix([text, other.text])) if other else 0
                if n_chars >= MIN_SHARED_CHARS and (best is None or n_chars > best.n_chars):
                    best = SharedStart(meta["id"], name, record, meta["title"], n_chars)
        return best

    def restore_shared_start(self, engine: Engine, identity: dict, found: SharedStart,
                             doc_ids: list[int]) -> Session | None:
        """`found`'s reading cut to the whole prefill chunks it shares with `doc_ids`, in a cache
        for all of them; None when anything does not match (then the reading starts at 0)."""
        expected = {**identity, "chunk_tokens": engine.prefill_chunk_tokens}
        return load_snapshot(self.book_dir(found.book_id), engine, found.record, expected, doc_ids, found.name,
                             len(doc_ids), shared_start=True)

    def n_read(self, book_id: str, model: str | None = None) -> int:
        """Tokens of the book a stopped reading (by `model`, a `model_fingerprint`) kept (0: none)."""
        return _n_read(self.meta(book_id) or {}, model)

    def forget_reading(self, book_id: str) -> None:
        """Drop a stopped reading of the book (its whole prefill is saved now)."""
        meta = self.meta(book_id)
        if meta is not None and meta.pop("partial", None) is not None:
            write_json(self.book_dir(book_id) / "meta.json", meta)
        (self.book_dir(book_id) / PARTIAL).unlink(missing_ok=True)


def _head(text: str) -> str:
    """The hash of a text's first `MIN_SHARED_CHARS` characters: texts that may share a reading."""
    return text_sha256(text[:MIN_SHARED_CHARS])[:16]


def _n_read(meta: dict, model: str | None = None) -> int:
    partial = meta.get("partial") or {}
    n = partial.get("n_tokens")
    return n if isinstance(n, int) and (model is None or partial.get("model") == model) else 0


def _label(meta: dict, model: str | None = None) -> str:
    """The book's title, after '45% read · ' when its reading (by `model`) stopped there (first: a
    narrow list cuts a long title's end)."""
    n, total = _n_read(meta, model), meta.get("n_tokens")
    return (f"{n / total:.0%} read · " if n and isinstance(total, int) and total > n else "") + meta["title"]
