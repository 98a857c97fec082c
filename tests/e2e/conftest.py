"""Fixtures for the browser test (docs/UI-TESTING.md): the app on a free port, Debian's Chromium
driven by Playwright (never `playwright install`), a real PDF of a few pages, screenshots saved
under tests/e2e/artifacts/ (gitignored) for a person to look at."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ART = Path(os.environ.get("E2E_ARTIFACTS", Path(__file__).resolve().parent / "artifacts"))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ASSETS = Path(os.environ.get("BOOKCHAT_CACHE", Path.home() / ".cache" / "bookchat")) / "assets"


@pytest.fixture(scope="session")
def app_url(tmp_path_factory):
    from app import child
    from tests.conftest import packaged_or_skip

    packaged_or_skip("smollm2-135m")
    # 96 tokens: the answer view is redrawn every 0.25 s (app/ui.py REDRAW_EVERY_S), and 24 tokens of
    # SmolLM2 (~0.5 s) could end before the test saw "streaming"
    args = ["--model", "smollm2-135m", "--threads", "1", "--library", str(tmp_path_factory.mktemp("library")),
            "--max-new-tokens", "96"]
    proc, url = child.start_app(args, ART / "app-e2e.log", env={"OMP_NUM_THREADS": "1"})
    yield url
    child.stop(proc)


@pytest.fixture(scope="session")
def pdf_path(tmp_path_factory) -> Path:
    """Three pages of R-intro.pdf (Debian's r-doc-pdf): the Preface and the start of chapter 1."""
    from pypdf import PdfReader, PdfWriter

    source = ASSETS / "R-intro.pdf"
    if not source.is_file():
        pytest.skip(f"{source} is missing: run `bash .ci/fetch_assets.sh`")
    writer = PdfWriter()
    for page in PdfReader(source).pages[6:9]:
        writer.add_page(page)
    path = tmp_path_factory.mktemp("docs") / "R-intro-excerpt.pdf"
    with open(path, "wb") as file:
        writer.write(file)
    return path


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y --no-install-recommends chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    errors: list[str] = []
    pg.on("pageerror", lambda error: errors.append(str(error)))
    yield pg
    pg.screenshot(path=str(ART / f"{request.node.name}-full.png"), full_page=True)
    context.close()
    assert not errors, errors
