"""Smoke test of the long-context benchmark (benchmarks/longctx.py --quick): it runs end to end on
real weights and writes a well-formed report. No timing assertions: speed is measured, not tested."""

import json

import pytest

from benchmarks import longctx
from tests.conftest import packaged_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    packaged_or_skip("smollm2-135m")
    out = tmp_path_factory.mktemp("longctx") / "longctx.json"
    assert longctx.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_quick_run_reports_every_method(quick_report):
    report, out = quick_report
    (ctx,) = report["contexts"]
    assert 900 <= ctx["n_doc_tokens"] <= 1100
    methods = [r["method"] for r in ctx["runs"]]
    assert methods == ["hf:plain", "hf:prompt-lookup", "ours:plain", "ours:ngram>retrieval>full"]
    for r in ctx["runs"]:
        assert 1 <= r["n_tokens"] <= 16 and r["tokens"]
        assert r["ttft_s"] > 0 and r["peak_rss_mib"] > 0 and r["read_gb_s"] > 0
    assert ctx["prefill"]["ours_tokens_per_s"] > 0 and ctx["prefill"]["hf_tokens_per_s"] > 0
    assert ctx["floor"]["ms"] > 0 and report["hardware"]["copy_gb_s"] > 0
    assert ctx["memory"]["ours"]["peak_mib"] > ctx["memory"]["ours"]["weights_mib"] > 0
    assert ctx["memory"]["hf"]["peak_mib"] > ctx["memory"]["hf"]["weights_mib"] > 0
    md = out.with_suffix(".md").read_text()
    assert md.count("| 1,0") == 1 + len(methods)  # the prefill row and one row per run
    assert md.count("| 1K | greedy |") == len(methods)  # the summary: one row per method


def test_ours_are_compared_with_both_hf_baselines(quick_report):
    report, _ = quick_report
    for r in report["contexts"][0]["runs"]:
        if r["method"].startswith("ours:"):
            assert r["speedup_vs_hf_plain"] > 0 and r["speedup_vs_hf_prompt_lookup"] > 0


def test_greedy_runs_are_compared_with_hf_plain(quick_report):
    """Every greedy run says whether it equals HF plain decoding (reported, not asserted: bf16
    kernels may round differently), and our runs carry a per-level breakdown."""
    report, _ = quick_report
    for r in report["contexts"][0]["runs"]:
        assert isinstance(r["equals_hf_plain"], bool)
        assert r["equals_hf_plain"] == (r["diverges_at"] is None)
        if r["method"].startswith("ours:"):
            assert [lv["level"] for lv in r["levels"]][-3:] == ["full", "below", "other"]
            assert abs(sum(lv["share"] for lv in r["levels"]) - 1) < 1e-6


def test_copy_share_counts_tokens_in_book_runs():
    book = list(range(100))
    grams = {tuple(book[i:i + longctx.COPY_NGRAM]) for i in range(len(book) - longctx.COPY_NGRAM + 1)}
    assert longctx.copy_share(list(range(10, 26)), grams) == 1.0  # a 16-token quote
    assert longctx.copy_share([500 + i for i in range(16)], grams) == 0.0  # nothing from the book
    assert longctx.copy_share(list(range(8)) + [999] * 8, grams) == 0.5  # half quoted


def test_draft_methods_come_with_a_draft_model():
    with_draft = longctx.parse_args(["--draft", "qwen2.5-coder-0.5b"]).methods
    assert {"hf:assisted", "ours:draft>full", "ours:draft>retrieval>full"} <= set(with_draft)
    assert not [m for m in longctx.parse_args([]).methods if longctx.needs_draft(m)]
    with pytest.raises(SystemExit):
        longctx.parse_args(["--methods", "ours:plain,ours:draft>full"])
