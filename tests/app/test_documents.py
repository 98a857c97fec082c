"""Ingestion (app/documents.py) on real documents and on bad files built here.

Real assets (Debian doc PDFs, a two-column groff PDF, Canterbury text, a scanned and two
encrypted PDFs) come from `.ci/fetch_assets.sh` into the asset cache (docs/ASSETS.md); a test
whose asset is missing skips and says how to fetch it. The Austen EPUB is committed, in
tests/data. Assertions are on content: phrases, page labels, chapter titles, what is gone
(ligature and control characters, running headers).
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import struct
import zipfile
import zlib
from pathlib import Path

import pytest

from app.documents import (
    CorruptDocument,
    Document,
    DrmProtected,
    EmptyDocument,
    Limits,
    PasswordRequired,
    ScannedPdf,
    Section,
    TooLarge,
    UnsupportedFormat,
    WrongPassword,
    chapters,
    load_document,
)
from app.formats.cleaning import run_together_words
from app.formats.document import heading_kinds

ASSETS = Path(os.environ.get("BOOKCHAT_CACHE", Path.home() / ".cache" / "bookchat")) / "assets"
DATA = Path(__file__).resolve().parents[1] / "data"  # committed: public domain (docs/ASSETS.md)
HAS_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is not None


def asset(name: str) -> Path:
    """A committed or fetched real document, or a skip that says how to get it."""
    for path in (DATA / name, ASSETS / name):
        if path.is_file():
            return path
    pytest.skip(f"{name} is not in {ASSETS}: run `bash .ci/fetch_assets.sh` first")


def flat(text: str) -> str:
    """Whitespace-insensitive view of a text, for phrases that wrap across lines."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def r_intro() -> Document:
    return load_document(asset("R-intro.pdf"))


@pytest.fixture(scope="module")
def bashref() -> Document:
    return load_document(asset("bashref.pdf"))


@pytest.fixture(scope="module")
def pride() -> Document:
    return load_document(asset("austen_prideprejudice.epub"))


# --- PDF: real documents --------------------------------------------------------------------

def test_r_intro_pages_carry_the_printed_page_labels(r_intro: Document) -> None:
    pages = r_intro.of_kind("page")
    assert len(pages) == 113
    assert [p.title for p in pages[:7]] == ["T-1", "T-2", "i", "ii", "iii", "iv", "1"]
    preface = r_intro.text.index("This introduction to R is derived from an original set of notes")
    assert r_intro.locate(preface) == "p. 1"
    chapter_1 = r_intro.text.index("1 Introduction and preliminaries\n1.1 The R environment")
    assert r_intro.locate(chapter_1) == "p. 2"
    assert r_intro.label_range(preface, chapter_1 + 10) == "pp. 1–2"
    assert r_intro.label_range(preface, chapter_1) == "p. 1"  # the end is exclusive


def test_r_intro_chapters_come_from_the_outline_and_start_at_their_heading(r_intro: Document) -> None:
    found = chapters(r_intro)
    assert [c.title for c in found[:3]] == ["Preface", "1 Introduction and preliminaries",
                                            "2 Simple manipulations; numbers and vectors"]
    assert len(found) == 21 and found[-1].title == "F References"
    start, end = r_intro.span(found[1])
    assert r_intro.text[start:].startswith("1 Introduction and preliminaries\n1.1 The R environment")
    assert "R is an integrated suite of software facilities" in flat(r_intro.text[start:end])


def test_r_intro_running_headers_and_page_numbers_are_gone(r_intro: Document) -> None:
    # pypdf's raw text starts most pages with "Chapter 7: Reading data from files 35" or "36".
    assert not re.search(r"(?m)^Chapter \d+: ", r_intro.text)
    assert not re.search(r"(?m)^\d+$", r_intro.text)
    assert not re.search(r"(?m)^(i|ii|iii|iv)$", r_intro.text)
    assert "Chapter 7 Reading data from files" not in r_intro.text  # only the outline knows it


def test_hyphenated_line_ends_are_rejoined_but_real_compounds_keep_their_hyphen(r_intro: Document) -> None:
    assert not re.search(r"corre-\s*sponding|coer-\s*cion|ma-\s*trices", r_intro.text)
    assert "corresponding" in r_intro.text and "matrices" in r_intro.text
    # "command-" / "line" at a line end: the manual writes "command-line" elsewhere, never "commandline".
    assert "command-line" in r_intro.text and "commandline" not in r_intro.text
    assert "S and S-Plus" in flat(r_intro.text)  # a capital after the hyphen: a name, kept


def test_dot_leaders_of_the_table_of_contents_collapse(r_intro: Document) -> None:
    assert "5.3 Index matrices ... 21" in r_intro.text
    assert ". . . ." not in r_intro.text and "....." not in r_intro.text


def test_debian_faq_words_keep_their_spaces() -> None:
    # Its CID fonts report an em-wide space, so pypdf dropped the 0.27 em word gaps: 1,500+ lines
    # came out as single words ("Permissionisgrantedtomake...").
    faq = load_document(asset("debian-faq.en.pdf"))
    assert "Permission is granted to make and distribute verbatim copies of this document" in flat(faq.text)
    assert "Permissionisgranted" not in faq.text
    assert len(run_together_words(faq.text)) < 5 and faq.notes == ()


def test_words_that_still_run_together_are_counted_and_the_user_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_together_words("Permissionisgrantedtomakeanddistribute; a SecurityHardeningBuildFlags page, "
                              "SecurityHardeningBuildFlags again; antidisestablishment") == [
        "Permissionisgrantedtomakeanddistribute"]
    import pypdf._page

    from app.formats import pdf
    monkeypatch.setattr(pypdf._page, "Font", pdf._PypdfFont)  # pypdf's own space widths, as before the fix
    faq = load_document(asset("debian-faq.en.pdf"))
    assert len(faq.notes) == 1 and re.match(r"\d{3,} words in this PDF ran together without spaces", faq.notes[0])


def test_bashref_running_chapter_headers_are_gone(bashref: Document) -> None:
    # 42 pages of the raw text start with "Chapter 3: Basic Shell Features <n>".
    assert not re.search(r"(?m)^(Chapter \d+|Appendix [A-D]): .* \d+$", bashref.text)
    assert "See Chapter 7 [Job Control], page 113" in flat(bashref.text)  # cross-references stay
    assert "rather than to augment the programming language" in flat(bashref.text)


def test_bashref_without_page_labels_counts_physical_pages(bashref: Document) -> None:
    assert len(bashref.of_kind("page")) == 196
    assert bashref.locate(bashref.text.index("Bash is the shell, or command language interpreter")) == "p. 7"
    assert [c.title for c in chapters(bashref)[:3]] == ["Introduction", "Definitions", "Basic Shell Features"]


def test_glpk_ligatures_and_tex_control_codes_become_letters() -> None:
    glpk = load_document(asset("glpk.pdf"))
    assert not re.search("[\ufb00-\ufb06]", glpk.text)  # ﬀ ﬁ ﬂ ﬃ ﬄ: NFKC
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f]", glpk.text)  # raw OT1 codes and maths symbols
    text = flat(glpk.text)
    assert "Bounds of variables can be finite as well as infinite" in text  # "\x0cnite" in pypdf's text
    assert "objective coefficients" in text and "glp find row" in text
    assert text.count("specifies") > 100


def test_two_column_pdf_reads_each_column_top_to_bottom() -> None:
    paper = load_document(asset("sample_docs.pdf"))  # groff mom: a journal article in two columns
    # Left column, lines 2-3 ("do-" / "lore" rejoined); a right-column line would cut in here.
    assert "Sed diam nonumy eirmod tempor invidunt ut labore et dolore\nmagna. Aliquyam erat, sed diam voluptua." \
        in paper.text
    headings = ["Schoenberg —", "Messiaen to Stockhausen —", "John Cage —", "Beyond Cage —"]
    offsets = [paper.text.index(h + "\n") for h in headings]
    assert offsets == sorted(offsets)  # left column, then right, then the next page
    assert "Chang, Connors" not in paper.text  # the running header of its pages 2 and 3
    assert not re.search(r"(?m)^-\d+-$", paper.text)  # centred page numbers "-1-"


def test_progress_reports_each_page_and_raising_cancels_between_pages() -> None:
    class Cancelled(Exception):
        pass

    calls: list[tuple[str, int, int]] = []

    def cancel_at_third_page(stage: str, done: int, total: int) -> None:
        calls.append((stage, done, total))
        if done == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        load_document(asset("R-intro.pdf"), progress=cancel_at_third_page)
    assert calls == [("extract", n, 113) for n in range(4)]
    calls.clear()
    load_document(asset("sample_docs.pdf"), progress=lambda *call: calls.append(call))
    assert calls[-3:] == [("extract", 12, 12), ("clean", 0, 1), ("clean", 1, 1)]


# --- PDF: scanned, encrypted, broken, too large ---------------------------------------------

def test_scanned_pdf_without_text_layer_says_to_run_ocr() -> None:
    message = r"scanned images without a text layer \(no text on 1 of its 1 pages\).*ocrmypdf"
    with pytest.raises(ScannedPdf, match=message):
        load_document(asset("c03-29.pdf"))


def test_encrypted_pdf_asks_for_the_password_and_opens_with_it() -> None:
    path = asset("r3-user-password.pdf")  # pypdf's test file, RC4, user password "asdfzxcv"
    with pytest.raises(PasswordRequired, match="protected by a password. Enter the password"):
        load_document(path)
    with pytest.raises(WrongPassword, match="That password does not open this PDF"):
        load_document(path, password="hunter2")
    assert load_document(path, password="asdfzxcv").text == "pdf encryption test\npassword: asdfzxcv"


@pytest.mark.skipif(not HAS_CRYPTOGRAPHY, reason="AES needs the 'cryptography' package")
def test_aes256_pdf_made_by_qpdf_opens_with_its_password() -> None:
    path = asset("R-intro-aes256.pdf")  # R-intro pages 7-12, qpdf --encrypt bookchat owner-secret 256
    with pytest.raises(PasswordRequired):
        load_document(path)
    with pytest.raises(WrongPassword):
        load_document(path, password="wrong")
    excerpt = load_document(path, password="bookchat")
    assert "This introduction to R is derived from an original set of notes" in flat(excerpt.text)
    assert len(excerpt.of_kind("page")) == 6


@pytest.mark.skipif(HAS_CRYPTOGRAPHY, reason="only without the 'cryptography' package")
def test_aes256_pdf_without_cryptography_says_what_to_install() -> None:
    with pytest.raises(UnsupportedFormat, match=r"encrypted with AES.*pip install cryptography"):
        load_document(asset("R-intro-aes256.pdf"), password="bookchat")


def test_truncated_pdf_is_corrupt(tmp_path: Path) -> None:
    data = asset("R-intro.pdf").read_bytes()
    (tmp_path / "cut.pdf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDocument, match="This PDF is incomplete: it does not end with %%EOF"):
        load_document(tmp_path / "cut.pdf")


def test_pdf_with_a_damaged_middle_is_corrupt(tmp_path: Path) -> None:
    data = bytearray(asset("R-intro.pdf").read_bytes())
    data[200_000:260_000] = bytes(60_000)  # objects and the page tree's cross-references zeroed
    (tmp_path / "holes.pdf").write_bytes(data)
    with pytest.raises(CorruptDocument, match="This PDF is damaged"):
        load_document(tmp_path / "holes.pdf")


@pytest.mark.timeout(60)
def test_pdf_content_stream_of_a_gigabyte_is_refused_not_decoded(tmp_path: Path) -> None:
    raw = deflate_repeating(b" " * (1 << 20), 1024)  # 1 GiB of spaces in 1 MB of deflate
    adler = 1
    for _ in range(1024):
        adler = zlib.adler32(b" " * (1 << 20), adler)
    stream = b"\x78\xda" + raw + struct.pack(">I", adler)
    (tmp_path / "bomb.pdf").write_bytes(one_page_pdf(stream))
    with pytest.raises(TooLarge, match=r"Page 1 of this PDF holds data that would decode to more than 64\.0 MB"):
        load_document(tmp_path / "bomb.pdf")


def test_limits_on_file_size_pages_and_characters() -> None:
    with pytest.raises(TooLarge, match=r"The file is 617\.2 KB; the limit is 100\.0 KB"):
        load_document(asset("R-intro.pdf"), limits=Limits(max_file_bytes=100 * 1024))
    with pytest.raises(TooLarge, match="The document has 113 pages; the limit is 50"):
        load_document(asset("R-intro.pdf"), limits=Limits(max_pages=50))
    with pytest.raises(TooLarge, match="longer than the limit of 10,000 characters"):
        load_document(asset("alice29.txt"), limits=Limits(max_chars=10_000))
    with pytest.raises(ValueError, match="Limits.max_pages must be positive"):
        Limits(max_pages=0)


# --- EPUB -------------------------------------------------------------------------------------

def test_epub_follows_the_spine_with_chapter_titles_from_the_nav(pride: Document) -> None:
    assert pride.title == "Pride and Prejudice" and pride.source_format == "epub"
    titles = [c.title for c in chapters(pride)]
    assert titles == ["Pride and Prejudice"] + [f"Chapter {n}" for n in range(1, 62)]
    opening = pride.text.index("It is a truth universally acknowledged")
    assert pride.locate(opening) == "Chapter 1"
    assert pride.label_range(opening, pride.text.index("Mr. Bennet was among the earliest")) == "Chapter 1 – Chapter 2"
    start, end = pride.span(chapters(pride)[1])
    assert pride.text[start:end].startswith("Chapter 1\n\nIt is a truth")
    assert pride.text[start:end].endswith("its solace was visiting and news.\n\n")
    assert pride.text.endswith("had been the means of uniting them.")


def test_epub2_with_ncx_and_epub_without_toc_use_their_headings(tmp_path: Path) -> None:
    body = [("one.xhtml", "<h1>The Beginning</h1><p>First <em>words</em>.</p><h2>A scene</h2><p>More.</p>"),
            ("two.xhtml", "<h1>The End</h1><p>Last words.</p>")]
    build_epub(tmp_path / "ncx.epub", body, nav=False, ncx=True)
    book = load_document(tmp_path / "ncx.epub")
    assert [(c.title, c.kind) for c in book.sections] == [("The Beginning", "chapter"), ("The End", "chapter")]
    assert book.text == "The Beginning\n\nFirst words.\n\nA scene\n\nMore.\n\nThe End\n\nLast words."
    build_epub(tmp_path / "bare.epub", body, nav=False, ncx=False)
    bare = load_document(tmp_path / "bare.epub")
    assert [(c.title, c.kind) for c in bare.sections] == [
        ("The Beginning", "chapter"), ("A scene", "section"), ("The End", "chapter")]
    assert bare.locate(bare.text.index("More.")) == "A scene"


def test_live_manual_epub_with_fragment_links_in_its_manifest_reads_by_chapter() -> None:
    # Its OPF lists 'about-manual.xhtml#o8' etc. as items of the spine: once read as file names.
    manual = load_document(asset("live-manual.en.epub"))
    titles = [c.title for c in chapters(manual)]
    assert len(titles) >= 20 and "Installation" in titles and "Customizing run time behaviours" in titles
    assert manual.text.count("This manual serves as a single access point to all documentation") == 1
    start, end = manual.span(chapters(manual)[titles.index("Installation")])
    assert "3.1 Requirements" in manual.text[start:end] and "4. The basics" not in manual.text[start:end]


def test_epub_manifest_fragments_are_not_file_names_and_repeats_are_read_once(tmp_path: Path) -> None:
    body = [("one.xhtml", "<h1>One</h1><p id='a'>First.</p>"), ("two.xhtml", "<h1>Two</h1><p>Second.</p>")]
    build_epub(tmp_path / "frag.epub", body, nav=True, ncx=False,
               extra_items=(("one.xhtml#a", "doc0a"), ("two.xhtml#b", "doc1b")))
    book = load_document(tmp_path / "frag.epub")
    assert book.text == "One\n\nFirst.\n\nTwo\n\nSecond."


def test_ubuntu_packaging_guide_with_broken_toc_links_reads_chapter_by_chapter() -> None:
    # Its NCX and nav link 'getting-set-up.xhtml', the file is 'ubuntu-packaging-guide/getting-set-up.xhtml':
    # only the first link resolved, so the whole guide was one chapter.
    guide = load_document(asset("ubuntu-packaging-guide.epub"))
    titles = [c.title for c in chapters(guide)]
    assert len(titles) > 50 and "2. Getting Set Up" in titles
    start, end = guide.span(chapters(guide)[titles.index("2. Getting Set Up")])
    assert 2_000 < end - start < 100_000 and "pbuilder" in guide.text[start:end]


def test_epub_with_broken_toc_links_falls_back_to_headings_then_to_spine_items(tmp_path: Path) -> None:
    body = [("one.xhtml", "<h1>The Beginning</h1><p>First.</p><h2>A scene</h2><p>More.</p>"),
            ("two.xhtml", "<h1>The End</h1><p>Last words.</p>")]
    build_epub(tmp_path / "broken.epub", body, nav=True, ncx=True, link_prefix="missing/")
    book = load_document(tmp_path / "broken.epub")
    assert [(c.title, c.kind) for c in book.sections] == [
        ("The Beginning", "chapter"), ("A scene", "section"), ("The End", "chapter")]
    plain = [("part1.xhtml", "<p>First.</p>"), ("part2.xhtml", "<p>Last words.</p>")]
    build_epub(tmp_path / "plain.epub", plain, nav=True, ncx=False, link_prefix="missing/")
    assert [(c.title, c.kind) for c in load_document(tmp_path / "plain.epub").sections] == [
        ("part1", "chapter"), ("part2", "chapter")]


def test_drm_epub_is_refused(tmp_path: Path) -> None:
    encryption = encryption_xml("http://www.w3.org/2001/04/xmlenc#aes128-cbc", "EPUB/text/ch002.xhtml")
    rewrite_zip(asset("austen_prideprejudice.epub"), tmp_path / "drm.epub",
                replace={"EPUB/text/ch002.xhtml": random.Random(0).randbytes(5000)},
                add={"META-INF/encryption.xml": encryption})
    with pytest.raises(DrmProtected, match=r"protected by DRM: 1 of its files is encrypted"):
        load_document(tmp_path / "drm.epub")


def test_font_obfuscation_is_not_drm(tmp_path: Path) -> None:
    encryption = encryption_xml("http://www.idpf.org/2008/embedding", "EPUB/fonts/Body.otf")
    rewrite_zip(asset("austen_prideprejudice.epub"), tmp_path / "fonts.epub",
                add={"META-INF/encryption.xml": encryption, "EPUB/fonts/Body.otf": bytes(2000)})
    assert "It is a truth universally acknowledged" in load_document(tmp_path / "fonts.epub").text


@pytest.mark.parametrize(("change", "message"), [
    ({"drop": "META-INF/container.xml"}, "This EPUB is malformed: it has no 'META-INF/container.xml'"),
    ({"replace": {"EPUB/content.opf": b"<package><manifest>"}}, "EPUB/content.opf is not valid XML"),
    ({"drop": "EPUB/text/ch003.xhtml"}, "it has no 'EPUB/text/ch003.xhtml'"),
    ({"truncate": True}, "This EPUB is damaged or incomplete"),
], ids=["no-container", "broken-opf", "missing-chapter", "truncated"])
def test_malformed_epub_is_corrupt(tmp_path: Path, change: dict, message: str) -> None:
    target = tmp_path / "bad.epub"
    source = asset("austen_prideprejudice.epub")
    if change.get("truncate"):
        target.write_bytes(source.read_bytes()[:150_000])
    else:
        rewrite_zip(source, target, drop=change.get("drop"), replace=change.get("replace", {}))
    with pytest.raises(CorruptDocument, match=re.escape(message)):
        load_document(target)


@pytest.mark.parametrize("kind", ["epub", "docx"])
def test_zip_bomb_disguised_as_epub_or_docx_is_refused_before_unpacking(tmp_path: Path, kind: str) -> None:
    bomb = deflate_repeating(bytes(1 << 20), 3 * 1024)  # 3 GiB of zeros in 3 MB
    if kind == "epub":
        members = [("mimetype", b"application/epub+zip", None), ("META-INF/container.xml", CONTAINER, None),
                   ("content.opf", opf([("ch1.xhtml", "ch1")]), None), ("ch1.xhtml", bomb, 3 << 30)]
    else:
        members = [("[Content_Types].xml", b"<Types/>", None), ("word/document.xml", bomb, 3 << 30)]
    (tmp_path / f"book.{kind}").write_bytes(raw_zip(members))
    with pytest.raises(TooLarge, match=rf"This {kind.upper()} would unpack to 3\.0 GB; the limit is 1\.0 GB"):
        load_document(tmp_path / f"book.{kind}")


def test_small_zip_bomb_is_caught_by_its_ratio(tmp_path: Path) -> None:
    build_docx(tmp_path / "ratio.docx", "<w:p><w:r><w:t>hi</w:t></w:r></w:p>", padding=bytes(20 << 20))
    with pytest.raises(TooLarge, match=r"would unpack to [\d,]+ times its size"):
        load_document(tmp_path / "ratio.docx")


# --- Text, Markdown, HTML, DOCX ---------------------------------------------------------------

def test_alice_crlf_text_has_its_twelve_chapters() -> None:
    alice = load_document(asset("alice29.txt"))  # Canterbury corpus, CRLF line ends
    assert "\r" not in alice.text and alice.source_format == "txt"
    titles = [c.title for c in chapters(alice)]
    assert len(titles) == 12 and titles[0] == "CHAPTER I: Down the Rabbit-Hole"
    assert titles[-1] == "CHAPTER XII: Alice's Evidence"
    assert alice.locate(alice.text.index("Alice was beginning to get very tired")) == titles[0]
    assert "Alice was beginning to get very tired of sitting by her sister\non the bank" in alice.text


def test_bom_crlf_text_with_chapters_in_words_and_a_table_of_contents(tmp_path: Path) -> None:
    body = "\r\n".join(["My Book", "", "Chapter One", "Chapter Two", "", "Chapter One", "", "Once " * 60,
                        "", "CHAPTER TWO. The Sequel", "", "Twice " * 60, ""])
    (tmp_path / "book.txt").write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    book = load_document(tmp_path / "book.txt")
    assert book.text.startswith("My Book\n\nChapter One\nChapter Two\n\nChapter One\n\nOnce Once")
    assert "\ufeff" not in book.text and "\r" not in book.text
    assert [c.title for c in chapters(book)] == ["Chapter One", "CHAPTER TWO: The Sequel"]
    assert chapters(book)[0].start_char == book.text.index("Chapter One\n\nOnce")  # not the contents list


@pytest.mark.parametrize(("raw", "expected"), [
    ("Caf\u00e9 \u201cna\u00efve\u201d".encode("cp1252"), "Caf\u00e9 \u201cna\u00efve\u201d"),  # not UTF-8
    ("Caf\u00e9 \u201cna\u00efve\u201d".encode("utf-16"), "Caf\u00e9 \u201cna\u00efve\u201d"),  # BOM: UTF-16
    (("\u00e9t\u00e9 " * 20).encode() + b"\xff", ("\u00e9t\u00e9 " * 20) + "\ufffd"),  # one bad byte
    (b"tab\there\x07bell\x0cform feed", "tab\therebell\nform feed"),  # BEL dropped, FF a line break
], ids=["cp1252", "utf16-bom", "mostly-utf8", "controls"])
def test_text_encodings_fall_back_sensibly(tmp_path: Path, raw: bytes, expected: str) -> None:
    (tmp_path / "t.txt").write_bytes(raw)
    assert load_document(tmp_path / "t.txt").text == expected


def test_markdown_headings_become_chapters_and_code_is_not_a_heading(tmp_path: Path) -> None:
    (tmp_path / "play.md").write_text("Hamlet\n======\n\n## Act I\n\nWho's there?\n\n```\n# not a heading\n```\n\n"
                                      "### Scene two\n\nText.\n\nAct II\n------\n\nWords.\n", encoding="utf-8")
    play = load_document(tmp_path / "play.md")
    assert play.title == "Hamlet" and play.source_format == "markdown"
    assert [(s.title, s.kind) for s in play.sections] == [
        ("Hamlet", "chapter"), ("Act I", "chapter"), ("Scene two", "section"), ("Act II", "chapter")]
    assert play.locate(play.text.index("Text.")) == "Scene two"


def test_html_drops_script_and_style_and_reads_its_charset(tmp_path: Path) -> None:
    page = ('<html><head><meta charset="windows-1252"><title>Essays</title><style>p{color:red}</style>'
            '<script>alert("x")</script></head><body><h1>On Caf\xe9s</h1><p>One&nbsp;<b>bold</b>\n  claim.'
            '<br>Next line.</p><h1>On Tea</h1><p>Steep.</p></body></html>')
    (tmp_path / "essays.html").write_bytes(page.encode("cp1252"))
    essays = load_document(tmp_path / "essays.html")
    assert essays.title == "Essays"
    assert essays.text == "On Caf\u00e9s\n\nOne bold claim.\nNext line.\n\nOn Tea\n\nSteep."
    assert [c.title for c in chapters(essays)] == ["On Caf\u00e9s", "On Tea"]


def test_docx_paragraphs_headings_and_tables(tmp_path: Path) -> None:
    body = (para("A Report", "Title") + para("Introduction", "Heading1") + para("It began with a tab:\tthen.")
            + "<w:tbl><w:tr><w:tc>" + para("cell a") + "</w:tc><w:tc>" + para("cell b") + "</w:tc></w:tr></w:tbl>"
            + para("Details", "Heading2")
            + para("Deleted ", after="<w:del><w:r><w:delText>gone</w:delText></w:r></w:del><w:r><w:t>kept</w:t></w:r>")
            + para("Results", "Heading1") + para("Fine."))
    build_docx(tmp_path / "report.docx", body, title="Quarterly Report")
    report = load_document(tmp_path / "report.docx")
    assert report.title == "Quarterly Report" and report.source_format == "docx"
    assert report.text == ("A Report\n\nIntroduction\n\nIt began with a tab:\tthen.\n\ncell a\tcell b\n\n"
                           "Details\n\nDeleted kept\n\nResults\n\nFine.")
    assert [c.title for c in chapters(report)] == ["Introduction", "Results"]
    assert report.locate(report.text.index("Deleted")) == "Details"


def test_docx_headings_from_localised_style_names(tmp_path: Path) -> None:
    styles = (f'<w:styles xmlns:w="{W_NS}"><w:style w:styleId="berschrift1"><w:name w:val="heading 1"/></w:style>'
              f'<w:style w:styleId="Titre2"><w:name w:val="Titre 2"/><w:pPr><w:outlineLvl w:val="1"/></w:pPr>'
              f'</w:style></w:styles>')
    body = para("Kapitel", "berschrift1") + para("Teil", "Titre2") + para("Text.") + para("Ende", "berschrift1")
    build_docx(tmp_path / "de.docx", body, styles=styles)
    book = load_document(tmp_path / "de.docx")
    assert [(s.title, s.kind) for s in book.sections] == [("Kapitel", "chapter"), ("Teil", "section"),
                                                          ("Ende", "chapter")]
    assert book.title == "Kapitel"  # no core.xml title: the first heading


# --- Bad files built here ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "data", "error", "message"), [
    ("empty.txt", b"", EmptyDocument, "The file is empty (0 bytes)"),
    ("blank.txt", b" \r\n\t\n", EmptyDocument, "This text file contains no text"),
    ("photo.txt", b"\x89PNG\r\n\x1a\n" + bytes(64), UnsupportedFormat, "This file is a PNG image"),
    ("noise.txt", random.Random(1).randbytes(4096), UnsupportedFormat, "'noise.txt' holds binary data, not text"),
    ("book.doc", b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504), UnsupportedFormat,
     "an old Word .doc or a password-protected Office file"),
    ("book.xyz", b"plain words", UnsupportedFormat, "Files ending in '.xyz' are not supported"),
    ("archive.epub", b"PK\x03\x04" + bytes(60), CorruptDocument, "This EPUB is damaged or incomplete"),
    ("garbage.pdf", b"%PDF-1.4\n" + random.Random(2).randbytes(3000) + b"\n%%EOF\n", CorruptDocument,
     "This PDF is damaged and cannot be read"),
], ids=["empty", "blank", "png-renamed", "random-bytes", "ole-doc", "unknown-extension", "broken-zip",
        "garbage-pdf"])
def test_bad_file_gets_a_typed_error_a_person_can_act_on(tmp_path: Path, name: str, data: bytes,
                                                         error: type[Exception], message: str) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(error, match=re.escape(message)):
        load_document(tmp_path / name)


def test_magic_bytes_beat_the_extension(tmp_path: Path) -> None:
    (tmp_path / "renamed.txt").write_bytes(asset("r3-user-password.pdf").read_bytes())
    with pytest.raises(PasswordRequired):  # read as the PDF it is, not as text
        load_document(tmp_path / "renamed.txt")
    (tmp_path / "page.txt").write_text("<!DOCTYPE html><title>T</title><p>Hello <i>there</i></p>")
    assert load_document(tmp_path / "page.txt").text == "Hello there"
    (tmp_path / "notes.txt").write_text("How PDFs begin:\n\n%PDF-1.7 then objects.")
    assert load_document(tmp_path / "notes.txt").text.endswith("%PDF-1.7 then objects.")


# --- Document: the offset -> label map, pure ------------------------------------------------------

def test_locate_and_label_range_on_pages_chapters_and_plain_text() -> None:
    text = "a" * 100
    paged = Document("t", text, "pdf", [Section("11", 0, "page"), Section("Ch", 5, "chapter"),
                                        Section("12", 40, "page"), Section("13", 40, "page"),  # 12 is empty
                                        Section("14", 80, "page")])
    assert paged.locate(39) == "p. 11" and paged.locate(40) == "p. 13"  # the empty page owns nothing
    assert paged.label_range(10, 40) == "p. 11"  # end is exclusive
    assert paged.label_range(10, 85) == "pp. 11–14"
    assert paged.span(paged.sections[0]) == (0, 40) and paged.span(paged.sections[1]) == (5, 100)
    headed = Document("t", text, "markdown", [Section("One", 10, "chapter"), Section("1.1", 30, "section"),
                                              Section("Two", 60, "chapter")])
    assert headed.locate(5) == "at 5%" and headed.locate(35) == "1.1"
    assert headed.label_range(12, 70) == "One – Two"
    assert headed.span(headed.sections[1]) == (30, 60)
    assert Document("t", text, "txt", []).label_range(0, 51) == "0–50%"


def test_heading_kinds_treat_a_lone_top_heading_as_the_title() -> None:
    assert heading_kinds([1, 2, 3, 2]) == ["chapter", "chapter", "section", "chapter"]
    assert heading_kinds([1, 2, 1, 2]) == ["chapter", "section", "chapter", "section"]
    assert heading_kinds([2]) == ["chapter"] and heading_kinds([]) == []


def test_chapters_fall_back_to_sections_then_nothing() -> None:
    only_sections = Document("t", "abc", "html", [Section("A", 0, "section")])
    assert chapters(only_sections) == [Section("A", 0, "section")]
    assert chapters(Document("t", "abc", "txt", [Section("1", 0, "page")])) == []


# --- Builders for the files above ---------------------------------------------------------------

CONTAINER = (b'<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
             b'<rootfiles><rootfile full-path="content.opf" media-type="application/oebps-package+xml"/>'
             b'</rootfiles></container>')
W_NS = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"


def deflate_repeating(chunk: bytes, n_chunks: int) -> bytes:
    """Raw deflate of `chunk * n_chunks` in milliseconds: after a full flush the compressor's
    output for an identical chunk repeats byte for byte, so it is computed once."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    unit = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    return first + unit * (n_chunks - 1) + compressor.flush()


def one_page_pdf(content_stream: bytes) -> bytes:
    """A valid one-page PDF whose content is `content_stream`, already FlateDecode-compressed."""
    page = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
            b" /Resources << /Font << /F1 5 0 R >> >> >>")
    stream = b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(content_stream), content_stream)
    font = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>", page, stream, font]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def raw_zip(members: list[tuple[str, bytes, int | None]]) -> bytes:
    """A zip from (name, data, None) stored members and (name, raw deflate, unpacked size) ones.

    The deflated members' CRC is left 0: a bomb must be refused before any byte is unpacked.
    """
    out, directory = bytearray(), bytearray()
    for name, data, n_unpacked in members:
        method, crc = (0, zlib.crc32(data)) if n_unpacked is None else (8, 0)
        size = len(data) if n_unpacked is None else n_unpacked
        header = struct.pack("<5H3L2H", 20, 0, method, 0, 0, crc, len(data), size, len(name), 0)
        directory += b"PK\x01\x02" + struct.pack("<H", 20) + header + struct.pack("<3H2L", 0, 0, 0, 0, len(out))
        directory += name.encode()
        out += b"PK\x03\x04" + header + name.encode() + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(directory), len(out), 0)
    return bytes(out + directory + end)


def opf(items: list[tuple[str, str]], nav: bool = False, ncx: bool = False) -> bytes:
    manifest = "".join(f'<item id="{i}" href="{h}" media-type="application/xhtml+xml"/>' for h, i in items)
    manifest += '<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>' if nav else ""
    manifest += '<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>' if ncx else ""
    spine = "".join(f'<itemref idref="{i}"/>' for _, i in items)
    toc = ' toc="ncx"' if ncx else ""
    return (f'<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            f'<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>Test Book</dc:title></metadata>'
            f'<manifest>{manifest}</manifest><spine{toc}>{spine}</spine>'
            f'</package>').encode()


def build_epub(path: Path, documents: list[tuple[str, str]], nav: bool, ncx: bool,
               extra_items: tuple[tuple[str, str], ...] = (), link_prefix: str = "") -> None:
    """A small EPUB: one XHTML file per (name, body); a nav or NCX listing each file's first <h1>.

    `extra_items` are more (href, id) manifest items, in the spine too; `link_prefix` breaks the
    table of contents' links.
    """
    items = [(name, f"doc{idx}") for idx, (name, _) in enumerate(documents)] + list(extra_items)
    titles = [found.group(1) if (found := re.search(r"<h1>(.*?)</h1>", body)) else name
              for name, body in documents]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        archive.writestr("META-INF/container.xml", CONTAINER)
        archive.writestr("content.opf", opf(items, nav, ncx))
        for name, body in documents:
            archive.writestr(name, f'<html xmlns="http://www.w3.org/1999/xhtml"><body>{body}</body></html>')
        links = "".join(f'<li><a href="{link_prefix}{name}">{title}</a></li>'
                        for (name, _), title in zip(documents, titles))
        if nav:
            archive.writestr("nav.xhtml", f'<html><body><nav epub:type="toc"><ol>{links}</ol></nav></body></html>')
        if ncx:
            points = "".join(f'<navPoint id="p{i}"><navLabel><text>{t}</text></navLabel>'
                             f'<content src="{link_prefix}{n}"/></navPoint>'
                             for i, ((n, _), t) in enumerate(zip(documents, titles)))
            archive.writestr("toc.ncx", f'<ncx xmlns="http://www.daisy.org/z3986/2005/ncx/"><navMap>{points}'
                                        f'</navMap></ncx>')


def encryption_xml(algorithm: str, uri: str) -> bytes:
    return (f'<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
            f'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData>'
            f'<enc:EncryptionMethod Algorithm="{algorithm}"/><enc:CipherData>'
            f'<enc:CipherReference URI="{uri}"/></enc:CipherData></enc:EncryptedData></encryption>').encode()


def rewrite_zip(source: Path, target: Path, drop: str | None = None, replace: dict[str, bytes] | None = None,
                add: dict[str, bytes] | None = None) -> None:
    """Copy a zip member by member, dropping, replacing or adding some."""
    replace, add = replace or {}, add or {}
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        for info in old.infolist():
            if info.filename != drop:
                new.writestr(info.filename, replace.get(info.filename, old.read(info.filename)))
        for name, data in add.items():
            new.writestr(name, data)


def para(text: str, style: str | None = None, after: str = "") -> str:
    """One w:p with a run of `text` (tabs as w:tab), then the raw run markup `after`."""
    style_xml = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
    run = "<w:tab/>".join(f'<w:t xml:space="preserve">{part}</w:t>' for part in text.split("\t"))
    return f"<w:p>{style_xml}<w:r>{run}</w:r>{after}</w:p>"


def build_docx(path: Path, body: str, title: str | None = None, padding: bytes | None = None,
               styles: str | None = None) -> None:
    """A minimal DOCX: document.xml (w: namespace); optional core.xml title, styles, padding."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", '<Types xmlns="http://schemas.openxmlformats.org/package/2006/'
                                                'content-types"/>')
        archive.writestr("word/document.xml", f'<w:document xmlns:w="{W_NS}"><w:body>{body}</w:body></w:document>')
        if title:
            archive.writestr("docProps/core.xml", f'<cp:coreProperties xmlns:cp="x" xmlns:dc="http://purl.org/dc/'
                                                  f'elements/1.1/"><dc:title>{title}</dc:title></cp:coreProperties>')
        if padding:
            archive.writestr("word/media/padding.bin", padding)
        if styles:
            archive.writestr("word/styles.xml", styles)
