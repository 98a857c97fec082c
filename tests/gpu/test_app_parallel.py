"""`app.py --gpus 2` on CPU: the app's own handlers (upload, ask, regenerate, a second reader
reopening the book from its snapshot) over an engine of two gloo ranks that `Engine.load` starts
itself, as the app does, give the same chat as one process. The app always answers through its
batcher (engine/batch.py), so this is the path a user runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import parallel
from engine.config import EngineConfig, RetrievalConfig
from engine.session import Engine
from tests.conftest import tiny_hf
from tests.reliability.conftest import last, make_app, request, run, write_book
from tests.tools.test_chat import TINY

LEVELS = "ngram>retrieval>full"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A random 2-layer Qwen2 (4 query / 2 KV heads) with a small ChatML tokenizer, saved."""
    tokenizer = TINY["chatml-gpt2"]()
    hf = tiny_hf("qwen2", vocab=len(tokenizer))
    hf.config.eos_token_id = tokenizer.eos_token_id
    folder = tmp_path_factory.mktemp("tiny-chat")
    hf.float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def chat_through_the_handlers(engine, tmp_path) -> list:
    app = make_app(engine, tmp_path / "library", outline=True)  # one process: outlined beside the answers
    req = request("reader")
    status = last(app, run(app.load_book(str(write_book(tmp_path, n_chars=1500)), "", req)), "status")
    assert "Ready" in status, status
    outline_status = app.outlines.refresh(req)[0]  # the progress line, or an update with the reason there is none
    outline_status = outline_status if isinstance(outline_status, str) else outline_status["value"]
    is_parallel = isinstance(engine, parallel.Leader)  # the ranks run one batch in step: no outline there
    assert ("not made under tensor parallel" in outline_status) == is_parallel, outline_status
    assert (app.outlines.worker is None) == is_parallel
    settings = (0.0, 1.0, 12, 0, LEVELS)
    metrics = last(app, run(app.ask("Who is Sir Walter?", [], *settings, req)), "metrics")
    assert "done" in metrics, metrics
    last(app, run(app.ask("And Anne?", [], *settings, req)), "metrics")
    metrics = last(app, run(app.regenerate(*settings, req)), "metrics")
    assert "done" in metrics, metrics
    turns = [(t.question, t.ids) for t in app.users["reader"].book.turns]
    # a second reader opens the same book: its prefill snapshot (one file, every rank's heads)
    other = request("second")
    status = last(app, run(app.load_book(str(tmp_path / "persuasion.txt"), "", other)), "status")
    assert "restored from the saved snapshot" in status, status
    last(app, run(app.ask("Who is Sir Walter?", [], *settings, other)), "metrics")
    assert not [p for p in (tmp_path / "library").rglob("*") if ".rank" in p.name or ".tmp" in p.name]
    app.close()
    return turns + [(t.question, t.ids) for t in app.users["second"].book.turns]


@pytest.mark.timeout(240)
def test_app_with_two_gloo_ranks_answers_as_one_process(chat_model_dir, tmp_path):
    config = EngineConfig(target=str(chat_model_dir), device="cpu", dtype="float32", levels=LEVELS,
                          prefill_chunk_tokens=64, gamma_bottom=3, gamma_middle=3, use_cpu_kernel=False,
                          retrieval=RetrievalConfig(budget_tokens=64, sink_tokens=4, window_tokens=16,
                                                    chunk_tokens=4, n_score_queries=4, rebuild_every_tokens=16))
    one = chat_through_the_handlers(Engine.load(config), tmp_path / "one")
    leader = Engine.load(replace(config, n_gpus=2))
    try:
        assert isinstance(leader, parallel.Leader)
        two = chat_through_the_handlers(leader, tmp_path / "two")
    finally:
        leader.close()
    assert len(two) == 3 and all(len(ids) > 12 for _, ids in two)
    assert two == one
