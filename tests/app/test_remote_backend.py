"""`python -m api` with an API key, and `app.py --backend openai` answering through it.

One server (SmolLM2-135M) and one app (tokenizer only, no model) serve the module. Checked: the
server refuses clients without the key (through the official `openai` client); the app reads a
book, sends it to the server once (one prefill there), and answers a question through it, the
server prefilling only the question; the app's metrics are measured client-side (its token count
is the server's) and the speculative metrics and the reading view say they are not available;
Stop in the app ends the answer on the server.
"""

from __future__ import annotations

import sys
import time

import httpx
import pytest

from app import child
from tests.app.test_ui_api import ART, ROOT, start_app, text_of
from tests.conftest import packaged_or_skip

openai = pytest.importorskip("openai")
MODEL, KEY = "smollm2-135m", "test-key-25"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    packaged_or_skip(MODEL)
    port, library = child.free_port(), tmp_path_factory.mktemp("server-library")
    proc = child.start([sys.executable, "-m", "api", "--model", MODEL, "--threads", "1", "--port", str(port),
                        "--api-key", KEY, "--library", str(library)], f"http://127.0.0.1:{port}/v1/models",
                       ART / "api-serve.log", {"OMP_NUM_THREADS": "1"}, timeout_s=180,
                       headers={"Authorization": f"Bearer {KEY}"})
    url = f"http://127.0.0.1:{port}/v1"
    yield url
    child.stop(proc)


def test_the_server_refuses_a_missing_or_wrong_key(server):
    wrong = openai.OpenAI(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    missing = httpx.post(server + "/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]


@pytest.fixture(scope="module")
def app_url(server, tmp_path_factory):
    library = tmp_path_factory.mktemp("app-library")
    proc, url = start_app(["--backend", "openai", "--base-url", server, "--api-key", KEY, "--model", MODEL,
                           "--library", str(library)], ART / "app-remote.log")
    yield url
    child.stop(proc)


def served(server) -> list[dict]:
    return httpx.get(server + "/bookchat/requests", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]


@pytest.fixture(scope="module")
def opened(app_url, server, tmp_path_factory):
    """A gradio client of the app with a book open, and the server's records of opening it."""
    from gradio_client import Client, handle_file

    path = tmp_path_factory.mktemp("books") / "persuasion-start.txt"
    path.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:4500], encoding="utf-8")
    client = Client(app_url, verbose=False)
    n_before = len(served(server))
    loaded = client.predict(handle_file(str(path)), "", api_name="/load_book")
    return client, loaded, served(server)[n_before:]


def test_the_app_reads_a_book_once_on_the_server_and_answers_through_it(opened, server):
    from app.tokens import PlainChatFormat
    from engine.loading import load_tokenizer
    from engine.models import resolve_model

    client, loaded, warm = opened
    status = loaded[0]
    assert "fits" in status and "Ready" in status, status
    assert "Where the model is reading: not available with a remote backend." in loaded
    assert len(warm) == 1 and warm[0]["cache"] == "none" and warm[0]["prefill_tokens"] == warm[0]["prompt_tokens"]

    question = "Who is Sir Walter Elliot?"
    job = client.submit(question, [], 0.0, 1.0, 24, 0, "remote", api_name="/ask")
    updates = list(job)
    _, chatbot, metrics, *_ = job.result()
    assert len(updates) > 2 and text_of(chatbot[-2]) == question and text_of(chatbot[-1]).strip()
    answered = served(server)[-1]
    chat = PlainChatFormat(load_tokenizer(resolve_model(MODEL)))
    n_question = len(chat.question_ids(question, is_first=True, previous_answer_ended=False))
    assert answered["cache"] == "memory" and answered["prefill_tokens"] <= n_question + 1
    assert "tokens/s" in metrics and "TBT now" in metrics and f"{answered['completion_tokens']} tokens" in metrics
    assert "not available with a remote backend" in metrics and "| full |" not in metrics


def test_stop_in_the_app_stops_the_answer_on_the_server(opened, server):
    """Stop closes the app's stream; the server sees the client go and cancels the answer."""
    client, n_before = opened[0], len(served(server))
    job = client.submit("Tell me the whole story of the Elliot family.", [], 0.0, 1.0, 400, 0, "remote",
                        api_name="/ask")
    deadline = time.time() + 120
    while len(job.outputs()) < 3 and not job.done():
        assert time.time() < deadline
        time.sleep(0.05)
    client.predict(api_name="/stop")
    _, _, metrics, *_ = job.result()
    assert "stopped" in metrics
    deadline = time.time() + 60
    while len(records := served(server)) == n_before:  # recorded when the server's answer has ended
        assert time.time() < deadline, "the server's answer did not end"
        time.sleep(0.5)
    assert records[-1]["finish_reason"] == "cancelled" and records[-1]["completion_tokens"] < 400


def test_the_api_server_shut_down_mid_reading_saves_it(tmp_path):
    """`python -m api` killed (SIGTERM) while it reads a document: it stops serving, and the reading
    so far is saved in the library before it exits, as the app does. The document begins as one read
    before, so its reading starts from that one's chunks and has something to keep at once."""
    import os
    import signal
    import threading

    from app.library import Library, text_sha256

    packaged_or_skip(MODEL)
    port, library = child.free_port(), tmp_path / "library"
    proc = child.start([sys.executable, "-m", "api", "--model", MODEL, "--threads", "1", "--port", str(port),
                        "--library", str(library)], f"http://127.0.0.1:{port}/v1/models",
                       ART / "api-shutdown.log", {"OMP_NUM_THREADS": "1"}, timeout_s=180)
    text = (ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")
    first, longer = text[:8_000], text[:30_000]  # about 2,000 and 7,500 tokens

    def ask(document: str) -> httpx.Response:
        messages = [{"role": "user", "content": document}, {"role": "user", "content": "Who is Sir Walter?"}]
        return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300,
                          json={"model": MODEL, "messages": messages, "max_tokens": 4})
    try:
        assert ask(first).status_code == 200
        threading.Thread(target=lambda: ask(longer), daemon=True).start()
        time.sleep(1.5)  # reading the 5,500 tokens after the first 2,000 takes several seconds here
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        child.stop(proc)
    log = (ART / "api-shutdown.log").read_text()
    assert "a document being read saves what it read" in log
    assert Library(library).n_read(text_sha256(longer)[:16]) >= 1024, log
