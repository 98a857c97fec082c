"""PDF -> Document with pypdf: text per page, cleaned, with the page map and the outline.

pypdf runs under a configuration derived from `Limits`, so a stream that would decode to
gigabytes raises instead of hanging; `progress` is called before every page, so a caller can
cancel between pages. Encryption: the empty password is tried first, then the given one.
Cleaning (ligatures, hyphens, running headers) is `cleaning.py`; this module reads and maps.
Word gaps: pypdf sizes them against each font's space, misread for some CID fonts, which glued
whole lines together (`_PlausibleSpaceFont` corrects it); words that still run together are
counted and the Document gets a note for the user.
"""

from __future__ import annotations

import os
import re
import struct
import unicodedata
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pypdf import (
    PageObject,
    PasswordType,
    PdfReader,
    apply_configuration,
    get_configuration,
)
from pypdf import _page as _pypdf_page
from pypdf.errors import DependencyError, LimitReachedError, PyPdfError

from app.formats.cleaning import (
    drop_running_lines,
    join_hyphenated,
    pdf_page_lines,
    run_together_words,
    tidy_blank_lines,
)
from app.formats.document import Document, DocumentBuilder
from app.formats.errors import (
    CorruptDocument,
    EmptyDocument,
    PasswordRequired,
    ScannedPdf,
    TooLarge,
    UnsupportedFormat,
    WrongPassword,
)
from app.formats.limits import Limits, Progress, check_chars, check_pages, human_bytes

# pypdf reports malformed files with its own errors but also with assorted built-in ones.
_PYPDF_FAILURES = (PyPdfError, ValueError, KeyError, IndexError, TypeError, AttributeError,
                   RecursionError, OverflowError, UnicodeError, zlib.error, struct.error)
_MIN_PAGE_CHARS = 20  # fewer visible characters than this: the page has no real text layer
_IMAGE_PROBE_PAGES = 20  # pages inspected for images when telling scanned from empty
_EOF_TAIL_BYTES = 8192  # %%EOF must sit this close to the end (some writers append padding)
_OutlineEntry = tuple[str, int, int]  # title, page index, depth (0 = chapter, 1 = section)
_MAX_SPACE_EM = 0.6  # no text font's space is wider than a monospace one (0.6 em); wider is misread
_MIN_RUN_TOGETHER = 10  # run-together words before the user is warned (a few are URLs or names)


_PypdfFont = getattr(_pypdf_page.Font, "pypdf_font", _pypdf_page.Font)  # pypdf's own, even on a reload


class _PlausibleSpaceFont(_PypdfFont):  # type: ignore[misc, valid-type]
    """pypdf's Font, but a space width over 0.6 em is replaced by half the font's default width.

    pypdf inserts a space for a TJ gap wider than half the font's space. For Identity-H fonts it
    reads the width of CID 32, often an em-wide glyph (Debian's debian-faq.en.pdf: 1000 units),
    so word gaps of 0.27 em were dropped and whole lines came out as one word.
    """

    pypdf_font = _PypdfFont

    @classmethod
    def from_font_resource(cls, pdf_font_dict: Any) -> Any:
        font = _PypdfFont.from_font_resource(pdf_font_dict)
        if font.space_width > 1000 * _MAX_SPACE_EM:
            font.space_width = font.character_widths.get("default", 500) // 2
        return font


_pypdf_page.Font = _PlausibleSpaceFont  # page text extraction builds its fonts through this name


def load_pdf(path: str, password: str | None, limits: Limits, progress: Progress) -> Document:
    """Read a PDF into a Document whose sections are its pages plus its outline entries."""
    _check_complete(path)
    with apply_configuration(get_configuration().with_overwrites(**_pypdf_limits(limits))):
        reader = _open(path, password)
        n_pages = _guard(lambda: len(reader.pages), "its page tree cannot be read")
        check_pages(n_pages, limits)
        raw_pages = _extract_pages(reader, n_pages, limits, progress)
        _check_text_layer(reader, raw_pages)
        progress("clean", 0, 1)
        labels = _page_labels(reader, n_pages)
        pages = join_hyphenated(drop_running_lines([pdf_page_lines(raw) for raw in raw_pages], labels))
        document = _assemble(pages, labels, _outline(reader), _title(reader, path), limits)
        progress("clean", 1, 1)
    return _with_spacing_note(document)


def _with_spacing_note(document: Document) -> Document:
    """Warn when many words ran together: the model would read them as garbage."""
    words = run_together_words(document.text)
    if len(words) < _MIN_RUN_TOGETHER:
        return document
    note = (f"{len(words)} words in this PDF ran together without spaces (for example "
            f"'{words[0][:40]}'), so answers about those passages may be poor. If another copy of the "
            "book exists (EPUB, HTML, or a PDF from another tool), load that instead.")
    return replace(document, notes=(*document.notes, note))


def _pypdf_limits(limits: Limits) -> dict[str, int]:
    n_bytes = limits.max_pdf_stream_bytes
    names = ("maximum_declared_stream_length", "array_based_stream_maximum_output_length",
             "jbig2_maximum_output_length", "lzw_maximum_output_length", "run_length_maximum_output_length",
             "zlib_maximum_output_length", "brotli_maximum_output_length", "image_maximum_buffer_size")
    return {name: n_bytes for name in names}


def _check_complete(path: str) -> None:
    with open(path, "rb") as file:
        file.seek(max(0, os.path.getsize(path) - _EOF_TAIL_BYTES))
        tail = file.read()
    if b"%%EOF" not in tail:
        raise CorruptDocument("This PDF is incomplete: it does not end with %%EOF, so it was probably "
                              "cut off while downloading or copying. Get a complete copy.")


def _open(path: str, password: str | None) -> PdfReader:
    try:
        reader = PdfReader(path, strict=False)  # tries the empty password by itself
        if reader.is_encrypted and reader.decrypt(password or "") == PasswordType.NOT_DECRYPTED:
            if password is None:
                raise PasswordRequired("This PDF is protected by a password. Enter the password to open it.")
            raise WrongPassword("That password does not open this PDF. Check it and try again.")
    except DependencyError as error:
        raise UnsupportedFormat("This PDF is encrypted with AES, which needs the Python package "
                                "'cryptography' (pip install cryptography). Or remove the password "
                                "first: qpdf --decrypt --password=PASSWORD in.pdf out.pdf") from error
    except LimitReachedError as error:
        raise TooLarge(f"This PDF's structure is too large to read safely ({error}).") from error
    except _PYPDF_FAILURES as error:
        raise CorruptDocument(f"This PDF is damaged and cannot be read ({error}). "
                              "Re-save it from a PDF viewer, or get another copy.") from error
    return reader


def _guard(read: Callable[[], Any], what: str) -> Any:
    try:
        return read()
    except LimitReachedError as error:
        raise TooLarge(f"This PDF is too large to read safely: {what} ({error}).") from error
    except _PYPDF_FAILURES as error:
        raise CorruptDocument(f"This PDF is damaged: {what} ({error}). "
                              "Re-save it from a PDF viewer, or get another copy.") from error


def _extract_pages(reader: PdfReader, n_pages: int, limits: Limits, progress: Progress) -> list[str]:
    texts: list[str] = []
    n_chars = 0
    for page_idx in range(n_pages):
        progress("extract", page_idx, n_pages)
        try:
            text = reader.pages[page_idx].extract_text()
        except LimitReachedError as error:
            raise TooLarge(f"Page {page_idx + 1} of this PDF holds data that would decode to more than "
                           f"{human_bytes(limits.max_pdf_stream_bytes)} ({error}). That is not a normal "
                           "text page; the file is probably malicious or broken.") from error
        except _PYPDF_FAILURES as error:
            raise CorruptDocument(f"Page {page_idx + 1} of this PDF is damaged and cannot be read "
                                  f"({error}). Re-save it from a PDF viewer, or get another copy.") from error
        n_chars += len(text)
        check_chars(n_chars, limits)
        texts.append(text)
    progress("extract", n_pages, n_pages)
    return texts


def _check_text_layer(reader: PdfReader, raw_pages: list[str]) -> None:
    n_pages = len(raw_pages)
    n_textless = sum(1 for text in raw_pages if len("".join(text.split())) < _MIN_PAGE_CHARS)
    if n_pages - n_textless > n_pages // 10:
        return  # mostly text; a few image-only plates are fine
    if any(_has_image(reader.pages[idx]) for idx in range(min(n_pages, _IMAGE_PROBE_PAGES))):
        raise ScannedPdf(f"This PDF seems to be scanned images without a text layer (no text on "
                         f"{n_textless} of its {n_pages} pages). Run OCR on it first (for example "
                         "`ocrmypdf in.pdf out.pdf`) and load the result.")
    if n_textless == n_pages:
        raise EmptyDocument("This PDF contains no text: its pages are blank, or the file is damaged. If a PDF "
                            "viewer shows text, re-save it from there (or print it to a new PDF) and load that.")


def _has_image(node: PageObject | Any, depth: int = 0) -> bool:
    try:
        resources = _resolve(node.get("/Resources")) or {}
        for xobject in (_resolve(resources.get("/XObject")) or {}).values():
            xobject = xobject.get_object()
            if xobject.get("/Subtype") == "/Image":
                return True
            if xobject.get("/Subtype") == "/Form" and depth < 2 and _has_image(xobject, depth + 1):
                return True
    except LimitReachedError:
        return True  # a stream too large to even look at is an image, not text
    except _PYPDF_FAILURES:
        return False
    return False


def _resolve(obj: Any) -> Any:
    return obj.get_object() if obj is not None else None


def _page_labels(reader: PdfReader, n_pages: int) -> list[str]:
    try:
        labels = [str(label) for label in reader.page_labels]
    except _PYPDF_FAILURES:
        labels = []
    return labels if len(labels) == n_pages else [str(idx + 1) for idx in range(n_pages)]


def _outline(reader: PdfReader) -> list[_OutlineEntry]:
    entries: list[_OutlineEntry] = []
    try:
        _walk_outline(reader, reader.outline, 0, entries)
    except _PYPDF_FAILURES:
        return []  # a broken outline costs chapter names, not the book
    return entries


def _walk_outline(reader: PdfReader, nodes: list[Any], depth: int, entries: list[_OutlineEntry]) -> None:
    for node in nodes:
        if isinstance(node, list):  # children of the entry before
            if depth < 1:
                _walk_outline(reader, node, depth + 1, entries)
            continue
        page_idx = reader.get_destination_page_number(node)
        if page_idx is not None and page_idx >= 0 and str(node.title).strip():
            entries.append((str(node.title), page_idx, depth))


def _title(reader: PdfReader, path: str) -> str:
    try:
        title = (reader.metadata.title if reader.metadata else None) or ""
    except _PYPDF_FAILURES:
        title = ""
    return str(title).strip() or os.path.splitext(os.path.basename(path))[0]


def _assemble(pages: list[list[str]], labels: list[str], outline: list[_OutlineEntry], title: str,
              limits: Limits) -> Document:
    by_page: dict[int, list[tuple[str, int]]] = {}
    for entry_title, page_idx, depth in outline:
        by_page.setdefault(page_idx, []).append((entry_title, depth))
    builder = DocumentBuilder(limits)
    for page_idx, lines in enumerate(pages):
        text = tidy_blank_lines("\n".join(lines))
        builder.mark(labels[page_idx], "page")
        for entry_title, depth in by_page.get(page_idx, []):
            builder.mark(entry_title, "chapter" if depth == 0 else "section", _heading_offset(text, entry_title))
        builder.add(text)
    return builder.build(title, "pdf")


def _heading_offset(page_text: str, title: str) -> int:
    """Where an outline title starts on its page ('1 Introduction' for 'Introduction'), else 0."""
    words = unicodedata.normalize("NFKC", title).split()
    if not words:
        return 0
    pattern = r"(?im)^(?:[\w.]+\s+)?" + r"\s+".join(re.escape(word) for word in words)
    found = re.search(pattern, page_text)
    return found.start() if found else 0
