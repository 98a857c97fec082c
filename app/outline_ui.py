"""The outline on the page (issue 56): the panel, its handlers, and the app's one outline worker.

`Outlines` starts a reader's outline when a book is uploaded or opened (the whole book, also one
longer than the context), shows its progress and ETA, cancels and resumes it, and exports it to
Markdown; `panel` lays out its components and `wire` connects them. The worker runs only while
no reader's answer is decoded and no book is read (`App.batcher`, `App.jobs`). The logic is in
app/outline.py and app/outline_worker.py; app/ui.py calls `start`, `use` and `forget`.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import gradio as gr

from app.documents import Document
from app.outline import Outline, Prompter, SummaryCache, new_outline, outline_markdown
from app.outline_worker import OutlineWorker
from app.speeds import duration
from engine.parallel import Leader

if TYPE_CHECKING:
    from app.backend import Backend
    from app.ui import App, User

REFRESH_S = 1.0  # the panel's refresh: its progress line; rows are redrawn only when they change
STATE_WORDS = {"running": "*summarizing …*", "waiting": "*waiting*", "failed": "⚠ not summarized: {note}",
               "skipped": "*({note}: nothing to summarize)*"}


class Outlines:
    """Every reader's outline, made by one background worker over the app's engine."""

    def __init__(self, app: App):
        self.app = app
        self.cache = SummaryCache(app.library.root if app.library else None)
        self.by_user: dict[int, Outline] = {}  # id(User) -> the outline of the book they uploaded last
        self.documents: dict[int, Document] = {}  # id(User) -> that book
        self.shown: dict[int, tuple[int, int]] = {}  # id(User) -> (id, version) of the rows last drawn
        self.worker: OutlineWorker | None = None
        self.use(app.backend)

    def use(self, backend: Backend) -> None:
        """A (new) backend: outlines under way stop, saying so; Resume makes them with its model."""
        if self.worker is not None:
            self.worker.close()
        self.worker, self.off = None, off_reason(self.app, backend)
        if self.off:
            return
        self.worker = OutlineWorker(backend.outline_engine, Prompter(self.app.chat), self.cache,
                                    is_busy=self._readers_first)
        self.model = backend.fingerprint

    def _readers_first(self) -> bool:
        b = self.app.batcher
        return bool(b.active or b.waiting or self.app.jobs)

    def start(self, user: User, document: Document) -> None:
        """Outline the whole `document` (a part picked from it afterwards keeps this outline)."""
        if self.worker is None:
            return
        old = self.by_user.get(id(user))
        if old is not None and self.documents[id(user)].text == document.text and old.model == self.model:
            if not old.is_complete:  # the same book again: its outline goes on
                self.worker.start(old)
            return
        if old is not None:
            self.worker.cancel(old, "another book was opened")
        engine = self.worker.engine
        outline = new_outline(document, self.worker.prompter, self.model, self.worker.sampling_id,
                              engine.max_context, self.cache)
        self.by_user[id(user)], self.documents[id(user)] = outline, document
        self.worker.start(outline)

    def close(self) -> None:
        """The app stops: the round under way ends; finished summaries are already in the library."""
        if self.worker is not None:
            self.worker.close("the app stopped")

    def forget(self, user: User) -> None:
        outline = self.by_user.pop(id(user), None)
        self.documents.pop(id(user), None)
        if outline is not None and self.worker is not None:
            self.worker.cancel(outline)

    # ---- handlers ---------------------------------------------------------------------------
    def refresh(self, request: gr.Request):
        """The progress line, and the rows when they changed since this page last drew them."""
        user = self.app.user(request)
        outline = self.by_user.get(id(user))
        if outline is None:
            return gr.update(value=self.off or NO_OUTLINE), gr.skip()
        seen = (id(outline), outline.version)
        rows = gr.skip() if self.shown.get(id(user)) == seen else render_rows(outline)
        self.shown[id(user)] = seen
        return self.progress(outline), rows

    def progress(self, outline: Outline) -> str:
        n_done, n_rows = outline.counts()
        n_cached = sum(t.state == "cached" for t in outline.rows)
        head = f"**{n_done} of {n_rows} parts** summarized" + (f" ({n_cached} from the library)" if n_cached else "")
        if outline.is_complete:
            return head + " · the book summary is ready below."
        if outline.stopped:
            return head + f" · stopped: {outline.stopped}. **Resume** goes on from there."
        if n_rows == 0:
            return "This book has no text to summarize."
        worker = self.worker
        if worker is None or outline.model != self.model:
            return head + " · stopped: the model changed. **Resume** makes the rest with the loaded model."
        left = worker.seconds_left(outline)
        eta = f" · about {duration(left)} left (at the rate measured here)" if left else \
            " · the time left shows after the first part"
        if self._readers_first():
            return head + eta + " · paused: a reader's question or a book being read goes first."
        if n_done == n_rows:
            return head + " · now the book summary, from the chapter summaries …"
        is_behind = worker.runs and not any(run.outline is outline for run in worker.runs.values())
        return head + eta + (" · after another reader's outline" if is_behind else "")

    def cancel(self, request: gr.Request):
        outline = self.by_user.get(id(self.app.user(request)))
        if outline is not None and self.worker is not None:
            self.worker.cancel(outline)
        return self.refresh(request)

    def resume(self, request: gr.Request):
        """Go on with the outline; after a model change, made with the loaded model (the summaries
        the old one made stay cached for it)."""
        user = self.app.user(request)
        outline = self.by_user.get(id(user))
        if outline is not None and self.worker is not None:
            if outline.model != self.model:
                self.start(user, self.documents[id(user)])
            else:
                self.worker.start(outline)
        return self.refresh(request)

    def export(self, request: gr.Request):
        outline = self.by_user.get(id(self.app.user(request)))
        if outline is None:
            return gr.update(value=None, visible=False)
        slug = re.sub(r"[^\w-]+", "-", outline.title.lower()).strip("-")[:40] or "book"
        path = Path(tempfile.mkdtemp(prefix="bookchat-outline-")) / f"{slug}-outline.md"
        try:
            path.write_text(outline_markdown(outline), encoding="utf-8")
        except OSError as error:
            gr.Warning(f"The outline could not be written ({error.strerror}).")
            return gr.update(value=None, visible=False)
        return gr.update(value=str(path), visible=True)

    def markdown(self, request: gr.Request) -> str:
        """The outline as Markdown ("" when none): the export's text, for API callers."""
        outline = self.by_user.get(id(self.app.user(request)))
        return "" if outline is None else outline_markdown(outline)


NO_OUTLINE = "Upload a book: its outline, chapter by chapter, is made here in the background."


def off_reason(app: App, backend: Backend) -> str:
    """Why no outline is made in the background with `backend` ("": one is)."""
    if not app.outline:
        return "Outlines are off (`--no-outline`): summarize a book that fits with **Summarize the book**."
    if isinstance(backend.outline_engine, Leader):  # every rank must run the same rounds
        return ("Outlines are not made under tensor parallel yet (the ranks run the readers' rounds in step). "
                "With one GPU, or on the CPU, the outline is made in the background.")
    if backend.outline_engine is None:  # a server owns its model and its time
        return "Outlines are made with the local engine only, not through a remote server."
    return ""


def render_rows(outline: Outline) -> str:
    lines = []
    if outline.book_summary:
        lines += ["#### Book summary *(made from chapter summaries)*", "", outline.book_summary, ""]
    for task in outline.rows:
        body = task.summary if task.summary else STATE_WORDS.get(task.state, "").format(note=task.note)
        lines += [f"**{task.label}** — {body}", ""]
    return "\n".join(lines)


def panel(app: App, c: SimpleNamespace) -> None:
    """The Outline accordion: progress, Cancel / Resume / Export, the rows (a scrolling box)."""
    with gr.Accordion("Outline and book summary", open=True, elem_id="outline-panel"):
        c.outline_status = gr.Markdown(NO_OUTLINE, elem_id="outline-status")
        with gr.Row():
            c.outline_cancel = gr.Button("Cancel outline", size="sm", elem_id="outline-cancel")
            c.outline_resume = gr.Button("Resume outline", size="sm", elem_id="outline-resume")
            c.outline_export = gr.Button("Export outline .md", size="sm", elem_id="outline-export")
        c.outline_file = gr.File(label="Exported outline", visible=False, elem_id="outline-file", interactive=False)
        c.outline = gr.Markdown("", elem_id="outline", max_height=360)
        c.outline_timer = gr.Timer(REFRESH_S)


def wire(app: App, c: SimpleNamespace) -> None:
    o, shown = app.outlines, [c.outline_status, c.outline]
    quick = dict(show_progress="hidden", concurrency_limit=None)
    c.outline_timer.tick(o.refresh, None, shown, api_name=False, **quick)
    c.outline_cancel.click(o.cancel, None, shown, api_name="cancel_outline", **quick)
    c.outline_resume.click(o.resume, None, shown, api_name="resume_outline", **quick)
    c.outline_export.click(o.export, None, c.outline_file, api_name=False, **quick)
    gr.api(o.markdown, api_name="outline")
