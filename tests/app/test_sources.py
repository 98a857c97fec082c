"""An answer's sources and quotes (app/sources.py): chunks of attention become labelled passages
of about a paragraph, the re-read prompt is exactly the documented text, quotes are looked up with
white space and typographic quotes normalised. Pure functions on hand-written documents."""

from __future__ import annotations

from app.formats.document import Document, Section
from app.sources import (
    CUT_NOTE,
    PASSAGE_MAX_CHARS,
    QuoteIndex,
    Source,
    find_passages,
    footer,
    paragraphs,
    with_passages,
)

SHORT = "Anne smiled."  # a line of dialogue: shorter than a passage
LONG = " ".join(f"word{i}" for i in range(400))  # longer than a passage


def book(*blocks: str, chapters: bool = True) -> Document:
    text = "\n\n".join(blocks)
    sections = []
    if chapters:
        at = 0
        for block in blocks:
            if block.startswith("Chapter"):
                sections.append(Section(block, at, "chapter"))
            at += len(block) + 2
    return Document("Book", text, "txt", sections)


def span_of(document: Document, needle: str, share: float) -> tuple[int, int, float]:
    at = document.text.index(needle)
    return at, at + len(needle), share


def test_paragraphs_are_the_blocks_between_blank_lines():
    assert paragraphs("a b\n\nc\n \n\nd") == [(0, 3), (5, 6), (10, 11)]
    assert paragraphs("") == [] and paragraphs("\n\n  \n\n") == []


def test_the_best_chunk_gives_its_paragraph_labelled_with_its_chapter():
    first = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, never took up any book but the Baronetage. " * 3
    second = "Mr Shepherd, a civil, cautious lawyer, advised him to let the house and retrench. " * 3
    doc = book("Chapter 1", first.strip(), "Chapter 2", second.strip())
    chunks = [span_of(doc, "a civil, cautious lawyer", 0.6), span_of(doc, "Baronetage", 0.3),
              span_of(doc, "Chapter 1", 0.1)]
    best, other, *_ = find_passages(doc, chunks, n=2)
    assert best.label == "Chapter 2" and best.text == second.strip() and abs(best.share - 0.6) < 1e-12
    assert other.label == "Chapter 1" and other.text.startswith("Sir Walter") and abs(other.share - 0.3) < 1e-12
    assert doc.text[best.start_char:best.end_char] == second.strip()


def test_a_short_paragraph_takes_its_neighbours_and_a_long_one_is_cut_around_the_chunk():
    doc = book(SHORT, "He bowed.", "The rain had stopped; the whole party walked to the Cobb together. " * 4, LONG)
    (short,) = find_passages(doc, [span_of(doc, "Anne smiled", 1.0)], n=1)
    assert short.text.startswith("Anne smiled. He bowed. The rain") and len(short.text) >= 200
    (cut,) = find_passages(doc, [span_of(doc, "word300 ", 1.0)], n=1)
    assert "word300" in cut.text and len(cut.text) <= PASSAGE_MAX_CHARS
    assert not cut.text.startswith("word0 ") and cut.text.split()[0].startswith("word")  # whole words


def test_chunks_inside_a_kept_passage_add_to_its_share_instead_of_repeating_it():
    doc = book("Chapter 1", "Louisa jumped from the steps and fell on the pavement of the Lower Cobb. " * 3)
    chunks = [span_of(doc, "Louisa jumped", 0.5), span_of(doc, "the Lower Cobb", 0.4), span_of(doc, "Chapter 1", 0.1)]
    found = find_passages(doc, chunks, n=3)
    assert len(found) == 1 and abs(found[0].share - 1.0) < 1e-12  # the short heading joined the paragraph


def test_no_chapters_gives_a_position_and_a_cut_book_says_where_it_ends():
    doc = book("Some words of a plain text file with no headings at all, " * 5, "And the end here " * 12,
               chapters=False)
    (last,) = find_passages(doc, [span_of(doc, "the end here", 1.0)], n=1, is_cut=True)
    assert last.label.endswith("%") and last.note == CUT_NOTE
    (first,) = find_passages(doc, [span_of(doc, "Some words", 1.0)], n=1, is_cut=True)
    assert first.label == doc.label_range(first.start_char, first.end_char) and first.label.startswith("0")
    assert first.note == ""


def test_empty_chunks_and_empty_books_give_no_source_and_no_error():
    doc = book("Chapter 1", "Text.")
    assert find_passages(doc, [(len(doc.text), len(doc.text), 1.0)]) == []  # past the text: the template's end
    assert find_passages(Document("Empty", "", "txt"), [(0, 5, 1.0)]) == []
    assert find_passages(doc, []) == []


def test_reread_prompt_is_the_question_then_the_labelled_passages():
    sources = [Source("Chapter 2", 'He said "no".', 0, 10, 0.5), Source("p. 3", "Bath.", 20, 25, 0.2)]
    assert with_passages(" Who? ", sources) == (
        'Who?\n\nPassages from the book that may help:\n[1] (Chapter 2) "He said "no"."\n[2] (p. 3) "Bath."')
    assert with_passages("Who?", []) == "Who?"
    assert with_passages(" Who? ", sources, first=True) == (
        'Passages from the book that may help:\n[1] (Chapter 2) "He said "no"."\n[2] (p. 3) "Bath."\n\nWho?')
    assert with_passages("Who?", [], first=True) == "Who?"


def test_sources_round_trip_through_json_and_old_ones_without_a_note_read():
    source = Source("Chapter 2", "text", 3, 7, 0.25, CUT_NOTE)
    assert Source.from_json(source.to_json()) == source
    old = {"label": "p. 2", "text": "t", "start_char": 0, "end_char": 1, "share": 0.5}
    assert Source.from_json(old).note == ""


def test_quotes_are_found_with_typographic_quotes_and_white_space_normalised():
    doc = book("Chapter 1", "Vanity was the beginning\nand the end of Sir Walter Elliot’s character; vanity of person.")
    index = QuoteIndex(doc)
    quotes = index.check('He is vain: “Vanity was the beginning and the end of Sir Walter Elliot\'s character”. '
                         'He said "I am the king of Bath" and "ok".')
    found, missing = quotes  # "ok" is too short to be a quotation
    assert found.is_found and found.label == "Chapter 1"
    assert doc.text[found.start_char:found.end_char].startswith("Vanity was the beginning\nand")
    assert doc.text[found.start_char:found.end_char].endswith("Elliot’s character")
    assert not missing.is_found and missing.label == "not in the book" and missing.text == "I am the king of Bath"
    assert index.check("No quotes here.") == []


def test_a_quote_the_answer_wrapped_onto_the_next_line_is_still_checked():
    """SmolLM2 answered 'the "Lady Russell's\nDaughter."' (seen in the browser test): the quote
    went unchecked. A blank line still ends a quote: two separate paragraphs are not one."""
    doc = book("Chapter 1", "Vanity was the beginning and the end of Sir Walter Elliot's character.")
    wrapped, = QuoteIndex(doc).check('He said "Vanity was the beginning\nand the end" of it.')
    assert wrapped.is_found and wrapped.text == "Vanity was the beginning\nand the end"
    missing, = QuoteIndex(doc).check('It is the "Lady Russell\'s\nDaughter."')
    assert not missing.is_found and missing.label == "not in the book"
    assert QuoteIndex(doc).check('An open "quote.\n\nA new paragraph" here.') == []


def test_footer_names_sources_and_quotes():
    index = QuoteIndex(book("Chapter 1", "She walked to Bath."))
    text = footer([Source("Chapter 1", "She walked to Bath.", 0, 10, 0.42)], index.check('"walked to Bath" and "flew"'))
    assert text == ("**Sources:** [1] Chapter 1 (42%)\n\n"
                    "**Quotes:** “walked to Bath” — Chapter 1 · “flew” — not in the book")
