"""Opening a book's prefill: its saved snapshot, else a reading in parts, kept when it stops and
taken up again from there, then saved.

`open_session` is the workflow; app/library.py is the store it calls (never the other way round).
A whole novel takes a long time to read on a CPU (benchmarks/RESULTS.md §5). `Reading` reads a book in parts of
`READ_PART_TOKENS` (engine `Engine.open(n_first=...)`, then `Session.read`), each a whole number
of the engine's prefill chunks, so the forwards are those of one uninterrupted reading and the KV
is the same, bit for bit. What was read is saved in the library (`partial.pt`, verified like a
snapshot: app/snapshots.py) whenever the reading stops (Cancel, a closed tab, the app shut down:
`ReadingStopped`) or fails, and after a part at most every `SAVE_READING_EVERY_S`; the next
opening of the book restores it and reads on. A book that begins as another one read before (its
first 32K tokens after its first 16K, chapters 1-12 after 1-6) starts from the chunks they share.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from app.documents import Document
from app.library import Library, text_sha256
from app.storage import write_failure
from engine.config import Cancelled, EngineError

if TYPE_CHECKING:
    from engine.session import Engine, Session

# Tokens a part (rounded down to whole prefill chunks), and how often at most the reading so far
# is saved after a part: a crash loses at most this much reading. A save writes the whole cache
# read so far, so it is not done after every part (`python -m benchmarks.reading` times both).
READ_PART_TOKENS = 4096
SAVE_READING_EVERY_S = 600.0


class ReadingStopped(Cancelled):
    """A book's prefill was stopped after `n_read` tokens; the library keeps the first `n_kept`
    (all of them, unless the disk refused the last save)."""

    def __init__(self, book_id: str, n_read: int, n_tokens: int, n_kept: int):
        self.book_id, self.n_read, self.n_tokens, self.n_kept = book_id, n_read, n_tokens, n_kept
        if n_kept == n_read:
            then = "It is in the library: open it again to read on from there."
        elif n_kept:
            then = f"The disk took only its first {n_kept:,} tokens: the next reading goes on from there."
        else:
            then = "What was read could not be saved, so the next reading starts from the beginning."
        EngineError.__init__(self, f"Stopped after reading {n_read / n_tokens:.0%} of the book ({n_read:,} of "
                                   f"{n_tokens:,} tokens). {then}")

    @property
    def is_saved(self) -> bool:
        """The library lists the book, to read on from `n_kept`."""
        return self.n_kept > 0


def open_session(library: Library, engine: Engine, document: Document, doc_ids: list[int], on_progress=None,
                 cancel=None, on_resume=None, among: set[str] | None = None) -> tuple[str, Session, bool, str | None]:
    """(book id, session, whether restored, a note when the library could not be written): the
    saved prefill when it matches, else a new prefill, snapshotted, read on from where a stopped
    reading ended, or from another book's (of `among`) it begins as (`on_resume(n tokens read
    before, that book's title or None)`). The book is listed once it is ready, or
    once part of it is saved; a failed write never loses the session."""
    identity, sha = library.model_identity(engine), text_sha256(document.text)
    book_id = sha[:16]
    session = library.restore_snapshot(book_id, engine, identity, sha, doc_ids)
    restored = session is not None
    if session is None:
        session = Reading(library, engine, document, doc_ids, identity, sha, among).run(on_progress, cancel, on_resume)
    try:
        library.add_book(document, identity["model"], len(doc_ids))
        if not restored:
            library.save_snapshot(book_id, session, identity, sha)
            library.forget_reading(book_id)
    except OSError as error:
        return book_id, session, restored, (f"The book could not be saved to the library ({write_failure(error)}). "
                                            "It is open and answers normally; next time it is read again.")
    return book_id, session, restored, None


class Reading:
    """One book's prefill in parts, from where a stopped reading of it ended; the reading so far
    is saved every `SAVE_READING_EVERY_S` and when it stops or fails."""

    def __init__(self, library: Library, engine: Engine, document: Document, doc_ids: list[int], identity: dict,
                 doc_sha256: str, among: set[str] | None = None):
        self.library, self.engine, self.document, self.doc_ids = library, engine, document, doc_ids
        self.among = among  # the books whose readings it may start from (a private library's); None: all
        self.identity, self.sha, self.book_id = identity, doc_sha256, doc_sha256[:16]
        self.chunk = engine.prefill_chunk_tokens
        self.part = max(1, READ_PART_TOKENS // self.chunk) * self.chunk
        self.n_saved, self.saved_at = 0, time.monotonic()

    def run(self, on_progress=None, cancel=None, on_resume=None) -> Session:
        doc_ids, n_total = self.doc_ids, len(self.doc_ids)

        def progress(start: int):  # a part's progress as the whole book's
            return on_progress and (lambda done, _total: on_progress(start + done, n_total))
        library, model = self.library, self.identity["model"]
        session = library.restore_reading(self.book_id, self.engine, self.identity, self.sha, doc_ids)
        source = None if session is not None else library.read_before(self.document.text, model, self.chunk, self.among)
        if source:  # another book this one begins as
            session = library.restore_shared_start(self.engine, self.identity, source, doc_ids)
        if session is None:  # stopped in this first part: nothing is kept
            session = self.engine.open(doc_ids, progress(0), cancel, n_first=self.part)
        else:
            self.n_saved = 0 if source else session.length  # another book's reading: nothing of this one saved
            if on_resume:
                on_resume(session.length, source and source.title)
        try:
            while (start := session.length) < n_total:
                session.read(doc_ids[start:start + self.part], progress(start), cancel)
                if time.monotonic() - self.saved_at >= SAVE_READING_EVERY_S:
                    self.save(session)
        except Cancelled:
            self.save(session)
            raise ReadingStopped(self.book_id, session.length, n_total, self.n_saved) from None
        except BaseException:
            with contextlib.suppress(Exception):  # the failure is the news, not a save it prevents
                self.save(session)
            raise
        return session

    def save(self, session: Session) -> bool:
        """Keep the reading so far in the library (listing the book); False when it could not be
        written (a full disk: the reading goes on, and the next save tries again)."""
        if session.length == self.n_saved:
            return True
        try:
            self.library.add_book(self.document, self.identity["model"], len(self.doc_ids))
            self.library.save_reading(self.book_id, session, self.identity, self.sha, len(self.doc_ids), self.chunk)
        except OSError:
            return False
        self.n_saved, self.saved_at = session.length, time.monotonic()
        return True
