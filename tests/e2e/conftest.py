"""Fixtures for the browser test (UI-TESTING.md): the app on a free port, Debian's Chromium
driven by Playwright (never `playwright install`), a real PDF of a few pages, screenshots saved
under tests/e2e/artifacts/ (gitignored) for a person to look at."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ART = Path(os.environ.get("E2E_ARTIFACTS", Path(__file__).resolve().parent / "artifacts"))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ASSETS = Path(os.environ.get("BOOKCHAT_CACHE", Path.home() / ".cache" / "bookchat")) / "assets"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_url(tmp_path_factory):
    import httpx

    from engine import models

    if models.packaged_model_dir("smollm2-135m", assemble=False) is None:
        pytest.skip("smollm2-135m is not assembled: run `python -m engine.models --only smollm2-135m`")
    port, library = _free_port(), tmp_path_factory.mktemp("library")
    ART.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, APP_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1")
    args = ["--model", "smollm2-135m", "--threads", "1", "--library", str(library), "--max-new-tokens", "24"]
    with open(ART / "app-e2e.log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}/", time.time() + 120
    while True:
        assert proc.poll() is None, f"the app exited, see {ART / 'app-e2e.log'}"
        try:
            if httpx.get(url + "gradio_api/info", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "the app did not start in 120 s"
        time.sleep(0.3)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


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
