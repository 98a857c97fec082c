"""The outline in headless Chromium (issue 56): a book longer than the context is uploaded, its
outline starts at once; reading a part of it and a question pause it (the page says so), the answer
comes, the outline fills in, and its Markdown export is offered. Screenshots under tests/e2e/artifacts/."""

from __future__ import annotations

import re

from tests.e2e.conftest import ART, ROOT

ERROR_PILLS = '[data-testid="status-tracker"] .error'


def test_the_outline_fills_in_behind_a_question_and_is_exported(app_url, page, tmp_path):
    from playwright.sync_api import expect

    book = tmp_path / "persuasion-three-chapters.txt"  # about twice SmolLM2's context
    book.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    page.goto(app_url)
    page.locator("#upload input[type=file]").set_input_files(str(book))
    status, outline_status = page.locator("#doc-status"), page.locator("#outline-status")
    rows = page.locator("#outline")
    expect(status).to_contain_text("too long by", timeout=60_000)
    expect(outline_status).to_contain_text(re.compile(r"of \d+ parts"))
    expect(rows).to_contain_text("Chapter 1 —")

    page.locator("#load-selection").click()  # the first tokens that fit: a reading goes first
    expect(outline_status).to_contain_text("paused", timeout=60_000)
    expect(status).to_contain_text("Ready", timeout=240_000)
    msg, metrics = page.locator("#msg textarea"), page.locator("#metrics")
    msg.fill("Who is Sir Walter Elliot?")
    msg.press("Enter")
    expect(metrics).to_contain_text("streaming", timeout=60_000)
    expect(outline_status).to_contain_text("paused")  # the answer goes first
    expect(metrics).to_contain_text("done", timeout=240_000)
    assert page.locator('#chatbot [data-testid="bot"]').last.inner_text().strip()

    expect(outline_status).to_contain_text(re.compile(r"[1-9]\d* of \d+ parts"), timeout=480_000)
    page.screenshot(path=str(ART / "outline.png"), full_page=True)
    page.locator("#outline-export").click()
    exported = page.locator("#outline-file")
    expect(exported).to_contain_text(re.compile(r"persuasion-three-chapters-outline\s*\.md"))
    text = page.request.get(exported.locator("a").first.get_attribute("href")).text()
    assert text.startswith("# persuasion-three-chapters\n") and "### Chapter 1\n" in text
    assert page.locator(ERROR_PILLS).count() == 0
