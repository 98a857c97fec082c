"""The sources under an answer, clickable, and the book view: the book's text at a passage, highlighted.

`add` puts the two components on the page (a gr.Radio of the answer's sources and checked quotes,
a gr.HTML panel); `wire` connects them: picking a source renders the chapters around it with the
passage in a <mark>, scrolled into view; clicking an answer in the chat lists that answer's
sources. `render_view` is a pure function of the document and a span (any format as ingested:
the Document's text). A source is found again by its stored text when the book open now is not
the text it was found in (read again in a larger part); failing that its stored text is shown.
"""

from __future__ import annotations

import html
from types import SimpleNamespace
from typing import TYPE_CHECKING

import gradio as gr

from app.documents import Document, chapters
from app.sources import Quote, QuoteIndex, Source, normalise

if TYPE_CHECKING:
    from app.session import BookSession
    from app.ui import App

AROUND_CHARS = 20_000  # at most this much text either side of a passage (a long chapter is cut)
NO_CHAPTERS_CHARS = 4_000  # either side, when the book has no chapters
SCROLL_TO_MARK = "() => document.querySelector('#book-view mark')?.scrollIntoView({block: 'center'})"
NOTHING = "Click a source or a quote under an answer to open the book at that passage."


def add(c: SimpleNamespace) -> None:
    """The components, named in `c`: the answer's sources, the book view."""
    c.sources = gr.Radio([], label="Sources and quotes of the answer: click one to open the book there",
                         elem_id="sources", visible=False)
    c.book_view = gr.HTML(f"<div class='book-view-note'>{NOTHING}</div>", elem_id="book-view", visible=False)


def wire(app: App, c: SimpleNamespace) -> None:
    view = Handlers(app)
    c.sources.input(view.show, [c.sources], [c.book_view], api_name="show_source",
                    concurrency_limit=None).then(None, js=SCROLL_TO_MARK)
    c.chatbot.select(view.pick_turn, None, [c.sources], api_name=False, concurrency_limit=None)


def choices(book: BookSession | None, turn_idx: int | None = None) -> dict:
    """The radio's update: the sources and quotes of one answer (default: the last one)."""
    if book is None or not book.turns:
        return gr.update(choices=[], value=None, visible=False)
    turn_idx = len(book.turns) - 1 if turn_idx is None else turn_idx
    turn = book.turns[turn_idx]
    found = [(f"[{i}] {s['label']} ({s['share']:.0%}): {_short(s['text'])}", f"s:{turn_idx}:{i - 1}")
             for i, s in enumerate(turn.sources, 1)]
    found += [(f"“{_short(q['text'])}” — {q['label']}", f"q:{turn_idx}:{i}") for i, q in enumerate(turn.quotes)]
    return gr.update(choices=found, value=None, visible=bool(found))


class Handlers:
    """The components' handlers, over the app's users (their open book and its turns)."""

    def __init__(self, app: App):
        self.app = app

    def pick_turn(self, event: gr.SelectData, request: gr.Request) -> dict:
        """Clicking a message in the chat lists its answer's sources."""
        book = self.app.user(request).book
        index = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        if book is None or not isinstance(index, int) or not 0 <= index // 2 < len(book.turns):
            return gr.update()
        return choices(book, index // 2)

    def show(self, choice: str | None, request: gr.Request) -> dict:
        """The book view at the picked source or quote (a sentence, never an error, when it cannot be)."""
        book = self.app.user(request).book
        try:
            kind, turn_idx, idx = (choice or "").split(":")
            turn = book.turns[int(turn_idx)]
            item = turn.sources[int(idx)] if kind == "s" else turn.quotes[int(idx)]
        except (AttributeError, ValueError, IndexError, TypeError):
            return gr.update(value=_note("That source belongs to a chat that is not open now: ask again, or "
                                         "open its chat from the library."), visible=True)
        if kind == "q" and item["start_char"] < 0:
            return gr.update(value=_note(f"“{html.escape(item['text'])}” is not in the book: the answer's "
                                         "words, not a quotation."), visible=True)
        source = Source.from_json(item) if kind == "s" else _quote_source(Quote.from_json(item))
        return gr.update(value=render_view(book.document, source, book.quote_index()), visible=True)


def _quote_source(quote: Quote) -> Source:
    return Source(quote.label, quote.text, quote.start_char, quote.end_char, 0.0)


def locate(document: Document, source: Source, index: QuoteIndex | None = None) -> tuple[int, int] | None:
    """[start, end) of the source's text in `document`: at its stored place, else wherever its
    text is (the book read again in another part); None when the text is not there."""
    a, b = source.start_char, source.end_char
    if 0 <= a < b <= len(document.text) and normalise(document.text[a:b])[0] == normalise(source.text)[0]:
        return a, b
    found = (index or QuoteIndex(document)).find(source.text)
    return (found.start_char, found.end_char) if found.is_found else None


def render_view(document: Document, source: Source, index: QuoteIndex | None = None) -> str:
    """HTML of the chapters around the passage (the one before, its own, the one after; at most
    AROUND_CHARS either side), the passage in a <mark>, in a scrolling panel."""
    span = locate(document, source, index)
    where = f"<b>{html.escape(source.label)}</b>" + (f" · {source.share:.0%} of the question's attention"
                                                      if source.share else "")
    if span is None:
        return (_head(where) + _note("This passage is not in the part of the book open now; as it was found:")
                + f"<div class='book-text'><mark>{html.escape(source.text)}</mark></div>")
    a, b = span
    lo, hi = _window(document, a, b)
    text = document.text
    body = (("… " if lo > 0 else "") + html.escape(text[lo:a]) + f"<mark>{html.escape(text[a:b])}</mark>"
            + html.escape(text[b:hi]) + (" …" if hi < len(text) else ""))
    note = f"<div class='book-view-note'>{html.escape(source.note)}</div>" if source.note else ""
    return (_head(where) + note + "<div class='book-text' style='white-space: pre-wrap; max-height: 420px; "
            f"overflow-y: auto; line-height: 1.5'>{body}</div>")


def _window(document: Document, a: int, b: int) -> tuple[int, int]:
    """[lo, hi): the chapter before the passage's, its own and the next, cut to AROUND_CHARS."""
    found = chapters(document)
    if not found:
        return max(0, a - NO_CHAPTERS_CHARS), min(len(document.text), b + NO_CHAPTERS_CHARS)
    spans = [document.span(s) for s in found]
    own = max([i for i, (start, _) in enumerate(spans) if start <= a], default=0)
    lo = spans[max(own - 1, 0)][0] if spans[0][0] <= a else 0
    hi = spans[min(own + 1, len(spans) - 1)][1]
    return max(lo, a - AROUND_CHARS), min(max(hi, b), b + AROUND_CHARS)


def _head(where: str) -> str:
    return f"<div class='book-view-head'>{where}</div>"


def _note(text: str) -> str:
    return f"<div class='book-view-note'>{text}</div>"


def _short(text: str, n_chars: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n_chars else text[:n_chars].rsplit(" ", 1)[0] + " …"
