"""Which format a file really is, from its bytes first and its name second.

Magic bytes win over the extension: a PDF renamed .txt is read as a PDF, and a PNG renamed .txt
is refused with a message that names what it is. Extensions only decide among text formats
(TXT, Markdown, HTML), which have no magic. Zip archives are told apart by their member names.
"""

from __future__ import annotations

import os
import zipfile
import zlib

from app.formats.errors import SUPPORTED, CorruptDocument, UnsupportedFormat

_TEXT_EXTENSIONS = {"": "txt", ".txt": "txt", ".text": "txt", ".md": "markdown",
                    ".markdown": "markdown", ".html": "html", ".htm": "html", ".xhtml": "html"}

# Binary formats we recognise only to name them in the refusal: (magic, what it is, what to do).
_FOREIGN_MAGIC: list[tuple[bytes, str, str]] = [
    (b"\x89PNG\r\n\x1a\n", "a PNG image", ""), (b"\xff\xd8\xff", "a JPEG image", ""),
    (b"GIF8", "a GIF image", ""), (b"II*\x00", "a TIFF image", ""), (b"MM\x00*", "a TIFF image", ""),
    (b"\x1f\x8b", "a gzip archive", "Unpack it first. "),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "Unpack it first. "),
    (b"Rar!", "a RAR archive", "Unpack it first. "), (b"\x7fELF", "a program (ELF)", ""),
    (b"MZ", "a Windows program", ""), (b"AT&TFORM", "a DjVu file", "Convert it to PDF. "),
    (b"{\\rtf", "an RTF file", "Save it as DOCX or PDF. "), (b"%!PS", "a PostScript file", "Convert it to PDF. "),
    (b"SQLite format 3", "a database", ""),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old Word .doc or a password-protected Office file",
     "Save it from Word or LibreOffice as .docx, without a password. "),
]


def sniff_format(path: str, head: bytes) -> str:
    """'pdf' | 'epub' | 'docx' | 'txt' | 'markdown' | 'html' for a file starting with `head`.

    `head` is the first few KB. Raises UnsupportedFormat for anything else.
    """
    extension = os.path.splitext(path)[1].lower()
    # The PDF header may follow up to 1 KB of junk; then only trust it in a file named .pdf.
    if head.startswith(b"%PDF-") or (b"%PDF-" in head[:1024] and extension == ".pdf"):
        return "pdf"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return _zip_kind(path)
    if head[60:68] == b"BOOKMOBI":
        raise UnsupportedFormat(f"This is a Kindle/MOBI e-book, which we cannot read. Convert it to "
                                f"EPUB (for example with Calibre). We read {SUPPORTED}.")
    for magic, what, advice in _FOREIGN_MAGIC:
        if head.startswith(magic):
            raise UnsupportedFormat(f"This file is {what}, not a document we can read. {advice}"
                                    f"We read {SUPPORTED}.")
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").lower().startswith((b"<!doctype html", b"<html")):
        return "html"
    return _text_kind(extension)


def _zip_kind(path: str) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            mimetype = b""
            if "mimetype" in names:
                with archive.open("mimetype") as member:  # read 64 bytes: its size may be a lie
                    mimetype = member.read(64)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError) as error:
        what = {".epub": "EPUB", ".docx": "DOCX"}.get(os.path.splitext(path)[1].lower(), "zip-based file")
        raise CorruptDocument(f"This {what} is damaged or incomplete ({error}). "
                              "Download or export it again.") from error
    if mimetype.strip() == b"application/epub+zip" or "META-INF/container.xml" in names:
        return "epub"
    if "word/document.xml" in names:
        return "docx"
    raise UnsupportedFormat(f"This is a zip archive that is neither an EPUB nor a DOCX. "
                            f"We read {SUPPORTED}.")


def _text_kind(extension: str) -> str:
    if extension not in _TEXT_EXTENSIONS:
        raise UnsupportedFormat(f"Files ending in '{extension}' are not supported. We read {SUPPORTED}.")
    return _TEXT_EXTENSIONS[extension]
