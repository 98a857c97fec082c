"""Plain text and Markdown: decoding bytes to text, and finding chapters and headings.

Decoding: a BOM decides; else UTF-16 when every other byte is NUL; else UTF-8; else, when the
bytes are mostly valid UTF-8, UTF-8 with the few bad bytes replaced; else Windows-1252 (then
Latin-1, which never fails). Every fallback leaves a note on the Document that the UI shows.
Binary data named .txt is refused. Chapters in TXT come from lines like "Chapter 1" / "CHAPTER I" after a blank
line; Markdown sections from its headings. HTML is `markup.py`.
"""

from __future__ import annotations

import codecs
import os
import re
from dataclasses import replace

from app.formats.cleaning import clean_text
from app.formats.document import Document, DocumentBuilder, heading_kinds
from app.formats.errors import SUPPORTED, UnsupportedFormat
from app.formats.limits import Limits, check_chars

_BOMS = [(codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")]  # UTF-32 LE before UTF-16 LE
_BINARY_PROBE_BYTES = 65536
_MAX_CONTROL_SHARE = 0.01  # text has almost no C0 controls besides \t \n \r \f; binary ~12%
_MAX_STRAY_CONTROLS = 4  # a few stray controls (a BEL, an ESC) in a short note are still text
_TEXT_CONTROLS = frozenset(b"\t\n\r\f\x1a\x1b")  # \x1a: DOS end-of-file, \x1b: ANSI colour codes
_MIN_MULTIBYTE_PER_ERROR = 10  # "mostly UTF-8": ten good non-ASCII characters per bad byte

_NUMBER = (r"\d+|[IVXLCDM]+|[ivxlcdm]+|(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve"
           r"|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty"
           r"|sixty|seventy|eighty|ninety)(?:[- ](?:one|two|three|four|five|six|seven|eight|nine))?")
_CHAPTER_LINE = re.compile(rf"^[ \t]*((?:chapter|chap\.)[ \t]+(?:{_NUMBER}))\b\.?(?:[ \t]*[:.\-–—][ \t]*|[ \t]+)?"
                           r"(.{0,80})$", re.IGNORECASE | re.MULTILINE)
_MAX_SUBTITLE_CHARS = 80
_MIN_CHAPTER_CHARS = 200  # a shorter "chapter" is a table-of-contents entry
_ATX_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")


def decode_text(data: bytes, path: str) -> str:
    """Bytes of a text file -> str (see the module docstring for the order of attempts)."""
    return decode_text_noted(data, path)[0]


def decode_text_noted(data: bytes, path: str) -> tuple[str, str | None]:
    """(text, a note for the user when the bytes were not clean UTF-8, else None)."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return _replaced(data.decode(encoding, errors="replace"), encoding.upper())
    sample = data[:_BINARY_PROBE_BYTES]
    for encoding, zeros in (("utf-16-le", sample[1::2]), ("utf-16-be", sample[0::2])):
        if len(sample) >= 4 and not zeros.strip(b"\x00"):  # ASCII-range UTF-16 without a BOM
            return _replaced(data.decode(encoding, errors="replace"), "UTF-16")
    _refuse_binary(sample, path)
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    replaced = data.decode("utf-8", errors="replace")
    n_bad = replaced.count("\ufffd")
    n_multibyte = sum(1 for char in replaced if ord(char) > 127) - n_bad
    if n_multibyte >= _MIN_MULTIBYTE_PER_ERROR * n_bad:
        return _replaced(replaced, "UTF-8")
    note = "This file is not UTF-8; it was read as Windows-1252. If letters look wrong, save it as UTF-8."
    try:
        return data.decode("cp1252"), note
    except UnicodeDecodeError:
        return data.decode("latin-1"), note.replace("Windows-1252", "Latin-1")


def _replaced(text: str, encoding: str) -> tuple[str, str | None]:
    n_bad = text.count("\ufffd")
    if not n_bad:
        return text, None
    return text, (f"{n_bad:,} byte sequence{'s' * (n_bad != 1)} in this file {'are' if n_bad != 1 else 'is'} "
                  f"not valid {encoding} and show{'s' * (n_bad == 1)} as \ufffd.")


def load_text(path: str, kind: str, limits: Limits) -> Document:
    """A .txt (chapters from 'Chapter N' lines) or Markdown (sections from headings) file."""
    with open(path, "rb") as file:
        text, note = decode_text_noted(file.read(), path)
    check_chars(len(text), limits)  # before cleaning: a file over the limit is refused at once
    text = clean_text(text)
    stem = os.path.splitext(os.path.basename(path))[0]
    builder = DocumentBuilder(limits)
    if kind == "markdown":
        headings = _markdown_headings(text)
        title = next((t for level, t, _ in headings if level == 1), stem)
        for (_, heading, offset), section_kind in zip(headings, heading_kinds([h[0] for h in headings])):
            builder.mark(heading, section_kind, offset)
    else:
        title = stem
        for heading, offset in _txt_chapters(text):
            builder.mark(heading, "chapter", offset)
    builder.add(text)
    document = builder.build(title, "markdown" if kind == "markdown" else "txt")
    return replace(document, notes=(note,)) if note else document


def _refuse_binary(sample: bytes, path: str) -> None:
    n_controls = sum(1 for byte in sample if byte < 32 and byte not in _TEXT_CONTROLS)
    if b"\x00" in sample or n_controls > max(_MAX_CONTROL_SHARE * len(sample), _MAX_STRAY_CONTROLS):
        name = os.path.basename(path)
        raise UnsupportedFormat(f"'{name}' holds binary data, not text, whatever its name says. "
                                f"Choose the book itself; we read {SUPPORTED}.")


def _txt_chapters(text: str) -> list[tuple[str, int]]:
    """(title, offset) of each 'Chapter N' line that follows a blank line, TOC entries dropped."""
    found: list[tuple[str, int]] = []
    for match in _CHAPTER_LINE.finditer(text):
        if match.start() > 0 and not text[:match.start()].endswith("\n\n"):
            continue  # inside a paragraph or a list of chapters
        subtitle = match.group(2).strip() or _subtitle_after(text, match.end())
        label = match.group(1).strip()
        found.append((f"{label}: {subtitle}" if subtitle else label, match.start()))
    ends = [offset for _, offset in found[1:]] + [len(text)]
    return [(title, start) for (title, start), end in zip(found, ends)
            if len("".join(text[start:end].split())) >= _MIN_CHAPTER_CHARS]


def _subtitle_after(text: str, offset: int) -> str:
    """A short line right after 'CHAPTER I' that stands alone: 'Down the Rabbit-Hole'."""
    rest = text[offset:].lstrip("\n")
    line, _, after = rest.partition("\n")
    line = line.strip()
    stands_alone = after.startswith("\n") or not after
    if line and len(line) <= _MAX_SUBTITLE_CHARS and stands_alone and not line[0].islower():
        return line
    return ""


def _markdown_headings(text: str) -> list[tuple[int, str, int]]:
    """(level, title, offset) of ATX (# Title) and setext (Title / ===) headings outside code."""
    headings: list[tuple[int, str, int]] = []
    in_fence = False
    offset = 0
    lines = text.split("\n")
    for idx, line in enumerate(lines):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            heading = _heading_at(lines, idx)
            if heading:
                headings.append((heading[0], heading[1], offset))
        offset += len(line) + 1
    return headings


def _heading_at(lines: list[str], idx: int) -> tuple[int, str] | None:
    atx = _ATX_HEADING.match(lines[idx])
    if atx:
        return len(atx.group(1)), atx.group(2)
    underline = lines[idx + 1].strip() if idx + 1 < len(lines) else ""
    is_setext = len(underline) >= 3 and set(underline) in ({"="}, {"-"})
    if is_setext and lines[idx].strip() and (idx == 0 or not lines[idx - 1].strip()):
        return (1 if underline[0] == "=" else 2), lines[idx].strip()
    return None
