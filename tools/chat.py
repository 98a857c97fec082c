"""Chat prompts from the model's own chat template, cut so a book is prefilled once.

The first user message is `book + SEPARATOR + question`; later turns append only the new
question. The template pieces around the user text come from rendering the tokenizer's template
with marker strings and splitting on them, so no model's template is written down here.
User text (book, questions) is always plain text: a book quoting `<|im_start|>` or Qwen's
non-special added token `<tool_call>` gets the ids of those characters, never a control token
(`PlainText`). Template pieces are tokenized normally.
Nothing here runs a model or knows about speculation.
"""

from __future__ import annotations

import json
import weakref

from engine.config import EngineError

# Between the book and the first question, inside one user message. The document's ids end
# before the space: tokenizers attach a space to the word after it, so the joint tokenization
# cuts there too (after "\n\n" it would not: GPT-2's regex splits "\n\nWho" as "\n", "\n", "Who").
DOC_END, QUESTION_START = "\n\nQuestion:", " "
SEPARATOR = DOC_END + QUESTION_START
# The system message of every chat: keep answers on the book (issue 21). A template that refuses a
# system role renders without it.
BOOK_SYSTEM = ("You are a helpful assistant. The user gives you a book and asks about it. Answer from the "
               "book; if the book does not say, say that it does not.")
# Markers: printable, so templates that `trim` the content keep them.
_DOC, _ANSWER, _QUESTION = "[[BOOKCHAT-DOC]]", "[[BOOKCHAT-ANSWER]]", "[[BOOKCHAT-QUESTION]]"


class ChatFormat:
    """Token ids of a chat about one document, in the order they enter the KV cache.

    document_ids(book) + question_ids(q1, is_first=True) + answer 1 + question_ids(q2, ...) ...
    equals tokenizing the whole rendered conversation (tests check it token for token), for
    templates that render earlier turns verbatim (ours do; some strip reasoning from old answers).
    """

    def __init__(self, tokenizer, system: str | None = BOOK_SYSTEM, end_ids: set[int] = frozenset()):
        """end_ids: more tokens that end an answer (the model's generation_config, Engine.end_ids)."""
        self.tokenizer = tokenizer
        self._added = [t.content for t in tokenizer.added_tokens_decoder.values()]
        self.system = system if system and self._accepts_system(system) else None
        first = self._render([_user(_DOC + SEPARATOR + _QUESTION)])
        doc_prefix, rest = _split_once(first, _DOC)
        after_question = _split_once(rest, _QUESTION)[1]
        later = self._render([_user(_DOC + _QUESTION), _assistant(_ANSWER), _user(_QUESTION)])
        between_turns, after_q2 = _split_once(_split_once(later, _ANSWER)[1], _QUESTION)
        if after_q2 != after_question:
            raise EngineError("The chat template ends later user turns unlike the first one.")
        # Template text touching user text with no added token between them is one pre-tokenizer
        # segment in the rendered prompt, so it is tokenized together with the user text.
        self._prefix, self._prefix_tail = self._cut_after_last_added(doc_prefix)
        self._between, self._between_tail = self._cut_after_last_added(between_turns)
        self._after_head, self._after = self._cut_before_first_added(after_question)
        between_ids = self._template(self._between)
        is_special = bool(between_ids) and between_ids[0] in tokenizer.all_special_ids
        self.end_of_turn_id: int | None = between_ids[0] if is_special else None
        self.stop_ids: set[int] = ({tokenizer.eos_token_id, self.end_of_turn_id} | set(end_ids)) - {None}

    def document_ids(self, text: str) -> list[int]:
        """Template prefix (system prompt, user-turn start) + book + DOC_END: all before a question."""
        return self._template(self._prefix) + self._user_text(self._prefix_tail + text.strip() + DOC_END)

    def question_ids(self, question: str, is_first: bool, previous_answer_ended: bool) -> list[int]:
        """The question and the assistant generation prompt, after the turn change if not first.

        `previous_answer_ended`: the last answer's ids already end with the end-of-turn token
        (the model stopped on it), so it is not appended again.
        """
        question = question.strip() + self._after_head
        if is_first:
            return self._user_text(QUESTION_START + question) + self._template(self._after)
        between = self._template(self._between)
        if previous_answer_ended and between[:1] == [self.end_of_turn_id]:
            between = between[1:]
        return between + self._user_text(self._between_tail + question) + self._template(self._after)

    def answer_ids(self, answer: str, has_ended: bool) -> list[int]:
        """The ids a model that wrote `answer` left in the cache (tests, chats restored from text)."""
        stop = [self.end_of_turn_id] if has_ended and self.end_of_turn_id is not None else []
        return self._user_text(answer) + stop

    def _cut_after_last_added(self, text: str) -> tuple[str, str]:
        cut = max((text.rfind(token) + len(token) for token in self._added if token in text), default=0)
        return text[:cut], text[cut:]

    def _cut_before_first_added(self, text: str) -> tuple[str, str]:
        cut = min((text.find(token) for token in self._added if token in text), default=len(text))
        return text[:cut], text[cut:]

    def messages(self, turns: list[dict[str, str]]) -> list[dict[str, str]]:
        """The whole conversation as the template sees it: the system message, then `turns`."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + turns

    def _render(self, turns: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(self.messages(turns), tokenize=False, add_generation_prompt=True)

    def _accepts_system(self, system: str) -> bool:
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template([{"role": "system", "content": system}, _user("x")],
                                                      tokenize=False, add_generation_prompt=True)
        except TemplateError:  # e.g. "System role not supported"
            return False
        return system in text

    def _template(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _user_text(self, text: str) -> list[int]:
        return plain_text(self.tokenizer).ids(text)


class PlainText:
    """Encodes text so that no added token (special or not) can come out of it.

    `split_special_tokens=True` splits *special* tokens only; tokenizers also hold non-special
    added tokens (Qwen2.5: `<tool_call>`) that still match. This encodes with a copy of the
    tokenizer in which every added token is special and special tokens are split; other text gets
    exactly the ids the tokenizer gives it.
    """

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer

        self.tokenizer, self.backend = tokenizer, None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # every Hugging Face "fast" tokenizer; slow ones split special tokens only
            spec = json.loads(backend.to_str())
            for added in spec.get("added_tokens") or []:
                added["special"] = True
            spec["truncation"], spec["padding"] = None, None
            self.backend = Tokenizer.from_str(json.dumps(spec))
            self.backend.encode_special_tokens = True

    def ids(self, text: str) -> list[int]:
        if self.backend is None:
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return self.backend.encode(text, add_special_tokens=False).ids

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) characters of each token of `text`."""
        if self.backend is None:
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                                  return_offsets_mapping=True)["offset_mapping"]
        return self.backend.encode(text, add_special_tokens=False).offsets


_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> PlainText


def plain_text(tokenizer) -> PlainText:
    """The PlainText of `tokenizer`, built once (copying a large vocabulary is not free)."""
    if tokenizer not in _PLAIN:
        _PLAIN[tokenizer] = PlainText(tokenizer)
    return _PLAIN[tokenizer]


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def _split_once(text: str, marker: str) -> tuple[str, str]:
    """Text before and after the one occurrence of `marker` in a rendered template."""
    if text.count(marker) != 1:
        raise EngineError(f"The chat template does not render user text verbatim ({marker!r}).")
    before, after = text.split(marker)
    return before, after
