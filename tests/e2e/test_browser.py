"""The app in headless Chromium (docs/UI-TESTING.md): upload a real PDF, watch the prefill finish,
ask, see the answer stream and the metrics move, stop a second answer, and check that a bad file
leaves the book and chat alone, with no Gradio error pill anywhere. Screenshots land in
tests/e2e/artifacts/; look at them."""

from __future__ import annotations

import re

from conftest import ART, ROOT
from playwright.sync_api import expect

ERROR_PILLS = '[data-testid="status-tracker"] .error'


def test_upload_pdf_ask_stream_and_stop(app_url, pdf_path, page):
    page.goto(app_url)
    msg = page.locator("#msg textarea")
    expect(msg).to_be_visible()
    page.locator("#upload input[type=file]").set_input_files(str(pdf_path))
    status = page.locator("#doc-status")
    expect(status).to_contain_text("of 7,168 — fits", timeout=60_000)
    expect(status).to_contain_text("Ready", timeout=90_000)
    expect(page.locator("#chatbot")).to_contain_text("is read. Ask about it below")  # not "Upload a book"

    msg.fill("What is R?")
    msg.press("Enter")
    metrics, bot = page.locator("#metrics"), page.locator('#chatbot [data-testid="bot"]').last
    expect(metrics).to_contain_text("streaming", timeout=60_000)
    first_metrics, first_text = metrics.inner_text(), bot.inner_text()
    expect(metrics).not_to_have_text(first_metrics, timeout=30_000)  # the numbers move while it streams
    expect(metrics).to_contain_text("done", timeout=90_000)
    assert len(bot.inner_text()) > len(first_text.strip("…")), "the answer did not grow while streaming"
    final = metrics.inner_text()
    assert re.search(r"[\d.]+ tokens/s", final) and "TBT now" in final and "vs plain" in final
    assert re.search(r"full\s+\d+%", final), final
    expect(page.locator("#reading")).to_contain_text("p. ")
    expect(page.locator("#plot svg")).to_be_visible()
    page.screenshot(path=str(ART / "answered.png"))

    page.locator("#settings").get_by_text("Settings", exact=True).click()
    max_new = page.locator("#max-new input[type=number]")
    max_new.fill("300")
    max_new.press("Tab")
    msg.fill("Explain how to start R, step by step.")
    msg.press("Enter")
    expect(metrics).to_contain_text("streaming", timeout=60_000)
    page.locator("#stop").click()
    expect(metrics).to_contain_text("stopped", timeout=30_000)
    expect(bot).to_contain_text("(stopped)")
    stopped = bot.inner_text()
    page.wait_for_timeout(1000)
    assert bot.inner_text() == stopped  # nothing streams after Stop
    assert page.locator(ERROR_PILLS).count() == 0
    page.locator("#settings").get_by_text("Settings", exact=True).click()  # fold the settings for the screenshot
    page.screenshot(path=str(ART / "stopped.png"))


def test_bad_file_keeps_the_book_and_chat(app_url, pdf_path, page, tmp_path):
    page.goto(app_url)
    page.locator("#upload input[type=file]").set_input_files(str(pdf_path))
    expect(page.locator("#doc-status")).to_contain_text("Ready", timeout=90_000)  # restored from its snapshot
    msg = page.locator("#msg textarea")
    msg.fill("Who wrote R?")
    msg.press("Enter")
    expect(page.locator("#metrics")).to_contain_text("done", timeout=90_000)
    answer = page.locator('#chatbot [data-testid="bot"]').last.inner_text()

    broken = tmp_path / "broken.pdf"
    broken.write_bytes(pdf_path.read_bytes()[:3000])
    page.locator("#upload input[type=file]").set_input_files(str(broken))
    expect(page.locator("#doc-status")).to_contain_text("is still open", timeout=30_000)
    assert page.locator('#chatbot [data-testid="bot"]').last.inner_text() == answer
    assert page.locator(ERROR_PILLS).count() == 0
    page.screenshot(path=str(ART / "bad-file.png"))


def test_a_stopped_reading_reads_on_and_a_book_is_removed(app_url, page, tmp_path):
    """Cancel a reading in its second part (4,096 tokens a part): the message says what was kept
    and the library picks the book, so "Open book" reads on from there; then Remove… names what
    it deletes, and Remove deletes it."""
    book = tmp_path / "persuasion-opening.txt"
    book.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:26000], encoding="utf-8")
    page.goto(app_url)
    page.locator("#upload input[type=file]").set_input_files(str(book))
    status = page.locator("#doc-status")
    expect(status).to_contain_text(re.compile(r"chunk (9|1\d) of"), timeout=120_000)
    page.locator("#cancel-prefill").click()
    expect(status).to_contain_text("Stopped after reading", timeout=60_000)
    expect(page.locator("#books input")).to_have_value(re.compile(r"\d+% read · persuasion-opening"))
    page.screenshot(path=str(ART / "reading-stopped.png"))
    page.locator("#open-book").click()
    expect(status).to_contain_text("a stopped reading had kept", timeout=120_000)
    expect(status).to_contain_text("Ready")

    page.locator("#remove-book").click()
    expect(page.locator("#confirm-note")).to_contain_text("Remove persuasion-opening from the library")
    page.locator("#confirm-remove").scroll_into_view_if_needed()
    page.screenshot(path=str(ART / "remove-confirm.png"))
    page.locator("#confirm-remove").click()
    expect(status).to_contain_text(re.compile(r"Removed persuasion-opening from the library: \d+ MB freed"))
    expect(page.locator("#book-title")).to_contain_text("No book open")
    expect(page.locator("#chatbot")).to_contain_text("Upload a book, then ask about it.")
    assert page.locator(ERROR_PILLS).count() == 0


def test_a_too_long_book_reads_chosen_chapters_and_then_only_what_is_new(app_url, page):
    """The whole novel, far beyond the context: ticking chapters makes the load button say what it
    will read (and refuse too many); chapter 1 read, then chapters 1-2 start from it."""
    page.goto(app_url)
    page.locator("#upload input[type=file]").set_input_files(str(ROOT / "assets" / "persuasion.txt"))
    status, load = page.locator("#doc-status"), page.locator("#load-selection")
    chapters = page.locator("#pick-chapters")
    expect(status).to_contain_text("too long by", timeout=60_000)
    expect(load).to_have_text(re.compile(r"Read the first [\d,]+ tokens"))
    for n in range(1, 25):
        chapters.get_by_text(f"Chapter {n} (").click()
    expect(load).to_have_text(re.compile(r"24 chapters, [\d,]+ tokens: [\d,]+ too many"))
    expect(load).to_be_disabled()
    load.scroll_into_view_if_needed()  # the list scrolls: the button stays under it
    page.screenshot(path=str(ART / "chapters.png"))
    for n in range(2, 25):
        chapters.get_by_text(f"Chapter {n} (").click()
    expect(load).to_have_text(re.compile(r"Read 1 chapter, [\d,]+ tokens"))
    load.click()
    expect(status).to_contain_text("Ready", timeout=120_000)

    expect(status).to_contain_text("To read more of persuasion, tick more chapters below")
    chapters.get_by_text("Chapter 2 (").click()  # the picker stays, chapter 1 still ticked
    expect(load).to_have_text(re.compile(r"Read 2 chapters, [\d,]+ tokens"))
    load.click()
    expect(status).to_contain_text(re.compile(r"after the [\d,]+ read before in persuasion \(Chapter 1\)"),
                                   timeout=120_000)
    expect(status).to_contain_text("Ready")
    assert page.locator(ERROR_PILLS).count() == 0
