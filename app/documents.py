"""File -> Document: the one entry point the app uses to ingest a book.

`load_document` checks the file (size, empty, real format by magic bytes), dispatches to the
reader for its format (`app/formats/`), and returns a `Document`: cleaned text plus sections
(pages, chapters, headings) that map character offsets back to "p. 12" or "Chapter 3".
Everything a file can do wrong is a `DocumentError` subclass with a message a person can act on.
Tokenising and fitting into the model's context are not done here (see app/session.py).
"""

from __future__ import annotations

import os

from app.formats.document import Document, Section, SectionKind
from app.formats.errors import (
    CorruptDocument,
    DocumentError,
    DrmProtected,
    EmptyDocument,
    PasswordRequired,
    ScannedPdf,
    TooLarge,
    UnsupportedFormat,
    WrongPassword,
)
from app.formats.limits import Limits, Progress, check_file_size, no_progress
from app.formats.sniff import sniff_format

__all__ = ["CorruptDocument", "Document", "DocumentError", "DrmProtected", "EmptyDocument", "Limits",
           "PasswordRequired", "Progress", "ScannedPdf", "Section", "SectionKind", "TooLarge",
           "UnsupportedFormat", "WrongPassword", "chapters", "load_document"]

_SNIFF_BYTES = 8192
DEFAULT_LIMITS = Limits()


def load_document(path: str | os.PathLike[str], password: str | None = None, limits: Limits = DEFAULT_LIMITS,
                  progress: Progress = no_progress) -> Document:
    """Read a PDF, EPUB, TXT, Markdown, HTML or DOCX file into a Document.

    `password` opens an encrypted PDF. `progress(stage, done, total)` is called between pages /
    chapters and may raise to cancel. Raises a DocumentError subclass for any bad file.
    """
    path = os.fspath(path)
    n_bytes = os.path.getsize(path)
    if n_bytes == 0:
        raise EmptyDocument("The file is empty (0 bytes). Choose the book file itself, not a placeholder.")
    check_file_size(n_bytes, limits)
    with open(path, "rb") as file:
        head = file.read(_SNIFF_BYTES)
    kind = sniff_format(path, head)
    document = _read(kind, path, password, limits, progress)
    if not document.text.strip():
        raise EmptyDocument(f"This {_FORMAT_NAMES[kind]} file contains no text.")
    return document


def chapters(document: Document) -> list[Section]:
    """The chapters a user can pick from when the whole book is too long; [] when none are known.

    Falls back to top-level headings ('section') for documents without chapter-level structure.
    Use `document.span(section)` for each chapter's character range.
    """
    return document.of_kind("chapter") or document.of_kind("section")


_FORMAT_NAMES = {"pdf": "PDF", "epub": "EPUB", "docx": "DOCX", "txt": "text", "markdown": "Markdown",
                 "html": "HTML"}


def _read(kind: str, path: str, password: str | None, limits: Limits, progress: Progress) -> Document:
    # Readers are imported on use: importing pypdf takes a noticeable time and most books are not PDFs.
    if kind == "pdf":
        from app.formats.pdf import load_pdf
        return load_pdf(path, password, limits, progress)
    if kind == "epub":
        from app.formats.epub import load_epub
        return load_epub(path, limits, progress)
    progress("extract", 0, 1)  # one step: these formats read in well under a second
    document = _read_single(kind, path, limits)
    progress("extract", 1, 1)
    return document


def _read_single(kind: str, path: str, limits: Limits) -> Document:
    if kind == "docx":
        from app.formats.docx import load_docx
        return load_docx(path, limits)
    if kind == "html":
        from app.formats.markup import load_html
        return load_html(path, limits)
    from app.formats.plain import load_text
    return load_text(path, kind, limits)
