"""Smoke tests of the llama.cpp side-by-side benchmark (benchmarks/peers.py --quick): it skips
cleanly when llama.cpp is not built, and with a stand-in llama-bench (the outside world, printing
llama-bench's JSON) it runs ours on real weights and reports both with ratios. No timing
assertions: speed is measured, not tested."""

import json
import stat

import pytest

from benchmarks import peers
from engine.models import gguf_path

FAKE_BENCH = """#!/bin/sh
# stand-in llama-bench: 50 tokens/s decoding (-n > 0), 400 tokens/s prefilling
case " $* " in *" -n 0 "*) ts=400.0 ;; *) ts=50.0 ;; esac
echo "[{\\"n_threads\\": 1, \\"avg_ts\\": $ts}]"
"""

FAKE_LOOKUP = """#!/bin/sh
# stand-in llama-lookup: its log's summary lines, on stderr as llama.cpp's LOG_INF writes them
echo "encoded  300 tokens in    1.000 seconds, speed:  300.000 t/s" >&2
echo "decoded    8 tokens in    0.100 seconds, speed:   80.000 t/s" >&2
echo "accept       = 50.000%" >&2
"""


def fake_tool(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_quick_skips_cleanly_without_llamacpp(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMACPP_DIR", str(tmp_path / "absent"))
    out = tmp_path / "peers.json"
    assert peers.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "llama-bench" in report["skipped"] and report["runs"] == []


@pytest.mark.slow
def test_quick_reports_ours_beside_llama_bench(tmp_path, monkeypatch):
    if not gguf_path("smollm2-135m").is_file():
        pytest.skip("smollm2-135m is not assembled: run `python -m tools.models --only smollm2-135m`")
    bench = tmp_path / "llama" / "bin" / "llama-bench"
    bench.parent.mkdir(parents=True)
    fake_tool(bench, FAKE_BENCH)
    fake_tool(bench.parent / "llama-lookup", FAKE_LOOKUP)
    monkeypatch.setenv("LLAMACPP_DIR", str(tmp_path / "llama"))
    out = tmp_path / "peers.json"
    assert peers.main(["--quick", "--out", str(out), "--stacks", "ngram>full", "--spec"]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["threads"] == 1 and 200 <= run["n_doc_tokens"] <= 300
    assert run["llama.cpp"]["decode"]["ms_per_token"] == pytest.approx(20.0)
    assert run["llama.cpp"]["prefill"]["tokens_per_s"] == pytest.approx(400.0)
    ours = run["ours"]["float32"]
    assert ours["ms_per_token"] > 0 and ours["prefill_tokens_per_s"] > 0 and 1 <= ours["n_tokens"] <= 8
    ratio = 20.0 / ours["ms_per_token"]
    assert f"({ratio:.2f}x)" in report["table"]
    stacks = ours["stacks"]
    assert list(stacks) == ["plain", "ngram>full"] and stacks["ngram>full"]["tokens"] == stacks["plain"]["tokens"]
    assert run["llama.cpp"]["lookup"]["ms_per_token"] == pytest.approx(12.5)
    assert run["llama.cpp"]["lookup"]["accept"] == pytest.approx(0.5)
    assert "| llama.cpp lookup | 12.5 | 1.60x | 0.50 |" in report["table"]
    assert "`ngram>full`" in report["table"]
    assert "<|im_start|>" in out.with_suffix(".prompt256.txt").read_text()  # the chat-wrapped book, as text
