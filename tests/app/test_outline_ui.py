"""The outline's handlers (app/outline_ui.py) over tiny random engines: a reader's work pauses it
and the page says so, the same book again keeps its outline, a model switch stops it and says so,
Resume makes it with the loaded model, export writes the Markdown. The worker never gets a round
here (a reading is always under way), so nothing depends on timing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import app.outline_ui as outline_ui
from app.backend import LocalEngine
from app.outline_ui import Outlines
from engine.batch import Batcher
from tests.app.test_outline import CharPrompter, book
from tests.conftest import tiny_engine


@pytest.fixture
def app(monkeypatch):
    monkeypatch.setattr(outline_ui, "Prompter", lambda chat: CharPrompter())  # no tokenizer in a tiny model
    user = SimpleNamespace()
    fake = SimpleNamespace(backend=LocalEngine(tiny_engine("ngram>full")), chat=None, library=None, outline=True,
                           batcher=Batcher(background=False), jobs={"a book being read"}, user=lambda request: user)
    fake.outlines = Outlines(fake)
    fake.me = user
    return fake


def test_the_outline_waits_while_a_book_is_read_and_says_so(app):
    app.outlines.start(app.me, book())
    outline = app.outlines.by_user[id(app.me)]
    status, rows = app.outlines.refresh(None)
    assert status.startswith("**0 of 5 parts** summarized") and "paused: a reader's question or a book" in status
    assert "**Chapter 1** — *waiting*" in rows and "**Chapter 6** — *(empty: nothing to summarize)*" in rows
    assert app.outlines.worker.n_rounds == 0 and outline.rows[0].state == "waiting"
    app.outlines.start(app.me, book())  # the same book again (a part of it was picked): the same outline
    assert app.outlines.by_user[id(app.me)] is outline


def test_a_model_switch_stops_the_outline_and_resume_makes_it_with_the_new_model(app):
    app.outlines.start(app.me, book())
    old = app.outlines.by_user[id(app.me)]
    app.backend = LocalEngine(tiny_engine("ngram>full", seed=5, vocab=120))  # another model (its fingerprint differs)
    app.outlines.use(app.backend)
    assert old.stopped == "the model changed"
    assert "stopped: the model changed. **Resume** goes on from there." in app.outlines.progress(old)
    app.outlines.resume(None)
    new = app.outlines.by_user[id(app.me)]
    assert new is not old and new.model != old.model and new.model == app.outlines.model and not new.stopped


def test_export_writes_the_outline_as_markdown(app):
    app.outlines.start(app.me, book())
    update = app.outlines.export(None)
    text = Path(update["value"]).read_text(encoding="utf-8")
    assert text.startswith("# Book\n\n## Outline\n\n### Chapter 1\n\n*(not summarized yet)*")
    assert app.outlines.markdown(None) == text


def test_no_outline_when_turned_off_or_under_tensor_parallel(app):
    from engine.parallel import Leader

    app.outline = False
    app.outlines.use(app.backend)
    app.outlines.start(app.me, book())
    assert app.outlines.worker is None and id(app.me) not in app.outlines.by_user  # keyed by id(User)
    assert "Outlines are off (`--no-outline`)" in app.outlines.refresh(None)[0]["value"]
    app.outline = True
    app.outlines.use(LocalEngine(object.__new__(Leader)))  # rank 0 of a tensor-parallel engine (not started)
    assert app.outlines.worker is None and "tensor parallel" in app.outlines.refresh(None)[0]["value"]
    app.outlines.use(app.backend)
    assert app.outlines.worker is not None and app.outlines.off == ""


def test_close_ends_the_worker_thread(app):
    app.jobs.clear()  # nothing read now: the worker runs
    app.outlines.start(app.me, book())
    worker = app.outlines.worker
    assert worker.thread.is_alive()
    app.outlines.close()
    assert not worker.thread.is_alive() and worker.closed
