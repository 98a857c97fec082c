"""Smoke test of benchmarks/app_stream.py: the app started on SmolLM2, one answer through
gradio_client, and the metrics panel's figures read back (a changed panel format reads as None
here). No timing assertions: speed is measured, not tested."""

import json

from benchmarks import app_stream
from tests.conftest import packaged_or_skip


def test_one_answer_through_the_app_reports_its_figures(tmp_path):
    packaged_or_skip("smollm2-135m")
    out = tmp_path / "app_stream.json"
    app_stream.main(["--client", "--levels", "ngram>retrieval>full", "--chars", "3000", "--answers", "1",
                     "--app-args", "--model smollm2-135m --threads 1 --max-new-tokens 8", "--out", str(out)])
    (answer,) = json.loads(out.read_text())["answers"]
    assert answer["tbt_mean_ms"] > 0 and answer["plain_ms"] > 0 and answer["speedup"] > 0


def test_the_panels_figures_read_from_markdown_and_from_the_page():
    """gradio_client returns the panel's Markdown; Chromium's page has the bold already drawn."""
    want = {"tbt_mean_ms": 33, "plain_ms": 46, "speedup": 1.39}
    markdown = ("**29.9** tokens/s · 24 tokens · **1.39×** vs plain (46 ms/token now)  \n"
                "TBT now **19** ms · mean **33** ms")
    assert app_stream.figures(markdown) == want
    assert app_stream.figures(markdown.replace("**", "")) == want
