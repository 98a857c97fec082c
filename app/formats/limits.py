"""Resource bounds for ingestion and the checks that enforce them.

A document may be hostile (zip bombs, PDF streams that decode to gigabytes) or merely huge; every
reader checks these bounds before the expensive step, so nothing hangs or eats memory. Limits
are a frozen dataclass handed down by argument; the app maps its flags onto the fields 1:1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from app.formats.errors import TooLarge

MB = 1024 * 1024
GB = 1024 * MB

# progress(stage, done, total): called before each unit of work (a page, a spine item). It may
# raise (e.g. the app's Cancelled) to stop ingestion; the exception propagates unchanged.
Progress = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    """The default progress callback: ignores everything, never cancels."""


@dataclass(frozen=True)
class Limits:
    """Upper bounds for one document. Defaults fit any real book and stop runaway files."""

    max_file_bytes: int = 200 * MB  # large illustrated PDFs reach ~100 MB; text books are far smaller
    max_pages: int = 5000  # the longest printed books have ~3000 pages
    max_chars: int = 20_000_000  # ~5 M tokens: far past any context window, stops runaway extraction
    max_zip_uncompressed_bytes: int = 1 * GB  # EPUB/DOCX unpacked; real ones stay under ~100 MB
    max_zip_ratio: float = 100.0  # XHTML/XML compress 3-20x; zip bombs 1000x
    max_pdf_stream_bytes: int = 64 * MB  # one decoded PDF stream; a text page needs < 1 MB

    def __post_init__(self) -> None:
        for field in fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"Limits.{field.name} must be positive, got {getattr(self, field.name)}")


def human_bytes(n_bytes: float) -> str:
    """1536 -> '1.5 KB': sizes in messages people read."""
    for unit in ("bytes", "KB", "MB", "GB"):
        if n_bytes < 1024 or unit == "GB":
            return f"{n_bytes:.0f} {unit}" if unit == "bytes" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def check_file_size(n_bytes: int, limits: Limits) -> None:
    """Refuse a file over `max_file_bytes` before reading it."""
    if n_bytes > limits.max_file_bytes:
        raise TooLarge(f"The file is {human_bytes(n_bytes)}; the limit is "
                       f"{human_bytes(limits.max_file_bytes)}. Split it, or raise the file-size limit.")


def check_pages(n_pages: int, limits: Limits) -> None:
    """Refuse a document with more pages than `max_pages` before extracting any."""
    if n_pages > limits.max_pages:
        raise TooLarge(f"The document has {n_pages:,} pages; the limit is {limits.max_pages:,}. "
                       "Split it, or raise the page limit.")


def check_chars(n_chars: int, limits: Limits) -> None:
    """Refuse extracted text longer than `max_chars` (called as extraction goes, to stop early)."""
    if n_chars > limits.max_chars:
        raise TooLarge(f"The text of this document is longer than the limit of {limits.max_chars:,} "
                       "characters. Load a part of it (some chapters), or raise the character limit.")
