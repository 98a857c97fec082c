"""Text repair: Unicode normalisation, control characters, and the PDF-specific clean-up.

PDF text from pypdf keeps what typesetting did to the words: ligatures (NFKC turns "ﬁ" into
"fi"; TeX fonts without a ToUnicode entry come out as raw OT1 codes 0x0B-0x0F), end-of-line
hyphens, running headers/footers, page numbers and dot leaders. Pages are lists of lines here;
the PDF reader decides the page map. Nothing in this module reads files.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from itertools import pairwise

# TeX's OT1 encoding puts ff fi fl ffi ffl at 0x0B-0x0F; pdfTeX's ToUnicode maps often omit them.
_OT1_LIGATURES = {"\x0b": "ff", "\x0c": "fi", "\x0d": "fl", "\x0e": "ffi", "\x0f": "ffl"}
_OT1_CODE = re.compile(r"(?<=[^\W\d_])[\x0b-\x0f]|[\x0b-\x0f](?=[^\W\d_])")
# C0/C1 controls but \t \n, lone surrogates, private-use glyphs, zero-width space/joiners, BOM.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ue000-\uf8ff"
                      "\U000f0000-\U0010ffff\u200b\u2060\ufeff]")
_LINE_BREAKS = re.compile("\r\n|[\r\f\v\u2028\u2029\x85]")
_BLANK_RUNS = re.compile(r"\n{3,}")
_DOT_LEADER = re.compile(r"(?: ?\.){4,} ?")
_PAGE_NUMBER = re.compile(r"^[\s\-–—(\[|]*(?:[Pp]age|p\.)?\s*(\d+|[ivxlc]+)(?:\s*(?:of|/)\s*\d+)?[\s\-–—)\]|]*$")
_HYPHEN_TAIL = re.compile(r"([^\W\d_]+)[-\u00ad]$")
_WORD_HEAD = re.compile(r"([^\W\d_]+)(\S*)\s*(.*)$")  # word, its trailing punctuation, the rest
_SENTENCE_END = re.compile(r"[.,;:!?)\]}]$")
_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")
_LONG_WORD = re.compile(r"[^\W\d_]{26,}")  # longer than any common English word

_ZONE_LINES = 2  # running headers/footers live in the first/last two lines of a page
_NEAR_PAGES = 2  # a line repeated within two pages (odd/even headers) is a running header
_MIN_CHAIN_PAGES = 3  # ... on three pages in a row at least (fewer is coincidence in manuals)
_MIN_SHIFT_VOTES = 3  # pages agreeing on "printed = physical - shift" before we trust the shift
_MAX_HEADER_CHARS = 120
_FRONT_MATTER_PAGES = 30  # roman page numbers ("iv") are believed here; later "x" is code or maths

Pages = list[list[str]]


def clean_text(text: str, compatibility: bool = False) -> str:
    """Newlines to LF, Unicode NFC (NFKC if `compatibility`), no control characters, no blank runs."""
    text = _LINE_BREAKS.sub("\n", text)
    text = unicodedata.normalize("NFKC" if compatibility else "NFC", text)
    text = _CONTROL.sub("", text).replace("\u00ad", "")
    return tidy_blank_lines("\n".join(line.rstrip() for line in text.split("\n")))


def tidy_blank_lines(text: str) -> str:
    """At most one blank line in a row, none at either end."""
    return _BLANK_RUNS.sub("\n\n", text).strip("\n")


def pdf_page_lines(raw: str) -> list[str]:
    """One page of pypdf text -> clean lines (ligatures resolved, NFKC, spaces squeezed)."""
    text = _OT1_CODE.sub(lambda m: _OT1_LIGATURES[m.group()], raw)
    text = unicodedata.normalize("NFKC", text)
    text = _CONTROL.sub(" ", text)  # pypdf ends lines with \n; a stray \r or \f is a glyph code
    return [" ".join(_DOT_LEADER.sub(" ... ", line).split()) for line in text.split("\n")]


def drop_running_lines(pages: Pages, labels: list[str]) -> Pages:
    """Remove page numbers and running headers/footers from the top and bottom of each page.

    Lines are peeled from each end of a page (two at most) while they are page furniture: a bare
    page number; a line starting or ending with the page's number ("Chapter 3: Basic Shell
    Features 45"), on pages that print no bare number; or a line that, digits aside, also sits
    at the edge of a page at most two pages away (odd/even running headers).
    """
    zones = [_zone(lines) for lines in pages]
    printed = _printed_numbers(pages, zones)
    seen: dict[str, dict[int, bool]] = {}  # line key -> {page index: is it the page's edge line}
    for page_idx, zone in enumerate(zones):
        for line_idx in zone:
            line = pages[page_idx][line_idx]
            is_edge = line_idx in (zone[0], zone[-1]) and not _SENTENCE_END.search(line)
            on_page = seen.setdefault(_repeat_key(line), {})
            on_page[page_idx] = on_page.get(page_idx, True) and is_edge
    running = {key for key, on_page in seen.items() if key and _is_running(on_page)}
    return [_without_running(lines, zone, page_idx, {labels[page_idx], printed[page_idx]} - {""}, running)
            for page_idx, (lines, zone) in enumerate(zip(pages, zones))]


def join_hyphenated(pages: Pages) -> Pages:
    """Re-join words split at line ends ("pro-" / "gramming"), across page breaks too.

    The document is its own dictionary: "self-" / "contained" keeps its hyphen when the document
    writes "self-contained" elsewhere and never "selfcontained".
    """
    words, compounds = _vocabulary(pages)
    positions = [(p, i) for p, lines in enumerate(pages) for i, line in enumerate(lines) if line]
    emptied: set[tuple[int, int]] = set()
    for (page_idx, line_idx), (next_page, next_line) in pairwise(positions):
        tail = _HYPHEN_TAIL.search(pages[page_idx][line_idx])
        head = _WORD_HEAD.match(pages[next_page][next_line])
        if not tail or not head:
            continue
        first, second = tail.group(1), head.group(1)
        is_known = f"{first}-{second}".lower() in compounds  # "S-" / "Plus": the book writes "S-Plus"
        if not (is_known or _continues_word(first, second)):
            continue
        is_compound = is_known and (first + second).lower() not in words
        pages[page_idx][line_idx] = (pages[page_idx][line_idx][:-1] + ("-" if is_compound else "")
                                     + second + head.group(2))
        pages[next_page][next_line] = head.group(3)
        if not pages[next_page][next_line]:
            emptied.add((next_page, next_line))
    return [[line.replace("\u00ad", "") for idx, line in enumerate(lines) if (page_idx, idx) not in emptied]
            for page_idx, lines in enumerate(pages)]


def _continues_word(first: str, second: str) -> bool:
    # "pro-" + "gramming", or all capitals ("EX-" + "PRESS"); "GNU Math-" + "Prog" is a name.
    return second[0].islower() or (len(first) > 1 and first.isupper() and second.isupper())


def _zone(lines: list[str]) -> list[int]:
    filled = [idx for idx, line in enumerate(lines) if line]
    return sorted(set(filled[:_ZONE_LINES] + filled[-_ZONE_LINES:]))


def _repeat_key(line: str) -> str:
    return re.sub(r"\d+", "#", "".join(line.lower().split())) if len(line) <= _MAX_HEADER_CHARS else ""


def _is_running(on_page: dict[int, bool]) -> bool:
    """Pages in a chain with gaps of at most two (odd/even headers): three pages, or two when the
    line is the very first/last of both pages and does not end like a sentence."""
    longest = run = 1
    for a, b in pairwise(sorted(on_page)):
        run = run + 1 if b - a <= _NEAR_PAGES else 1
        longest = max(longest, run)
    return longest >= _MIN_CHAIN_PAGES or (longest == 2 and all(on_page.values()))


def _printed_numbers(pages: Pages, zones: list[list[int]]) -> list[str]:
    """The number printed on each page ('' if unknown), from the commonest physical-printed shift.

    Needed when a PDF has no page labels: bashref.pdf prints "1" on its 7th page.
    """
    shifts = Counter(page_idx + 1 - int(pages[page_idx][line_idx])
                     for page_idx, zone in enumerate(zones) for line_idx in zone
                     if pages[page_idx][line_idx].isdigit() and len(pages[page_idx][line_idx]) < 6)
    shift, n_pages = shifts.most_common(1)[0] if shifts else (0, 0)
    if n_pages < _MIN_SHIFT_VOTES:
        return [""] * len(pages)
    return [str(page_idx + 1 - shift) if page_idx + 1 > shift else "" for page_idx in range(len(pages))]


def _without_running(lines: list[str], zone: list[int], page_idx: int, labels: set[str],
                     running: set[str]) -> list[str]:
    if any(_is_page_number(lines[idx], page_idx, labels) for idx in zone):
        labels = set()  # a page prints its number once: a "1 Introduction" heading stays
    dropped: set[int] = set()
    for edge in (zone[:_ZONE_LINES], zone[::-1][:_ZONE_LINES]):
        for idx in edge:
            line = lines[idx]
            if not (_is_page_number(line, page_idx, labels) or _repeat_key(line) in running
                    or any(_carries_label(line, label) for label in labels)):
                break
            dropped.add(idx)
    return [line for idx, line in enumerate(lines) if idx not in dropped]


def _is_page_number(line: str, page_idx: int, labels: set[str]) -> bool:
    number = _PAGE_NUMBER.match(line)
    if number is None:
        return False
    return number.group(1).isdigit() or page_idx < _FRONT_MATTER_PAGES or number.group(1) in labels


def _carries_label(line: str, label: str) -> bool:
    if len(line) > _MAX_HEADER_CHARS or not re.search(r"[^\W\d_]{2}", line):
        return False
    return line.startswith(label + " ") or line.endswith(" " + label)


def _vocabulary(pages: Pages) -> tuple[set[str], set[str]]:
    words: set[str] = set()
    compounds: set[str] = set()
    for lines in pages:
        for line in lines:
            for word in _WORD.findall(line.lower()):
                (compounds if "-" in word else words).add(word)
    return words, compounds


def run_together_words(text: str) -> list[str]:
    """Letter runs over 25 letters that occur once: words a PDF printed without spaces between.

    A long name repeated in the text (an identifier, a URL part) is real; a run that occurs
    exactly once is almost always several words glued together by the extraction.
    """
    counts = Counter(_LONG_WORD.findall(text))
    return [word for word, n in counts.items() if n == 1]
