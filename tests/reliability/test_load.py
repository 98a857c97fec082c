"""Cancellation and load: Stop during a prefill or an answer frees the engine within one step (the
handler runs in a worker thread as under Gradio; Stop comes from another thread mid-forward);
20 rapid ask/stop cycles and three rounds of three concurrent users (gradio_client, each closing
when done) leave memory flat and the engine answering.
"""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.reliability.conftest import (
    LEVELS,
    client,
    last,
    make_app,
    open_with_chat,
    request,
    rss_bytes,
    run,
    wait_until,
    write_book,
)

MB = 1024 * 1024


class Handler:
    """Runs a handler's generator in a thread, as Gradio's worker does, collecting its updates."""

    def __init__(self, updates):
        self.updates: list[dict] = []
        self.thread = threading.Thread(target=lambda: self.updates.extend(updates), daemon=True)
        self.thread.start()

    def join(self, timeout_s: float) -> list[dict]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the handler did not finish within {timeout_s} s of Stop"
        return self.updates


@pytest.fixture
def app(engine, tmp_path):
    return make_app(engine, tmp_path / "lib")


def test_stop_during_prefill_frees_the_engine_within_one_chunk(app, engine, tmp_path, slow_forwards):
    req, book = open_with_chat(app, tmp_path)
    slow = slow_forwards(delay_s=0.02)
    chunk, before = engine.config.prefill_chunk_tokens, engine.n_prefill_tokens
    loading = Handler(app.load_book(str(write_book(tmp_path, "long.txt", 12_000, start=50_000)), "", req))
    wait_until(lambda: engine.n_prefill_tokens - before >= 3 * chunk, 30, "three prefill chunks")
    app.request_stop(req)
    at_stop, stopped_at = engine.n_prefill_tokens, time.monotonic()
    updates = loading.join(10)
    assert time.monotonic() - stopped_at < 2.0
    assert engine.n_prefill_tokens - at_stop <= chunk  # at most the chunk that was running
    assert engine.n_prefill_tokens - before < 2_500  # far from the ~2,900 tokens of the whole book
    status = last(app, updates, "status")
    assert status.startswith("Loading cancelled.") and status.endswith("*persuasion* is still open."), status
    assert app.users["reader"].book is book and len(book.turns) == 1
    calls = slow.n_calls
    metrics = last(app, run(app.ask("Who is Anne?", [], 0.0, 1.0, 4, 0, LEVELS, req)), "metrics")
    assert "done" in metrics and slow.n_calls > calls  # the engine is free and answers at once


def test_stop_during_an_answer_frees_the_engine_within_one_step(app, tmp_path, slow_forwards):
    req, book = open_with_chat(app, tmp_path)
    slow = slow_forwards(delay_s=0.02)
    start = slow.n_calls
    answering = Handler(app.ask("Tell me everything about the Elliots.", [], 0.0, 1.0, 400, 0, LEVELS, req))
    wait_until(lambda: slow.n_calls - start >= 6, 30, "the answer to stream")
    app.request_stop(req)
    at_stop = slow.n_calls
    updates = answering.join(10)
    assert slow.n_calls - at_stop <= 1  # the forward in flight, then nothing (ngram>full: one per step)
    assert "stopped" in last(app, updates, "metrics")
    shown = last(app, updates, "chatbot")[-1]["content"]
    assert shown.split("\n\n**Sources:**")[0].endswith("*(stopped)*"), shown  # the answer, then its sources
    assert book.turns[-1].finish_reason == "cancelled" and not book.session.lock.locked()
    assert "done" in last(app, run(app.ask("Who is Anne?", [], 0.0, 1.0, 4, 0, LEVELS, req)), "metrics")


def ask_then_stop(app, req) -> str:
    answering = Handler(app.ask("Tell me about the Elliot family.", [], 0.0, 1.0, 300, 0, LEVELS, req))
    wait_until(lambda: len(answering.updates) >= 2, 30, "the first streamed update", every_s=0.001)
    app.request_stop(req)
    return last(app, answering.join(10), "metrics")


def test_twenty_rapid_ask_stop_cycles_leave_memory_flat_and_the_engine_usable(app, tmp_path):
    req, book = open_with_chat(app, tmp_path)
    for _ in range(3):  # warm up: caches, allocator pools, first-call imports
        ask_then_stop(app, req)
    gc.collect()
    n_threads, rss_before = threading.active_count(), rss_bytes()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        states = [ask_then_stop(app, req) for _ in range(20)]
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all("stopped" in s or "done" in s for s in states) and sum("stopped" in s for s in states) >= 15
    assert len(book.turns) == 24 and all(t.end == n.start for t, n in zip(book.turns, book.turns[1:]))
    assert after - before < 2 * MB, f"Python heap grew by {(after - before) / MB:.1f} MB over 20 cycles"
    assert rss_bytes() - rss_before < 40 * MB, f"RSS grew by {(rss_bytes() - rss_before) / MB:.0f} MB"
    assert threading.active_count() <= n_threads and not book.session.lock.locked()
    assert "done" in last(app, run(app.ask("Who is Anne?", [], 0.0, 1.0, 4, 0, LEVELS, req)), "metrics")


def user_visit(url: str, book, question: str):
    """One reader: upload a book, ask, read the answer, leave (the browser tab closes)."""
    from gradio_client import handle_file

    reader = client(url)
    status = reader.predict(handle_file(str(book)), "", api_name="/load_book")[0]
    metrics = reader.predict(question, [], 0.0, 1.0, 24, 0, LEVELS, api_name="/ask")[2]
    return reader, status, metrics


def test_three_concurrent_users_in_rounds_leave_memory_flat(served, engine, tmp_path):
    books = [write_book(tmp_path, f"reader{i}.txt", 6000, start=40_000 * i) for i in range(3)]
    rss_after_first = None
    for round_idx in range(3):
        with ThreadPoolExecutor(3) as pool:
            visits = list(pool.map(user_visit, [served.url] * 3, books, [f"Question {i}?" for i in range(3)]))
        assert all("Ready" in status and "done" in metrics for _, status, metrics in visits), visits
        hashes = [reader.session_hash for reader, _, _ in visits]
        books_in_memory = [weakref.ref(served.app.users[h].book) for h in hashes]
        for reader, _, _ in visits:
            reader.close()
        wait_until(lambda hashes=hashes: not set(hashes) & set(served.app.users), 15, "closed sessions forgotten")
        gc.collect()
        assert all(ref() is None for ref in books_in_memory), "a closed session's book (KV cache) is still alive"
        if round_idx == 0:
            rss_after_first = rss_bytes()
    assert rss_bytes() - rss_after_first < 60 * MB, f"RSS grew by {(rss_bytes() - rss_after_first) / MB:.0f} MB"
    _, status, metrics = user_visit(served.url, books[0], "Still there?")
    assert "Ready" in status and "done" in metrics


def test_opening_more_books_than_the_limit_closes_the_least_recently_used(engine, tmp_path):
    app = make_app(engine, tmp_path / "lib", max_open_books=2)
    readers = [request(name) for name in ("ann", "bob", "cid")]
    for i, req in enumerate(readers):
        status = last(app, run(app.load_book(str(write_book(tmp_path, f"b{i}.txt", 3000, 30_000 * i)), "", req)),
                      "status")
        assert "Ready" in status
    open_books = {name: app.users[name].book is not None for name in ("ann", "bob", "cid")}
    assert open_books == {"ann": False, "bob": True, "cid": True}
    metrics = last(app, run(app.ask("Who?", [], 0.0, 1.0, 4, 0, LEVELS, readers[0])), "metrics")
    assert "Your book was closed to make room for other readers. Reopen it from the library" in metrics
    status = last(app, run(app.open_saved(app.library.books()[-1]["id"], readers[0])), "status")
    assert "restored from the saved snapshot" in status and app.users["bob"].book is None  # now Bob is oldest
