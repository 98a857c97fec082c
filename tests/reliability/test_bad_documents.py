"""Every bad document of issue 5, built here: the API raises a typed error whose message says what
to do, the UI shows that message, and the book and chat that were open stay open, unchanged, and
still answer. Nothing hangs (each load is timed) and a zip that lies about its size cannot spike
memory. Limits are small here (2 MB, 20 pages, 600,000 characters) so the files stay small.
"""

from __future__ import annotations

import random
import re
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from app.documents import (
    CorruptDocument,
    DrmProtected,
    EmptyDocument,
    Limits,
    PasswordRequired,
    ScannedPdf,
    TooLarge,
    UnsupportedFormat,
    WrongPassword,
    load_document,
)
from tests.reliability import bad_files
from tests.reliability.conftest import (
    LEVELS,
    book_text,
    last,
    make_app,
    open_with_chat,
    request,
    run,
    write_book,
)

MB = 1024 * 1024
LIMITS = Limits(max_file_bytes=2 * MB, max_pages=20, max_chars=600_000)
LOAD_SECONDS = 20  # "nothing hangs": every bad file is refused well within this


def _damaged_middle(path: Path) -> None:
    data = bytearray(bad_files.text_pdf([bad_files.SENTENCE * 8] * 6))
    data[200:-300] = random.Random(0).randbytes(len(data) - 500)  # objects and page tree overwritten
    path.write_bytes(data)


def _epub_without(member: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        good = path.with_name("good.epub")
        bad_files.minimal_epub(good)
        bad_files.rewrite_zip(good, path, drop=member if member.startswith("META") else None,
                              replace={} if member.startswith("META") else {member: b"<package><manifest>"})
    return build


def _write(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


# (id, file name, builder, password, error, message the user gets: a regex on str(error))
CASES = [
    ("truncated-pdf", "book.pdf", lambda p: p.write_bytes(bad_files.text_pdf([bad_files.SENTENCE * 8] * 6)[:2500]),
     None, CorruptDocument, r"This PDF is incomplete: it does not end with %%EOF, so it was probably cut off"),
    ("corrupt-pdf", "book.pdf", _write(b"%PDF-1.4\n" + random.Random(2).randbytes(3000) + b"\n%%EOF\n"),
     None, CorruptDocument, r"This PDF is damaged and cannot be read \(.*\)\. Re-save it from a PDF viewer"),
    ("damaged-pdf", "book.pdf", _damaged_middle, None, EmptyDocument,
     r"This PDF contains no text: its pages are blank, or the file is damaged\. If a PDF viewer shows text"),
    ("password-pdf", "locked.pdf", _write(bad_files.encrypted_pdf("open sesame")), None, PasswordRequired,
     r"This PDF is protected by a password\. Enter the password to open it\."),
    ("wrong-password", "locked.pdf", _write(bad_files.encrypted_pdf("open sesame")), "sesame", WrongPassword,
     r"That password does not open this PDF\. Check it and try again\."),
    ("scanned-pdf", "scan.pdf", _write(bad_files.scanned_pdf(3)), None, ScannedPdf,
     r"This PDF seems to be scanned images without a text layer \(no text on 3 of its 3 pages\)\. Run OCR"),
    ("pdf-stream-of-a-gigabyte", "bomb.pdf", _write(bad_files.inflating_pdf(1)), None, TooLarge,
     r"Page 1 of this PDF holds data that would decode to more than 64\.0 MB .*probably malicious or broken"),
    ("pdf-over-page-limit", "long.pdf", _write(bad_files.text_pdf(["Page. " + bad_files.SENTENCE] * 30)), None,
     TooLarge, r"The document has 30 pages; the limit is 20\. Split it, or raise the page limit\."),
    ("drm-epub", "drm.epub", lambda p: bad_files.minimal_epub(p, drm=True), None, DrmProtected,
     r"This EPUB is protected by DRM: 1 of its files is encrypted \(META-INF/encryption\.xml\)"),
    ("epub-without-container", "bad.epub", _epub_without("META-INF/container.xml"), None, CorruptDocument,
     r"This EPUB is malformed: it has no 'META-INF/container\.xml'\. Export it again"),
    ("epub-with-broken-opf", "bad.epub", _epub_without("content.opf"), None, CorruptDocument,
     r"This EPUB is malformed: content\.opf is not valid XML"),
    ("zip-bomb-epub", "bomb.epub", _write(bad_files.zip_bomb("epub")), None, TooLarge,
     r"This EPUB would unpack to 1\.5 GB; the limit is 1\.0 GB\. It looks like a zip bomb"),
    ("zip-bomb-docx", "bomb.docx", _write(bad_files.zip_bomb("docx")), None, TooLarge,
     r"This DOCX would unpack to 1\.5 GB; the limit is 1\.0 GB\. It looks like a zip bomb"),
    ("lying-zip-bomb-epub", "bomb.epub", _write(bad_files.zip_bomb("epub", lying=True)), None, CorruptDocument,
     r"This EPUB is damaged: 'ch1\.xhtml' cannot be unpacked \(Bad CRC-32"),
    ("lying-zip-bomb-docx", "bomb.docx", _write(bad_files.zip_bomb("docx", lying=True)), None, CorruptDocument,
     r"This DOCX is damaged: 'word/document\.xml' cannot be unpacked \(Bad CRC-32"),
    ("binary-named-txt", "chapter.txt", _write(random.Random(1).randbytes(4096)), None, UnsupportedFormat,
     r"'chapter\.txt' holds binary data, not text, whatever its name says"),
    ("png-named-txt", "chapter.txt", _write(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4), None, UnsupportedFormat,
     r"This file is a PNG image, not a document we can read"),
    ("zero-bytes", "empty.txt", _write(b""), None, EmptyDocument,
     r"The file is empty \(0 bytes\)\. Choose the book file itself"),
    ("only-whitespace", "blank.md", _write(b"\r\n \t\n\n"), None, EmptyDocument,
     r"This Markdown file contains no text"),
    ("over-size-limit", "huge.txt", _write(b"All work and no play. " * (3 * MB // 22)), None, TooLarge,
     r"The file is 3\.0 MB; the limit is 2\.0 MB\. Split it, or raise the file-size limit\."),
    ("over-character-limit", "long.txt", lambda p: p.write_text(book_text(470_000) * 2, encoding="utf-8"), None,
     TooLarge, r"longer than the limit of 600,000 characters\. Load a part of it"),
]
IDS = [case[0] for case in CASES]


@pytest.fixture(scope="module")
def app(engine, tmp_path_factory):
    return make_app(engine, tmp_path_factory.mktemp("library"), limits=LIMITS)


@pytest.fixture(scope="module")
def reader(app, tmp_path_factory):
    """A user with a book open and one answered question."""
    return open_with_chat(app, tmp_path_factory.mktemp("books"))


@pytest.mark.parametrize(("name", "builder", "password", "error", "message"), [c[1:] for c in CASES], ids=IDS)
def test_bad_file_raises_a_typed_error_with_a_message(tmp_path, name, builder, password, error, message):
    builder(tmp_path / name)
    started = time.monotonic()
    with pytest.raises(error, match=message):
        load_document(tmp_path / name, password, LIMITS)
    assert time.monotonic() - started < LOAD_SECONDS


@pytest.mark.parametrize(("name", "builder", "password", "error", "message"), [c[1:] for c in CASES], ids=IDS)
def test_bad_file_shows_its_message_and_the_open_book_and_chat_survive(app, reader, engine, tmp_path, name,
                                                                      builder, password, error, message):
    req, book = reader
    before = (app.export("md", req), list(book.turns), book.session.length, engine.n_prefills, app.library.books())
    builder(tmp_path / name)
    started = time.monotonic()
    updates = run(app.load_book(str(tmp_path / name), "", req))
    if password is not None:  # the password prompt first, then the wrong password typed into it
        assert "protected by a password" in last(app, updates, "status")
        updates = run(app.unlock(password, req))
    assert time.monotonic() - started < LOAD_SECONDS
    status = last(app, updates, "status")
    assert re.search(message, status), status
    assert status.endswith("*Persuasion* is still open.") or status.endswith("*persuasion* is still open."), status
    is_password = error in (PasswordRequired, WrongPassword)
    assert last(app, updates, "password_row")["visible"] is is_password  # the password box only when it helps
    assert app.users["reader"].book is book
    after = (app.export("md", req), list(book.turns), book.session.length, engine.n_prefills, app.library.books())
    assert after == before


def test_the_book_still_answers_after_every_bad_file(app, reader):
    req, book = reader
    metrics = last(app, run(app.ask("Where is Kellynch Hall?", [], 0.0, 1.0, 6, 0, LEVELS, req)), "metrics")
    assert "done" in metrics and len(book.turns) == 2 and not book.session.lock.locked()


def test_the_right_password_opens_the_locked_pdf(app, tmp_path):
    req, path = request("locked-reader"), tmp_path / "locked.pdf"
    path.write_bytes(bad_files.encrypted_pdf("open sesame"))
    run(app.load_book(str(path), "", req))
    status = last(app, run(app.unlock("open sesame", req)), "status")
    assert "Ready: ask a question." in status, status
    assert "Kellynch Hall" in app.users["locked-reader"].book.document.text


@pytest.mark.parametrize("kind", ["epub", "docx"])
def test_a_zip_lying_about_its_size_is_refused_without_inflating_it(tmp_path, kind):
    path = tmp_path / f"bomb.{kind}"
    path.write_bytes(bad_files.zip_bomb(kind, lying=True))  # 1.5 GiB behind a header that says 64 KB
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDocument):
            load_document(path, limits=LIMITS)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 64 * MB, f"reading the bomb allocated {peak_bytes / MB:.0f} MB"


def test_a_book_far_beyond_the_context_is_not_prefilled_and_the_user_chooses(app, reader, engine, tmp_path):
    from app.session import open_book, prepare
    from engine.config import DocumentTooLong

    req, book = reader
    path = tmp_path / "persuasion-whole.txt"
    path.write_text(book_text(470_000), encoding="utf-8")  # the whole novel: ~36x the 3,072-token budget
    n_prefills = engine.n_prefills
    updates = run(app.load_book(str(path), "", req))
    status = last(app, updates, "status")
    found = re.search(r"([\d,]+) tokens of 3,072 — too long by ([\d,]+)", status)
    assert found and int(found[1].replace(",", "")) > 30 * 3072, status
    assert "Choose what to read below; nothing is cut silently." in status and status.endswith("is still open.")
    assert last(app, updates, "fit_row")["visible"] and engine.n_prefills == n_prefills
    assert app.users["reader"].book is book  # still open until the user picks a part

    prepared = prepare(engine, app.chat, load_document(path, limits=LIMITS))  # the API: a typed error
    with pytest.raises(DocumentTooLong, match=r"The prompt has [\d,]+ tokens but the model's context holds 3,072"):
        open_book(engine, app.chat, prepared, None)
    with pytest.raises(DocumentTooLong):
        engine.open(prepared.doc_ids)
    assert engine.n_prefills == n_prefills

    status = last(app, run(app.load_selection(1024, [], req)), "status")  # the user keeps the beginning
    assert "first 1,024 tokens" in status and "Ready" in status, status
    assert app.users["reader"].book is not book  # read from the chunks it shares with the book read before
    assert app.users["reader"].book.n_read_before and engine.n_prefills == n_prefills


def test_the_load_button_says_what_the_chosen_chapters_hold_and_refuses_too_many(app, engine, tmp_path):
    req = request("picker")
    path = tmp_path / "chapters.txt"
    chapters = (f"CHAPTER {i}\n\n{book_text(2_500 + 700 * i, start=40_000 * i)}\n\n" for i in range(1, 9))
    path.write_text("".join(chapters), encoding="utf-8")
    updates = run(app.load_book(str(path), "", req))
    assert "too long by" in last(app, updates, "status")
    assert app.selection_note(1024, [], req)["value"] == "Read the first 1,024 tokens"
    choices = [value for _, value in last(app, updates, "pick")["choices"]]
    assert len(choices) >= 8, choices  # ours, and any the book's own text holds

    everything = app.selection_note(1024, choices, req)
    found = re.fullmatch(rf"{len(choices)} chapters, ([\d,]+) tokens: ([\d,]+) too many", everything["value"])
    assert found and not everything["interactive"], everything
    assert int(found[1].replace(",", "")) - int(found[2].replace(",", "")) == 3072

    two = app.selection_note(1024, ["2", "0"], req)
    found = re.fullmatch(r"Read 2 chapters, ([\d,]+) tokens", two["value"])
    assert found and two["interactive"], two
    assert "Ready" in last(app, run(app.load_selection(1024, ["2", "0"], req)), "status")
    assert app.users["picker"].book.doc_len == int(found[1].replace(",", ""))  # the label counted what was read
    assert app.selection_note(1024, ["2", "0", "1"], req)["value"].startswith("Read 3 chapters")  # more of it
    assert app.selection_note(1024, ["1"], request("nobody")) == {"__type__": "update"}  # no book: left alone


def test_the_model_table_shows_the_speed_this_machine_just_measured(engine, tmp_path):
    app, model = make_app(engine, tmp_path / "library"), engine.config.target
    assert f"`{model}` **(loaded)** | | 4K | not measured here yet | your model |" in app.model_table()
    updates = run(app.load_book(str(write_book(tmp_path)), "", request("first-book")))
    table = last(app, updates, "models")
    assert re.search(rf"`{re.escape(model)}` \*\*\(loaded\)\*\* \| \| 4K \| [\d,]+ tokens/s prefill \([\d,]+ tokens\)",
                     table), table
    assert app.model_table() == table  # and a page opened later shows it too (demo.load)


def test_more_of_a_long_book_reads_only_what_is_new(engine, tmp_path):
    """A reader keeps the first 1,024 tokens of a novel, then asks for its first 2,048: the app says
    the first part was read before and reads only the rest."""
    app, req = make_app(engine, tmp_path / "library", limits=LIMITS), request("more")
    path = tmp_path / "novel.txt"
    path.write_text(book_text(470_000), encoding="utf-8")
    run(app.load_book(str(path), "", req))
    updates = run(app.load_selection(1024, [], req))
    assert "To read more of *novel*, tick more chapters below" in last(app, updates, "status")
    assert last(app, updates, "fit_row")["visible"]  # the choice of parts stays, no upload again
    n_before, chunk = engine.n_prefill_tokens, engine.prefill_chunk_tokens

    status = last(app, run(app.load_selection(2048, [], req)), "status")
    book = app.users["more"].book
    assert book.n_read_before % chunk == 0 and book.n_read_before >= 1024 - chunk  # the first part, not read again
    assert book.doc_len - book.n_read_before == engine.n_prefill_tokens - n_before
    assert f"{book.n_read_before / book.doc_len:.0%} was read before" in status, status  # said before reading
    assert f"after the {book.n_read_before:,} read before in *novel (first 1,024 tokens)*" in status, status
    run(app.load_book(str(write_book(tmp_path, "short.txt")), "", req))  # a book that fits: no parts on offer
    assert app.users["more"].pending is None


@pytest.mark.parametrize(("raw", "expected", "note"), [
    ("Café “naïve” — déjà vu. ".encode("cp1252") * 20, "Café “naïve” — déjà vu.",
     "This file is not UTF-8; it was read as Windows-1252. If letters look wrong, save it as UTF-8."),
    (("Ça va — très bien, où est la bibliothèque? " * 20).encode() + b"\xff\xfe", "Ça va — très bien",
     "2 byte sequences in this file are not valid UTF-8 and show as \ufffd."),
    ("Plain words without a byte order mark. ".encode("utf-16-le") * 20, "Plain words without a byte order mark.",
     None),
], ids=["cp1252", "utf8-with-bad-bytes", "utf16-without-bom"])
def test_invalid_utf8_is_read_and_the_user_is_told_how(app, tmp_path, raw, expected, note):
    path, req = tmp_path / "notes.txt", request("encodings")
    path.write_bytes(raw)
    document = load_document(path, limits=LIMITS)
    assert document.text.startswith(expected) and document.notes == ((note,) if note else ())
    status = last(app, run(app.load_book(str(path), "", req)), "status")
    assert "Ready" in status and (f"⚠ {note}" in status if note else "⚠" not in status), status


def test_limits_are_flags_with_sensible_defaults():
    import importlib.util

    from tests.reliability.conftest import ROOT

    spec = importlib.util.spec_from_file_location("bookchat_main", ROOT / "app.py")  # `app` is the package
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    defaults, default_limits = main.parse_args([]), Limits()
    assert defaults.max_file_mb * MB == default_limits.max_file_bytes == 200 * MB
    assert (defaults.max_pages, defaults.max_chars) == (default_limits.max_pages, default_limits.max_chars)
    assert defaults.max_doc_tokens is None  # the model's context (minus room for the chat) unless given
    given = main.parse_args(["--max-file-mb", "2", "--max-pages", "20", "--max-chars", "600000", "--max-doc-tokens",
                             "3000", "--max-open-books", "2", "--share-timeout", "3"])
    assert (given.max_file_mb, given.max_pages, given.max_chars, given.max_doc_tokens) == (2, 20, 600_000, 3000)
    assert (given.max_open_books, given.share_timeout, given.private) == (2, 3.0, False)
