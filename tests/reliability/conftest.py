"""Fixtures for the reliability suite: a tiny random Llama that speaks through SmolLM2's real
tokenizer and chat template (so prompts, special tokens and page maps are real, and a prefill of
a few thousand tokens takes a fraction of a second), the app around it, driven either through
its handlers with a fake request or through gradio_client against a server started here.

Skips when SmolLM2's tokenizer is not assembled (`python -m tools.models --only smollm2-135m`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import tiny_hf

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_HEARTBEAT_INTERVAL", "0.5")  # a closed client is forgotten within a second
ROOT = Path(__file__).resolve().parents[2]
PERSUASION = ROOT / "assets" / "persuasion.txt"
LEVELS = "ngram>full"
CONTEXT_TOKENS = 4096  # the tiny model's context: the app's document budget is 3,072 tokens


def packaged_dir(name: str) -> Path | None:
    from engine import models

    return models.packaged_model_dir(name, convert=False)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    folder = packaged_dir("smollm2-135m")
    if folder is None:
        pytest.skip("smollm2-135m is not assembled: run `python -m tools.models --only smollm2-135m`")
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(smol_dir, tmp_path_factory) -> Path:
    """A Hugging Face folder: random 2-layer Llama (hidden 64) with SmolLM2's tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    hf = tiny_hf("llama", seed=0, vocab=len(tokenizer), max_positions=CONTEXT_TOKENS)
    hf.config.bos_token_id, hf.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    folder = tmp_path_factory.mktemp("tiny-smol")
    hf.float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_engine(folder: Path, **overrides):
    from engine.config import EngineConfig
    from engine.session import Engine

    settings = dict(target=str(folder), dtype="float32", device="cpu", levels=LEVELS, prefill_chunk_tokens=64)
    return Engine.load(EngineConfig(**(settings | overrides)))


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    return load_engine(tiny_model_dir)


def request(name: str) -> SimpleNamespace:
    """What the handlers read from gr.Request: one browser session."""
    return SimpleNamespace(session_hash=name, username=None)


def make_app(engine, library_root: Path | None, **kwargs):
    from app.backend import LocalEngine
    from app.library import Library
    from app.ui import App

    kwargs.setdefault("outline", False)  # these tests count prefills and memory: no background outline
    app = App(LocalEngine(engine), Library(library_root) if library_root else None, **kwargs)
    app.demo = app.build()
    return app


def run(updates) -> list[dict]:
    """Drain a handler's generator (or wrap a plain return value)."""
    return list(updates) if hasattr(updates, "__next__") else [updates]


def last(app, updates: list[dict], component: str):
    """The last value a handler gave `component` (None when it never set it)."""
    target = getattr(app.c, component)
    values = [u[target] for u in updates if target in u]
    return values[-1] if values else None


def book_text(n_chars: int = 4500, start: int = 0) -> str:
    return PERSUASION.read_text(encoding="utf-8")[start:start + n_chars]


def write_book(folder: Path, name: str = "persuasion.txt", n_chars: int = 4500, start: int = 0) -> Path:
    path = folder / name
    path.write_text(book_text(n_chars, start), encoding="utf-8")
    return path


def open_with_chat(app, folder: Path, user: str = "reader", question: str = "Who is Sir Walter?"):
    """A user with a book open and one answered question; returns (request, book)."""
    req = request(user)
    status = last(app, run(app.load_book(str(write_book(folder)), "", req)), "status")
    assert "Ready" in status, status
    metrics = last(app, run(app.ask(question, [], 0.0, 1.0, 8, 0, LEVELS, req)), "metrics")
    assert "done" in metrics, metrics
    return req, app.users[user].book


class SlowForwards:
    """Counts (and slows) the target's forward passes: a pre-hook on its first decoder layer runs
    once per forward whatever the engine's batching, so 'calls after Stop' counts engine steps."""

    def __init__(self, engine, delay_s: float = 0.0):
        self.n_calls, self.delay_s = 0, delay_s
        self.lock = threading.Lock()
        self.handle = engine.target.model.layers[0].register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        with self.lock:
            self.n_calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)

    def remove(self):
        self.handle.remove()


@pytest.fixture
def slow_forwards(engine):
    hooks = []

    def make(delay_s: float = 0.0) -> SlowForwards:
        hooks.append(SlowForwards(engine, delay_s))
        return hooks[-1]

    yield make
    for hook in hooks:
        hook.remove()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(every_s)
    return value


def rss_bytes(pid: str = "self") -> int:
    """Resident memory after a garbage collection and, on glibc, giving freed heap pages back
    (so the number tracks live memory, not what the allocator keeps for later)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/status")



@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    """The app (private sessions, 1 MB uploads) served on a free port in this process."""
    from app.documents import Limits
    from app.server import serve

    app = make_app(engine, tmp_path_factory.mktemp("library"), private=True, limits=Limits(max_file_bytes=1 << 20))
    url, _ = serve(app.demo, free_port(), share=False, auth=None, max_file_mb=1, say=lambda message: None)
    yield SimpleNamespace(app=app, url=url)
    app.demo.close()


def client(url: str, **kwargs):
    from gradio_client import Client

    return Client(url, verbose=False, **kwargs)
