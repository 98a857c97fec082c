"""Books and their chats on disk, written so that a crash never leaves a half-written file.

    <root>/<book_id>/meta.json              title, doc_sha256, model, n_tokens, created, opened, snapshot
    <root>/<book_id>/document.json          the Document (text + sections): a book reopens without its file
    <root>/<book_id>/chats/<chat_id>.json   messages, token boundaries and token ids of every turn (export: .md / .json)
    <root>/<book_id>/snapshot.pt            the prefill snapshot (engine `Session.save`)

`book_id` is the start of the sha256 of the prefilled text, so the same text is one book. Every
write goes to a temporary file in the same folder, then `os.replace`. A snapshot is used only
when its model fingerprint and document hash match and its tokens equal the document's; anything
else (another model, a tampered or truncated file) means a new prefill, never wrong answers.
This module knows nothing of Gradio; it does not tokenise or prefill (app/session.py does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

from app.documents import Document, Section
from engine.engine import Engine, Session


def default_root() -> Path:
    """$BOOKCHAT_LIBRARY, else ~/.local/share/bookchat."""
    return Path(os.environ.get("BOOKCHAT_LIBRARY") or Path.home() / ".local" / "share" / "bookchat")


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_fingerprint(engine: Engine) -> str:
    """What a snapshot's KV cache depends on: the model's name and its shapes and dtype."""
    c = engine.target.config
    return f"{engine.config.target}|L{c.n_layers}|d{c.dim}|kv{c.n_kv_heads}x{c.head_dim}|V{c.vocab_size}|{engine.dtype}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8"))


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def chat_markdown(chat: dict) -> str:
    """A chat (`BookSession.to_json()`) as Markdown for people."""
    lines = [f"# {chat.get('book', 'Chat')}", "", f"Exported {time.strftime('%Y-%m-%d %H:%M')}", ""]
    for turn in chat["turns"]:
        lines += [f"**You:** {turn['question']}", "", turn["answer"], ""]
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


class Library:
    """The books a user has read, one folder each under `root`."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)

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
        meta.update(model=model, n_tokens=n_tokens, opened=time.time())
        write_json(folder / "meta.json", meta)
        return book_id

    def touch(self, book_id: str) -> None:
        meta = self.meta(book_id)
        if meta is not None:
            meta["opened"] = time.time()
            write_json(self.book_dir(book_id) / "meta.json", meta)

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

    def choices(self, book_id: str | None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(label, id) pairs for pickers: every book, and the chats of `book_id`."""
        books = [(b["title"], b["id"]) for b in self.books()]
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

    def save_snapshot(self, book_id: str, session: Session, model: str) -> None:
        """Store the prefill snapshot of a freshly prefilled session (document tokens only)."""
        folder = self.book_dir(book_id)
        meta = self.meta(book_id) or {}
        snapshot = {"model": model, "doc_sha256": meta.get("doc_sha256"), "n_tokens": session.length}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".snapshot.", suffix=".tmp")
        os.close(fd)
        try:
            session.save(tmp, meta=snapshot)
            os.replace(tmp, folder / "snapshot.pt")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        write_json(folder / "meta.json", {**meta, "snapshot": snapshot})

    def open_session(self, engine: Engine, document: Document, doc_ids: list[int], on_progress=None,
                     cancel=None) -> tuple[str, Session, bool]:
        """(book id, session, whether restored): the saved prefill when it matches, else a new prefill,
        snapshotted. The book is listed only once it is ready (a cancelled prefill adds nothing)."""
        model, book_id = model_fingerprint(engine), text_sha256(document.text)[:16]
        session = self.restore_snapshot(book_id, engine, model, doc_ids)
        restored = session is not None
        if session is None:
            session = engine.open(doc_ids, on_progress=on_progress, cancel=cancel)
        self.add_book(document, model, len(doc_ids))
        if not restored:
            with contextlib.suppress(OSError):  # disk full: the book works; the next open prefills again
                self.save_snapshot(book_id, session, model)
        return book_id, session, restored

    def restore_snapshot(self, book_id: str, engine: Engine, model: str, doc_ids: list[int]) -> Session | None:
        """The saved prefill of this book, or None when there is none or it does not match."""
        folder = self.book_dir(book_id)
        meta, path = self.meta(book_id) or {}, folder / "snapshot.pt"
        snapshot = meta.get("snapshot") or {}
        expected = {"model": model, "doc_sha256": meta.get("doc_sha256"), "n_tokens": len(doc_ids)}
        if not path.is_file() or snapshot != expected:
            return None
        try:
            session = Session.restore(engine, path)
        except Exception:  # a truncated or tampered file: torch/pickle raise many types
            return None
        c, k = engine.target.config, session.full.k
        is_same_shape = (k.shape[0], k.shape[2], k.shape[4], k.dtype) == (c.n_layers, c.n_kv_heads, c.head_dim,
                                                                          engine.dtype)
        is_same_text = session.tokens == doc_ids and session.full.length == len(doc_ids)
        return session if is_same_shape and is_same_text else None
