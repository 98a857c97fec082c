"""The metrics panel's table (app/views.py), without a server."""

from app.views import Counters, render_metrics
from engine.session import Stats
from engine.speculative import LevelStats


def test_a_level_that_tested_nothing_shows_a_dash_not_zero_percent():
    """On CPUs the top level often checks the bottom drafter's drafts itself and skips the
    middle level for a whole answer: its row must not read as "every draft rejected"."""
    top = LevelStats("full", n_checks=10, n_tested=12, n_accepted=9, n_emitted=19)
    stats = Stats([LevelStats("retrieval"), top], n_tokens=19, tbt_ms_mean=50.0)
    html = render_metrics("answering", stats, None, Counters())
    assert "| retrieval | – | – | 0 |" in html and "| full | 75% | 1.90 | 10 |" in html
    assert "–: it checked no drafts, it drafted" in html  # the dash explained under the table
    assert "checked no drafts" not in render_metrics("idle", None, None, Counters())  # no table, no legend


def test_the_speedup_compares_the_stack_with_a_plain_step_taken_in_the_same_answer():
    from app.views import speedup_note

    now = Stats([], n_tokens=20, tbt_ms_mean=120.0, step_ms_mean=90.0, plain_ms=99.0)
    assert speedup_note(now, probe_ms=70.0) == " · **1.10×** vs plain (99 ms/token now)"
    not_yet = Stats([], n_tokens=3, tbt_ms_mean=140.0, step_ms_mean=100.0)
    assert speedup_note(not_yet, probe_ms=70.0) == " · **0.50×** vs plain (70 ms/token at opening)"
    assert speedup_note(not_yet, probe_ms=None) == ""


def test_an_offloaded_book_in_pageable_memory_is_said_in_the_metrics():
    """Issue 54 row 8: the engine fell back to pageable host memory; the reader is told why it is slower."""
    stats = Stats([LevelStats("full")], n_tokens=3, tbt_ms_mean=100.0, kv_host_memory="pageable")
    assert "refused pinned memory" in render_metrics("answering", stats, None, Counters())
    pinned = Stats([LevelStats("full")], n_tokens=3, tbt_ms_mean=100.0, kv_host_memory="pinned")
    assert "pinned memory" not in render_metrics("answering", pinned, None, Counters())
