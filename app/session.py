"""One open book: its prefilled engine session, the chat about it, and what fits in the context.

`prepare` tokenises a Document and says whether it fits ("117,342 tokens of 131,072 — fits");
`keep_first` / `pick_chapters` make the shorter Document a user chose (never silently). `open_book`
restores the book's prefill snapshot or prefills it. `BookSession` asks, regenerates, edits and
clears, keeping each turn's token boundaries for `Session.truncate`, and autosaves every answer.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from app.documents import Document, Limits, Section, load_document
from app.library import Library, book_id_of, model_fingerprint
from app.reading import open_session
from app.sources import NEUTRAL_QUESTION, Quote, QuoteIndex, Source, find_passages, footer, with_passages
from app.speeds import attention_share, duration, time_left
from app.storage import write_failure
from app.tokens import TokenMap
from engine.config import Cancelled, DocumentTooLong, EmptyPrompt, EngineConfig, EngineError, SamplingConfig
from engine.session import Engine, Session, Stats
from tools.chat import ChatFormat
from tools.models import assemble_missing

if TYPE_CHECKING:
    from app.backend import Backend

# the model's context a book must leave free for the chat about it (questions, answers): a longer
# book is offered in parts. Not the engine's CHAT_CAPACITY_TOKENS, the cache it allocates beyond a document
CHAT_RESERVE_TOKENS = 1024
Report = Callable[[str, str], None]  # report(stage, detail): "Prefill", "chunk 3 of 9 · 410 tokens/s · ETA 12 s"


class ChatFull(EngineError):
    """A question that no longer fits after the book and the chat so far (re-read passages count:
    they are part of the conversation). The chat and the book stay as they are."""

    def __init__(self, n_book: int, n_chat: int, n_question: int, max_tokens: int):
        self.n_book, self.n_chat, self.n_question, self.max_tokens = n_book, n_chat, n_question, max_tokens
        super().__init__(
            f"This chat has filled the model's context: the book takes {n_book:,} of its {max_tokens:,} "
            f"tokens and the chat {n_chat:,}, so a question of {n_question:,} tokens has no room. Start a "
            f"New chat (the book stays read; this chat is kept in the library), or read a shorter part of "
            f"the book for longer chats.")


@dataclass(frozen=True)
class Prepared:
    """A tokenised document and whether it fits the context budget."""

    document: Document
    doc_ids: list[int]
    tokens: TokenMap
    budget_tokens: int

    @property
    def fits(self) -> bool:
        return len(self.doc_ids) <= self.budget_tokens

    def fit_message(self) -> str:
        n, budget = len(self.doc_ids), self.budget_tokens
        return f"{n:,} tokens of {budget:,} — " + ("fits" if self.fits else f"too long by {n - budget:,}")


def prepare(engine: Engine | Backend, chat: ChatFormat, document: Document, max_tokens: int | None = None) -> Prepared:
    budget, doc_ids = engine.max_context - CHAT_RESERVE_TOKENS, chat.document_ids(document.text)
    return Prepared(document, doc_ids, TokenMap(engine.tokenizer, document.text, len(doc_ids)),
                    min(budget, max_tokens or budget))


def keep_first(prepared: Prepared, n_tokens: int) -> Document:
    """The document cut after about `n_tokens` tokens (at a token boundary)."""
    doc = prepared.document
    cut = prepared.tokens.char(prepared.tokens.shift + max(1, n_tokens))
    return Document(f"{doc.title} (first {n_tokens:,} tokens)", doc.text[:cut], doc.source_format,
                    [s for s in doc.sections if s.start_char < cut])


def pick_chapters(document: Document, picked: list[Section]) -> Document:
    """The chosen chapters, in book order, joined by blank lines, with their sections kept."""
    parts, sections, offset = [], [], 0
    for chapter in sorted(picked, key=lambda s: s.start_char):
        a, b = document.span(chapter)
        sections += [Section(s.title, s.start_char - a + offset, s.kind)
                     for s in document.sections if a <= s.start_char < b]
        parts.append(document.text[a:b].strip("\n"))
        offset += len(parts[-1]) + 2
    names = ", ".join(s.title for s in picked[:3]) + (" …" if len(picked) > 3 else "")
    return Document(f"{document.title} ({names})", "\n\n".join(parts), document.source_format, sections)


@dataclass
class Turn:
    question: str
    answer: str = ""
    start: int = 0  # session length before the question
    answer_start: int = 0  # after the question and the generation prompt
    end: int = 0  # after the answer
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    ids: list[int] = field(default_factory=list)  # tokens [start, end): restores the chat exactly
    sources: list[dict] = field(default_factory=list)  # app.sources.Source.to_json(), best first
    quotes: list[dict] = field(default_factory=list)  # app.sources.Quote.to_json() of the answer's quotes
    reread: bool = False  # the sources were quoted after the question (app.sources.with_passages)


@dataclass(frozen=True)
class Passage:
    label: str  # "pp. 12–13", "Chapter 3"
    snippet: str
    share: float  # of the retrieval cache's chunks


@dataclass
class Update:
    answer: str
    stats: Stats
    reading: list[Passage] | None  # None: unchanged since the last update
    finish_reason: str | None


class BookSession:
    """An open book and one chat about it; the engine session holds document + chat tokens."""

    # what its answers report (app/views.py shows them); a server's (app/remote.py) report neither
    has_reading = True  # where the model reads: the reading view
    has_levels = True  # each level's acceptance and the speed-up over plain decoding

    def __init__(self, engine: Engine, chat: ChatFormat, prepared: Prepared, session: Session,
                 book_id: str, library: Library | None = None):
        self.engine, self.chat, self.session, self.book_id, self.library = engine, chat, session, book_id, library
        self.document, self.doc_ids, self.tokens = prepared.document, prepared.doc_ids, prepared.tokens
        self.doc_len = len(prepared.doc_ids)
        self.turns: list[Turn] = []
        self.chat_id, self.created = uuid.uuid4().hex[:12], time.time()
        self.plain_ms: float | None = None  # plain decoding ms/token at this context (the speedup's base)
        self.save_error: str | None = None
        self.batcher = None  # engine.batch.Batcher: answers decoded together with other readers'
        self.n_read_before = 0  # tokens a stopped reading had kept, read on from when this book opened
        self.read_before_in: str | None = None  # or the title of another book they were read in
        self.is_cut = False  # the text ends where "keep the first N tokens" cut the book
        self._quotes: QuoteIndex | None = None  # built at the first answer
        self.passages_first = False  # re-reading quotes the passages before the question, not after

    def ask(self, question: str, sampling: SamplingConfig, cancel=None, reread: bool = False) -> Iterator[Update]:
        """Answer `question`; its sources are found first and, with `reread`, quoted after it."""
        if not (question := question.strip()):
            raise EmptyPrompt("question")
        s, last = self.session, self.turns[-1] if self.turns else None
        ended = last is not None and last.ids[-1:] == [self.chat.end_of_turn_id]
        q_ids = self.chat.question_ids(question, is_first=last is None, previous_answer_ended=ended)
        try:  # the engine's own rule for room, said as what a reader can do about it
            self.engine.check_ids(q_ids, "question", s.length)
        except DocumentTooLong:
            raise ChatFull(self.doc_len, s.length - self.doc_len, len(q_ids), self.engine.max_context) from None
        sources = self.find_sources(q_ids, self.chat.question_ids(NEUTRAL_QUESTION, last is None, ended))
        while reread and sources:  # the passages leave room for the answer, or the last ones go
            reread_ids = self.chat.question_ids(with_passages(question, sources, self.passages_first),
                                                last is None, ended)
            if s.length + len(reread_ids) + sampling.max_new_tokens < self.engine.max_context:
                q_ids = reread_ids
                break
            sources = sources[:-1]
        turn = Turn(question, start=s.length, answer_start=s.length + len(q_ids),
                    sources=[x.to_json() for x in sources], reread=reread and bool(sources))
        answer_ids = []
        if self.batcher is not None:
            events = self.batcher.ask(s, q_ids, sampling, cancel=cancel, stop_ids=self.chat.stop_ids)
        else:
            events = s.ask(q_ids, sampling, cancel=cancel, stop_ids=self.chat.stop_ids)
        try:
            for event in events:
                answer_ids += event.tokens
                turn.answer, turn.finish_reason = self._decode(answer_ids).rstrip("\ufffd"), event.finish_reason
                yield Update(turn.answer, event.stats, self.passages(event.reading), event.finish_reason)
        finally:
            events.close()  # releases the session's lock now, even when our caller went away mid-answer
            if s.length >= turn.answer_start:  # the question is in: keep the (maybe partial) turn
                turn.end, turn.ids = s.length, s.tokens[turn.start:s.length]
                turn.answer, turn.finish_reason = self._decode(answer_ids), turn.finish_reason or "cancelled"
                turn.quotes = [q.to_json() for q in self.quote_index().check(turn.answer)]
                self.turns.append(turn)
                self.autosave()
            else:  # failed or cancelled before the question got in: undo any partial prefill
                s.truncate(turn.start)

    def edit_last(self, question: str | None, sampling: SamplingConfig, cancel=None,
                  reread: bool = False) -> Iterator[Update]:
        """Replace the last turn: the same question (regenerate) or an edited one."""
        if not self.turns:
            raise EmptyPrompt("chat (ask a question first)")
        last = self.turns.pop()
        self.session.truncate(last.start)
        return self.ask(last.question if question is None else question, sampling, cancel, reread)

    def find_sources(self, q_ids: list[int], neutral_ids: list[int]) -> list[Source]:
        """The passages the question's attention goes to most (engine `Session.score_document`);
        none when the question does not fit (asking then says why)."""
        try:
            ranges = self.session.score_document(q_ids, self.tokens.shift, self.doc_len, neutral_ids)
        except EngineError:
            return []
        chars = [(self.tokens.char(a), self.tokens.char(b), share) for a, b, share in ranges]
        return find_passages(self.document, chars, is_cut=self.is_cut)

    def quote_index(self) -> QuoteIndex:
        if self._quotes is None or self._quotes.document is not self.document:
            self._quotes = QuoteIndex(self.document)
        return self._quotes

    def clear(self) -> None:
        """Start a new, empty chat; the old one stays in the library."""
        self.session.truncate(self.doc_len)
        self.turns, self.chat_id, self.created = [], uuid.uuid4().hex[:12], time.time()

    def load_chat(self, data: dict) -> None:
        """Continue a saved chat: its tokens follow the document and are prefilled at the next question."""
        turns = [Turn(**t) for t in data["turns"]]
        starts = [self.doc_len] + [t.end for t in turns[:-1]]  # each turn starts where the last ended
        if any(t.start != start or t.end != t.start + len(t.ids) for t, start in zip(turns, starts, strict=True)):
            raise ValueError("the chat's token boundaries do not match this book")
        self.session.truncate(self.doc_len)
        self.session.start(self.doc_ids + [i for t in turns for i in t.ids])
        self.turns, self.chat_id, self.created = turns, data["id"], data.get("created", time.time())

    def messages(self) -> list[dict]:
        """The chat for gr.Chatbot; a stopped answer says so."""
        return [m for t in self.turns for m in ({"role": "user", "content": t.question}, {
            "role": "assistant", "content": t.answer + (" *(stopped)*" if t.finish_reason == "cancelled" else "")
            + _footer(t)})]

    def to_json(self) -> dict:
        title = self.turns[0].question[:60] if self.turns else "New chat"
        return {"id": self.chat_id, "title": title, "book": self.document.title, "book_id": self.book_id,
                "created": self.created, "updated": time.time(), "doc_tokens": self.doc_len,
                "messages": self.messages(), "turns": [asdict(t) for t in self.turns]}

    def autosave(self) -> None:
        """Save the chat (and the book, if a full disk kept it out of the library when it opened)."""
        try:
            if self.library is not None:
                if self.library.meta(self.book_id) is None:
                    self.library.add_book(self.document, self.read_by(), self.doc_len)
                self.library.save_chat(self.book_id, self.to_json())
            self.save_error = None
        except OSError as error:  # e.g. disk full: the previous file stays intact (atomic write)
            self.save_error = (f"This chat could not be saved ({write_failure(error)}). It stays open here and is "
                               "saved with the next answer once there is room.")

    def read_by(self) -> str:
        """The model the library lists this book as read by."""
        return model_fingerprint(self.engine)

    def passages(self, ranges: list[tuple[int, int, float]] | None, top: int = 5) -> list[Passage] | None:
        """Page/section labels and snippets of the document ranges the retrieval cache reads."""
        if ranges is None:
            return None
        found = []
        for start, end, share in ranges:
            if start >= self.doc_len:  # the recent window: the question and the answer so far
                continue
            a, b = self.tokens.char(start), self.tokens.char(min(end, self.doc_len))
            snippet = " ".join(self.document.text[a:b].split())
            found.append(Passage(self.document.label_range(a, max(a + 1, b)),
                                 snippet[:160] + ("…" if len(snippet) > 160 else ""), share))
        return found[:top]

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True).strip()


def _footer(turn: Turn) -> str:
    """The sources and checked quotes under an answer (a chat saved before them has none)."""
    text = footer([Source.from_json(x) for x in turn.sources], [Quote.from_json(q) for q in turn.quotes])
    return "\n\n" + text if text else ""


def read_document(path: str, password: str | None, limits: Limits, engine: Engine | Backend, chat: ChatFormat,
                  max_tokens: int | None, report: Report, cancel: threading.Event) -> Prepared:
    """File -> tokenised document; report(stage, detail) between pages; cancel raises Cancelled."""
    def progress(stage: str, done: int, total: int):
        if cancel.is_set():
            raise Cancelled("reading of the file")
        report(stage.capitalize(), f"{done} of {total}" if total > 1 else "")
    document = load_document(path, password or None, limits, progress)
    report("Tokenize", "counting tokens …")
    return prepare(engine, chat, document, max_tokens)


def load_engine(config: EngineConfig, report: Report | None = None, cancel=None) -> Engine:
    """The engine of `config`, assembling its packaged models on first use (a few minutes: the
    steps go to `report`); `cancel` is not checked (loading cannot stop half-way)."""
    # the GGUF; Engine.load converts it if it cannot read its blocks
    assemble_missing([config.target, config.draft], lambda message: report and report("Model", message))
    return Engine.load(config)


def n_read_before(engine: Engine, library: Library, prepared: Prepared, among: set[str] | None) -> int:
    """Tokens of this book the library holds by this model: a stopped reading of it, or about
    the whole prefill chunks it shares with another book's reading (of `among`, if given) it
    begins as (0: none)."""
    model, text, chunk = model_fingerprint(engine), prepared.document.text, engine.prefill_chunk_tokens
    if n := library.n_read(book_id_of(text), model):
        return n
    if not (found := library.read_before(text, model, chunk, among)):
        return 0
    n = min(found.record["n_tokens"], len(prepared.doc_ids) - 1, prepared.tokens.char_to_token(found.n_chars))
    return n - n % chunk


def open_book(engine: Engine, chat: ChatFormat, prepared: Prepared, library: Library | None,
              report: Report | None = None, cancel=None, measure_plain: bool = False,
              among: set[str] | None = None) -> tuple[BookSession, bool]:
    """Restore the book's snapshot or prefill it (reporting chunk i of N, tokens/s, ETA), from the
    start another book of the library (of `among`, if given) shares with it; optionally time plain
    decoding for the speedup figure. Returns the book and whether it was restored.
    Raises DocumentTooLong when the document does not fit its budget (the caller offers choices)."""
    if not prepared.fits:
        raise DocumentTooLong(len(prepared.doc_ids), prepared.budget_tokens)
    chunk, share = engine.prefill_chunk_tokens, attention_share(engine.target.config)  # chunk: larger offloaded
    started, n_before, read_in = time.perf_counter(), 0, None

    def progress(done: int, total: int):
        elapsed = max(time.perf_counter() - started, 1e-6)
        left = time_left(elapsed, done, total, share, n_before)  # later tokens read more keys: not at this rate
        if report:  # chunk i of N, measured speed, and the time left
            report("Prefill", f"chunk {math.ceil(done / chunk)} of {math.ceil(total / chunk)} · "
                              f"{(done - n_before) / elapsed:,.0f} tokens/s · about {duration(left)} left")

    def resume(n_read: int, source: str | None = None):  # a stopped reading, or another book's, read on from
        nonlocal started, n_before, read_in
        started, n_before, read_in = time.perf_counter(), n_read, source
        if report:
            where = f"its first {n_read:,} tokens were read before, in *{source}*" if source else \
                f"where the last reading stopped ({n_read:,} tokens read before)"
            report("Prefill", f"reading on from {n_read / len(prepared.doc_ids):.0%}: {where} …")
    if library is None:
        book_id, restored, note = "0", False, None
        session = engine.open(prepared.doc_ids, on_progress=progress, cancel=cancel)
    else:
        book_id, session, restored, note = open_session(library, engine, prepared.document, prepared.doc_ids,
                                                        progress, cancel, resume, among)
    book = BookSession(engine, chat, prepared, session, book_id, library)
    book.save_error, book.n_read_before, book.read_before_in = note, n_before, read_in
    if measure_plain:
        if report:
            report("Prefill", "measuring plain decoding for the speedup …")
        book.plain_ms = session.probe_plain_tbt(8)
    return book, restored
