"""The OpenAI-compatible API of `python app.py --api`, through the official `openai` client.

One app (SmolLM2-135M) serves the module. Checked: the model list; a greedy answer about a book
equal to the engine's own `Session.ask` on the same prompt; a second question on the book that
prefills only the question (from memory), and a book snapshotted by the library (here, in this
process) answering the API without a prefill, from disk; streaming equal to the whole answer,
with usage and our metrics on the last chunk; stop strings; a client that disconnects mid-stream
stops its answer; OpenAI-shaped errors. Refusals (key, non-local client, full queue) run on the
same routes in this process, through Starlette's test client.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from app import child
from tests.app.test_ui_api import ART, ROOT, start_app

openai = pytest.importorskip("openai")
MODEL = "smollm2-135m"
QUESTION = "Who is Sir Walter Elliot?"


def book(start: int, n_chars: int = 4500) -> str:
    return (ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[start:start + n_chars].strip()


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("library")


@pytest.fixture(scope="module")
def server(library):
    proc, url = start_app(["--model", MODEL, "--threads", "1", "--library", str(library), "--api"],
                          ART / "app-openai-api.log")
    yield url
    child.stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.session import Engine

    return Engine.load(EngineConfig(target=MODEL))


@pytest.fixture(scope="module")
def chat(engine):
    from app.tokens import PlainChatFormat

    return PlainChatFormat(engine.tokenizer)


def ask(client, text: str, question: str, **kw):
    messages = [{"role": "system", "content": text}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


@pytest.fixture(scope="module")
def first_answer(client):
    return ask(client, book(0), QUESTION, max_tokens=48, temperature=0)


def test_models_lists_the_engine(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_answer_equals_session_ask(first_answer, engine, chat):
    from engine.config import SamplingConfig

    session = engine.open(chat.document_ids(book(0)))
    q_ids = chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    events = session.ask(q_ids, SamplingConfig(max_new_tokens=48), stop_ids=chat.stop_ids | engine.end_ids)
    ids = [t for e in events for t in e.tokens]
    assert first_answer.choices[0].message.content == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert first_answer.usage.completion_tokens == len(ids)
    expected_prompt = chat.document_ids(book(0)) + chat.question_ids(QUESTION, True, False)
    assert first_answer.usage.prompt_tokens == len(expected_prompt)
    metrics = first_answer.model_extra["bookchat"]
    assert metrics["cache"] == "none" and metrics["prefill_tokens"] == len(expected_prompt)
    assert first_answer.usage.prompt_tokens_details.cached_tokens == 0


def test_second_question_prefills_only_the_question(first_answer, client, chat):
    question = "What does Sir Walter read?"
    answer = ask(client, book(0), question, max_tokens=8)
    n_doc, q_ids = len(chat.document_ids(book(0))), chat.question_ids(question, True, False)
    metrics, usage = answer.model_extra["bookchat"], answer.usage
    print(f"second question: {metrics['prefill_tokens']} tokens prefilled, {usage.prompt_tokens_details.cached_tokens}"
          f" cached ({metrics['cache']}), first token after {metrics['ttft_s']:.2f} s")
    assert metrics["cache"] == "memory" and usage.prompt_tokens == n_doc + len(q_ids)
    # the session rolls back to the shared prefix; its last token is fed again with the question
    assert metrics["prefill_tokens"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert len(q_ids) - 2 <= metrics["prefill_tokens"] <= len(q_ids) + 1


def test_a_book_snapshotted_by_the_library_answers_from_disk(client, engine, chat, library):
    """The same hash rule as the library: a snapshot written by app/reading.py `open_session` (as the UI
    does when it opens a book) serves an API request with that text; only the question is prefilled."""
    from app.documents import Document
    from app.library import Library
    from app.reading import open_session

    text = book(20000)
    open_session(Library(library), engine, Document("Persuasion, later", text, "txt"), chat.document_ids(text))
    answer = ask(client, text, QUESTION, max_tokens=4)
    metrics, q_ids = answer.model_extra["bookchat"], chat.question_ids(QUESTION, True, False)
    print(f"from disk: {metrics['prefill_tokens']} tokens prefilled, session in {metrics['document_s']:.2f} s, "
          f"first token after {metrics['ttft_s']:.2f} s")
    assert metrics["cache"] == "disk"
    assert answer.usage.prompt_tokens_details.cached_tokens == len(chat.document_ids(text))
    assert metrics["prefill_tokens"] == len(q_ids)


@pytest.fixture(scope="module")
def steady_answer(client):
    """The answer to QUESTION when the book's session in memory already holds it: a session rolled
    back to a shared prefix feeds its last tokens again, in a prefill chunk of another shape than a
    fresh prefill's, and bf16 rounding may then flip a near tie. From the second time on the rollback
    is the same (to the question), so answers repeat exactly."""
    ask(client, book(0), QUESTION, max_tokens=48)
    return ask(client, book(0), QUESTION, max_tokens=48)


def test_stream_equals_the_whole_answer(steady_answer, client):
    stream = ask(client, book(0), QUESTION, max_tokens=48, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == steady_answer.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == steady_answer.choices[0].finish_reason
    last = chunks[-1]
    assert last.usage.completion_tokens == steady_answer.usage.completion_tokens
    metrics = last.model_extra["bookchat"]
    assert metrics["levels"][-1]["name"] == "full" and metrics["levels"][-1]["checks"] >= 1


def test_stop_strings_cut_the_answer(steady_answer, client):
    full = steady_answer.choices[0].message.content
    stop = full[12:16]
    expected = full[:full.find(stop)]
    answer = ask(client, book(0), QUESTION, max_tokens=48, stop=[stop, "never appears"])
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == "stop"
    streamed = ask(client, book(0), QUESTION, max_tokens=48, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_a_client_that_disconnects_stops_its_answer(client, server):
    stream = ask(client, book(0), "Tell the whole story.", max_tokens=1000, stream=True,
                 extra_body={"ignore_eos": True})
    n_content, answer_id = 0, None
    for chunk in stream:
        answer_id = chunk.id
        n_content += bool(chunk.choices and chunk.choices[0].delta.content)
        if n_content == 3:
            break
    stream.close()
    deadline = time.time() + 60
    while True:
        done = {r["id"]: r for r in httpx.get(server + "v1/bookchat/requests").json()["data"]}
        if answer_id in done:
            break
        assert time.time() < deadline, "the answer did not stop after its client went away"
        time.sleep(0.5)
    assert done[answer_id]["finish_reason"] == "cancelled"
    assert done[answer_id]["completion_tokens"] < 1000


def test_ui_and_api_answers_are_decoded_together(client, server, tmp_path):
    """The UI's reader and an API client answer at the same time in packed forwards of one batcher."""
    import threading

    from gradio_client import Client, handle_file

    path = tmp_path / "persuasion-start.txt"
    path.write_text(book(0, 3000), encoding="utf-8")
    ui = Client(server, verbose=False)
    assert "Ready" in ui.predict(handle_file(str(path)), "", api_name="/load_book")[0]
    before = httpx.get(server + "v1/bookchat/requests").json()["batcher"]
    started = threading.Event()

    def api_answer():
        stream = ask(client, book(0), "Tell the whole story.", max_tokens=60, stream=True,
                     extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()
    thread = threading.Thread(target=api_answer)
    thread.start()
    assert started.wait(120)
    ui.predict("Tell the whole story of the Elliot family.", [], 0.0, 1.0, 40, 0, "ngram>retrieval>full",
               api_name="/ask")
    thread.join(120)
    after = httpx.get(server + "v1/bookchat/requests").json()["batcher"]
    n_forwards, n_segments = (after[k] - before[k] for k in ("n_forwards", "n_segments"))
    assert n_segments > n_forwards, (n_segments, n_forwards)  # some forwards served both readers


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        ask(client, "A short text.", "Hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="last message"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "Hi"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        ask(client, "word " * 9000, "Hi")
    raw = httpx.post(server + "v1/chat/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]


def api_routes(engine, chat, **kw):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from api.server import ChatAPI, Fixed
    from engine.batch import Batcher

    return TestClient(Starlette(routes=ChatAPI(Fixed(engine, chat), Batcher(max_active=1), **kw).routes()))


def test_without_a_key_only_local_clients_are_answered(engine, chat):
    response = api_routes(engine, chat).get("/v1/models")  # Starlette's test client is not 127.0.0.1
    assert response.status_code == 403 and "127.0.0.1" in response.json()["error"]["message"]


def test_with_a_key_every_client_needs_it(engine, chat):
    routes = api_routes(engine, chat, api_key="sesame")
    assert routes.get("/v1/models").status_code == 401
    assert routes.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == \
        "invalid_api_key"
    assert routes.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_a_full_queue_answers_429(engine, chat):
    response = api_routes(engine, chat, api_key="k", max_requests=0).post(
        "/v1/chat/completions", headers={"Authorization": "Bearer k"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"


def test_login_or_share_needs_an_api_key(capsys):
    from app.api import api_key

    assert api_key(None, False) is None and api_key("mine", True) == "mine"
    generated = api_key(None, True)
    assert generated and generated in capsys.readouterr().out
