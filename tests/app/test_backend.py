"""The app's backend Protocol (app/backend.py): the app runs on a backend that has the Protocol's
members and nothing else, and both real backends (the local engine, a remote server) have them.

A scripted backend answers from a script: were the app to read anything of a backend the
Protocol does not name (a device, a config), loading a book or asking would raise here. A remote
backend runs over a fake `openai` client, so what a reader sees of a server is checked without one.
"""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import pytest

from app.backend import Backend, LocalEngine
from app.library import Library, book_id_of
from app.model_files import Machine
from app.remote import Clock, RemoteBook
from engine.config import EngineError, SamplingConfig
from tests.app.test_ui_api import text_of
from tests.conftest import packaged_or_skip, tiny_engine
from tests.reliability.conftest import last, request, run, write_book

ANSWER = ("Sir", " Walter", " Elliot", ".")


def protocol_members() -> set[str]:
    methods = {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    return set(Backend.__annotations__) | methods


def public_members(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


class ScriptedBook(RemoteBook):
    """A book whose every answer is `ANSWER`, chunk by chunk."""

    def stream(self, question: str, sampling: SamplingConfig, cancel=None):
        answer, clock = "", Clock()
        for chunk in ANSWER:
            answer += chunk
            clock.tick()
            yield answer, None, clock
        yield answer, "stop", clock


class Scripted:
    """A backend with exactly the Protocol's members."""

    draft, levels, yarn_factor, where = None, "scripted", 1.0, "scripted here"
    can_load_models = decodes_here = False
    fingerprint = outline_engine = None
    attention_share = 0.0

    def __init__(self, tokenizer):
        self.name, self.tokenizer, self.end_ids = "scripted-model", tokenizer, set()
        self.max_context, self.default_sampling = 4096, SamplingConfig()

    def machine(self) -> Machine:
        return Machine("cpu", 1 << 30, 4, frozenset())

    def level_stacks(self) -> list[str]:
        return [self.levels]

    def open_book(self, chat, prepared, library, report=None, cancel=None, measure_plain=False, among=None):
        time.sleep(0.02)  # a reading app/speeds.py rounds to 0 s it divides by when describing it
        return ScriptedBook(self, chat, prepared, book_id_of(prepared.document.text), library), False

    def n_read_before(self, library, prepared, among) -> int:
        return 0

    def load(self, target, draft, yarn_factor, report=None, cancel=None):
        raise EngineError("this script has one model.")


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loading import load_tokenizer

    return load_tokenizer(packaged_or_skip("smollm2-135m"))


def built(backend, folder):
    from app.ui import App

    app = App(backend, Library(folder / "library"))
    app.demo = app.build()
    return app


def test_the_app_reads_and_answers_through_a_backend_with_only_the_protocols_members(tokenizer, tmp_path):
    backend = Scripted(tokenizer)
    assert public_members(backend) == protocol_members()  # the fake has no more and no less
    app, req = built(backend, tmp_path), request("reader")
    assert not app.c.long_books.visible  # it cannot load another model: no YaRN to tick
    loaded = run(app.load_book(str(write_book(tmp_path)), "", req))
    assert "Ready" in last(app, loaded, "status"), loaded
    assert last(app, loaded, "reading") == "Where the model is reading: not available with a remote backend."
    answered = run(app.ask("Who is Sir Walter?", [], 0.0, 1.0, 8, 0, "scripted", req))
    metrics = last(app, answered, "metrics")
    assert "done" in metrics and "Speculative-decoding metrics: not available" in metrics, metrics
    assert text_of(last(app, answered, "chatbot")[-1]) == "Sir Walter Elliot."
    assert "local engine only" in app.outlines.refresh(req)[0]["value"]
    status = last(app, run(app.switch_model("other", False, req, "none")), "model_status")
    assert status == "⚠ Could not load `other`: this script has one model. `scripted-model` stays loaded."
    assert app.backend is backend and app.users["reader"].book.turns[0].answer == "Sir Walter Elliot."


class FakeOpenAI:
    """The `openai.OpenAI` calls RemoteEngine makes: the model list, and a streamed answer."""

    def __init__(self, **kwargs):
        self.base_url = kwargs["base_url"]
        card = SimpleNamespace(id="served-model", model_extra={"max_model_len": 4096})
        self.models = SimpleNamespace(list=lambda: SimpleNamespace(data=[card]))
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **request):
        """Each chunk of `ANSWER`, then the finish reason and the token count."""
        def chunk(content, reason=None, usage=None):
            delta = SimpleNamespace(content=content)
            return SimpleNamespace(choices=[SimpleNamespace(delta=delta, finish_reason=reason)], usage=usage)
        end = chunk(None, "stop", SimpleNamespace(completion_tokens=len(ANSWER)))
        return Stream([*map(chunk, ANSWER), end])


class Stream(list):
    def close(self):
        pass


@pytest.fixture
def remote(tokenizer, monkeypatch):
    openai = pytest.importorskip("openai")
    from app.remote import RemoteEngine

    monkeypatch.setattr(openai, "OpenAI", FakeOpenAI)
    return RemoteEngine("http://server.test/v1", None, tokenizer)


def test_both_backends_have_the_protocols_members_and_the_remote_one_no_imitated_engine(remote):
    local = LocalEngine(tiny_engine("ngram>full"))
    for backend in (local, remote):
        assert protocol_members() <= public_members(backend), type(backend).__name__
        for name in ("open_book", "n_read_before", "load"):
            wanted = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
            assert list(inspect.signature(getattr(backend, name)).parameters) == wanted, name
    assert not {"config", "device", "dtype", "prefill_chunk_tokens", "has_draft"} & public_members(remote)
    assert remote.name == "served-model at http://server.test/v1" and remote.max_context == 4096
    assert local.level_stacks() == ["plain", "ngram>full", "retrieval>full", "ngram>retrieval>full", "selfspec>full"]


def test_a_remote_backend_shows_what_it_did_before_the_protocol(remote, tmp_path):
    """The header, the reading view and the metrics of a book answered by a server."""
    app, req = built(remote, tmp_path), request("reader")
    offered = [value for _, value in app.c.settings["levels"].choices]  # the level stacks the settings offer
    assert remote.where == "remote remote" and offered == ["remote"] and not app.c.long_books.visible
    loaded = run(app.load_book(str(write_book(tmp_path)), "", req))
    assert "Ready" in last(app, loaded, "status"), loaded
    assert app.library.meta(app.users["reader"].book.book_id)["model"] == remote.name  # listed, read there
    answered = run(app.ask("Who is Sir Walter?", [], 0.0, 1.0, 8, 0, "remote", req))
    metrics = last(app, answered, "metrics")
    assert f"{len(ANSWER)} tokens" in metrics and "not available with a remote backend" in metrics, metrics
    assert "| level |" not in metrics and "vs plain" not in metrics and "other programs" not in metrics
    assert text_of(last(app, answered, "chatbot")[-1]) == "Sir Walter Elliot."
