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
