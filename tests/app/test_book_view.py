"""The book view (app/book_view.py): a source opens the chapters around it with the passage marked;
a source of an old chat is found again by its text in a book read in a larger part, or shown as
stored; the radio lists an answer's sources and quotes. Pure functions on hand-written books."""

from __future__ import annotations

from types import SimpleNamespace

from app.book_view import AROUND_CHARS, choices, locate, render_view
from app.formats.document import Document, Section
from app.sources import Source


def chaptered(n_chapters: int = 5, words: int = 50) -> Document:
    blocks, sections, at = [], [], 0
    for i in range(1, n_chapters + 1):
        for block in (f"Chapter {i}", " ".join(f"c{i}w{j}" for j in range(words))):
            if block.startswith("Chapter"):
                sections.append(Section(block, at, "chapter"))
            blocks.append(block)
            at += len(block) + 2
    return Document("Book", "\n\n".join(blocks), "txt", sections)


def source_of(document: Document, needle: str) -> Source:
    at = document.text.index(needle)
    return Source("Chapter 3", needle, at, at + len(needle), 0.4)


def test_the_view_marks_the_passage_among_the_chapters_around_it():
    doc = chaptered()
    view = render_view(doc, source_of(doc, "c3w10 c3w11"))
    assert "<mark>c3w10 c3w11</mark>" in view and "40% of the question" in view
    assert "c2w0" in view and "c4w49" in view  # the chapter before and after, to scroll to
    assert "c1w0" not in view and "c5w0" not in view


def test_a_book_without_chapters_shows_the_text_around_and_html_is_escaped():
    text = "x " * 10_000 + "<b>the passage</b>" + " y" * 10_000
    doc = Document("Plain", text, "txt")
    view = render_view(doc, source_of(doc, "<b>the passage</b>"))
    assert "<mark>&lt;b&gt;the passage&lt;/b&gt;</mark>" in view
    assert view.count("x") < 3_000 and "… " in view  # a window, cut with an ellipsis


def test_a_huge_chapter_is_cut_around_the_passage():
    doc = chaptered(n_chapters=2, words=20_000)
    view = render_view(doc, source_of(doc, "c2w10000 "))
    assert "<mark>c2w10000 </mark>" in view and len(view) < 2 * AROUND_CHARS + 2_000


def test_an_old_source_is_found_by_its_text_when_the_book_was_read_in_a_larger_part():
    part = chaptered(n_chapters=2)
    source = source_of(part, "c2w3 c2w4")
    whole = Document("Book", "Preface\n\n" + part.text + "\n\nChapter 3\n\nmore", "txt")  # offsets moved
    assert locate(part, source) == (source.start_char, source.end_char)
    a, b = locate(whole, source)
    assert whole.text[a:b] == "c2w3 c2w4"
    assert "<mark>c2w3 c2w4</mark>" in render_view(whole, source)
    gone = Document("Other", "Nothing of the kind.", "txt")
    assert locate(gone, source) is None
    assert "not in the part of the book open now" in render_view(gone, source)


def test_the_radio_lists_the_sources_and_quotes_of_the_answer():
    turn = SimpleNamespace(sources=[Source("Chapter 1", "Some text", 0, 9, 0.5).to_json()],
                           quotes=[{"text": "made up", "start_char": -1, "end_char": -1, "label": "not in the book"}])
    book = SimpleNamespace(turns=[SimpleNamespace(sources=[], quotes=[]), turn])
    update = choices(book)
    assert update["choices"] == [("[1] Chapter 1 (50%): Some text", "s:1:0"),
                                 ("“made up” — not in the book", "q:1:0")]
    assert update["visible"] and not choices(book, 0)["visible"] and not choices(None)["visible"]
