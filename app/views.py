"""What the panels show, as Markdown/HTML: the upload checklist, live metrics, the plot, the reading.

Pure functions of the state they are given (no Gradio, no engine calls), so app/ui.py stays
layout and wiring. Counters shown are the viewer's own (a user never sees another's numbers).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from app.session import BookSession
from engine.session import Stats

STAGES = ("Extract", "Clean", "Tokenize", "Prefill")
NOT_AVAILABLE = "not available with a remote backend"  # what a book whose answers report neither shows


@dataclass
class Stages:
    """The upload's checklist (extract → clean → tokenize → prefill) as Markdown."""

    name: str
    rows: dict[str, tuple[bool, str]] = field(default_factory=dict)  # stage -> (is done, detail)

    def set(self, stage: str, detail: str = "", is_done: bool = False) -> str:  # the stages before it are done
        stage = stage if stage in STAGES else "Extract"
        self.rows = {s: (True, self.rows.get(s, (True, ""))[1]) for s in STAGES[:STAGES.index(stage)]}
        self.rows[stage] = (is_done, detail)
        return self.render()

    def render(self) -> str:
        rows = [f"- {'✓' if done else '◌'} {stage}" + (f" — {detail}" if detail else "")
                for stage in STAGES if stage in self.rows for done, detail in [self.rows[stage]]]
        return "\n".join([f"**{self.name}**", "", *rows])


@dataclass
class Counters:
    """One user's engine work: documents prefilled and tokens prefilled (books and questions)."""

    n_prefills: int = 0
    n_prefill_tokens: int = 0


LEVELS_LEGEND = ("<small>accepted: the drafted tokens this level kept (each is the full model's own) · "
                 "–: it checked no drafts, it drafted</small>")


def render_metrics(state: str, stats: Stats | None, book: BookSession | None, counters: Counters,
                   cpu_note: str = "") -> str:
    """State pill, speed, TBT, speedup vs plain decoding, a row per checking level, a note when other
    programs take the engine's cores (app/cpu.py), the user's counters."""
    head, blocks = [f"<span class='state'>{state}</span>"], []
    if stats is not None and stats.n_tokens:
        speedup = ""
        if book is not None and book.has_levels and book.session.levels != "plain":
            speedup = speedup_note(stats, book.plain_ms)
        head += [f"**{stats.tokens_per_s:.1f}** tokens/s · {stats.n_tokens:,} tokens{speedup}",
                 f"TBT now **{stats.tbt_ms_last:.0f}** ms · mean **{stats.tbt_ms_mean:.0f}** ms · "
                 f"first token {stats.ttft_s:.2f} s"]
        # a level that tested nothing shows "–", not 0%: on CPUs the middle level is often skipped
        # (the top checks the bottom drafter's drafts itself, engine/speculative.py `LevelStack`)
        if book is not None and not book.has_levels:
            blocks.append(f"Speculative-decoding metrics: {NOT_AVAILABLE}.")
        rows = [f"| {s.name} | {f'{100 * s.acceptance:.0f}%' if s.n_tested else '–'} | "
                f"{f'{s.tokens_per_check:.2f}' if s.n_checks else '–'} | {s.n_checks} |" for s in stats.levels]
        if rows:
            blocks.append("\n".join(["| level | accepted | tokens/check | checks |", "|:--|--:|--:|--:|", *rows]))
            blocks.append(LEVELS_LEGEND)
    if stats is not None and stats.kv_host_memory == "pageable":
        blocks.append("⚠ The book's memory is in pageable host memory (this system refused pinned memory): "
                      "each step copies it to the GPU more slowly.")
    if cpu_note:
        blocks.append(cpu_note)
    if book is not None and book.save_error:
        blocks.append(f"⚠ {book.save_error}")
    blocks.append(f"<small>prefills: {counters.n_prefills} · prefilled tokens: {counters.n_prefill_tokens:,}</small>")
    return "\n\n".join(["  \n".join(head), *blocks])


def speedup_note(stats: Stats, probe_ms: float | None) -> str:
    """The stack against plain decoding. Both as the engine runs now: its own time per token
    against the top level's one-token check (a plain step) in the same answer, so what the app
    and browser take between steps slows both alike. Before the top has checked one token alone:
    the wall-clock TBT against the probe at the book's opening (engine alone, so lower)."""
    if stats.plain_ms and stats.step_ms_mean:
        return f" · **{stats.plain_ms / stats.step_ms_mean:.2f}×** vs plain ({stats.plain_ms:.0f} ms/token now)"
    if probe_ms and stats.tbt_ms_mean:
        return f" · **{probe_ms / stats.tbt_ms_mean:.2f}×** vs plain ({probe_ms:.0f} ms/token at opening)"
    return ""


def render_plot(points: list[tuple[float, float]]) -> str:
    """Inline SVG: time between tokens (ms) and the top level's acceptance, one point per step."""
    if len(points) < 2:
        return "<div class='plot-empty'>The live plot appears while an answer streams.</div>"
    top = max(p[0] for p in points) or 1.0

    def line(values: list[float], cls: str) -> str:  # x and y in [0, 1], stretched by the viewBox
        xy = " ".join(f"{i / (len(values) - 1):.4f},{1 - min(v, 1.0):.4f}" for i, v in enumerate(values))
        return f"<polyline class='{cls}' points='{xy}'/>"

    return (f"<svg viewBox='-0.02 -0.06 1.04 1.12' preserveAspectRatio='none' class='plot' role='img'>"
            f"{line([p[0] / top for p in points], 'tbt')}{line([p[1] for p in points], 'acc')}</svg>"
            f"<div class='legend'><span class='tbt'>━ TBT (max {top:.0f} ms)</span>"
            f"<span class='acc'>━ acceptance (0–100%)</span></div>")


def render_reading(book: BookSession | None, passages) -> str:
    if book is None:
        return "Load a book to see which passages the model reads."
    if not book.has_reading:
        return f"Where the model is reading: {NOT_AVAILABLE}."
    if "retrieval" not in book.session.levels:
        return f"The level stack `{book.session.levels}` has no retrieval level: every check reads the whole book."
    if not passages:
        return "The retrieval level picks its passages when the answer starts."
    return "\n\n".join(f"<div class='passage'><b>{p.label}</b> <span class='share'>{100 * p.share:.0f}%</span>"
                       f"<div class='snippet'>{html.escape(p.snippet)}</div></div>" for p in passages)
