"""DOCX -> Document with the standard library: zip + word/document.xml.

Paragraphs become blocks (table rows become tab-separated lines); a paragraph whose style is a
heading ("Heading 1", or any style with an outline level in styles.xml) starts a chapter or
section. Tracked deletions (w:delText), comments and footnotes are left out.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
import zipfile

from app.formats.archive import has_member, open_archive, read_member
from app.formats.cleaning import clean_text
from app.formats.document import Document, DocumentBuilder, heading_kinds
from app.formats.errors import CorruptDocument
from app.formats.limits import Limits

W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_DC_TITLE = "{http://purl.org/dc/elements/1.1/}title"
_HEADING_NAME = re.compile(r"^heading\s*(\d)$", re.IGNORECASE)
_RUN_TEXT = {W + "t": None, W + "tab": "\t", W + "br": "\n", W + "cr": "\n", W + "noBreakHyphen": "-"}
_Paragraph = tuple[str, int | None]  # text, heading level (None for body text)


def load_docx(path: str, limits: Limits) -> Document:
    """Read the main document part; headings from paragraph styles."""
    with open_archive(path, "DOCX", limits) as archive:
        body = _parse(read_member(archive, "word/document.xml", "DOCX"), "word/document.xml").find(W + "body")
        levels = _style_levels(archive)
        title = _core_title(archive)
    paragraphs = _block_paragraphs(body, levels) if body is not None else []
    headings = [level for _, level in paragraphs if level is not None]
    kinds = iter(heading_kinds(headings))
    builder = DocumentBuilder(limits)
    for text, level in paragraphs:
        if level is not None:
            builder.mark(text, next(kinds))
        builder.add(clean_text(text))
    first_heading = next((text for text, level in paragraphs if level is not None), "")
    return builder.build(title or first_heading or os.path.splitext(os.path.basename(path))[0], "docx")


def _block_paragraphs(container: ET.Element, levels: dict[str, int]) -> list[_Paragraph]:
    """Paragraphs of a body, table cell or content control, in document order."""
    paragraphs: list[_Paragraph] = []
    for child in container:
        if child.tag == W + "p":
            paragraphs.append((_paragraph_text(child), _heading_level(child, levels)))
        elif child.tag == W + "tbl":
            paragraphs.extend((_row_text(row, levels), None) for row in child.iter(W + "tr"))
        else:  # w:sdt, w:sdtContent, w:customXml, w:ins...: look inside
            paragraphs.extend(_block_paragraphs(child, levels))
    return paragraphs


def _paragraph_text(paragraph: ET.Element) -> str:
    parts: list[str] = []
    for element in paragraph.iter():
        if element.tag in _RUN_TEXT:
            fixed = _RUN_TEXT[element.tag]
            parts.append(element.text or "" if fixed is None else fixed)
    return "".join(parts).strip()


def _row_text(row: ET.Element, levels: dict[str, int]) -> str:
    cells = [" ".join(text for text, _ in _block_paragraphs(cell, levels) if text) for cell in row.iter(W + "tc")]
    return "\t".join(cells)


def _heading_level(paragraph: ET.Element, levels: dict[str, int]) -> int | None:
    properties = paragraph.find(W + "pPr")
    if properties is None:
        return None
    outline = properties.find(W + "outlineLvl")
    if outline is not None and (outline.get(W + "val") or "").isdigit():
        return int(outline.get(W + "val") or 0) + 1
    style = properties.find(W + "pStyle")
    style_id = style.get(W + "val", "") if style is not None else ""
    by_name = _HEADING_NAME.match(style_id)
    return levels.get(style_id) or (int(by_name.group(1)) if by_name else None)


def _style_levels(archive: zipfile.ZipFile) -> dict[str, int]:
    """Style id -> heading level, from names ('heading 1') or outline levels in styles.xml."""
    if not has_member(archive, "word/styles.xml"):
        return {}
    levels: dict[str, int] = {}
    for style in _parse(read_member(archive, "word/styles.xml", "DOCX"), "word/styles.xml").iter(W + "style"):
        name = style.find(W + "name")
        by_name = _HEADING_NAME.match(name.get(W + "val", "") if name is not None else "")
        outline = style.find(f"{W}pPr/{W}outlineLvl")
        if by_name:
            levels[style.get(W + "styleId", "")] = int(by_name.group(1))
        elif outline is not None and (outline.get(W + "val") or "").isdigit():
            levels[style.get(W + "styleId", "")] = int(outline.get(W + "val") or 0) + 1
    return levels


def _core_title(archive: zipfile.ZipFile) -> str:
    if not has_member(archive, "docProps/core.xml"):
        return ""
    title = _parse(read_member(archive, "docProps/core.xml", "DOCX"), "docProps/core.xml").find(_DC_TITLE)
    return " ".join((title.text or "").split()) if title is not None else ""


def _parse(data: bytes, name: str) -> ET.Element:
    try:
        return ET.fromstring(data)  # expat >= 2.4 bounds entity expansion (billion laughs)
    except ET.ParseError as error:
        raise CorruptDocument(f"This DOCX is malformed: {name} is not valid XML ({error}). "
                              "Open it in Word or LibreOffice and save it again.") from error
