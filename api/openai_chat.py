"""OpenAI chat requests -> the engine's prompt, sampling and stop rules (no HTTP here).

`parse_request` checks a `/v1/chat/completions` body and returns a `ChatRequest`: the prompt's
token ids, where its leading document ends, the `SamplingConfig`, stop strings and stop ids.
Every bad field raises `ApiError` (an OpenAI-shaped error with its HTTP status).

A request whose first message (system or user) is at least `min_document_chars` long and is
followed by user/assistant turns is a chat about a document: its ids are the app's
(`ChatFormat.document_ids` + `question_ids` + `answer_ids`), so the document's prefill is the
same tokens the library snapshots, and a saved book answers the API without a new prefill. Any
other conversation is rendered with the model's chat template as it stands.

`StopText` cuts the streamed text at the first stop string, holding back the characters that
could still turn into one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import SAMPLING_FIELDS, SamplingConfig
from tools.chat import ChatFormat

MIN_DOCUMENT_CHARS = 2000  # a first message this long is a document worth caching (~500 tokens)
MAX_STOP_STRINGS = 4  # as OpenAI


class ApiError(Exception):
    """An error the client caused or must handle, sent as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    ids: list[int]  # the whole prompt, generation prompt included
    document: str | None  # the leading document's text (cached by it), None for other chats
    n_document_tokens: int  # ids[:n_document_tokens] are the document's ids (0 without one)
    sampling: SamplingConfig
    stop: tuple[str, ...]  # stop strings, cut from the text
    stop_ids: frozenset[int]  # stop tokens (end of turn, end of text), unless ignore_eos
    is_stream: bool
    include_usage: bool


def parse_request(body: object, chat: ChatFormat, model_id: str, max_context: int, defaults: SamplingConfig,
                  stop_ids: frozenset[int], min_document_chars: int = MIN_DOCUMENT_CHARS) -> ChatRequest:
    """`defaults`: the sampling of fields the request leaves out (the model's own settings and the
    server's answer length); `stop_ids`: the tokens that end an answer (unless `ignore_eos`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    if body.get("model") not in (None, model_id):
        raise ApiError(404, f"The model {body.get('model')!r} does not exist; this server serves {model_id!r}.",
                       code="model_not_found", param="model")
    _refuse_unsupported(body)
    messages = _messages(body.get("messages"))
    document, turns = _document_and_turns(messages, min_document_chars)
    if document is not None:
        n_doc = len(doc_ids := chat.document_ids(document))
        ids = doc_ids + _turn_ids(chat, turns)
    else:
        n_doc, ids = 0, _template_ids(chat.tokenizer, messages)
    if len(ids) + 1 > max_context:
        raise ApiError(400, f"The prompt has {len(ids):,} tokens but the model's context holds {max_context:,}.",
                       code="context_length_exceeded", param="messages")
    stream_options = body.get("stream_options") or {}
    stop_ids = frozenset() if body.get("ignore_eos") else stop_ids
    return ChatRequest(ids, document, n_doc, _sampling(body, defaults), _stop(body.get("stop")), stop_ids,
                       bool(body.get("stream")), isinstance(stream_options, dict)
                       and bool(stream_options.get("include_usage")))


def _refuse_unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise ApiError(400, "Only n=1 is supported.", param="n")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "Tools and functions are not supported.", param="tools")
    if body.get("logprobs"):
        raise ApiError(400, "logprobs are not supported.", param="logprobs")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise ApiError(400, "Only text responses are supported.", param="response_format")


def _messages(raw: object) -> list[tuple[str, str]]:
    """(role, text) pairs; "developer" counts as "system"; text parts are joined."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "`messages` must be a non-empty list.", param="messages")
    out = []
    for i, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: role must be system, user or assistant, got {role!r}.",
                           param=f"messages[{i}].role")
        out.append((role, _text(message.get("content"), i)))
    if out[-1][0] != "user":
        raise ApiError(400, "The last message must be the user's.", param="messages")
    return out


def _text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be text (a string or text parts).",
                   param=f"messages[{i}].content")


def _document_and_turns(messages, min_chars: int) -> tuple[str | None, list[tuple[str, str]]]:
    """The leading document and the user/assistant turns after it, or (None, []) for other chats."""
    (role, text), rest = messages[0], messages[1:]
    is_document = role in ("system", "user") and len(text.strip()) >= min_chars and bool(rest)
    is_alternating = all(r == ("user" if i % 2 == 0 else "assistant") for i, (r, _) in enumerate(rest))
    return (text, rest) if is_document and is_alternating else (None, [])


def _turn_ids(chat: ChatFormat, turns: list[tuple[str, str]]) -> list[int]:
    """Question, answer, question, ... after the document, as BookSession puts them in the cache."""
    ids: list[int] = []
    for i in range(0, len(turns), 2):
        if not turns[i][1].strip():
            raise ApiError(400, "A user message is empty.", param="messages")
        ids += chat.question_ids(turns[i][1], is_first=i == 0, previous_answer_ended=True)
        if i + 1 < len(turns):
            ids += chat.answer_ids(turns[i + 1][1].strip(), has_ended=True)
    return ids


def _template_ids(tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as error:  # jinja's TemplateError: e.g. a template without a system role
        raise ApiError(400, f"The model's chat template refused these messages: {error}", param="messages") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sampling(body: dict, defaults: SamplingConfig) -> SamplingConfig:
    values = {}
    for name, kind in SAMPLING_FIELDS.items():  # `max_new_tokens` is OpenAI's `max_tokens`, below
        if name != "max_new_tokens" and body.get(name) is not None:
            values[name] = _number(body[name], kind, name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        values["max_new_tokens"] = _number(max_tokens, int, "max_tokens")
    if values.get("top_k") == -1:  # vLLM's "off"
        values["top_k"] = 0
    try:
        return replace(defaults, **values)
    except ValueError as error:
        raise ApiError(400, str(error)) from None


def _number(value: object, kind: type, name: str):
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
        raise ApiError(400, f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {value!r}.",
                       param=name)
    return kind(value)


def _stop(raw: object) -> tuple[str, ...]:
    stop = (raw,) if isinstance(raw, str) else tuple(raw or ())
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"`stop` must be a string or up to {MAX_STOP_STRINGS} non-empty strings.", param="stop")
    return stop


class StopText:
    """The answer's text so far, cut at the first stop string; `push` returns what may be sent now."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.sent, self.is_stopped = stop, 0, False
        self.hold = max((len(s) for s in stop), default=1) - 1  # a stop string may still be forming

    def push(self, text: str, is_last: bool) -> str:
        """`text`: the whole answer decoded so far. Returns the new characters safe to send."""
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            text, self.is_stopped, is_last = text[:min(cuts)], True, True
        end = len(text) if is_last else max(self.sent, len(text.rstrip("\ufffd")) - self.hold)
        new, self.sent = text[self.sent:end], max(self.sent, end)
        return new
