"""The Gradio app's handlers: what each button, upload and question does (docs/DESIGN.md "What a user sees").

The page and which event calls which handler are in app/layout.py. Each browser session
(`request.session_hash`) has its own `User`: open book, pending document, stop flag, counters.
Stop sets that flag (docs/UI-TESTING.md: never `cancels=`). Handlers catch every typed error and show
it, so no Gradio error pill appears, and the open book and chat stay until a new book is fully
ready. Engine jobs share one queue (its position shows on the status or metrics panel). With
`private` (--share), a user's library lists only the books and chats of their own session. At
most `max_open_books` books stay in memory: opening one more closes the least recently used other
one (it reopens from its snapshot). Book logic lives in app/session.py, panel rendering in
app/views.py, serving in app/server.py.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import gradio as gr

from app import book_view, layout
from app.backend import Backend
from app.catalog import Catalog, render_found
from app.cpu import CpuWatch, cpu_note
from app.documents import Document, Limits, PasswordRequired, WrongPassword, chapters
from app.layout import LONG_BOOKS_NOTE, LONG_BOOKS_YARN, NO_BOOK, asking
from app.library import Library, book_id_of, chat_export_json, chat_markdown, write_export
from app.outline_ui import Outlines
from app.picker import NO_DRAFT, check_loadable, drafts, model_choices, suggested_draft
from app.reading import ReadingStopped
from app.server import say
from app.session import BookSession, Prepared, keep_first, pick_chapters, prepare, read_document
from app.settings import TUNED, Settings
from app.speeds import Speeds, disk_size, duration
from app.storage import write_failure
from app.tokens import PlainChatFormat
from app.views import Counters, Stages, render_metrics, render_plot, render_reading
from engine import models
from engine.batch import Batcher
from engine.config import LEVEL_STACKS, Cancelled, SamplingConfig

LONG_PREFILL_S = 120  # past this, a prefill's estimate names the faster model
# An answer's view (chat, metrics, plot) is redrawn at most this often, the tokens in between shown
# with the next redraw: the browser's work at every token took a core from decoding on 2 cores
# (measured: benchmarks/history/2026-11-results.md, "redraws every 0.25 s").
REDRAW_EVERY_S = 0.25


@dataclass
class User:
    cancel: threading.Event = field(default_factory=threading.Event)  # Stop / Cancel of this session
    book: BookSession | None = None
    pending: Prepared | None = None  # a document too long for the context, waiting for a choice
    editing: bool = False  # the next Send replaces the last question
    file: str | None = None  # the last uploaded file, kept for a password retry
    counters: Counters = field(default_factory=Counters)  # this user's prefills only
    book_ids: set[str] = field(default_factory=set)  # books and chats of this session (private library)
    chat_ids: set[str] = field(default_factory=set)
    last_active: float = field(default_factory=time.monotonic)
    notice: str | None = None  # why the book was closed, shown at the next question
    username: str | None = None  # the login that opened this session: only it may end the session
    titles: dict[str, str] = field(default_factory=dict)  # book id -> this user's title (private library)


def _picked(pending: Prepared, picked: list[str]) -> Document:
    found = chapters(pending.document)
    return pick_chapters(pending.document, [found[int(i)] for i in picked])


class App:
    def __init__(self, backend: Backend, library: Library | None, limits: Limits | None = None,
                 max_tokens: int | None = None, sampling: dict | None = None, private: bool = False,
                 max_open_books: int = 4, catalog: Catalog | None = None, outline: bool = True):
        self.backend, self.library = backend, library  # backend: app/backend.py
        self.catalog = catalog  # the models found on this machine (app/catalog.py); None: packaged ones only
        self.chat = PlainChatFormat(backend.tokenizer, end_ids=backend.end_ids)
        self.speeds = Speeds(library.root if library else None)  # measured on this machine, per model
        self.limits, self.max_tokens = limits or Limits(), max_tokens
        # the sampling values app.py's flags set, by SAMPLING_FIELDS name: the Settings start there,
        # over whichever model is loaded (`start_sampling`)
        self.sampling = dict(sampling or {})
        self.private, self.max_open_books = private, max_open_books
        self.users: dict[str, User] = {}
        # Readers' answers are decoded together, one packed forward per step (engine/batch.py);
        # every open book is already in memory, so as many answer at once as books may be open.
        self.batcher = Batcher(max_active=max_open_books)
        self.jobs: set[threading.Thread] = set()  # readings and prefills under way (`close` waits for them)
        self.reading_ids: set[str] = set()  # books being read now: not removed meanwhile
        self.outline = outline  # books outlined chapter by chapter in the background (`--no-outline`: not)
        self.outlines = Outlines(self)  # every reader's outline, made while the engine is idle (issue 56)

    def user(self, request: gr.Request) -> User:
        user = self.users.setdefault(request.session_hash or "none", User(username=request.username))
        user.last_active = time.monotonic()
        return user

    def forget(self, request: gr.Request) -> None:
        """The browser went away: stop its work and free its book (its KV cache) now. Gradio runs
        this for a heartbeat from anyone who names the session: only its own login may end it."""
        user = self.users.get(request.session_hash or "none")
        if user is not None and user.username == request.username:
            self.users.pop(request.session_hash or "none", None)
            user.cancel.set()
            user.book = user.pending = None
            self.outlines.forget(user)

    def _make_room(self, user: User) -> None:
        """Close the least recently used other books so at most `max_open_books` stay in memory."""
        others = sorted((u for u in list(self.users.values()) if u.book is not None and u is not user),
                        key=lambda u: u.last_active)
        for other in others[:max(0, len(others) + 1 - self.max_open_books)]:
            other.book, other.notice = None, ("Your book was closed to make room for other readers. Reopen it "
                                              "from the library: it restores in seconds.")

    def close(self, timeout_s: float = 120.0) -> None:
        """The app is shutting down: stop every reading under way and wait for it to save what it
        read (app/reading.py), so the book reads on from there next time."""
        if self.jobs:
            say("Saving the reading under way, so it goes on from there next time (Ctrl-C again: quit now) …")
            for user in list(self.users.values()):
                user.cancel.set()
        self.outlines.close()  # its round under way ends; its finished summaries are in the library
        deadline = time.monotonic() + timeout_s
        for job in list(self.jobs):
            job.join(max(0.0, deadline - time.monotonic()))

    def request_stop(self, request: gr.Request) -> None:
        self.user(request).cancel.set()

    def _progress(self, user: User, stages: Stages, job, *args):
        """Run `job(*args, report, cancel)` in a thread (it blocks: reading, prefill), show each report
        in the status, and return its result or raise its error. If the browser goes away, cancel it."""
        reports: queue.Queue = queue.Queue()

        def run():
            try:
                reports.put([job(*args, lambda stage, detail: reports.put(stages.set(stage, detail)), user.cancel)])
            except BaseException as error:  # handed over to this generator's thread
                reports.put(error)
            finally:
                self.jobs.discard(threading.current_thread())

        thread = threading.Thread(target=run, daemon=True)
        self.jobs.add(thread)
        thread.start()
        is_over = False
        try:
            while isinstance(item := reports.get(), str):
                yield {self.c.status: item}
            is_over = True
        finally:
            if not is_over:
                user.cancel.set()
        if isinstance(item, BaseException):
            raise item
        return item[0]

    def _kept(self, user: User, message: str) -> dict:
        """A failure: say why; the open book, if any, is untouched (nothing is replaced on failure)."""
        note = f"\n\n*{user.book.document.title}* is still open." if user.book else ""
        hidden = gr.update(visible=False)
        return {self.c.status: message + note, self.c.cancel: hidden, self.c.password_row: hidden}

    # ---- loading a book: file -> Document -> tokens -> fits? -> prefill or snapshot ----------
    def load_book(self, path: str | None, password: str, request: gr.Request):
        self.user(request).file = path
        yield from self.unlock(password, request)

    def unlock(self, password: str, request: gr.Request):
        """Read the uploaded file (again, with a password); the drop zone is emptied for the next one."""
        user, c = self.user(request), self.c
        user.cancel.clear()
        if not user.file:
            yield {c.status: "Choose a book file first."}
            return
        stages = Stages(Path(user.file).name)
        yield {c.status: stages.set("Extract", "reading …"), c.cancel: gr.update(visible=True), c.upload: None,
               c.fit_row: gr.update(visible=False)}
        try:
            prepared = yield from self._progress(user, stages, read_document, user.file, password, self.limits,
                                                 self.backend, self.chat, self.max_tokens)
        except (PasswordRequired, WrongPassword) as error:
            yield {**self._kept(user, str(error)), c.password_row: gr.update(visible=True)}
            return
        except Exception as error:  # DocumentError says what to do; anything else must not break the page either
            yield self._kept(user, f"⚠ {error}")
            return
        yield from self._fit_then_open(user, prepared, stages)

    def load_selection(self, n_tokens: float, picked: list[str], request: gr.Request):
        """A too-long book: load the ticked chapters, or else its first `n_tokens` tokens."""
        user = self.user(request)
        user.cancel.clear()
        if user.pending is None:
            yield {self.c.status: "Upload a book first."}
            return
        document = _picked(user.pending, picked) if picked else keep_first(user.pending, int(n_tokens))
        yield from self._fit_then_open(user, prepare(self.backend, self.chat, document, self.max_tokens),
                                       part_of=user.pending)

    def selection_note(self, n_tokens: float, picked: list[str], request: gr.Request):
        """The load button says what it will read, and refuses chapters that do not fit."""
        pending = self.user(request).pending
        if pending is None:
            return gr.update()
        if not picked:
            return gr.update(value=f"Read the first {int(n_tokens):,} tokens", interactive=True)
        n = len(self.chat.document_ids(_picked(pending, picked).text))
        over, what = n - pending.budget_tokens, f"{len(picked)} chapter{'s' * (len(picked) > 1)}, {n:,} tokens"
        return gr.update(value=f"Read {what}" if over <= 0 else f"{what}: {over:,} too many", interactive=over <= 0)

    def open_saved(self, book_id: str | None, request: gr.Request):
        user = self.user(request)
        is_visible = not self.private or book_id in user.book_ids
        try:
            document = self.library.document(book_id) if (self.library and book_id and is_visible) else None
        except ValueError:  # typed into the library box: not an id at all
            yield {self.c.status: f"There is no book {book_id!r} in the library: pick one from the list."}
            return
        if document is None:
            yield {self.c.status: "Pick a book from the library first."}
            return
        if self.private:  # the same text uploaded by someone else keeps this reader's title
            document = replace(document, title=user.titles.get(book_id, document.title))
        user.cancel.clear()
        yield from self._fit_then_open(user, prepare(self.backend, self.chat, document, self.max_tokens))

    def ask_remove(self, book_id: str | None, request: gr.Request):
        """Name what "Remove" deletes, and ask."""
        meta = self._removable(book_id, self.user(request))
        if isinstance(meta, str):
            return {self.c.status: meta, self.c.confirm_row: gr.update(visible=False)}
        n_chats, size = len(self.library.chats(book_id)), self.library.book_bytes(book_id)
        note = (f"Remove **{meta['title']}** from the library, with its {n_chats} chat{'s' * (n_chats != 1)} and "
                f"its saved reading ({disk_size(size)})? The file you uploaded is not touched.")
        return {self.c.confirm_note: note, self.c.confirm_row: gr.update(visible=True)}

    def remove_saved(self, book_id: str | None, request: gr.Request):
        """Delete a book from the library (closing it when it is this reader's open book)."""
        user, c, hidden = self.user(request), self.c, gr.update(visible=False)
        meta = self._removable(book_id, user)
        if isinstance(meta, str):
            return {c.status: meta, c.confirm_row: hidden}
        closed = {}
        if user.book is not None and user.book.book_id == book_id:
            user.book, user.editing = None, False
            closed = {c.chatbot: gr.update(value=[], placeholder=NO_BOOK), c.title: "### No book open",
                      c.plot: render_plot([]),
                      c.chapter: gr.update(choices=[], value=None, visible=False), c.summarize_chapter: hidden,
                      c.metrics: render_metrics("idle", None, None, user.counters),
                      c.reading: render_reading(None, None)}
        freed = self.library.remove_book(book_id)
        return {c.status: f"Removed *{meta['title']}* from the library: {disk_size(freed)} freed.",
                c.confirm_row: hidden, **closed, **self._library_view(user)}

    def _removable(self, book_id: str | None, user: User) -> dict | str:
        """The book's meta, or why it cannot be removed now."""
        if self.library is None or self.private:
            return "Books are removed by whoever runs this app (it is shared)."
        try:
            meta = self.library.meta(book_id) if book_id else None
        except ValueError:  # typed into the box: not an id
            meta = None
        if meta is None:
            return "Pick a book from the library first."
        if book_id in self.reading_ids:
            return f"*{meta['title']}* is being read: cancel the reading first."
        if any(u.book is not None and u.book.book_id == book_id for u in self.users.values() if u is not user):
            return f"*{meta['title']}* is open in another window: close that window first."
        return meta

    def _fit_then_open(self, user: User, prepared: Prepared, stages: Stages | None = None,
                       part_of: Prepared | None = None):
        """Read a book that fits (`part_of`: a part of that too-long one), else offer its parts."""
        c, stages = self.c, stages or Stages(prepared.document.title)
        estimate = self.prefill_estimate(len(prepared.doc_ids), self._n_read(user, prepared)) if prepared.fits else ""
        stages.set("Tokenize", prepared.fit_message() + estimate, is_done=prepared.fits)
        if part_of is None:  # the whole book's outline, in the background (a part keeps it)
            self.outlines.start(user, prepared.document)
        if prepared.fits:
            yield from self._open(user, prepared, stages, part_of)
            return
        user.pending, found = prepared, chapters(prepared.document)
        choices = [(f"{s.title} ({prepared.tokens.n_tokens_between(*prepared.document.span(s)):,} tokens)", str(i))
                   for i, s in enumerate(found)]
        most = max(256, prepared.budget_tokens - 64)
        note = "The book is longer than the model's context. Choose what to read below; nothing is cut silently."
        if self.backend.yarn_factor == 1 and not self.private and self.backend.can_load_models:  # it can grow
            note += f" Or tick **Long books** in the Model panel and load the model again: {LONG_BOOKS_NOTE}"
        yield {**self._kept(user, f"{stages.render()}\n\n{note}"), c.first_n: gr.update(maximum=most, value=most),
               c.fit_row: gr.update(visible=True), c.pick: gr.update(choices=choices, value=[], visible=bool(choices))}

    def _open(self, user: User, prepared: Prepared, stages: Stages, part_of: Prepared | None = None):
        c, started = self.c, time.perf_counter()
        more = {c.fit_row: gr.update(visible=True)} if part_of else {}  # its parts stay on offer
        yield {c.status: stages.set("Prefill", "starting …"), c.cancel: gr.update(visible=True),
               c.fit_row: gr.update(visible=False)}
        self._make_room(user)
        reading = book_id_of(prepared.document.text)
        self.reading_ids.add(reading)
        try:
            job = partial(self.backend.open_book, measure_plain=True,  # from another book: never another reader's
                          among=user.book_ids if self.private else None)
            book, restored = yield from self._progress(user, stages, job, self.chat, prepared, self.library)
        except ReadingStopped as error:  # what was read is kept: the book reads on from there next time
            if error.is_saved:
                user.book_ids.add(error.book_id)
                user.titles[error.book_id] = prepared.document.title
            kept = error.book_id if error.is_saved else None  # picked in the library: "Open book" reads on
            yield {**self._kept(user, str(error)), **self._library_view(user, kept), **more}
            return
        except Cancelled:
            yield {**self._kept(user, "Loading cancelled."), **more}
            return
        except Exception as error:  # EngineError (too long...) or e.g. out of memory: the open book stays
            yield {**self._kept(user, f"⚠ {error}"), **more}
            return
        finally:
            self.reading_ids.discard(reading)
        book.batcher = self.batcher
        how = self._timed(user, book, restored, time.perf_counter() - started)
        user.book, user.pending, user.editing, user.notice = book, part_of, False, None
        book.is_cut = part_of is not None  # a part of a longer book: its sources say where it ends
        user.book_ids.add(book.book_id)
        user.titles[book.book_id] = book.document.title
        titles = [s.title for s in chapters(book.document)]
        note = "".join(f"\n\n⚠ {n}" for n in (*book.document.notes, book.save_error) if n)
        if part_of:
            note += (f"\n\nTo read more of *{part_of.document.title}*, tick more chapters below (or keep more "
                     "tokens): what is read already is not read again.")
        yield {c.status: stages.set("Prefill", how, True) + "\n\nReady: ask a question." + note,
               c.cancel: gr.update(visible=False), c.password_row: gr.update(visible=False),
               c.chatbot: asking(book.document.title), c.plot: render_plot([]), c.sources: book_view.choices(None),
               c.metrics: render_metrics("ready", None, book, user.counters),
               c.reading: render_reading(book, None), c.title: f"### {book.document.title}",
               c.chapter: gr.update(choices=titles, value=titles[0] if titles else None, visible=bool(titles)),
               c.summarize_chapter: gr.update(visible=bool(titles)), c.models: self.model_table(),  # its speeds
               **self._library_view(user), **more}

    def _timed(self, user: User, book: BookSession, restored: bool, seconds: float) -> str:
        """Count a reading in the user's counters and this machine's speeds; what the Prefill line says."""
        n = book.doc_len
        n_now = n - book.n_read_before  # the tokens read now (a restored book read none)
        if not restored:  # counted here, not from the engine's totals: other readers' work goes on meanwhile
            user.counters.n_prefills += 1
            user.counters.n_prefill_tokens += n_now
            model = self.backend.name
            self.speeds.record_prefill(model, n, seconds - 8 * (book.plain_ms or 0) / 1000,  # less the probe
                                       self.backend.attention_share, start=book.n_read_before)  # read on: as a whole
            self.speeds.record_decode(model, n, book.plain_ms or 0)
        how = (f"restored from the saved snapshot in {seconds:.1f} s" if restored
               else f"{n_now:,} tokens in {seconds:.1f} s ({n_now / seconds:,.0f} tokens/s)")
        if book.n_read_before:
            how += f", after the {book.n_read_before:,} " + (f"read before in *{book.read_before_in}*"
                                                            if book.read_before_in else "a stopped reading had kept")
        return how

    def _n_read(self, user: User, prepared: Prepared) -> int:
        """Tokens of this book the library holds a reading of (app/session.py `n_read_before`)."""
        if self.library is None:
            return 0
        return self.backend.n_read_before(self.library, prepared, user.book_ids if self.private else None)

    def prefill_estimate(self, n_tokens: int, n_read: int = 0) -> str:
        """' · about 3 min to read here' from this machine's measured rate (what is left when a stopped
        reading kept `n_read` tokens), and the faster model's time when the wait is long; what the
        first book will do when nothing was measured yet."""
        model, share = self.backend.name, self.backend.attention_share
        seconds, before = self.speeds.prefill_s(model, n_tokens, share), ""
        if n_read:
            before = f" · {n_read / n_tokens:.0%} was read before, the rest reads on from there"
        if seconds is None:
            return before + " · the first book measures how fast this machine reads"
        if n_read:
            return before + f": about {duration(seconds - self.speeds.prefill_s(model, n_read, share))} left"
        text = f" · about {duration(seconds)} to read here"
        faster = self._faster_model(model, n_tokens, seconds, share)
        if seconds > LONG_PREFILL_S and faster:
            text += f"; {faster[0]} would take about {duration(faster[1])} (lower quality: choose it under Model)"
        return text

    def _faster_model(self, model: str, n_tokens: int, seconds: float, share: float) -> tuple[str, float] | None:
        """(name, estimated seconds) of a smaller packaged chat model: measured here (scaled with this
        model's attention share: a smaller model's is larger, so this errs short), or scaled from this
        model's time by file size."""
        this = models.PACKAGED_MODELS.get(model)
        for other in models.PACKAGED_MODELS.values():
            if this is None or other.n_bytes >= this.n_bytes or other.generation is None:
                continue  # bigger, or not a chat model for books (SmolLM2)
            estimate = self.speeds.prefill_s(other.name, n_tokens, share) or seconds * other.n_bytes / this.n_bytes
            return other.name, estimate
        return None

    def ask(self, message: str, history: list, temperature: float, top_p: float, max_new_tokens: float,
            seed: float, levels: str, request: gr.Request, top_k: float | None = None, min_p: float | None = None,
            repetition_penalty: float | None = None, presence_penalty: float | None = None,
            frequency_penalty: float | None = None, reread: bool | None = None):
        """Answer `message` (or, after Edit, replace the last question with it); `history` is shown only.
        The settings come in app/settings.py `INPUTS` order, as the page wires them; sampling settings an
        API caller leaves out keep the model's defaults. (Gradio passes `request` in its place, before
        the inputs that follow it.) `reread`: quote the sources after the question."""
        user = self.user(request)
        replace, user.editing = user.editing, False
        values = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, levels=levels,
                      top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, reread=reread)
        yield from self._answer(user, message, replace, values)

    def regenerate(self, temperature: float, top_p: float, max_new_tokens: float, seed: float, levels: str,
                   request: gr.Request, top_k: float | None = None, min_p: float | None = None,
                   repetition_penalty: float | None = None, presence_penalty: float | None = None,
                   frequency_penalty: float | None = None, reread: bool | None = None):
        book = self.user(request).book
        self.user(request).editing = True  # replace the last turn with a new answer to its question
        question = book.turns[-1].question if book and book.turns else ""
        yield from self.ask(question, [], temperature, top_p, max_new_tokens, seed, levels, request, top_k, min_p,
                            repetition_penalty, presence_penalty, frequency_penalty, reread)

    def _answer(self, user: User, question: str, replace: bool, values: dict):
        """`values`: the settings by app/settings.py `INPUTS` name; sampling values left out keep the
        model's own (`Backend.default_sampling`)."""
        c, book = self.c, user.book
        if book is None or not question.strip():
            text = ("Type a question first." if book
                    else user.notice or "**No book yet** — upload one on the left first.")
            yield {c.metrics: render_metrics(text, None, book, user.counters)}
            return
        user.cancel.clear()
        shown = (book.messages()[:-2] if replace else book.messages()) + [{"role": "user", "content": question}]
        yield {c.msg: gr.update(value="", show_label=False), c.chatbot: shown + [{"role": "assistant", "content": "…"}],
               c.metrics: render_metrics("thinking", None, book, user.counters), c.plot: render_plot([])}
        state, stats, points = "done", None, []
        watch = CpuWatch() if self.backend.decodes_here else None
        try:
            settings = Settings.of(values, self.backend.default_sampling)
            book.session.set_levels(settings.levels if settings.levels in LEVEL_STACKS else book.session.levels)
            run = book.edit_last if replace else book.ask
            last_turn = book.turns[-1] if book.turns else None
            try:
                drawn_at, reading = 0.0, None
                for update in run(question, settings.sampling, user.cancel, reread=settings.reread):
                    stats, reading = update.stats, update.reading or reading
                    points.append((stats.tbt_ms_last, stats.levels[-1].acceptance if stats.levels else 0.0))
                    state = {"cancelled": "stopped", "length": "done (length limit)"}.get(update.finish_reason, "done")
                    if update.finish_reason is None and time.monotonic() - drawn_at < REDRAW_EVERY_S:
                        continue  # shown with the next redraw
                    drawn_at = time.monotonic()
                    shown_state = "streaming" if update.finish_reason is None else state
                    out = {c.chatbot: shown + [{"role": "assistant", "content": update.answer or "…"}],
                           c.metrics: render_metrics(shown_state, stats, book, user.counters, cpu_note(watch)),
                           c.plot: render_plot(points)}
                    yield out if reading is None else {**out, c.reading: render_reading(book, reading)}
                    reading = None
            finally:
                if book.turns and book.turns[-1] is not last_turn:  # this reader's question went in
                    user.counters.n_prefill_tokens += book.turns[-1].answer_start - book.turns[-1].start
        except Cancelled:
            state = "stopped"
        except Exception as error:  # EngineError, bad settings, ...: the book and chat stay consistent
            state = f"error — {error}"
        if book.turns:
            user.chat_ids.add(book.chat_id)
        yield {c.chatbot: book.messages(), c.sources: book_view.choices(book),
               c.metrics: render_metrics(state, stats, book, user.counters, cpu_note(watch)),
               c.plot: render_plot(points), **self._library_view(user)}

    def edit_last(self, request: gr.Request):
        user = self.user(request)
        user.editing = bool(user.book and user.book.turns)
        return {self.c.msg: gr.update(value=user.book.turns[-1].question, show_label=True,
                                      label="Editing your last question: Send replaces it and its answer")
                if user.editing else gr.update()}

    def clear(self, request: gr.Request):
        user = self.user(request)
        user.editing = False
        if user.book:
            user.book.clear()
        return {self.c.chatbot: [], self.c.metrics: render_metrics("ready", None, user.book, user.counters),
                self.c.plot: render_plot([]), self.c.sources: book_view.choices(None), **self._library_view(user)}

    def export(self, fmt: str, request: gr.Request) -> str:
        """The open chat as Markdown or JSON text ("" when no book is open)."""
        book = self.user(request).book
        return "" if book is None else (chat_export_json if fmt == "json" else chat_markdown)(book.to_json())

    def export_file(self, fmt: str, request: gr.Request):
        book = self.user(request).book
        try:
            return gr.update(value=str(write_export(book.to_json(), fmt)) if book else None, visible=bool(book))
        except OSError as error:  # e.g. a full disk: say so in a toast, not an error pill
            gr.Warning(f"The export could not be written ({write_failure(error)}).")
            return gr.update(value=None, visible=False)

    def _library_view(self, user: User, selected: str | None = None) -> dict:
        """The library's books and the open book's chats; `selected` (else the open book) is picked,
        so "Open book" opens it."""
        book = user.book
        model = self.backend.fingerprint  # its readings: "45% read"
        books, chats = self.library.choices(book.book_id if book else None, model) if self.library else ([], [])
        if self.private:  # only what this session opened or wrote
            books = [(user.titles.get(book_id, title), book_id) for title, book_id in books if book_id in user.book_ids]
            chats = [c for c in chats if c[1] in user.chat_ids]
        return {self.c.books: gr.update(choices=books, value=selected or (book.book_id if book else None)),
                self.c.chats: gr.update(choices=chats, value=book.chat_id if book and book.turns else None)}

    def show_library(self, request: gr.Request):
        return self._library_view(self.user(request))

    def open_chat(self, chat_id: str | None, request: gr.Request):
        user, c = self.user(request), self.c
        if user.book is None or not chat_id or self.library is None or self.private and chat_id not in user.chat_ids:
            return {c.chatbot: gr.update()}
        try:
            user.book.load_chat(self.library.load_chat(user.book.book_id, chat_id))
        except (TypeError, KeyError, ValueError) as error:
            return {c.metrics: render_metrics(f"That chat could not be opened ({error}).", None, None, user.counters)}
        return {c.chatbot: user.book.messages(), c.metrics: render_metrics("ready", None, user.book, user.counters),
                c.sources: book_view.choices(user.book)}

    def engine_counters(self, request: gr.Request) -> dict:
        """This session's prefills (documents) and prefilled tokens (documents and questions)."""
        counters = self.user(request).counters
        return {"n_prefills": counters.n_prefills, "n_prefill_tokens": counters.n_prefill_tokens}

    # ---- layout ----------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        return layout.build(self)

    def start_sampling(self) -> SamplingConfig:
        """Where the Settings start: how the loaded model was tuned to be sampled (its own files),
        with what app.py's flags set."""
        return replace(self.backend.default_sampling, **self.sampling)

    def reset_settings(self) -> dict:
        """Updates that put the `TUNED` sampling controls at `start_sampling` and the level stack at the
        model's (the answer length and the seed stay as the reader set them)."""
        start, controls = self.start_sampling(), self.c.settings
        updates = {controls[name]: gr.update(value=getattr(start, name)) for name in TUNED}
        return updates | {controls["levels"]: gr.update(choices=self.backend.level_stacks(), value=self.backend.levels)}

    def sampling_note(self) -> str:
        """The Settings panel's first line: where its values come from."""
        d = self.backend.default_sampling
        how = ("greedy (its files give no sampling settings)" if d.is_greedy else
               f"temperature {d.temperature:g}, top-p {d.top_p:g}, top-k {d.top_k}, repetition penalty "
               f"{d.repetition_penalty:g}")
        flags = " ".join(f"`--{name.replace('_', '-')} {self.sampling[name]:g}`" for name in TUNED
                         if name in self.sampling)
        given = f", with {flags} from the command line" if flags else ""
        return (f"<small>Starts at how {self.backend.name} was tuned to be sampled: {how}{given}. Answers are "
                f"exact samples of the model with these settings, whichever level stack runs.</small>")

    # ---- the model picker (LM Studio style): size, context, speed measured here, quality -----
    def model_table(self) -> str:
        current, rows = self.backend.name, []
        for m in models.PACKAGED_MODELS.values():
            mark = " **(loaded)**" if m.name == current else ""
            rows.append(f"| `{m.name}`{mark} | {m.n_bytes / 1e9:.1f} GB | {m.n_context // 1024 or '?'}K | "
                        f"{self.speeds.describe(m.name)} | {m.note} |")
        if current not in models.PACKAGED_MODELS:  # a folder, a .gguf file or a hub id of the reader's
            rows.append(f"| `{current}` **(loaded)** | | {self.backend.max_context // 1024}K | "
                        f"{self.speeds.describe(current)} | your model |")
        head = "| model | file | context | measured on this machine | quality |\n|:--|--:|--:|:--|:--|"
        draft = f" · draft `{self.backend.draft}`" if self.backend.draft else ""
        found = render_found(self.catalog.found(wait=False), self.backend.machine()) if self.catalog else ""
        if self.catalog and self.catalog.is_searching:
            found += "\n\n*Reading the headers of the other models on this machine … (reopen the page to see them)*"
        found = f"\n\n**On this machine** (never downloaded; the engine reads their headers only)\n\n{found}" \
            if found else ""
        loaded = f"Loaded: `{current}`{draft} · levels `{self.backend.levels}`"
        return f"{loaded}\n\n{head}\n" + "\n".join(rows) + found

    def draft_choices(self, target: str | None, wait: bool = True) -> list[tuple[str, str]]:
        """(label, source) of the drafts that pair with `target`, the suggested one first, then none
        (without `wait`: among the models whose headers are read already)."""
        offered = drafts(self.catalog, self.backend.machine(), target, wait) if target else []
        return [*offered, ("none", NO_DRAFT)]

    def refresh_picker(self):
        """A page opened: the model table, the models found so far (the search runs on meanwhile) and
        the drafts among them for the loaded target."""
        b = self.backend
        return (self.model_table(), gr.update(choices=model_choices(self.catalog), value=b.name),
                gr.update(choices=self.draft_choices(b.name, wait=False), value=b.draft or NO_DRAFT))

    def drafts_offered(self, target: str | None):
        """The draft picker for a newly picked target: the drafts that pair with it, the suggested one chosen."""
        choices = self.draft_choices(target)
        return gr.update(choices=choices, value=choices[0][1])

    def switch_model(self, name: str | None, long_books: bool, request: gr.Request, draft: str | None = "auto"):
        """Load another model with `draft` ("auto": the one that pairs, `NO_DRAFT`: none), or the same one
        with YaRN for long books; every open book closes (its KV cache belongs to the old model) and
        reopens from the library with the new one. A model whose files say it will not run here is
        refused before loading, in one sentence. One reader's app only."""
        user, c = self.user(request), self.c
        if self.private:
            yield {c.model_status: "In a shared app the model is chosen when it starts (`--model`, `--yarn`)."}
            return
        name, yarn = name or self.backend.name, LONG_BOOKS_YARN if long_books else 1.0
        machine = self.backend.machine()
        draft = suggested_draft(self.catalog, machine, name) if draft in ("auto", None) else draft
        draft = None if draft in (NO_DRAFT, "") else draft
        if name == self.backend.name and yarn == self.backend.yarn_factor and draft == self.backend.draft:
            yield {c.model_status: f"`{name}` is already loaded" + (" for long books." if yarn != 1 else ".")}
            return
        user.cancel.clear()
        yield {c.model_status: f"Loading `{name}` … (the first time: a download of a few minutes)"}
        try:
            check_loadable(self.catalog, machine, name, draft)
            load = self.catalog.loadable if self.catalog else str  # a blob under a .gguf name (Ollama, HF cache)
            job = partial(self.backend.load, load(name), load(draft) if draft else NO_DRAFT, yarn)
            backend = yield from self._progress(user, Stages(name), job)
        except Exception as error:  # ModelNotFound, TokenizerMismatch, out of memory ...: keep the old one
            yield {c.model_status: f"⚠ Could not load `{name}`: {error} `{self.backend.name}` stays loaded.",
                   c.models: self.model_table()}
            return
        self.backend, self.chat = backend, PlainChatFormat(backend.tokenizer, end_ids=backend.end_ids)
        self.outlines.use(backend)  # outlines under way stop and say so
        for other in self.users.values():
            other.book = other.pending = None
            other.notice = f"The model changed to {name}: open your book again from the library."
        yield {c.model_status: f"`{name}` is loaded. Open a book from the library (it is read again with the new "
                               f"model).", c.models: self.model_table(), c.title: "### No book open",
               c.chatbot: gr.update(value=[], placeholder=NO_BOOK), c.sampling_note: self.sampling_note(),
               c.status: "Ready for a book.",
               **self.reset_settings()}
