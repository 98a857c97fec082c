"""A question's settings by name (app/settings.py): `INPUTS` is the one order the page wires the
controls in and the handlers take them in; everything else looks them up by name, and the
Settings start at the model's own sampling with what app.py's flags set.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from app.settings import INPUTS, TUNED, Settings
from app.ui import App
from engine.config import SAMPLING_FIELDS, SamplingConfig
from tests.app.test_backend import Scripted
from tests.conftest import packaged_or_skip

MODEL_OWN = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1)  # as Qwen's files


@pytest.fixture(scope="module")
def smol_tokenizer():
    from engine.loading import load_tokenizer

    return load_tokenizer(packaged_or_skip("smollm2-135m"))


def test_every_sampling_field_is_an_input_once_with_the_level_stack_and_rereading():
    assert sorted(INPUTS) == sorted([*SAMPLING_FIELDS, "levels", "reread"])
    assert INPUTS[:5] == ("temperature", "top_p", "max_new_tokens", "seed", "levels")  # what API callers send
    assert set(TUNED) == set(SAMPLING_FIELDS) - {"max_new_tokens", "seed"}


def test_the_settings_are_looked_up_by_name_whatever_their_order():
    values = dict(reread=True, frequency_penalty=0.5, levels="ngram>full", top_k=5, seed=3.0, max_new_tokens=64.0,
                  temperature=0.2, top_p=None, min_p=None)  # None, or left out: the model's own
    settings = Settings.of(values, MODEL_OWN)
    assert settings == Settings(replace(MODEL_OWN, temperature=0.2, top_k=5, seed=3, max_new_tokens=64,
                                        frequency_penalty=0.5), "ngram>full", True)
    assert type(settings.sampling.seed) is int and type(settings.sampling.max_new_tokens) is int  # from sliders
    assert Settings.of({"levels": "plain", "reread": None}, MODEL_OWN) == Settings(MODEL_OWN, "plain", False)
    with pytest.raises(ValueError, match="top_p"):
        Settings.of({"levels": "plain", "top_p": 0.0}, MODEL_OWN)


@pytest.mark.parametrize("handler", ["ask", "regenerate"])
def test_the_handlers_take_the_settings_in_the_one_order(handler):
    """Gradio passes the wired controls by position: each handler's parameters after the question
    (and Gradio's `request`, which it fills in itself) are `INPUTS`."""
    names = [n for n in inspect.signature(getattr(App, handler)).parameters if n not in ("self", "request")]
    assert names == (["message", "history"] if handler == "ask" else []) + list(INPUTS)


def test_the_page_starts_at_the_flags_over_the_models_own_and_wires_the_controls_by_name(smol_tokenizer, tmp_path):
    backend = Scripted(smol_tokenizer)
    backend.default_sampling = MODEL_OWN
    flags = {"top_k": 7, "min_p": 0.05, "seed": 3, "max_new_tokens": 99}
    app = App(backend, None, sampling=flags, outline=False)
    demo = app.build()
    controls = app.c.settings
    start = replace(MODEL_OWN, **flags)
    assert app.start_sampling() == start
    assert {name: controls[name].value for name in SAMPLING_FIELDS} == {n: getattr(start, n) for n in SAMPLING_FIELDS}
    assert controls["levels"].value == "scripted" and controls["reread"].value is False
    assert "`--top-k 7` `--min-p 0.05` from the command line" in app.sampling_note()

    events = {fn.api_name: [block._id for block in fn.inputs] for fn in demo.fns.values() if fn.api_name}
    in_order = [controls[name]._id for name in INPUTS]
    assert events["ask"] == [app.c.msg._id, app.c.chatbot._id, *in_order]
    assert events["regenerate"] == in_order

    reset = app.reset_settings()  # "Model's defaults": the model's own with the flags, the length and seed kept
    assert {name: reset[controls[name]]["value"] for name in TUNED} == {name: getattr(start, name) for name in TUNED}
    assert controls["max_new_tokens"] not in reset and controls["seed"] not in reset
    assert reset[controls["levels"]]["value"] == "scripted"
