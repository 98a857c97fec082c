"""The remote backend: the app answers through any OpenAI-compatible server (`--backend openai`).

vLLM, llama.cpp's server, or another copy of this app (`--api`, `python -m api`) answer;
ingestion, the library, chats and the UI stay here. `RemoteEngine` is the app's backend
(app/backend.py `Backend`): a tokenizer (the local `--model`'s, to count a book's tokens and
label pages: an estimate when the server runs another model), the context length the server
reports, a name, and what it cannot do here (load models, outline, keep readings). `RemoteBook`
is a `BookSession` whose questions are chat requests: the book as the system message, then the
turns, so every server's prefix cache (and our API's document snapshots) keeps the book prefilled.
Opening a book sends it once with a one-token answer, which prefills it on the server. TTFT, TBT
and tokens/s are measured here, between streamed chunks; the speculative-decoding metrics and the
reading view are not available.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from app.session import BookSession, Prepared, Report, Turn, Update
from engine.config import Cancelled, DocumentTooLong, EmptyPrompt, EngineError, SamplingConfig
from engine.session import Stats

DEFAULT_CONTEXT = 32768  # when the server does not say (vLLM says `max_model_len`, our API too)


class RemoteEngine:
    """A remote OpenAI-compatible server as the app's backend: it decodes with its own level
    stack, holds the book's prefill, and reports no attention (no sources, no reading view)."""

    draft, levels, yarn_factor = None, "remote", 1.0  # the server's own stack and context
    where = "remote remote"  # the header's device and dtype: both are the server's
    can_load_models = decodes_here = False
    fingerprint, outline_engine = None, None  # the library keeps no reading of it; no outlines
    attention_share = 0.0  # the server's prefill times, measured here, are taken as linear

    def __init__(self, base_url: str, api_key: str | None, tokenizer, model: str | None = None,
                 timeout_s: float = 600.0):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=1, timeout=timeout_s)
        try:
            served = self.client.models.list().data
        except openai.APIError as error:
            raise EngineError(f"The server at {base_url} did not list its models ({error}).") from None
        names = [m.id for m in served]
        if not names or (model is not None and model not in names):
            raise EngineError(f"The server at {base_url} serves {names or 'no models'}; pick one with --remote-model.")
        card = served[names.index(model or names[0])]
        self.model, self.tokenizer = card.id, tokenizer
        self.default_sampling, self.end_ids = SamplingConfig(), set()  # the app sends every field; the server stops
        self.max_context = int((card.model_extra or {}).get("max_model_len") or DEFAULT_CONTEXT)
        self.name = f"{self.model} at {base_url}"  # shown in the header

    def machine(self):
        """This machine's CPU: the server's device is not this machine's."""
        import torch

        from app.picker import machine_of

        return machine_of(torch.device("cpu"), torch.float32)

    def level_stacks(self) -> list[str]:
        return [self.levels]

    def open_book(self, chat, prepared: Prepared, library, report: Report | None = None, cancel=None,
                  measure_plain: bool = False, among: set[str] | None = None) -> tuple[RemoteBook, bool]:
        """The book sent to the server (`measure_plain` and `among`: nothing to measure or share here)."""
        if not prepared.fits:
            raise DocumentTooLong(len(prepared.doc_ids), prepared.budget_tokens)
        if report:
            report("Prefill", "sending the book to the server …")
        return open_remote_book(self, chat, prepared, library, cancel), False

    def n_read_before(self, library, prepared: Prepared, among: set[str] | None) -> int:
        return 0  # the server holds the prefill: the library keeps no reading of it

    def load(self, target: str, draft: str, yarn_factor: float, report=None, cancel=None) -> RemoteEngine:
        raise EngineError("the server answers with its own model (choose one it serves with --remote-model).")


def sampling_args(sampling: SamplingConfig) -> dict:
    """SamplingConfig -> the OpenAI request's fields (vLLM's names for the ones OpenAI lacks)."""
    args = dict(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
                seed=sampling.seed, presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty)
    extra = {k: v for k, v in (("top_k", sampling.top_k), ("min_p", sampling.min_p),
                               ("repetition_penalty", sampling.repetition_penalty)) if v not in (0, 0.0, 1.0)}
    return {**args, "extra_body": extra} if extra else args


class RemoteSession:
    """Where BookSession expects an engine session: the level stack is the server's."""

    levels = "remote"

    def set_levels(self, levels: str) -> None:
        pass

    def truncate(self, length: int) -> None:
        pass


class RemoteBook(BookSession):
    """A book whose questions go to the remote server; turns keep text only (no token ids)."""

    has_reading = has_levels = False  # the server's answers give no attention or level stats

    def __init__(self, engine: RemoteEngine, chat, prepared: Prepared, book_id: str, library=None):
        super().__init__(engine, chat, prepared, RemoteSession(), book_id, library)

    def request_messages(self, question: str) -> list[dict]:
        """The book as the system message, then the chat so far and the question."""
        out = [{"role": "system", "content": self.document.text}]
        for turn in self.turns:
            out += [{"role": "user", "content": turn.question}, {"role": "assistant", "content": turn.answer}]
        return out + [{"role": "user", "content": question}]

    def stream(self, question: str, sampling: SamplingConfig, cancel=None) -> Iterator[tuple[str, str | None, Clock]]:
        """(answer so far, finish reason or None, clock) as chunks arrive; "cancelled" when stopped."""
        import openai

        answer, reason, clock, stream = "", None, Clock(), None
        try:
            stream = self.engine.client.chat.completions.create(
                model=self.engine.model, messages=self.request_messages(question), stream=True,
                stream_options={"include_usage": True}, **sampling_args(sampling))
            for chunk in stream:
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                delta = chunk.choices[0].delta.content if chunk.choices else None
                reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
                if delta:
                    answer += delta
                    clock.tick()
                if chunk.usage is not None:
                    clock.n_tokens = chunk.usage.completion_tokens
                if delta:
                    yield answer, None, clock
        except openai.APIError as error:
            raise EngineError(f"The server at {self.engine.client.base_url} failed to answer: {error}") from None
        finally:
            if stream is not None:
                stream.close()  # a closed connection stops the answer on the server
        yield answer, reason or "stop", clock

    def ask(self, question: str, sampling: SamplingConfig, cancel=None, reread: bool = False) -> Iterator[Update]:
        """`reread` is ignored: a server's answer gives no attention over the book, so no sources."""
        if not (question := question.strip()):
            raise EmptyPrompt("question")
        turn = Turn(question)
        try:
            for answer, reason, clock in self.stream(question, sampling, cancel):
                turn.answer, turn.finish_reason = answer.strip(), reason
                yield Update(turn.answer, clock.stats(), None, reason)
        finally:
            if turn.answer or turn.finish_reason:
                turn.finish_reason = turn.finish_reason or "cancelled"
                self.turns.append(turn)
                self.autosave()

    def read_by(self) -> str:
        return self.engine.name  # the server's model: its fingerprint is not known here

    def load_chat(self, data: dict) -> None:
        self.turns = [Turn(**t) for t in data["turns"]]
        self.chat_id, self.created = data["id"], data.get("created", time.time())

    def warm(self, cancel=None) -> None:
        """Send the book once (a one-token answer), so the server holds its prefill."""
        for _, reason, _ in self.stream("Reply with one word: ready?", SamplingConfig(max_new_tokens=1), cancel):
            if reason == "cancelled":
                raise Cancelled("reading of the book on the server")


def open_remote_book(engine: RemoteEngine, chat, prepared: Prepared, library, cancel=None) -> RemoteBook:
    """The book, listed in the library (no snapshot: the server holds the prefill) and sent once."""
    from app.library import book_id_of

    book_id = book_id_of(prepared.document.text)
    book = RemoteBook(engine, chat, prepared, book_id, library)
    book.warm(cancel)
    if library is not None:
        try:
            library.add_book(prepared.document, book.read_by(), len(prepared.doc_ids))
        except OSError as error:
            book.save_error = f"The book could not be saved to the library ({error})."
    return book


class Clock:
    """TTFT, TBT and tokens/s from the chunks' arrival times (one chunk ~ one token until the
    server's usage gives the count)."""

    def __init__(self):
        self.started, self.first, self.last, self.gap_s, self.n_chunks = time.perf_counter(), 0.0, 0.0, 0.0, 0
        self.n_tokens: int | None = None

    def tick(self) -> None:
        t = time.perf_counter()
        self.gap_s, self.last = (t - self.last if self.last else 0.0), t
        self.first = self.first or t
        self.n_chunks += 1

    def stats(self) -> Stats:
        n = self.n_tokens or self.n_chunks
        mean_s = (self.last - self.first) / (n - 1) if n > 1 else 0.0
        return Stats([], n, time.perf_counter() - self.started, (self.first or self.started) - self.started,
                     1000 * self.gap_s, 1000 * mean_s)
