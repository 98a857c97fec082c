"""HTML and XHTML -> paragraphs, headings and element ids, with the standard html.parser.

Used for .html files and for each EPUB content document. Block elements end a paragraph;
inline whitespace collapses as a browser would, except inside <pre>; script, style, template
and noscript are dropped. Offsets are paragraph indices, which the callers turn into sections.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

from app.formats.cleaning import clean_text
from app.formats.document import Document, DocumentBuilder, SectionKind, heading_kinds
from app.formats.limits import Limits, check_chars
from app.formats.plain import decode_text

_BLOCK_TAGS = frozenset({
    "address", "article", "aside", "blockquote", "body", "dd", "div", "dl", "dt", "figcaption", "figure",
    "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p",
    "pre", "section", "table", "tbody", "td", "th", "thead", "tr", "ul"})
_SKIP_TAGS = frozenset({"script", "style", "template", "noscript"})
_HEADINGS = {f"h{level}": level for level in range(1, 7)}
_WHITESPACE = re.compile(r"\s+")  # outside <pre>, source line breaks are spaces; <br> makes "\n"
_MARKUP_CHARS_PER_TEXT_CHAR = 4  # generous: tags and attributes rarely triple a page's text
Marks = dict[int, list[tuple[str, SectionKind]]]  # paragraph index -> sections starting there
_META_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([\w-]+)""", re.IGNORECASE)


@dataclass
class HtmlText:
    """What one HTML document says: paragraphs in order, headings and ids pointing into them."""

    title: str = ""
    paragraphs: list[str] = field(default_factory=list)
    headings: list[tuple[int, str, int]] = field(default_factory=list)  # level, text, paragraph index
    ids: dict[str, int] = field(default_factory=dict)  # element id -> paragraph index


class _Extractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.result = HtmlText()
        self._buffer: list[str] = []
        self._n_skipping = 0
        self._n_pre = 0
        self._heading_level = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP_TAGS:
            self._n_skipping += 1
        element_id = dict(attrs).get("id")
        if element_id:
            self.result.ids.setdefault(element_id, len(self.result.paragraphs))
        if tag in _BLOCK_TAGS:
            self._flush()
        elif tag == "br":
            self._buffer.append("\n")
        self._n_pre += tag == "pre"
        self._heading_level = _HEADINGS.get(tag, self._heading_level)
        self._in_title = self._in_title or tag == "title"

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP_TAGS:
            self._n_skipping = max(0, self._n_skipping - 1)
        if tag in _BLOCK_TAGS:
            self._flush()
        self._n_pre = max(0, self._n_pre - (tag == "pre"))
        self._in_title = self._in_title and tag != "title"

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.result.title += data
        elif not self._n_skipping:
            self._buffer.append(data if self._n_pre else _WHITESPACE.sub(" ", data))

    def close(self) -> None:
        super().close()
        self._flush()

    def _flush(self) -> None:
        raw = "".join(self._buffer)
        self._buffer.clear()
        text = "\n".join(line.rstrip() if self._n_pre else " ".join(line.split())
                         for line in raw.split("\n")).strip("\n")
        if text.strip():
            if self._heading_level:
                self.result.headings.append((self._heading_level, " ".join(text.split()),
                                             len(self.result.paragraphs)))
            self.result.paragraphs.append(text)
        self._heading_level = 0


def extract_html(markup: str) -> HtmlText:
    """Parse HTML/XHTML text; never raises on malformed markup (html.parser is lenient)."""
    extractor = _Extractor()
    extractor.feed(markup)
    extractor.close()
    extractor.result.title = " ".join(extractor.result.title.split())
    return extractor.result


def decode_html(data: bytes, path: str) -> str:
    """HTML bytes -> str, honouring a <meta charset> / XML encoding declaration when it decodes."""
    declared = _META_CHARSET.search(data[:4096]) or re.search(rb"""encoding=["']([\w-]+)""", data[:200])
    if declared:
        try:
            return data.decode(declared.group(1).decode("ascii"))
        except (LookupError, UnicodeDecodeError):
            pass  # a wrong declaration: fall back to detection
    return decode_text(data, path)


def load_html(path: str, limits: Limits) -> Document:
    """An .html file: paragraphs as blocks, <h1>-<h6> as chapters and sections."""
    with open(path, "rb") as file:
        markup = decode_html(file.read(), path)
    check_chars(len(markup) // _MARKUP_CHARS_PER_TEXT_CHAR, limits)  # refuse a huge page before parsing
    html = extract_html(markup)
    builder = DocumentBuilder(limits)
    add_paragraphs(builder, html, mark_headings(html.headings))
    first_h1 = next((text for level, text, _ in html.headings if level == 1), "")
    return builder.build(html.title or first_h1 or os.path.splitext(os.path.basename(path))[0], "html")


def mark_headings(headings: list[tuple[int, str, int]]) -> Marks:
    """Paragraph index -> [(title, kind)] for the headings of one document."""
    marks: Marks = {}
    for (_, text, paragraph_idx), kind in zip(headings, heading_kinds([h[0] for h in headings])):
        marks.setdefault(paragraph_idx, []).append((text, kind))
    return marks


def add_paragraphs(builder: DocumentBuilder, html: HtmlText, marks: Marks) -> None:
    """Add a document's paragraphs to `builder`, starting the marked sections where they begin."""
    for paragraph_idx, paragraph in enumerate(html.paragraphs):
        for title, kind in marks.get(paragraph_idx, []):
            builder.mark(title, kind)
        builder.add(clean_text(paragraph))
    for paragraph_idx in sorted(idx for idx in marks if idx >= len(html.paragraphs)):
        for title, kind in marks[paragraph_idx]:
            builder.mark(title, kind)
