"""The result of ingestion: cleaned text plus a map from character offsets to pages and chapters.

`Document` answers "where is this passage?" (`locate`, `label_range`) for the UI's
"where the model is reading" panel and citations; `DocumentBuilder` is how every reader assembles
one: blocks of text joined by blank lines, sections marked where the next block starts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from app.formats.limits import Limits, check_chars

SectionKind = Literal["page", "chapter", "section"]
SourceFormat = Literal["pdf", "epub", "txt", "markdown", "html", "docx"]

# A section ends where the next section of one of these kinds starts.
_ENDED_BY: dict[str, tuple[str, ...]] = {"page": ("page",), "chapter": ("chapter",),
                                         "section": ("chapter", "section")}


@dataclass(frozen=True)
class Section:
    """A page, chapter or sub-section starting at `start_char` in `Document.text`."""

    title: str  # page label ("12", "iv") for pages; heading text otherwise
    start_char: int
    kind: SectionKind


@dataclass(frozen=True)
class Document:
    """A book as text. `sections` is sorted by `start_char`; treat the whole object as immutable."""

    title: str
    text: str
    source_format: SourceFormat
    sections: list[Section] = field(default_factory=list)
    notes: tuple[str, ...] = field(default=(), compare=False)  # for the user: e.g. how the file was decoded

    def locate(self, char_offset: int) -> str:
        """A human label for one offset: 'p. 12' when pages are known, else the chapter title."""
        return self._label(self._section_at(char_offset), char_offset)

    def label_range(self, start_char: int, end_char: int) -> str:
        """A label for the half-open range [start_char, end_char): 'pp. 12–13', 'Chapter 3'."""
        last_char = max(start_char, end_char - 1)
        first, last = self._section_at(start_char), self._section_at(last_char)
        if first is None or last is None:
            a, b = self._percent(start_char), self._percent(last_char)
            return f"at {a}%" if a == b else f"{a}–{b}%"
        if first == last:
            return self._label(first, start_char)
        if first.kind == "page":
            return f"pp. {first.title}–{last.title}"
        return f"{first.title} – {last.title}"

    def span(self, section: Section) -> tuple[int, int]:
        """[start, end) of a section: it ends where the next page / chapter / heading starts."""
        idx = self.sections.index(section)
        ends = [s.start_char for s in self.sections[idx + 1:]
                if s.kind in _ENDED_BY[section.kind] and s.start_char > section.start_char]
        return section.start_char, min(ends, default=len(self.text))

    def of_kind(self, kind: SectionKind) -> list[Section]:
        """The sections of one kind, in document order."""
        return [s for s in self.sections if s.kind == kind]

    @cached_property
    def _index(self) -> tuple[list[int], list[Section]]:
        # Pages when the source has them (most precise); otherwise chapters and headings.
        chosen = self.of_kind("page") or [s for s in self.sections if s.kind != "page"]
        return [s.start_char for s in chosen], chosen

    def _section_at(self, char_offset: int) -> Section | None:
        starts, chosen = self._index
        # bisect_right: of several sections starting at one offset (empty pages), the last owns it.
        idx = bisect.bisect_right(starts, char_offset) - 1
        return chosen[idx] if idx >= 0 else None

    def _label(self, section: Section | None, char_offset: int) -> str:
        if section is None:
            return f"at {self._percent(char_offset)}%"
        return f"p. {section.title}" if section.kind == "page" else section.title

    def _percent(self, char_offset: int) -> int:
        return min(100, max(0, 100 * char_offset // max(1, len(self.text))))


def heading_kinds(levels: list[int]) -> list[SectionKind]:
    """Heading levels (1 = biggest) -> 'chapter' for the chapter level and above, else 'section'.

    The chapter level is the biggest level present, unless it occurs once (a book title over
    H2 chapters), then the next one.
    """
    present = sorted(set(levels))
    if not present:
        return []
    top = present[1] if levels.count(present[0]) == 1 and len(present) > 1 else present[0]
    return ["chapter" if level <= top else "section" for level in levels]


class DocumentBuilder:
    """Joins text blocks with blank lines and records where sections start.

    `mark()` attaches a section to the next non-empty block, so an empty chapter never points
    past the end. The character limit is checked as blocks arrive, to stop early.
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._blocks: list[str] = []
        self._n_chars = 0
        self._pending: list[tuple[str, SectionKind, int]] = []
        self._sections: list[Section] = []

    def mark(self, title: str, kind: SectionKind, offset_in_block: int = 0) -> None:
        """Start a section in the next non-empty block added, `offset_in_block` chars into it."""
        self._pending.append((" ".join(title.split()), kind, offset_in_block))

    def add(self, block: str) -> None:
        """Append one block (a paragraph, page or chapter body); a blank block adds nothing."""
        stripped = block.strip("\n")
        if not stripped.strip():
            return
        start = self._n_chars + (2 if self._blocks else 0)
        self._flush(start, len(block) - len(block.lstrip("\n")), len(stripped))
        self._blocks.append(stripped)
        self._n_chars = start + len(stripped)
        check_chars(self._n_chars, self._limits)

    def build(self, title: str, source_format: SourceFormat) -> Document:
        """The finished Document; sections marked after the last block start at the end."""
        text = "\n\n".join(self._blocks)
        self._flush(len(text), 0, 0)
        sections = sorted(self._sections, key=lambda s: s.start_char)  # stable: marking order
        return Document(title=" ".join(title.split()), text=text, source_format=source_format,
                        sections=sections)

    def _flush(self, start: int, n_stripped: int, n_block_chars: int) -> None:
        for title, kind, offset in self._pending:
            inside = min(max(offset - n_stripped, 0), max(n_block_chars - 1, 0))
            self._sections.append(Section(title, start + inside, kind))
        self._pending.clear()
