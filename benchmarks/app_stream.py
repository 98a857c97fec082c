"""What a reader waits for in the app itself: time between tokens shown in the metrics panel while
the app streams, against the engine's own.

Starts `python app.py` (its defaults, or `--app-args`) on a free port with its own library, opens
the first `--chars` characters of assets/persuasion.txt and asks `--question` `--answers` times,
through Chromium (Playwright with Debian's /usr/bin/chromium, as a reader's browser on the same
machine) or, with `--client`, through gradio_client (no browser). Each answer's TBT is the app's
own figures: the mean over the answer, the speedup over plain decoding and the plain step it
compares with (the top level's one-token check in the same answer, app/views.py `speedup_note`).
The engine's figure for the same book and question: `python -m tools generate --file ... --question ...`.

    python -m benchmarks.app_stream --answers 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from app import child
from benchmarks.cli import add_common_args

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Summarize what happens in this part of the book in two paragraphs."


def figures(metrics: str) -> dict:
    """The metrics panel's mean TBT and plain step in ms, and its speedup."""
    mean, plain = re.search(r"mean \**(\d+)", metrics), re.search(r"\**([\d.]+)×\** vs plain \((\d+) ms", metrics)
    return {"tbt_mean_ms": mean and int(mean[1]), "plain_ms": plain and int(plain[2]),
            "speedup": plain and float(plain[1])}


def by_client(url: str, book: Path, question: str, answers: int, levels: str) -> list[dict]:
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False)
    client.predict(handle_file(str(book)), "", api_name="/load_book")
    out = []
    for _ in range(answers):
        job = client.submit(question, [], 0.7, 0.8, 256, 0, levels, api_name="/ask")
        out.append(figures(job.result()[2]))
    return out


def by_browser(url: str, book: Path, question: str, answers: int) -> list[dict]:
    from playwright.sync_api import expect, sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(url)
        page.locator("#upload input[type=file]").set_input_files(str(book))
        expect(page.locator("#doc-status")).to_contain_text("Ready", timeout=1_800_000)
        for _ in range(answers):
            page.locator("#msg textarea").fill(question)
            page.locator("#msg textarea").press("Enter")
            expect(page.locator("#metrics")).to_contain_text("streaming", timeout=600_000)
            expect(page.locator("#metrics")).to_contain_text("done", timeout=600_000)
            out.append(figures(page.locator("#metrics").inner_text()))
        browser.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.app_stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chars", type=int, default=30_000, help="characters of the book (30,000: about 7K tokens)")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--answers", type=int, default=2)
    p.add_argument("--client", action="store_true", help="gradio_client instead of Chromium")
    p.add_argument("--levels", default="retrieval>full", help="with --client: the stack asked for")
    p.add_argument("--app-args", default="", help="more arguments for app.py")
    add_common_args(p, "app_stream", model=False, threads=False)
    args = p.parse_args(argv)
    load = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        book = Path(tmp) / "persuasion-opening.txt"
        book.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:args.chars], encoding="utf-8")
        proc, url = child.start_app(["--library", str(Path(tmp) / "library"), *args.app_args.split()],
                                    Path(tmp) / "app.log", timeout_s=600)
        try:
            answers = (by_client(url, book, args.question, args.answers, args.levels) if args.client
                       else by_browser(url, book, args.question, args.answers))
        finally:
            child.stop(proc)
    report = {"command": "python -m benchmarks.app_stream " + " ".join(sys.argv[1:] if argv is None else argv),
              "load_avg_before": load, "answers": answers}
    for i, a in enumerate(answers):
        print(f"answer {i + 1}: mean TBT {a['tbt_mean_ms']} ms, {a['speedup']}x vs plain ({a['plain_ms']} ms)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
