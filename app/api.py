"""The app's side of the OpenAI-compatible API (api/server.py): prompt caching through the library.

A request that begins with a document is answered from the library's prefill snapshot of that
exact text: the same book id (sha256 of the text), the same token ids (`PlainChatFormat`) and the
same checks (app/snapshots.py) as a book opened in the UI, so a book read in the UI answers the
API at once, and a document first sent through the API is saved as a book (listed in the UI).
`--api` mounts the routes on Gradio's own FastAPI app, sharing the UI's batcher; the key rule is
the UI's: with --auth or --share a bearer key is required (--api-key, or one printed at start),
without them only 127.0.0.1 is answered.
"""

from __future__ import annotations

import secrets
import threading

from api.server import ChatAPI
from app.documents import Document
from app.library import Library, default_root
from app.reading import open_session
from app.tokens import PlainChatFormat
from engine.session import Engine, Session

TITLE_CHARS = 60


class LibraryDocuments:
    """api.server.Documents backed by the library: its snapshot, else a prefill it saves."""

    def __init__(self, library: Library):
        self.library = library

    def open(self, engine: Engine, text: str, doc_ids: list[int], cancel: threading.Event) -> tuple[Session, bool]:
        _, session, restored, _ = open_session(self.library, engine, Document(title(text), text, "txt"), doc_ids,
                                               cancel=cancel)
        return session, restored


def title(text: str) -> str:
    """A library title for a document that came through the API: its first line, shortened."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "Document")
    return "API: " + (first[:TITLE_CHARS] + "…" if len(first) > TITLE_CHARS else first)


def library_documents(engine: Engine, root: str | None) -> tuple[PlainChatFormat, LibraryDocuments]:
    """For `python -m api`: the app's chat format and the library at `root` (default: the app's)."""
    return PlainChatFormat(engine.tokenizer, end_ids=engine.end_ids), LibraryDocuments(Library(root or default_root()))


def api_key(given: str | None, is_login_required: bool) -> str | None:
    """--api-key, else a generated key when the UI needs a login (--auth, --share), else None."""
    if given or not is_login_required:
        return given or None
    key = secrets.token_urlsafe(24)
    print(f"API key (send `Authorization: Bearer KEY`): {key}", flush=True)
    return key


class Loaded:
    """api.server.Served: the UI's engine and chat format, the model it has loaded now (the Model
    panel may load another). app.py serves the API over the local engine only (app/backend.py)."""

    def __init__(self, ui):
        self.ui = ui  # app.ui.App

    @property
    def engine(self) -> Engine:
        return self.ui.backend.engine

    @property
    def chat(self) -> PlainChatFormat:
        return self.ui.chat


def chat_api(ui, key: str | None) -> ChatAPI:
    """The API over the UI's loaded model (`Loaded`), its library and its batcher (`ui`: app.ui.App)."""
    documents = LibraryDocuments(ui.library) if ui.library is not None else None
    return ChatAPI(Loaded(ui), ui.batcher, documents, key, ui.start_sampling().max_new_tokens,
                   keep_sessions=ui.max_open_books)
