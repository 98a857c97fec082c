"""Typed errors for everything a file can do wrong, each with a message a person can act on.

The UI shows `str(error)` as is and keeps the previous book; callers branch on the class
(`PasswordRequired` -> ask for a password). Programmer errors stay plain exceptions/asserts.
"""

from __future__ import annotations

SUPPORTED = "PDF, EPUB, TXT, Markdown, HTML or DOCX"


class DocumentError(Exception):
    """A file that cannot become a Document; the message says why and what to do."""


class ScannedPdf(DocumentError):
    """A PDF whose pages are images without a text layer."""


class PasswordRequired(DocumentError):
    """An encrypted PDF and no password given: ask the user for one."""


class WrongPassword(DocumentError):
    """An encrypted PDF and the given password does not open it."""


class DrmProtected(DocumentError):
    """An EPUB whose content files are encrypted (META-INF/encryption.xml)."""


class EmptyDocument(DocumentError):
    """A 0-byte file, or a document without any text."""


class UnsupportedFormat(DocumentError):
    """Not one of the formats we read (binary data, unknown extension, old .doc...)."""


class CorruptDocument(DocumentError):
    """A truncated or malformed PDF, EPUB or DOCX."""


class TooLarge(DocumentError):
    """Over a `Limits` bound: file size, pages, characters, or a zip that unpacks too far."""
