"""What the app needs of whatever answers its readers: the `Backend` Protocol, and `LocalEngine`,
this machine's engine (engine/session.py `Engine`) behind it.

The other backend is app/remote.py's `RemoteEngine`, an OpenAI-compatible server. The app asks a
backend what it can do (`can_load_models`, `decodes_here`, `outline_engine` ...) and lets each open
a book its own way; it never asks which one it is. What a book's answers report (sources, the
reading view, each level's acceptance) the book says itself (app/session.py `BookSession.has_reading`).
engine/ knows nothing of this module: the app calls the engine, never the other way round.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from app.library import Library, model_fingerprint
from app.picker import machine_of
from app.session import BookSession, Prepared, Report, load_engine, n_read_before, open_book
from app.speeds import attention_share
from engine.config import LEVEL_STACKS, Levels, SamplingConfig
from tools.chat import ChatFormat

if TYPE_CHECKING:
    from app.model_files import Machine
    from engine.session import Engine


class Backend(Protocol):
    """What the app reads and calls; `LocalEngine` and app/remote.py's `RemoteEngine` are the two."""

    name: str  # the model: the header, the picker and this machine's speeds name it
    draft: str | None  # its draft model (None: none)
    levels: str  # the level stack answers start with
    yarn_factor: float  # 1: the model's own context
    tokenizer: object  # counts a book's tokens and labels its pages (`decode`, as transformers' tokenizers)
    end_ids: set[int]  # every token a turn ends with
    max_context: int  # tokens
    default_sampling: SamplingConfig  # how the model was tuned to be sampled
    where: str  # the header's device and dtype, "cpu float32"
    can_load_models: bool  # the Model panel may load another model, or YaRN, in its place
    decodes_here: bool  # answers take this machine's cores (the metrics say when other programs do too)
    fingerprint: str | None  # the library's key of this model's readings (None: the library keeps none)
    attention_share: float  # of a prefill's time, the part that grows with the context (app/speeds.py)
    outline_engine: Engine | None  # outlines books while readers are idle (None: no outlines)

    def machine(self) -> Machine:
        """The device, memory and dtype a model picked in the Model panel would load on."""

    def level_stacks(self) -> list[str]:
        """The stacks the settings offer."""

    def open_book(self, chat: ChatFormat, prepared: Prepared, library: Library | None, report: Report | None = None,
                  cancel=None, measure_plain: bool = False, among: set[str] | None = None) -> tuple[BookSession, bool]:
        """The book ready for questions, and whether it was restored (app/session.py `open_book`)."""

    def n_read_before(self, library: Library, prepared: Prepared, among: set[str] | None) -> int:
        """Tokens of the book the library holds a reading of, which opening it reads on from."""

    def load(self, target: str, draft: str, yarn_factor: float, report: Report | None = None,
             cancel=None) -> Backend:
        """Another model in this one's place (`draft` "none": none); raises EngineError when it cannot."""


class LocalEngine:
    """The engine on this machine as the app's backend: every answer says what it read."""

    can_load_models = decodes_here = True

    def __init__(self, engine: Engine):
        self.engine = engine

    # read when asked, not copied: a tensor-parallel `Leader` forwards these to rank 0's engine
    name = property(lambda self: self.engine.config.target)
    draft = property(lambda self: self.engine.config.draft)
    levels = property(lambda self: self.engine.config.levels)
    yarn_factor = property(lambda self: self.engine.config.yarn_factor)
    tokenizer = property(lambda self: self.engine.tokenizer)
    end_ids = property(lambda self: self.engine.end_ids)
    max_context = property(lambda self: self.engine.max_context)
    default_sampling = property(lambda self: self.engine.default_sampling)
    where = property(lambda self: f"{self.engine.device.type} {str(self.engine.dtype).split('.')[-1]}")
    fingerprint = property(lambda self: model_fingerprint(self.engine))
    attention_share = property(lambda self: attention_share(self.engine.target.config))
    outline_engine = property(lambda self: self.engine)

    def machine(self) -> Machine:
        return machine_of(self.engine.device, self.engine.dtype)

    def level_stacks(self) -> list[str]:
        return [s for s in LEVEL_STACKS if self.engine.has_draft or not Levels.parse(s).needs_draft]

    def open_book(self, chat: ChatFormat, prepared: Prepared, library: Library | None, report: Report | None = None,
                  cancel=None, measure_plain: bool = False, among: set[str] | None = None) -> tuple[BookSession, bool]:
        return open_book(self.engine, chat, prepared, library, report, cancel, measure_plain, among)

    def n_read_before(self, library: Library, prepared: Prepared, among: set[str] | None) -> int:
        return n_read_before(self.engine, library, prepared, among)

    def load(self, target: str, draft: str, yarn_factor: float, report: Report | None = None,
             cancel=None) -> LocalEngine:
        config = replace(self.engine.config, target=target, draft=draft, levels="auto", yarn_factor=yarn_factor)
        return LocalEngine(load_engine(config, report, cancel))
