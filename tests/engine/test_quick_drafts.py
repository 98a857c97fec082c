"""The levels below the top run the GGUF's blocks with int8 activations (`EngineConfig.quick_drafts`,
engine/quant.py `quick_view`), the top its exact linears: the answer stays plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, SamplingConfig
from engine.quant import QuantLinear
from engine.session import Engine
from tests.conftest import XDIST, packaged_or_skip
from tools.chat import ChatFormat

BOOK = Path(__file__).parents[2] / "assets" / "persuasion.txt"
MODEL = "qwen2.5-coder-0.5b"  # Q4_K / Q6_K / Q5_0 / Q8_0 linears: every one has a quick path


def quick_linears(model) -> set[bool]:
    return {m.lossy for m in model.modules() if isinstance(m, QuantLinear)}


@pytest.fixture(scope="module")
def engine():
    packaged_or_skip(MODEL)
    torch.set_num_threads(1 if XDIST else 2)
    return Engine.load(EngineConfig(target=MODEL, draft=MODEL, levels="plain", device="cpu", dtype="float32",
                                    gamma_bottom=2, gamma_middle=3))


def test_only_the_levels_below_the_top_run_int8_activations(engine):
    session = engine.open(ChatFormat(engine.tokenizer).document_ids(BOOK.read_text())[:300])
    session.set_levels("draft>retrieval>full")
    top, middle = session.stack.top, session.stack.drafter.scorer
    bottom = session.stack.drafter.below
    assert top.model is engine.target and quick_linears(top.model) == {False}
    assert True in quick_linears(middle.model) and True in quick_linears(bottom.model)
    # the views share the weights: no second copy in memory
    assert middle.model.lm_head.weight.data_ptr() == engine.target.lm_head.weight.data_ptr()
    assert bottom.model.lm_head.weight.data_ptr() == engine.draft.lm_head.weight.data_ptr()
    engine.quick_drafts = False
    try:
        session.set_levels("plain")
        session.set_levels("draft>retrieval>full")
        assert session.stack.drafter.scorer.model is engine.target
        assert session.stack.drafter.below.model is engine.draft
    finally:
        engine.quick_drafts = True


@pytest.mark.parametrize("levels", ["retrieval>full", "selfspec>full", "draft>retrieval>full"])
def test_int8_drafts_leave_the_answer_plain_decodings(engine, levels):
    chat = ChatFormat(engine.tokenizer)
    doc = chat.document_ids(BOOK.read_text())[:800]
    q = chat.question_ids("Who is Sir Walter Elliot?", True, False)
    session = engine.open(doc)
    answers, stats = {}, {}
    for stack in ("plain", levels):
        session.set_levels(stack)
        tokens, last = [], None
        for last in session.ask(q, SamplingConfig(max_new_tokens=16)):
            tokens += last.tokens
        answers[stack], stats[stack] = tokens, last.stats
        session.truncate(len(doc))
    assert answers[levels] == answers["plain"]  # float32: exact, no near-tie allowance
    top = stats[levels].levels[-1]
    assert top.n_tested > 0, "the int8 drafts were never checked: the test would prove nothing"
