"""What each model measured on this machine: prefill rate and plain decoding time per token.

Every prefill the app runs and every plain-decoding probe (the speedup's baseline) is recorded in
`speeds.json` in the library folder, so the model picker shows speeds measured here, and a book
about to be prefilled gets a time estimate before it starts (issue 21). A prefill of n tokens
costs about n + share * n^2 / 2 tokens' worth of linear work (each token attends to those before
it; `attention_share` from the model's shapes), so the estimate scales the nearest
measured length by that (tests/app/test_speeds.py checks it against a whole novel's reading,
where scaling linearly says a quarter of the time). Estimates improve as books of that length are
read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.config import ModelConfig

KEEP = 8  # measurements kept per model and kind


class Speeds:
    def __init__(self, root: Path | None):
        self.path = None if root is None else Path(root) / "speeds.json"
        try:
            self.data: dict = json.loads(self.path.read_text()) if self.path and self.path.is_file() else {}
        except (OSError, ValueError):  # unreadable: start again, it only holds measurements
            self.data = {}

    def record_prefill(self, model: str, n_tokens: int, seconds: float, attention_share: float = 0.0,
                       start: int = 0) -> None:
        """A prefill of `n_tokens` took `seconds`; `start`: it read only the tokens from there (a
        stopped reading taken up again), recorded as the whole reading at that rate of work."""
        if n_tokens - start >= 256 and seconds > 0:  # a few tokens time the overheads, not the model
            whole = prefill_work(n_tokens, attention_share)
            seconds *= whole / (whole - prefill_work(start, attention_share))
            if round(seconds, 2) > 0:  # rounded to 0.00 (a remote server's instant "reading") it is no speed
                self._add(model, "prefill", [n_tokens, round(seconds, 2)])

    def record_decode(self, model: str, n_context: int, ms_per_token: float) -> None:
        if ms_per_token > 0:
            self._add(model, "decode", [n_context, round(ms_per_token, 1)])

    def prefill_s(self, model: str, n_tokens: int, attention_share: float = 0.0) -> float | None:
        """Estimated seconds to prefill `n_tokens`, from the nearest measured length (see the module
        doc; `attention_share` 0: linear); None if never measured."""
        near = self._nearest(model, "prefill", n_tokens)
        if near is None:
            return None
        return near[1] * prefill_work(n_tokens, attention_share) / prefill_work(near[0], attention_share)

    def decode_ms(self, model: str, n_context: int) -> float | None:
        near = self._nearest(model, "decode", n_context)
        return None if near is None else near[1]

    def describe(self, model: str) -> str:
        """'410 tokens/s prefill (8,192 tokens), 120 ms/token (8,192)' or 'not measured here yet'."""
        parts = []
        if self.data.get(model, {}).get("prefill"):
            n, s = self.data[model]["prefill"][-1]
            if s > 0:  # a file written before zero times were refused
                parts.append(f"{n / s:,.0f} tokens/s prefill ({n:,} tokens)")
        if self.data.get(model, {}).get("decode"):
            n, ms = self.data[model]["decode"][-1]
            parts.append(f"{ms:,.0f} ms/token ({n:,} tokens)")
        return ", ".join(parts) or "not measured here yet"

    def _nearest(self, model: str, kind: str, n: int) -> list | None:
        rows = self.data.get(model, {}).get(kind) or []
        return min(rows, key=lambda row: abs(row[0] - n), default=None)

    def _add(self, model: str, kind: str, row: list) -> None:
        rows = self.data.setdefault(model, {}).setdefault(kind, [])
        rows[:] = (rows + [row])[-KEEP:]
        if self.path is None:
            return
        try:  # best effort: a full disk must not break a prefill
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.data, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass


def attention_share(cfg: ModelConfig) -> float:
    """A token's attention multiply-adds per key it reads, over its linears' (lm_head aside): a
    prefill of n tokens does about n + share * n^2 / 2 tokens' worth of linear work."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    linears = cfg.n_layers * cfg.dim * (2 * q + 2 * kv + 3 * cfg.intermediate)
    return 2 * cfg.n_layers * q / linears


def prefill_work(n_tokens: int, attention_share: float) -> float:
    """A prefill of `n_tokens` in tokens' worth of linear work: each token also attends to the ones
    before it (`attention_share`)."""
    return n_tokens + attention_share * n_tokens * n_tokens / 2


def time_left(elapsed_s: float, done: int, total: int, attention_share: float, start: int = 0) -> float:
    """Seconds until a prefill `done` of `total` tokens into, `elapsed_s` after it started at token
    `start` (a stopped reading taken up again), ends: its rate so far in units of work, so the later
    tokens, which read more keys, are not timed at the first ones' rate."""
    done_work = prefill_work(done, attention_share)
    rate_work = done_work - prefill_work(start, attention_share)
    return elapsed_s * (prefill_work(total, attention_share) - done_work) / max(rate_work, 1e-9)


def disk_size(n_bytes: int) -> str:
    """'38 MB', '3.2 GB'."""
    return f"{n_bytes / 1e6:.0f} MB" if n_bytes < 1e9 else f"{n_bytes / 1e9:.1f} GB"


def duration(seconds: float) -> str:
    """'45 s', '3 min', '1 h 20 min'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"
