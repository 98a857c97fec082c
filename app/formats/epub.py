"""EPUB -> Document with the standard library: zip, container.xml, OPF spine, XHTML.

Order is the spine's, each file once (manifest hrefs may carry '#fragment's: Debian's
live-manual). Chapter titles come from the navigation document (EPUB 3 nav, else the EPUB 2 NCX)
when most of its links lead into the spine, one level down when it nests the whole book under its
title; else from headings (the Ubuntu packaging guide's links miss their folder); else each spine
document is a chapter. DRM (content encrypted in META-INF/encryption.xml) is refused; font
obfuscation, which encrypts only fonts, is not DRM. No AGPL readers (EbookLib, PyMuPDF).
"""

from __future__ import annotations

import os
import posixpath
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import unquote, urldefrag

from app.formats.archive import has_member, open_archive, read_member
from app.formats.document import Document, DocumentBuilder, SectionKind, heading_kinds
from app.formats.errors import CorruptDocument, DrmProtected
from app.formats.limits import Limits, Progress, check_chars
from app.formats.markup import (
    HtmlText,
    Marks,
    add_paragraphs,
    decode_html,
    extract_html,
)

_FONT_OBFUSCATION = {"http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC"}
_FONT_EXTENSIONS = (".ttf", ".otf", ".woff", ".woff2")
_HTML_TYPES = {"application/xhtml+xml", "text/html"}
_MIN_CHAPTERS = 3  # fewer top-level entries than this are a title page, not the book's chapters


@dataclass(frozen=True)
class _TocEntry:
    path: str  # member path inside the zip
    fragment: str
    title: str
    depth: int  # 0 = chapter, deeper = section


def load_epub(path: str, limits: Limits, progress: Progress) -> Document:
    """Read the spine's XHTML documents in order; sections from the table of contents."""
    with open_archive(path, "EPUB", limits) as archive:
        _refuse_drm(archive)
        opf_path = _rootfile(archive)
        package = _parse_xml(read_member(archive, opf_path, "EPUB"), opf_path)
        manifest = _manifest(package, posixpath.dirname(opf_path))
        # A spine item may repeat a file (items named 'x.xhtml#o8'): each file is read once.
        spine = list(dict.fromkeys(manifest[idref][0] for idref in _spine_idrefs(package, manifest)))
        toc = _toc(archive, package, manifest)
        documents: list[HtmlText] = []
        n_chars = 0
        for idx, member in enumerate(spine):
            progress("extract", idx, len(spine))
            documents.append(extract_html(decode_html(read_member(archive, member, "EPUB"), member)))
            n_chars += sum(len(paragraph) for paragraph in documents[-1].paragraphs)
            check_chars(n_chars, limits)  # stop early; the builder checks the final text again
        progress("extract", len(spine), len(spine))
    title = _metadata_title(package) or os.path.splitext(os.path.basename(path))[0]
    return _assemble(spine, documents, toc, title, limits)


def _refuse_drm(archive: zipfile.ZipFile) -> None:
    if not has_member(archive, "META-INF/encryption.xml"):
        return
    root = _parse_xml(read_member(archive, "META-INF/encryption.xml", "EPUB"), "META-INF/encryption.xml")
    encrypted = [data for data in _all(root, "EncryptedData") if not _only_font(data)]
    if encrypted:
        files = "1 of its files is" if len(encrypted) == 1 else f"{len(encrypted)} of its files are"
        raise DrmProtected(f"This EPUB is protected by DRM: {files} encrypted "
                           "(META-INF/encryption.xml), so its text cannot be read. Open it in the app you "
                           "bought it from, or load a DRM-free copy of the book.")


def _only_font(encrypted_data: ET.Element) -> bool:
    """Font obfuscation, or any encryption of a font file: the text stays readable."""
    algorithms = {method.get("Algorithm") for method in _all(encrypted_data, "EncryptionMethod")}
    uris = [reference.get("URI", "") for reference in _all(encrypted_data, "CipherReference")]
    return algorithms <= _FONT_OBFUSCATION or bool(uris) and all(uri.lower().endswith(_FONT_EXTENSIONS) for uri in uris)


def _rootfile(archive: zipfile.ZipFile) -> str:
    container = _parse_xml(read_member(archive, "META-INF/container.xml", "EPUB"), "META-INF/container.xml")
    for rootfile in _all(container, "rootfile"):
        if rootfile.get("full-path"):
            return str(rootfile.get("full-path"))
    raise CorruptDocument("This EPUB is malformed: META-INF/container.xml names no package file. "
                          "Export it again from the program that made it.")


def _manifest(package: ET.Element, base: str) -> dict[str, tuple[str, str, str]]:
    """id -> (member path, media type, properties). An href's '#fragment' is not part of the file."""
    return {item.get("id", ""): (_join(base, urldefrag(item.get("href", ""))[0]), item.get("media-type", ""),
                                 item.get("properties", ""))
            for item in _all(package, "item")}


def _spine_idrefs(package: ET.Element, manifest: dict[str, tuple[str, str, str]]) -> list[str]:
    idrefs = [ref.get("idref", "") for ref in _all(package, "itemref")]
    missing = [idref for idref in idrefs if idref not in manifest]
    if missing or not idrefs:
        problem = f"refers to unknown items ({', '.join(missing[:3])})" if missing else "is empty"
        raise CorruptDocument(f"This EPUB is malformed: its reading order (spine) {problem}. "
                              "Export it again from the program that made it.")
    return [idref for idref in idrefs if manifest[idref][1] in _HTML_TYPES
            or manifest[idref][0].lower().endswith((".xhtml", ".html", ".htm"))]


def _toc(archive: zipfile.ZipFile, package: ET.Element, manifest: dict[str, tuple[str, str, str]]) -> list[_TocEntry]:
    """Entries of the EPUB 3 nav document, else of the EPUB 2 NCX; [] when neither is usable."""
    nav = next((path for path, _, props in manifest.values() if "nav" in props.split()), None)
    if nav and has_member(archive, nav):
        entries = _NavParser.entries(decode_html(read_member(archive, nav, "EPUB"), nav), posixpath.dirname(nav))
        if entries:
            return entries
    spine = next(iter(_all(package, "spine")), None)
    ncx = manifest.get(spine.get("toc", "") if spine is not None else "", ("", "", ""))[0]
    if not ncx or not has_member(archive, ncx):
        return []
    return _ncx_entries(_parse_xml(read_member(archive, ncx, "EPUB"), ncx), posixpath.dirname(ncx))


def _ncx_entries(root: ET.Element, base: str) -> list[_TocEntry]:
    nav_map = next(iter(_all(root, "navMap")), None)
    return _nav_points(nav_map, base, 0) if nav_map is not None else []


def _nav_points(parent: ET.Element, base: str, depth: int) -> list[_TocEntry]:
    entries: list[_TocEntry] = []
    for point in (child for child in parent if _local(child.tag) == "navPoint"):
        # The point's own navLabel and content come before its child navPoints.
        label = " ".join((next(iter(_all(point, "text")), ET.Element("text")).text or "").split())
        content = next(iter(_all(point, "content")), None)
        if content is not None and label:
            path, fragment = urldefrag(content.get("src", ""))
            entries.append(_TocEntry(_join(base, path), fragment, label, depth))
        entries.extend(_nav_points(point, base, depth + 1))
    return entries


class _NavParser(HTMLParser):
    """The <nav epub:type="toc"> list of an EPUB 3 navigation document."""

    def __init__(self, base: str) -> None:
        super().__init__(convert_charrefs=True)
        self.base = base
        self.found: list[_TocEntry] = []
        self._in_toc = False
        self._n_lists = 0
        self._href: str | None = None
        self._label: list[str] = []

    @classmethod
    def entries(cls, markup: str, base: str) -> list[_TocEntry]:
        parser = cls(base)
        parser.feed(markup)
        parser.close()
        return parser.found

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "nav" and "toc" in f"{values.get('epub:type', '')} {values.get('role', '')}":
            self._in_toc = True
        elif self._in_toc and tag == "ol":
            self._n_lists += 1
        elif self._in_toc and tag == "a":
            self._href, self._label = values.get("href") or "", []

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav":
            self._in_toc = False
        elif self._in_toc and tag == "ol":
            self._n_lists -= 1
        elif self._in_toc and tag == "a" and self._href is not None:
            label = " ".join("".join(self._label).split())
            path, fragment = urldefrag(self._href)
            if label and path:
                self.found.append(_TocEntry(_join(self.base, path), fragment, label, max(0, self._n_lists - 1)))
            self._href = None

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._label.append(data)


def _assemble(spine: list[str], documents: list[HtmlText], toc: list[_TocEntry], title: str,
              limits: Limits) -> Document:
    builder = DocumentBuilder(limits)
    marks = _toc_marks(spine, documents, toc) if _toc_is_usable(spine, toc) else _heading_marks(documents)
    if len(documents) > 1 and _n_chapters(marks) < 2:
        marks = _spine_marks(spine, documents)
    for html, doc_marks in zip(documents, marks):
        add_paragraphs(builder, html, doc_marks)
    return builder.build(title, "epub")


def _toc_is_usable(spine: list[str], toc: list[_TocEntry]) -> bool:
    """Most table-of-contents links lead into the spine (some books' links point nowhere)."""
    members = set(spine)
    return 2 * sum(entry.path in members for entry in toc) > len(toc)


def _n_chapters(marks: list[Marks]) -> int:
    return sum(kind == "chapter" for doc_marks in marks for titles in doc_marks.values() for _, kind in titles)


def _spine_marks(spine: list[str], documents: list[HtmlText]) -> list[Marks]:
    """The last resort: each spine document is a chapter, named by its first heading or file name."""
    marks: list[Marks] = [{} for _ in documents]
    for doc_idx, (member, html) in enumerate(zip(spine, documents)):
        first = html.headings[0] if html.headings else None
        title = first[1] if first else posixpath.splitext(posixpath.basename(member))[0]
        if html.paragraphs:
            marks[doc_idx][first[2] if first else 0] = [(title, "chapter")]
    return marks


def _toc_marks(spine: list[str], documents: list[HtmlText], toc: list[_TocEntry]) -> list[Marks]:
    """Per spine document: paragraph index -> [(title, kind)] from the table of contents."""
    marks: list[Marks] = [{} for _ in documents]
    position = {member: idx for idx, member in enumerate(spine)}
    chapter_depth = _chapter_depth([entry.depth for entry in toc if entry.path in position])
    for entry in toc:
        doc_idx = position.get(entry.path)
        if doc_idx is not None:
            paragraph_idx = documents[doc_idx].ids.get(entry.fragment, 0) if entry.fragment else 0
            kind: SectionKind = "chapter" if entry.depth <= chapter_depth else "section"
            marks[doc_idx].setdefault(paragraph_idx, []).append((entry.title, kind))
    return marks


def _chapter_depth(depths: list[int]) -> int:
    """The shallowest depth with at least _MIN_CHAPTERS entries at or above it: a book whose table
    of contents nests everything under its title (and a contents page) gets chapters one level down."""
    for depth in sorted(set(depths)):
        if sum(d <= depth for d in depths) >= _MIN_CHAPTERS:
            return depth
    return 0


def _heading_marks(documents: list[HtmlText]) -> list[Marks]:
    """Per spine document: marks from <h1>-<h6>, the chapter level decided across the whole book."""
    flat = [(doc_idx, level, text, paragraph_idx) for doc_idx, html in enumerate(documents)
            for level, text, paragraph_idx in html.headings]
    marks: list[Marks] = [{} for _ in documents]
    for (doc_idx, _, text, paragraph_idx), kind in zip(flat, heading_kinds([f[1] for f in flat])):
        marks[doc_idx].setdefault(paragraph_idx, []).append((text, kind))
    return marks


def _metadata_title(package: ET.Element) -> str:
    titles = [" ".join((element.text or "").split()) for element in _all(package, "title")]
    return next((title for title in titles if title), "")


def _parse_xml(data: bytes, name: str) -> ET.Element:
    try:
        return ET.fromstring(data)  # expat >= 2.4 bounds entity expansion (billion laughs)
    except ET.ParseError as error:
        raise CorruptDocument(f"This EPUB is malformed: {name} is not valid XML ({error}). "
                              "Export it again from the program that made it.") from error


def _all(root: ET.Element, name: str) -> list[ET.Element]:
    """Every element called `name` under `root`, whatever its XML namespace."""
    return [element for element in root.iter() if _local(element.tag) == name]


def _local(tag: object) -> str:
    return tag.rsplit("}", 1)[-1] if isinstance(tag, str) else ""


def _join(base: str, href: str) -> str:
    return posixpath.normpath(posixpath.join(base, unquote(href))) if href else ""
