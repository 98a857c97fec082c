"""User text -> token ids as plain text, and token positions -> characters of the book.

A book or a question may spell the model's control tokens (`<|im_start|>`, `<|endoftext|>`,
`</s>`, Qwen's `<tool_call>`): they must become the ids of those characters, never the control
token, or a book could end the user turn and speak as the system. engine/chat.py splits
*special* tokens (`split_special_tokens=True`), but tokenizers also hold non-special added
tokens (Qwen2.5: `<tool_call>`) that still match. `PlainText` encodes with a copy of the
tokenizer in which every added token is special and special tokens are split, so no added token
can come out of user text; other text gets exactly the ids the tokenizer gives it.
`PlainChatFormat` is the engine's ChatFormat with that encoding of user text; template pieces
(the model's own control tokens) are tokenized as the engine does. `TokenMap` maps document
token positions back to characters (for page labels).
"""

from __future__ import annotations

import bisect
import json
import weakref

from engine.chat import DOC_END, ChatFormat

_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> PlainText


class PlainText:
    """Encodes text with no added token ever matching (see the module docstring)."""

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


def plain_text(tokenizer) -> PlainText:
    """The PlainText of `tokenizer`, built once (copying a 150K-token vocabulary takes ~0.2 s)."""
    if tokenizer not in _PLAIN:
        _PLAIN[tokenizer] = PlainText(tokenizer)
    return _PLAIN[tokenizer]


class PlainChatFormat(ChatFormat):
    """engine.chat.ChatFormat whose user text (book, questions, answers) is always plain text."""

    def __init__(self, tokenizer, end_ids: set[int] = frozenset()):
        self.plain = plain_text(tokenizer)
        super().__init__(tokenizer, end_ids=end_ids)

    def _user_text(self, text: str) -> list[int]:
        return self.plain.ids(text)


class TokenMap:
    """Document token position -> character offset in `Document.text` (for page labels)."""

    def __init__(self, tokenizer, text: str, n_doc_tokens: int):
        body = text.strip()  # what ChatFormat.document_ids tokenises, after the template prefix
        self.lead, self.n_chars = len(text) - len(text.lstrip()), len(text)
        self.offsets = [a for a, _ in plain_text(tokenizer).offsets(body)] or [0]  # start char of each token
        n_end = len(tokenizer(DOC_END, add_special_tokens=False)["input_ids"])
        # document ids = template prefix + body + DOC_END; joins may differ by a token: harmless here.
        self.shift = max(0, n_doc_tokens - n_end - len(self.offsets))

    def char(self, pos: int) -> int:
        idx = pos - self.shift
        return self.n_chars if idx >= len(self.offsets) else self.lead + self.offsets[max(idx, 0)]

    def n_tokens_between(self, start_char: int, end_char: int) -> int:
        return (bisect.bisect_left(self.offsets, end_char - self.lead)
                - bisect.bisect_left(self.offsets, start_char - self.lead))
