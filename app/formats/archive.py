"""Zip containers (EPUB, DOCX) opened so that a zip bomb cannot exhaust memory or disk.

The central directory's sizes are checked against `Limits` before anything is unpacked, and
members are read in small chunks up to their declared size, so the check bounds every read
(and its memory) even when a header lies. Overlapping-entry bombs declare far more than the
file holds and fail the ratio check.
"""

from __future__ import annotations

import os
import zipfile
import zlib

from app.formats.errors import CorruptDocument, TooLarge
from app.formats.limits import MB, Limits, human_bytes

_MIN_RATIO_CHECK_BYTES = 1 * MB  # tiny archives may compress well without being bombs
_READ_CHUNK_BYTES = 1 * MB  # inflated per read: bounds memory whatever a member's header claims
_ZIP_FAILURES = (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError,
                 RuntimeError)  # RuntimeError: a member encrypted with a zip password


def open_archive(path: str, what: str, limits: Limits) -> zipfile.ZipFile:
    """Open the zip at `path` (`what`: 'EPUB'/'DOCX', for messages) after the bomb checks."""
    try:
        archive = zipfile.ZipFile(path)
    except _ZIP_FAILURES as error:
        raise CorruptDocument(f"This {what} is damaged or incomplete ({error}). "
                              "Download or export it again.") from error
    try:
        _check_unpacked_size(archive, os.path.getsize(path), what, limits)
    except TooLarge:
        archive.close()
        raise
    return archive


def read_member(archive: zipfile.ZipFile, name: str, what: str) -> bytes:
    """The bytes of one member; a missing or damaged member is a CorruptDocument.

    Read in bounded chunks: `ZipFile.read` inflates up to 2 GB in one call before cutting to the
    declared size, so a member that lies about its size would spike memory by gigabytes.
    """
    try:
        with archive.open(name) as member:
            return b"".join(iter(lambda: member.read(_READ_CHUNK_BYTES), b""))
    except KeyError as error:
        raise CorruptDocument(f"This {what} is malformed: it has no '{name}'. "
                              "Export it again from the program that made it.") from error
    except _ZIP_FAILURES as error:
        raise CorruptDocument(f"This {what} is damaged: '{name}' cannot be unpacked ({error}). "
                              "Download or export it again.") from error


def has_member(archive: zipfile.ZipFile, name: str) -> bool:
    """Whether the zip holds a member called `name`."""
    try:
        archive.getinfo(name)
    except KeyError:
        return False
    return True


def _check_unpacked_size(archive: zipfile.ZipFile, n_file_bytes: int, what: str, limits: Limits) -> None:
    n_unpacked = sum(info.file_size for info in archive.infolist())
    if n_unpacked > limits.max_zip_uncompressed_bytes:
        raise TooLarge(f"This {what} would unpack to {human_bytes(n_unpacked)}; the limit is "
                       f"{human_bytes(limits.max_zip_uncompressed_bytes)}. It looks like a zip bomb, "
                       "not a book.")
    ratio = n_unpacked / max(1, n_file_bytes)
    if n_unpacked > _MIN_RATIO_CHECK_BYTES and ratio > limits.max_zip_ratio:
        raise TooLarge(f"This {what} would unpack to {ratio:,.0f} times its size "
                       f"({human_bytes(n_unpacked)}); real books stay under "
                       f"{limits.max_zip_ratio:,.0f} times. It looks like a zip bomb, not a book.")
