"""An OpenAI-compatible server for the engine: `/v1/models` and `/v1/chat/completions`.

`ChatAPI.routes()` are plain Starlette routes: the app mounts them on Gradio's own FastAPI app
(`python app.py --api`), `python -m api` runs them alone under uvicorn (api/__main__.py). Each request:
1. is authorised: with an API key, `Authorization: Bearer <key>`; without one, 127.0.0.1 only;
2. is parsed (api/openai_chat.py) into prompt ids, sampling settings and stop rules;
3. gets a session holding the longest cached prefix of its prompt: an idle session in memory
   (llama.cpp's slots: the last answers' sessions, rolled back to the shared prefix), else the
   document's prefill from `documents` (the app's library: a snapshot on disk, else a prefill it
   saves), else a new prefill; only the rest of the prompt is prefilled;
4. is answered through the shared `Batcher`, with every other reader (UI and API) in one forward.
A client that disconnects sets the answer's cancel flag: the batcher ends it at the next step.
Errors are OpenAI-shaped: 400 bad request, 401/403 refused, 404 unknown model, 429 queue full.
The last chunk of a stream (and a non-streamed answer) carries our metrics as `bookchat`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.openai_chat import MIN_DOCUMENT_CHARS, ApiError, ChatRequest, StopText, parse_request
from engine.batch import Batcher
from engine.config import EngineError
from engine.session import Engine, Session, Stats, shared_prefix
from tools.chat import ChatFormat

LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
MAX_REQUESTS = 64  # answering or waiting; more get 429 at once rather than waiting for minutes
_END = object()


class Served(Protocol):
    """What answers: the engine and its chat format (the app's UI may load another model meanwhile)."""

    engine: Engine
    chat: ChatFormat


@dataclass
class Fixed:
    engine: Engine
    chat: ChatFormat


class Documents(Protocol):
    def open(self, engine: Engine, text: str, doc_ids: list[int], cancel: threading.Event) -> tuple[Session, bool]:
        """A session holding exactly `doc_ids` (the prefill of `text`) and whether it was restored."""


class NewPrefill:
    """No store: every document not in memory is prefilled."""

    def open(self, engine: Engine, text: str, doc_ids: list[int], cancel: threading.Event) -> tuple[Session, bool]:
        return engine.open(doc_ids, cancel=cancel), False


@dataclass
class Outcome:
    """What one request cost; the `bookchat` field of its last chunk, and `/v1/bookchat/requests`."""

    id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens already in the session's cache
    prefill_tokens: int = 0  # prompt tokens this request prefilled
    cache: str = "none"  # "memory", "disk" or "none"
    document_s: float = 0.0  # getting the session: restoring or prefilling the document
    ttft_s: float = 0.0  # request received -> first answer token
    completion_tokens: int = 0
    finish_reason: str | None = None


def interrupt_on_termination() -> None:
    """A kill (SIGTERM) or a closed terminal (SIGHUP) shuts down as Ctrl-C does, so what is being
    read saves; not where they are ignored (`nohup` keeps a server running after its terminal)."""
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, signal.default_int_handler)


class ChatAPI:
    def __init__(self, served: Served, batcher: Batcher, documents: Documents | None = None,
                 api_key: str | None = None, default_max_tokens: int = 512, keep_sessions: int = 4,
                 max_requests: int = MAX_REQUESTS, min_document_chars: int = MIN_DOCUMENT_CHARS):
        self.served, self.batcher, self.documents = served, batcher, documents or NewPrefill()
        self.api_key, self.keep_sessions, self.default_max_tokens = api_key, keep_sessions, default_max_tokens
        self.max_requests, self.min_document_chars = max_requests, min_document_chars
        self.created = int(time.time())
        self.idle: list[tuple[Session, int]] = []  # finished answers' sessions and document lengths, oldest first
        self.lock = threading.Lock()  # guards `idle` and `n_requests`
        self.prefill_lock = threading.Lock()  # one document prefill at a time, as the UI loads books
        self.n_requests = 0
        self.recent: deque[Outcome] = deque(maxlen=64)
        self.answering: set[Answer] = set()  # under way (guarded by `lock`): `close` stops them

    def close(self, timeout_s: float = 120.0) -> None:
        """The server is shutting down: stop every answer under way and wait for it, so a document
        being read saves what it read (app/reading.py) and reads on from there next time."""
        with self.lock:
            answers = list(self.answering)
        if answers:
            print(f"Stopping {len(answers)} answer(s) under way; a document being read saves what it read "
                  "(Ctrl-C again: quit now) …", flush=True)
        deadline = time.monotonic() + timeout_s
        for answer in answers:
            answer.cancel.set()
        for answer in answers:
            answer.thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def engine(self) -> Engine:
        return self.served.engine

    @property
    def model_id(self) -> str:
        return self.engine.config.target

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
                Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
                Route("/v1/bookchat/requests", self._endpoint(self.requests), methods=["GET"])]

    def _endpoint(self, handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                self.authorize(request)
                return await handler(request)
            except ApiError as error:
                return JSONResponse(error.body(), status_code=error.status)
        return endpoint

    def authorize(self, request: Request) -> None:
        if self.api_key is not None:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given.encode(), self.api_key.encode()):
                raise ApiError(401, "Incorrect API key: send `Authorization: Bearer <key>` with the key the "
                                    "server printed at start (or was given with --api-key).", code="invalid_api_key")
        elif request.client is None or request.client.host not in LOCAL_HOSTS:
            raise ApiError(403, "Without an API key this server answers only 127.0.0.1; start it with --api-key.",
                           "permission_error", "local_only")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "bookchat",
            "max_model_len": self.engine.max_context}]})

    async def requests(self, request: Request) -> Response:
        b = self.batcher  # shared with the UI: n_segments > n_forwards when answers were packed together
        return JSONResponse({"object": "list", "data": [asdict(o) for o in self.recent],
                             "batcher": {"n_rounds": b.n_rounds, "n_forwards": b.n_forwards,
                                         "n_segments": b.n_segments}})

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "The request body is not valid JSON.") from None
        engine, chat = self.served.engine, self.served.chat
        # a field the request leaves out: the model's own sampling settings (generation_config.json)
        defaults = replace(engine.default_sampling, max_new_tokens=self.default_max_tokens)
        req = await run_in_threadpool(parse_request, body, chat, engine.config.target, engine.max_context, defaults,
                                      frozenset(chat.stop_ids | engine.end_ids), self.min_document_chars)
        with self.lock:
            if self.n_requests >= self.max_requests:
                raise ApiError(429, f"The server is busy ({self.n_requests} requests answering or waiting); "
                                    "try again shortly.", "rate_limit_error", "queue_full")
            self.n_requests += 1
        answer = Answer(self, req)
        try:
            first = await answer.next(request)  # errors before the first token are plain HTTP errors
        except BaseException:
            answer.cancel.set()
            raise
        if req.is_stream:
            return StreamingResponse(answer.sse(first), media_type="text/event-stream")
        return JSONResponse(await answer.whole(first, request))

    # ---- sessions: the longest cached prefix of a prompt -----------------------------------------
    def session_for(self, req: ChatRequest, outcome: Outcome, cancel: threading.Event) -> tuple[Session, int]:
        """(session, its document's length): an idle one sharing the longest prefix with the prompt
        (never giving up its own document for a shorter match), else the document's, else a new one."""
        engine = self.engine
        with self.lock:
            self.idle = [(s, n) for s, n in self.idle if s.engine is engine]  # another model was loaded
            best, n_shared = None, 0
            for session, n_doc in self.idle:
                n = shared_prefix(session.tokens, req.ids)
                if n > n_shared and n >= max(n_doc, req.n_document_tokens, 1):
                    best, n_shared = (session, n_doc), n
            if best is not None:
                self.idle.remove(best)
                best[0].truncate(min(n_shared, len(req.ids) - 1))  # at least one token left to ask with
                outcome.cache, outcome.cached_tokens = "memory", best[0].full.length
                return best
        started = time.perf_counter()
        with self.prefill_lock:
            if req.document is not None:
                session, restored = self.documents.open(engine, req.document, req.ids[:req.n_document_tokens],
                                                        cancel)
                outcome.cache, outcome.cached_tokens = ("disk", session.full.length) if restored else ("none", 0)
            else:
                session = engine.open(req.ids[:-1], cancel=cancel)
        outcome.document_s = time.perf_counter() - started
        return session, req.n_document_tokens

    def give_back(self, session: Session, n_doc: int) -> None:
        with self.lock:
            self.idle.append((session, n_doc))
            del self.idle[:max(0, len(self.idle) - self.keep_sessions)]

    def done(self, outcome: Outcome, answer: Answer) -> None:
        with self.lock:
            self.n_requests -= 1
            self.recent.append(outcome)
            self.answering.discard(answer)


class Answer:
    """One request's answer: decoded on a worker thread, its chunks handed to the event loop."""

    def __init__(self, api: ChatAPI, req: ChatRequest):
        self.api, self.req = api, req
        self.id, self.started = "chatcmpl-" + uuid.uuid4().hex[:24], time.perf_counter()
        self.outcome = Outcome(self.id, len(req.ids))
        self.cancel = threading.Event()
        self.stats: Stats | None = None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.thread = threading.Thread(target=self._run, name=f"answer-{self.id[-6:]}", daemon=True)
        with api.lock:
            api.answering.add(self)
        self.thread.start()

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _run(self) -> None:
        api, req, outcome, events = self.api, self.req, self.outcome, None
        try:
            session, n_doc = api.session_for(req, outcome, self.cancel)
            outcome.prefill_tokens = len(req.ids) - outcome.cached_tokens
            ids, stop, reason = [], StopText(req.stop), None
            events = api.batcher.ask(session, req.ids[session.length:], req.sampling, self.cancel, set(req.stop_ids))
            for event in events:
                ids += event.tokens
                self.stats, reason = event.stats, event.finish_reason
                text = stop.push(api.engine.tokenizer.decode(ids, skip_special_tokens=True), reason is not None)
                if stop.is_stopped:  # cut at a stop string: this answer ends here
                    reason = "stop"
                if not outcome.ttft_s and (text or reason):
                    outcome.ttft_s = time.perf_counter() - self.started
                if text or reason:
                    self._put((text, reason))
                if stop.is_stopped:
                    break
            events.close()  # returns once the batcher let the session go
            outcome.completion_tokens, outcome.finish_reason = len(ids), reason
            api.give_back(session, n_doc)
        except ApiError as error:
            self._put(error)
        except EngineError as error:  # too long, cancelled while reading the document, ...
            self._put(ApiError(400, str(error)))
        except Exception as error:  # e.g. out of memory: the session is dropped, the server goes on
            self._put(ApiError(500, f"The engine failed: {error}", "server_error"))
        finally:
            if events is not None:
                events.close()
            api.done(outcome, self)
            self._put(_END)

    async def next(self, request: Request | None):
        """The next (text, finish_reason), or _END. With `request`, a client that went away cancels
        the answer (a stream needs no polling: Starlette cancels it, see `sse`)."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.cancel.set()
                continue
            if isinstance(item, ApiError):
                raise item
            return item

    def metrics(self) -> dict:
        s, o = self.stats, self.outcome
        levels = [{"name": lv.name, "acceptance": lv.acceptance, "tokens_per_check": lv.tokens_per_check,
                   "checks": lv.n_checks} for lv in (s.levels if s else [])]
        return {**asdict(o), "levels": levels, "tbt_ms_mean": s.tbt_ms_mean if s else 0.0,
                "tokens_per_s": s.tokens_per_s if s else 0.0, "levels_stack": self.api.engine.config.levels}

    def usage(self) -> dict:
        o = self.outcome
        return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
                "total_tokens": o.prompt_tokens + o.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}

    def _chunk(self, choices: list, **extra) -> str:
        return "data: " + json.dumps({"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()),
                                      "model": self.api.model_id, "choices": choices, **extra}) + "\n\n"

    async def sse(self, first) -> AsyncIterator[str]:
        item, reason = first, None
        try:
            yield self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            while item is not _END:
                text, reason = item
                if text:
                    yield self._chunk([{"index": 0, "delta": {"content": text}, "finish_reason": None}])
                try:
                    item = await self.next(None)
                except ApiError as error:
                    yield "data: " + json.dumps(error.body()) + "\n\n"
                    return
            last = {"bookchat": self.metrics()}
            if self.req.include_usage:
                yield self._chunk([{"index": 0, "delta": {}, "finish_reason": reason}])
                yield self._chunk([], usage=self.usage(), **last)
            else:
                yield self._chunk([{"index": 0, "delta": {}, "finish_reason": reason}], **last)
            yield "data: [DONE]\n\n"
        finally:  # a client that disconnected lands here (the task is cancelled): stop the answer
            self.cancel.set()

    async def whole(self, first, request: Request) -> dict:
        parts, item, reason = [], first, None
        while item is not _END:
            text, reason = item
            parts.append(text)
            item = await self.next(request)
        return {"id": self.id, "object": "chat.completion", "created": int(time.time()), "model": self.api.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": reason}], "usage": self.usage(), "bookchat": self.metrics()}
