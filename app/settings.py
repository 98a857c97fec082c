"""What a question is answered with, by name: the sampling fields a reader sets, the level stack,
and whether the sources are re-read after the question.

`INPUTS` is the one order of these values: the Settings panel's controls are wired in it
(app/layout.py) and the `ask` and `regenerate` handlers take them in it (app/ui.py), as the UI's
API callers pass them by position. Everything else looks them up by name (`Settings.of`). The
sampling part is engine.config.SAMPLING_FIELDS, so a field SamplingConfig gains is a setting here.
This module knows nothing of Gradio.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import SAMPLING_FIELDS, SamplingConfig

# the API's first inputs since it began (temperature, top-p, answer length, seed, level stack), then
# every other sampling field, then re-reading: an API caller may leave out everything after `levels`
FIRST = ("temperature", "top_p", "max_new_tokens", "seed")
MORE = tuple(name for name in SAMPLING_FIELDS if name not in FIRST)
INPUTS = (*FIRST, "levels", *MORE, "reread")
# the controls "Model's defaults" puts back: the sampling a model's files tune (not the answer
# length or the seed) and the level stack
TUNED = ("temperature", "top_p", *MORE)


@dataclass(frozen=True)
class Settings:
    """One question's settings, as the handlers use them."""

    sampling: SamplingConfig
    levels: str  # a LEVEL_STACKS entry; anything else keeps the book's stack
    reread: bool = False  # quote the sources after the question (app/sources.py `with_passages`)

    @classmethod
    def of(cls, values: dict, defaults: SamplingConfig) -> Settings:
        """`values` by `INPUTS` name; a sampling value left out (None) keeps `defaults`' (the model's own)."""
        given = {name: SAMPLING_FIELDS[name](value) for name, value in values.items()
                 if name in SAMPLING_FIELDS and value is not None}
        return cls(replace(defaults, **given), values["levels"], bool(values.get("reread")))
