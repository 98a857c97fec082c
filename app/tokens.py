"""Token positions -> characters of the book, and the chat format the app uses.

A book or a question may spell the model's control tokens (`<|im_start|>`, `<|endoftext|>`,
`</s>`, Qwen's `<tool_call>`): they must become the ids of those characters, never the control
token, or a book could end the user turn and speak as the system. tools/chat.py's `ChatFormat`
does that itself (its `PlainText` encodes user text with every added token split), so
`PlainChatFormat` is that ChatFormat under the name the app has always used. `TokenMap` maps
document token positions back to characters (for page labels).
"""

from __future__ import annotations

import bisect

from tools.chat import DOC_END, ChatFormat, PlainText, plain_text

__all__ = ["PlainChatFormat", "PlainText", "TokenMap", "plain_text"]

PlainChatFormat = ChatFormat  # user text is plain text in the engine's own ChatFormat


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

    def char_to_token(self, char: int) -> int:
        """The document position of the first token that starts at or after `char`."""
        return self.shift + bisect.bisect_left(self.offsets, char - self.lead)

    def n_tokens_between(self, start_char: int, end_char: int) -> int:
        return (bisect.bisect_left(self.offsets, end_char - self.lead)
                - bisect.bisect_left(self.offsets, start_char - self.lead))
