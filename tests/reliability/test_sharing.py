"""Sharing: --share needs a login (given, or generated and printed) unless --share-without-auth
says otherwise (with a warning); a share link that cannot be made is reported within seconds and
the app keeps serving locally; engine jobs wait in one queue whose position clients see; two users
at once never see each other's book, chat, library or metrics; uploads are capped in size.
The share tunnel is made to fail by replacing gradio.networking.setup_tunnel, never by waiting
on the network.
"""

from __future__ import annotations

import argparse
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from app.server import login, serve
from tests.reliability.conftest import (
    LEVELS,
    ROOT,
    SlowForwards,
    client,
    free_port,
    last,
    make_app,
    request,
    run,
    wait_until,
    write_book,
)

# app/ui.py's `loading` and `answering` outputs as the API returns them (buttons and groups left out)
LOADING = ["status", "upload", "first_n", "pick", "chatbot", "metrics", "plot", "reading", "chapter", "title", "models",
           "books", "chats", "sources"]
ANSWERING = ["msg", "chatbot", "metrics", "plot", "reading", "books", "chats", "sources"]


def args(*argv: str) -> argparse.Namespace:
    return argparse.Namespace(share="--share" in argv, share_without_auth="--share-without-auth" in argv,
                              auth=next((a.split("=", 1)[1] for a in argv if a.startswith("--auth=")), None))


def test_share_without_auth_generates_and_prints_a_password():
    said: list[str] = []
    user, password = login(args("--share"), said.append)
    assert user == "reader" and len(password) >= 16
    assert said == [f"--share without --auth: log in as user 'reader' with password {password}"]
    assert login(args("--share"), said.append)[1] != password  # a new one each start


def test_share_without_auth_needs_the_explicit_flag_and_warns():
    said: list[str] = []
    assert login(args("--share", "--share-without-auth"), said.append) is None
    assert said == ["WARNING: --share-without-auth: anyone with the link can use this app and its library."]


def test_auth_is_used_as_given_and_a_malformed_one_refuses_to_start():
    said: list[str] = []
    assert login(args("--share", "--auth=ann:s3cret"), said.append) == ("ann", "s3cret") and said == []
    assert login(args(), said.append) is None and said == []  # local only: no login, nothing said
    with pytest.raises(SystemExit, match="--auth needs USER:PASS"):
        login(args("--share", "--auth=nopassword"), said.append)


@pytest.mark.parametrize("failure", ["refused", "hangs", "late"])
def test_a_share_link_that_fails_is_reported_within_seconds_and_local_serving_continues(
        engine, tmp_path, monkeypatch, failure):
    import gradio.networking

    def tunnel(*args, **kwargs):
        if failure == "refused":  # what an offline machine gets from Gradio's API server
            raise RuntimeError("Could not get share link from Gradio API Server.")
        time.sleep(3.0 if failure == "late" else 60.0)
        return "http://abcdef.gradio.live"

    monkeypatch.setattr(gradio.networking, "setup_tunnel", tunnel)
    app, said = make_app(engine, tmp_path / "lib"), []
    stamps: list[float] = []
    try:
        url, share_url = serve(app.demo, free_port(), share=True, auth=("ann", "pw"), max_file_mb=1,
                               share_timeout_s=1.5, say=lambda m: (said.append(m), stamps.append(time.monotonic())))
        assert share_url is None and said[0] == f"BookChat is running at {url}"
        assert said[1].startswith("Could not create a public share link (") and f"locally only, at {url}" in said[1]
        assert stamps[1] - stamps[0] < (0.5 if failure == "refused" else 2.5)  # within seconds, never minutes
        if failure == "refused":
            assert "Could not get share link from Gradio API Server." in said[1]
        else:
            assert "no answer from the share server in 2 s" in said[1]
        book = write_book(tmp_path)
        from gradio_client import handle_file

        with pytest.raises(Exception):  # noqa: B017 -- the login is still required locally
            client(url)
        status = client(url, auth=("ann", "pw")).predict(handle_file(str(book)), "", api_name="/load_book")[0]
        assert "Ready" in status
        if failure == "late":
            wait_until(lambda: len(said) > 2, 10, "the late link")
            assert said[2] == "The public link came up after all: https://abcdef.gradio.live"
            assert app.demo.share_url == "https://abcdef.gradio.live"
    finally:
        app.demo.close()


def test_app_py_with_share_prints_a_password_falls_back_to_local_and_requires_the_login(tiny_model_dir, tmp_path):
    """The real entry point: `python app.py --share` with the tunnel failing as it does offline."""
    from gradio_client import handle_file

    code = ("import runpy, sys, gradio.networking as networking\n"
            "def offline(*args, **kwargs): raise RuntimeError('Could not get share link from Gradio API Server.')\n"
            "networking.setup_tunnel = offline\n"
            "sys.argv = ['app.py'] + sys.argv[1:]\n"
            "runpy.run_path('app.py', run_name='__main__')\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", code, "--share", "--model", str(tiny_model_dir), "--dtype",
                             "float32", "--threads", "1", "--port", str(port), "--library", str(tmp_path / "lib")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.rstrip()) for line in proc.stdout], daemon=True).start()
    seen: list[tuple[float, str]] = []

    def wait_for(prefix: str) -> str:
        deadline = time.monotonic() + 120
        while not any(line.startswith(prefix) for _, line in seen):
            assert proc.poll() is None, "\n".join(line for _, line in seen)
            try:
                seen.append((time.monotonic(), lines.get(timeout=max(0.1, deadline - time.monotonic()))))
            except queue.Empty:
                pytest.fail(f"no {prefix!r} in 120 s:\n" + "\n".join(line for _, line in seen))
        return next((t, line) for t, line in seen if line.startswith(prefix))

    try:
        _, password_line = wait_for("--share without --auth: log in as user 'reader' with password ")
        password = password_line.rsplit(" ", 1)[1]
        running_at, _ = wait_for(f"BookChat is running at http://127.0.0.1:{port}")
        failed_at, failure = wait_for("Could not create a public share link")
        assert failed_at - running_at < 5 and "Serving locally only" in failure
        url = f"http://127.0.0.1:{port}/"
        assert httpx.get(url + "gradio_api/info", timeout=5).status_code == 401  # no login, no API
        reader = client(url, auth=("reader", password))
        status = reader.predict(handle_file(str(write_book(tmp_path))), "", api_name="/load_book")[0]
        assert "Ready" in status, status
    finally:
        proc.kill()
        proc.wait(10)


# ---- two users of one shared app ----------------------------------------------------------------------

def load_and_ask(url: str, book, question: str):
    from gradio_client import handle_file

    reader = client(url)
    loaded = reader.predict(handle_file(str(book)), "", api_name="/load_book")
    answered = reader.predict(question, [], 0.0, 1.0, 8, 0, LEVELS, api_name="/ask")
    return reader, dict(zip(LOADING, loaded, strict=True)), dict(zip(ANSWERING, answered, strict=True))


def test_two_users_at_once_never_see_each_others_book_chat_library_or_metrics(served, tmp_path):
    books = {"ann": write_book(tmp_path, "ann-book.txt", start=0), "bob": write_book(tmp_path, "bob-book.txt",
                                                                                    start=60_000)}
    questions = {"ann": "What does Sir Walter read, Ann asks?", "bob": "Where is Uppercross, Bob asks?"}
    with ThreadPoolExecutor(2) as pool:  # both at once: their jobs interleave in the one queue
        runs = dict(zip(books, pool.map(lambda name: load_and_ask(served.url, books[name], questions[name]), books)))
    for me, other in (("ann", "bob"), ("bob", "ann")):
        reader, loaded, answered = runs[me]
        assert "Ready" in loaded["status"] and f"{me}-book" in loaded["title"].lower() + loaded["status"]
        shown = str(loaded) + str(answered) + reader.predict("md", api_name="/export")
        assert questions[me] in shown and questions[other] not in shown and f"{other}-book" not in shown
        user = served.app.users[reader.session_hash]
        assert [b[1] for b in answered["books"]["choices"]] == [user.book.book_id]  # only their own book
        assert [c[1] for c in answered["chats"]["choices"]] == [user.book.chat_id]  # and their own chat
        counters = reader.predict(api_name="/engine_counters")
        n_question = len(served.app.chat.question_ids(questions[me], True, False))
        assert counters["n_prefills"] == 1  # their book and question only, not the other user's
        assert user.book.doc_len <= counters["n_prefill_tokens"] <= user.book.doc_len + n_question
        assert f"prefills: 1 · prefilled tokens: {counters['n_prefill_tokens']:,}" in answered["metrics"]
    (ann, _, _), (bob, _, _) = runs["ann"], runs["bob"]
    ann_user, bob_user = (served.app.users[c.session_hash] for c in (ann, bob))
    bob_book = bob_user.book
    status = bob.predict(ann_user.book.book_id, api_name="/open_book")[0]  # Ann's ids, typed in by Bob
    assert status == "Pick a book from the library first." and bob_user.book is bob_book
    bob.predict(ann_user.book.chat_id, api_name="/open_chat")
    assert questions["ann"] not in bob.predict("md", api_name="/export") and bob_user.book is bob_book
    for reader in (ann, bob):
        reader.close()


def test_a_waiting_user_sees_their_place_in_the_queue(served, engine, tmp_path):
    """Answers are decoded side by side (engine/batch.py); loading a book is one at a time, so a
    second reader who uploads while the first one's book is being read waits, and sees where."""
    from gradio_client import handle_file
    from gradio_client.utils import Status

    for name in ("ask", "load_book"):
        dependency = next(d for d in served.app.demo.config["dependencies"] if d["api_name"] == name)
        assert dependency["show_progress"] == "minimal"
    ask = next(d for d in served.app.demo.config["dependencies"] if d["api_name"] == "ask")
    assert ask["show_progress_on"] == [served.app.c.metrics._id]
    first, second = client(served.url), client(served.url)
    slow = SlowForwards(engine, delay_s=0.3)
    try:
        loading = first.submit(handle_file(str(write_book(tmp_path, "queue-a.txt", start=90_000))), "",
                               api_name="/load_book")
        wait_until(lambda: slow.n_calls >= 1, 30, "the first book's prefill to start")
        waiting = second.submit(handle_file(str(write_book(tmp_path, "queue-b.txt", start=95_000))), "",
                                api_name="/load_book")
        status = wait_until(lambda: (s := waiting.status()).code == Status.IN_QUEUE and s, 10, "a queue position")
        assert status.rank == 0 and status.queue_size >= 1  # first in line (the UI shows "queue: 1/1")
        assert not waiting.done()
        slow.delay_s = 0.0
        assert "Ready" in str(loading.result()[0])
        assert "Ready" in str(waiting.result()[0])  # it ran once the first load was done
    finally:
        slow.remove()
        first.close()
        second.close()


def test_uploads_over_the_limit_are_refused_before_the_app_reads_them(served, tmp_path):
    from gradio_client import handle_file

    big = tmp_path / "big.txt"
    big.write_bytes(b"All work and no play makes Jack a dull boy.\n" * 40_000)  # 1.7 MB; the limit is 1 MB
    reader = client(served.url)
    with pytest.raises(Exception, match="(?i)size|large|413"):
        reader.predict(handle_file(str(big)), "", api_name="/load_book")
    user = served.app.users.get(reader.session_hash)
    assert user is None or user.file is None  # the handler never saw the file
    reader.close()


# ---- sessions that only their own login may end, titles that stay with their reader ------------------

def test_with_a_login_no_visitor_can_end_another_readers_session_through_gradio_routes(engine, tmp_path):
    """Gradio's heartbeat route needs no login, and when its stream ends it runs the app's unload
    hook (App.forget) for the session it names; /cancel and /stream/<id>/close need none either."""
    app = make_app(engine, tmp_path / "lib", private=True)
    url, _ = serve(app.demo, free_port(), share=False, auth=("ann", "pw"), max_file_mb=1, say=lambda m: None)
    try:
        from gradio_client import handle_file

        ann = client(url, auth=("ann", "pw"))
        assert "Ready" in ann.predict(handle_file(str(write_book(tmp_path))), "", api_name="/load_book")[0]
        book = app.users[ann.session_hash].book
        with httpx.Client(base_url=url, timeout=5) as visitor:
            with visitor.stream("GET", f"gradio_api/heartbeat/{ann.session_hash}") as response:
                status = response.status_code  # then the stream is dropped, as a closed tab would
            time.sleep(1.5)  # the unload hook runs in the background right after the stream ends
            user = app.users.get(ann.session_hash)
            assert user is not None and user.book is book, "the visitor closed the reader's book"
            assert status == 401
            cancel = {"session_hash": ann.session_hash, "fn_index": 0, "event_id": "e"}
            assert visitor.post("gradio_api/cancel", json=cancel).status_code == 401
            assert visitor.post("gradio_api/stream/e/close").status_code == 401
            assert visitor.get(f"gradio_api/stream/{ann.session_hash}/0/1/playlist.m3u8").status_code == 401
        assert ann.predict(api_name="/engine_counters")["n_prefills"] == 1  # the reader goes on
        ann.close()  # the reader's own client goes away: its logged-in heartbeat ends, the book is freed
        wait_until(lambda: ann.session_hash not in app.users, 10, "the reader's own unload")
    finally:
        app.demo.close()


def test_an_unload_without_the_sessions_own_login_is_ignored(engine, tmp_path):
    app = make_app(engine, None)
    ann = SimpleNamespace(session_hash="s1", username="ann")
    app.user(ann).book_ids.add("0" * 16)
    app.forget(SimpleNamespace(session_hash="s1", username=None))  # someone without a login
    app.forget(SimpleNamespace(session_hash="s1", username="bob"))  # another login
    assert "s1" in app.users
    app.forget(ann)  # the reader's own browser went away
    assert "s1" not in app.users


def test_in_private_mode_a_reader_never_sees_another_readers_title_for_the_same_text(engine, tmp_path):
    app = make_app(engine, tmp_path / "lib", private=True)
    secret = write_book(tmp_path, "Ann's confidential notes.txt")
    plain = write_book(tmp_path, "bob-book.txt")  # the same text, so the same book id
    assert "Ready" in last(app, run(app.load_book(str(secret), "", request("ann"))), "status")
    updates = run(app.load_book(str(plain), "", request("bob")))
    book_id = app.users["bob"].book.book_id
    assert last(app, updates, "books")["choices"] == [("bob-book", book_id)]
    assert last(app, run(app.show_library(request("bob"))), "books")["choices"] == [("bob-book", book_id)]
    reopened = run(app.open_saved(book_id, request("bob")))
    assert last(app, reopened, "title") == "### bob-book" and "confidential" not in str(reopened)
    assert last(app, run(app.show_library(request("ann"))), "books")["choices"] == [
        ("Ann's confidential notes", book_id)]


def test_in_private_mode_a_reading_starts_only_from_the_readers_own_books(engine, tmp_path):
    """Ann's book and Bob's longer one begin alike: Bob's is read whole, never from Ann's reading
    (whose title he would see), and his own longer one then starts from his first."""
    app = make_app(engine, tmp_path / "lib", private=True)
    ann = write_book(tmp_path, "Ann's confidential notes.txt", n_chars=3_000)
    bob = write_book(tmp_path, "bob-book.txt", n_chars=4_500)
    assert "Ready" in last(app, run(app.load_book(str(ann), "", request("ann"))), "status")
    status = last(app, run(app.load_book(str(bob), "", request("bob"))), "status")
    assert app.users["bob"].book.n_read_before == 0 and "confidential" not in status, status
    longer = write_book(tmp_path, "bob-longer.txt", n_chars=6_000)
    status = last(app, run(app.load_book(str(longer), "", request("bob"))), "status")
    assert app.users["bob"].book.n_read_before > 0 and "read before in *bob-book*" in status, status
    ann_longer = write_book(tmp_path, "ann-longer.txt", n_chars=5_000)  # Ann: from hers, never from Bob's
    status = last(app, run(app.load_book(str(ann_longer), "", request("ann"))), "status")
    assert app.users["ann"].book.read_before_in == "Ann's confidential notes" and "bob" not in status, status


@pytest.mark.parametrize("typed", ["../../etc", "/etc/passwd", "00000000000000zz", " "])
def test_a_bad_book_id_typed_into_the_library_gets_a_message(engine, tmp_path, typed):
    app = make_app(engine, tmp_path / "lib")  # not private: any id is looked up in the library
    status = last(app, run(app.open_saved(typed, request("ann"))), "status")
    assert status in (f"There is no book {typed!r} in the library: pick one from the list.",
                      "Pick a book from the library first.")
    assert typed.strip() == "" or "pick one from the list" in status


def test_new_chat_and_opening_a_chat_never_wait_behind_another_readers_prefill(served, engine, tmp_path):
    """Loading is one at a time; New chat and picking a saved chat touch only the reader's own cache."""
    from gradio_client import handle_file

    bob = client(served.url)
    loaded = bob.predict(handle_file(str(write_book(tmp_path, "busy-b.txt", start=30_000))), "", api_name="/load_book")
    assert "Ready" in loaded[0]
    ann, slow = client(served.url), SlowForwards(engine, delay_s=0.5)
    try:
        loading = ann.submit(handle_file(str(write_book(tmp_path, "busy-a.txt", start=40_000))), "",
                             api_name="/load_book")
        wait_until(lambda: slow.n_calls >= 1, 30, "the first book's prefill to start")
        started = time.monotonic()
        bob.predict(api_name="/clear")
        bob.predict("", api_name="/open_chat")
        assert time.monotonic() - started < 3.0 and not loading.done()  # done while the prefill still runs
        slow.delay_s = 0.0
        assert "Ready" in str(loading.result()[0])
    finally:
        slow.remove()
        ann.close()
        bob.close()
