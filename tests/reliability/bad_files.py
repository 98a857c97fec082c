"""Builders of the hostile and broken files the reliability suite feeds the app, each made here
from nothing (no downloads): text and image-only PDFs, a PDF whose content stream inflates to a
gigabyte, encrypted PDFs, EPUBs with DRM or a broken structure, zip bombs named .epub/.docx.
The small zip/EPUB/DOCX writers are shared with tests/app/test_documents.py."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

from tests.app.test_documents import (
    CONTAINER,
    build_docx,
    build_epub,
    deflate_repeating,
    encryption_xml,
    one_page_pdf,
    opf,
    raw_zip,
    rewrite_zip,
)

__all__ = ["CONTAINER", "build_docx", "build_epub", "encryption_xml", "opf", "raw_zip", "rewrite_zip"]

SENTENCE = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who never took up any book. "


def _pdf(page_objects: list[tuple[bytes, bytes]], extra: list[bytes]) -> bytes:
    """A PDF with one page per (content stream, resources) and `extra` objects numbered after them."""
    n_pages = len(page_objects)
    kids = b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(n_pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, n_pages)]
    for i, (content, resources) in enumerate(page_objects):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R /Resources %s >>"
                       % (4 + 2 * i, resources))
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
    objects += extra
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def text_pdf(pages: list[str]) -> bytes:
    """A PDF whose pages show these texts in Helvetica, one line per 80 characters."""
    font_number = 3 + 2 * len(pages)
    resources = b"<< /Font << /F1 %d 0 R >> >>" % font_number
    streams = []
    for text in pages:
        lines = [text[i:i + 80] for i in range(0, len(text), 80)] or [""]
        shown = b" T* ".join(b"(%s) Tj" % line.replace("\\", "").replace("(", "").replace(")", "").encode("latin-1")
                             for line in lines)
        streams.append((b"BT /F1 10 Tf 14 TL 40 750 Td " + shown + b" ET", resources))
    return _pdf(streams, [b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"])


def scanned_pdf(n_pages: int = 2) -> bytes:
    """Pages that only draw an 8x8 grey image: what a scanner without OCR produces."""
    image_number = 3 + 2 * n_pages
    resources = b"<< /XObject << /Im1 %d 0 R >> >>" % image_number
    pixels = bytes(range(0, 256, 4))
    image = (b"<< /Type /XObject /Subtype /Image /Width 8 /Height 8 /ColorSpace /DeviceGray "
             b"/BitsPerComponent 8 /Length %d >>\nstream\n%s\nendstream" % (len(pixels), pixels))
    return _pdf([(b"q 612 0 0 792 0 0 cm /Im1 Do Q", resources)] * n_pages, [image])


def encrypted_pdf(password: str) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf([SENTENCE * 3]))))
    writer.encrypt(user_password=password, owner_password="owner-" + password, algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def inflating_pdf(n_gib: int = 1) -> bytes:
    """One page whose FlateDecode content stream is ~1 MB on disk and `n_gib` GiB of spaces inflated."""
    chunk, n_chunks = b" " * (1 << 20), 1024 * n_gib
    adler = 1
    for _ in range(n_chunks):
        adler = zlib.adler32(chunk, adler)
    return one_page_pdf(b"\x78\xda" + deflate_repeating(chunk, n_chunks) + struct.pack(">I", adler))


def minimal_epub(path: Path, drm: bool = False) -> None:
    """A two-chapter EPUB 3; with `drm`, chapter two is 'encrypted' (META-INF/encryption.xml)."""
    body = [("one.xhtml", f"<h1>One</h1><p>{SENTENCE * 4}</p>"), ("two.xhtml", f"<h1>Two</h1><p>{SENTENCE}</p>")]
    build_epub(path, body, nav=True, ncx=False)
    if drm:
        plain = path.with_suffix(".plain.epub")
        path.rename(plain)
        rewrite_zip(plain, path, replace={"two.xhtml": bytes(range(256)) * 8},
                    add={"META-INF/encryption.xml": encryption_xml("http://www.w3.org/2001/04/xmlenc#aes128-cbc",
                                                                   "two.xhtml")})
        plain.unlink()


def zip_bomb(kind: str, lying: bool = False) -> bytes:
    """An EPUB/DOCX of 1.5 MB whose one member inflates to 1.5 GiB. `lying`: its headers declare
    64 KB instead, so a reader that trusts them to bound its memory is fooled."""
    bomb = deflate_repeating(bytes(1 << 20), 1536)
    declared = (64 << 10) if lying else (1536 << 20)
    if kind == "epub":
        return raw_zip([("mimetype", b"application/epub+zip", None), ("META-INF/container.xml", CONTAINER, None),
                        ("content.opf", opf([("ch1.xhtml", "ch1")]), None), ("ch1.xhtml", bomb, declared)])
    return raw_zip([("[Content_Types].xml", b"<Types/>", None), ("word/document.xml", bomb, declared)])
