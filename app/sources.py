"""An answer's sources and quotes: passages of the book, from the model's own attention, a reader can check.

`find_passages` turns the engine's chunk shares (`Session.score_document`: the question's
attention over the whole book) into a few passages of about a paragraph, labelled with the
book's chapter, page or position; `with_passages` is the question as "re-read before answering"
sends it; `QuoteIndex` looks up the spans an answer puts in quotation marks. Plain data and
text: no Gradio, no engine calls (app/session.py calls the engine; app/book_view.py renders).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass, replace

from app.formats.document import Document

N_SOURCES = 3  # passages kept with an answer (and quoted when re-reading)
PASSAGE_MIN_CHARS = 200  # a shorter paragraph (a line of dialogue) takes its neighbours with it
PASSAGE_MAX_CHARS = 700  # a longer one is cut around the chunk the question read most
REREAD_HEADER = "Passages from the book that may help:"
# what the question's attention is contrasted with (engine/sources.py `contrast`): a question that
# asks for nothing in particular, so a chunk every question reads (the opening, headings) does not count
NEUTRAL_QUESTION = "What does the book say?"
CUT_NOTE = "cut where the part of the book that was read ends"
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class Source:
    """A passage of the book an answer read, as stored with the chat (JSON: `asdict`)."""

    label: str  # "Chapter 3", "p. 12", "at 23%": where it is
    text: str  # the passage as in the book, white space collapsed
    start_char: int  # [start_char, end_char) in the Document's text the chat was made with
    end_char: int
    share: float  # of the question's attention over the book
    note: str = ""  # e.g. CUT_NOTE

    @classmethod
    def from_json(cls, data: dict) -> Source:
        return cls(**{k: data[k] for k in ("label", "text", "start_char", "end_char", "share") if k in data},
                   note=data.get("note", ""))

    def to_json(self) -> dict:
        return asdict(self)


def paragraphs(text: str) -> list[tuple[int, int]]:
    """[start, end) of each paragraph (blocks between blank lines) of `text`, empty ones left out."""
    spans, at = [], 0
    for m in [*_PARAGRAPH_BREAK.finditer(text), None]:
        end = m.start() if m else len(text)
        if text[at:end].strip():
            spans.append((at, end))
        at = m.end() if m else end
    return spans


def find_passages(document: Document, char_ranges: list[tuple[int, int, float]], n: int = N_SOURCES,
                  is_cut: bool = False) -> list[Source]:
    """The `n` passages the question read most: chunks (char [start, end), share) taken best
    first, each grown to its paragraph (short ones with their neighbours, long ones cut around
    it); a passage's share sums the chunks inside it and those whose paragraph touches it.
    `is_cut`: the text ends where a reading was cut ("keep the first N tokens"), so a passage
    touching its end says so. Best share first."""
    text, paras = document.text, paragraphs(document.text)
    if not paras:
        return []
    starts, found = [a for a, _ in paras], []
    for a, b, w in sorted(char_ranges, key=lambda r: -r[2]):
        if len(found) == n:
            break
        middle = (a + b) // 2
        if any(s.start_char <= middle < s.end_char for s in found) or not text[a:b].strip():
            continue
        start, end = _grow(paras, max(0, bisect.bisect_right(starts, middle) - 1), a, b, text)
        near = [i for i, s in enumerate(found) if start < s.end_char and s.start_char < end]
        if near:  # a neighbour of a kept passage (its heading, the next line): it adds to that one
            found[near[0]] = replace(found[near[0]], share=found[near[0]].share + w)
            continue
        share = sum(w for x, y, w in char_ranges if start <= (x + y) // 2 < end)
        note = CUT_NOTE if is_cut and end >= len(text.rstrip()) else ""
        found.append(Source(document.label_range(start, end), " ".join(text[start:end].split()), start, end,
                            share, note))
    return sorted(found, key=lambda s: -s.share)


def _grow(paras: list[tuple[int, int]], idx: int, a: int, b: int, text: str) -> tuple[int, int]:
    """The paragraph `idx` (holding chars [a, b)), with neighbours while short, cut while long."""
    lo = hi = idx
    start, end = paras[idx]
    while end - start < PASSAGE_MIN_CHARS and (lo > 0 or hi < len(paras) - 1):
        if hi < len(paras) - 1:
            hi += 1
            end = paras[hi][1]
        if end - start < PASSAGE_MIN_CHARS and lo > 0:
            lo -= 1
            start = paras[lo][0]
    if end - start > PASSAGE_MAX_CHARS:  # a window around the chunk, at word boundaries
        centre = (a + b) // 2
        lo_char = max(start, min(centre - PASSAGE_MAX_CHARS // 2, end - PASSAGE_MAX_CHARS))
        hi_char = min(end, lo_char + PASSAGE_MAX_CHARS)
        if lo_char > start:
            lo_char = text.find(" ", lo_char, hi_char) + 1 or lo_char
        space = text.rfind(" ", lo_char, hi_char)
        if hi_char < end and space > lo_char:
            hi_char = space
        start, end = lo_char, hi_char
    return start, end


def with_passages(question: str, sources: list[Source], first: bool = False) -> str:
    """The user turn as "re-read before answering" sends it: the question, a blank line, then
    REREAD_HEADER and one line per passage, `[1] (Chapter 3) "text"`; `first`: the passages, a
    blank line, then the question (the question last, nearest the answer)."""
    if not sources:
        return question
    lines = [f'[{i}] ({s.label}) "{s.text}"' for i, s in enumerate(sources, 1)]
    passages = f"{REREAD_HEADER}\n" + "\n".join(lines)
    return f"{passages}\n\n{question.strip()}" if first else f"{question.strip()}\n\n{passages}"


# ---- quotes: the spans an answer puts in quotation marks, looked up in the book --------------
# a quote may wrap onto the next line (a small model breaks lines mid-answer), never over a blank one
_QUOTE = re.compile(r'"((?:[^"\n]|\n(?!\s*\n)){3,}?)"|“((?:[^”\n]|\n(?!\s*\n)){3,}?)”')
_SAME = str.maketrans({"“": '"', "”": '"', "„": '"', "‘": "'", "’": "'", "‚": "'", "\u00a0": " "})
MIN_QUOTE_CHARS = 4  # "a" or "it" in quotes is not a quotation of the book


@dataclass(frozen=True)
class Quote:
    text: str  # as the answer wrote it
    start_char: int  # its place in the book; -1: not in the book
    end_char: int
    label: str  # where it is, or "not in the book"

    @property
    def is_found(self) -> bool:
        return self.start_char >= 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Quote:
        return cls(data["text"], data["start_char"], data["end_char"], data["label"])


def normalise(text: str) -> tuple[str, list[int]]:
    """`text` with typographic quotes made straight, runs of white space made one space and case
    folded; and for each character of the result its offset in `text`."""
    out, where, was_space = [], [], False
    for i, ch in enumerate(text.translate(_SAME)):
        if ch.isspace():
            if not was_space:
                out.append(" ")
                where.append(i)
            was_space = True
            continue
        was_space = False
        folded = ch.casefold()
        out.append(folded)
        where.extend([i] * len(folded))
    return "".join(out), where


class QuoteIndex:
    """A book's normalised text, built once, so each quote is one substring search."""

    def __init__(self, document: Document):
        self.document = document
        self.text, self.where = normalise(document.text)

    def find(self, quote: str) -> Quote:
        needle = normalise(quote)[0].strip(" .,;:!?'\"…")
        at = self.text.find(needle) if len(needle) >= MIN_QUOTE_CHARS else -1
        if at < 0:
            return Quote(quote, -1, -1, "not in the book")
        a, b = self.where[at], self.where[at + len(needle) - 1] + 1
        return Quote(quote, a, b, self.document.label_range(a, b))

    def check(self, answer: str) -> list[Quote]:
        """Every quoted span of `answer` (straight or typographic double quotes), looked up."""
        spans = [m.group(1) or m.group(2) for m in _QUOTE.finditer(answer)]
        return [self.find(s) for s in dict.fromkeys(s.strip() for s in spans) if len(s.strip()) >= MIN_QUOTE_CHARS]


def footer(sources: list[Source], quotes: list[Quote]) -> str:
    """Markdown under an answer (in the chat and its export): its sources and its checked quotes."""
    lines = []
    if sources:
        lines.append("**Sources:** " + " · ".join(f"[{i}] {s.label} ({s.share:.0%})" for i, s in enumerate(sources, 1)))
    if quotes:
        lines.append("**Quotes:** " + " · ".join(f"“{_short(q.text)}” — {q.label if q.is_found else 'not in the book'}"
                                                 for q in quotes))
    return "\n\n".join(lines)


def export_lines(turn: dict) -> list[str]:
    """Markdown lines of a saved turn's sources and quotes, for the chat's export (none: [])."""
    lines = []
    if turn.get("sources"):
        how = " (quoted after the question: re-read before answering)" if turn.get("reread") else ""
        lines += [f"Sources{how}:", ""]
        lines += [f"{i}. {s['label']}, {s['share']:.0%} of the question's attention"
                  + (f" ({s['note']})" if s.get("note") else "") + f": > {s['text']}"
                  for i, s in enumerate(turn["sources"], 1)]
        lines.append("")
    if turn.get("quotes"):
        lines += ["Quotes: " + " · ".join(f"“{q['text']}” — {q['label']}" for q in turn["quotes"]), ""]
    return lines


def _short(text: str, n_chars: int = 60) -> str:
    return text if len(text) <= n_chars else text[:n_chars].rsplit(" ", 1)[0] + " …"
