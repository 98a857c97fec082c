"""Sources in headless Chromium (issue 55): ask, see the sources under the answer, click one and see
the passage highlighted in the book view, export the chat with them, reopen the chat in a new page
and see the same sources. Screenshots under tests/e2e/artifacts/ (sources.png, reopened.png): look."""

from __future__ import annotations

import re

from tests.e2e.conftest import ART, ROOT

ERROR_PILLS = '[data-testid="status-tracker"] .error'


def test_sources_open_the_book_at_the_passage_and_come_back_with_the_chat(app_url, page, tmp_path):
    from playwright.sync_api import expect

    book = tmp_path / "persuasion-opening.txt"
    book.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:9_000], encoding="utf-8")
    page.goto(app_url)
    page.locator("#upload input[type=file]").set_input_files(str(book))
    expect(page.locator("#doc-status")).to_contain_text("Ready", timeout=240_000)
    msg, metrics = page.locator("#msg textarea"), page.locator("#metrics")
    msg.fill("Which book does Sir Walter Elliot like to read?")
    msg.press("Enter")
    expect(metrics).to_contain_text("done", timeout=240_000)
    bot = page.locator('#chatbot [data-testid="bot"]').last
    expect(bot).to_contain_text(re.compile(r"Sources: \[1\] .+\(\d+%\)"))
    sources = page.locator("#sources")
    expect(sources).to_be_visible()
    labels = sources.locator("label")
    first = labels.first.inner_text()
    labels.first.click()
    view = page.locator("#book-view")
    expect(view.locator("mark")).to_be_visible(timeout=30_000)
    marked = " ".join(view.locator("mark").inner_text().split())
    assert marked[:40] in " ".join(first.split()) or first.split(": ", 1)[1][:30] in marked
    page.screenshot(path=str(ART / "sources.png"), full_page=True)

    page.locator("#export-md").click()
    # the file's name, which Gradio shows with its extension split off
    expect(page.locator("#export-file")).to_contain_text(re.compile(r"persuasion-opening-chat\s*\.md"))
    link = page.locator("#export-file a").first
    with page.expect_download() as download:
        link.click()
    exported = download.value.path().read_text(encoding="utf-8")
    assert "Sources:" in exported and "of the question's attention" in exported
    answer = bot.inner_text()

    page.goto(app_url)  # a new session: open the book and the chat from the library
    page.locator("#books input").click()
    page.get_by_role("option", name=re.compile("persuasion-opening")).first.click()
    page.locator("#open-book").click()
    expect(page.locator("#doc-status")).to_contain_text("Ready", timeout=120_000)
    chats = page.locator("#chats input")
    chats.click()
    page.get_by_role("option").first.click()
    reopened = page.locator('#chatbot [data-testid="bot"]').last
    expect(reopened).to_contain_text("Sources: [1]", timeout=30_000)
    assert " ".join(reopened.inner_text().split()) == " ".join(answer.split())
    expect(page.locator("#sources label").first).to_have_text(first)
    assert page.locator(ERROR_PILLS).count() == 0
    page.screenshot(path=str(ART / "reopened.png"), full_page=True)
