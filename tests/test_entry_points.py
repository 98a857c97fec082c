"""The three entry points, `python app.py`, `python -m api` and `python -m tools generate`, take
the same sampling flags (one per engine.config.SAMPLING_FIELDS field) with the same defaults; the
app's Settings start at what they set.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.config import ANSWER_TOKENS, SAMPLING_FIELDS, SamplingConfig
from tools.flags import sampling_from_args

ROOT = Path(__file__).resolve().parent.parent
GIVEN = {"temperature": 0.3, "top_p": 0.9, "top_k": 5, "max_new_tokens": 64, "seed": 3, "min_p": 0.1,
         "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5}


def app_entry():
    """app.py (`import app` is the app/ package)."""
    spec = importlib.util.spec_from_file_location("app_main", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsers() -> dict:
    from api.__main__ import parse_args as api_args
    from tools.__main__ import parse_args as engine_args

    generate = ["generate", "--file", "b.txt", "--question", "q"]
    return {"app.py": app_entry().parse_args, "python -m api": api_args,
            "python -m tools generate": lambda argv: engine_args([*generate, *argv])}


def flags(values: dict) -> list[str]:
    return [part for name, value in values.items() for part in (f"--{name.replace('_', '-')}", str(value))]


@pytest.mark.parametrize("entry", ["app.py", "python -m api", "python -m tools generate"])
def test_every_entry_point_takes_the_same_sampling_flags_with_the_same_defaults(entry):
    assert set(GIVEN) == set(SAMPLING_FIELDS)  # a new sampling field gets a flag here too
    parse = parsers()[entry]
    unset = parse([])
    assert {name: getattr(unset, name) for name in SAMPLING_FIELDS} == {
        name: ANSWER_TOKENS if name == "max_new_tokens" else None for name in SAMPLING_FIELDS}  # the model's own
    model_own = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20)
    assert sampling_from_args(unset, model_own) == SamplingConfig(temperature=0.7, top_p=0.8, top_k=20,
                                                                  max_new_tokens=ANSWER_TOKENS)
    assert sampling_from_args(parse(flags(GIVEN)), model_own) == SamplingConfig(**GIVEN)


def test_the_apps_flags_are_where_its_settings_start(capsys):
    app = app_entry()
    assert app.sampling_flags(app.parse_args([])) == {"max_new_tokens": ANSWER_TOKENS}  # the rest: the model's own
    assert app.sampling_flags(app.parse_args(flags({"top_k": 5, "seed": 3}))) == {
        "top_k": 5, "seed": 3, "max_new_tokens": ANSWER_TOKENS}
    with pytest.raises(SystemExit):  # refused before the model loads
        app.parse_args(["--top-p", "2"])
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
