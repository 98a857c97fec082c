"""Outlines made in the background, never in a reader's way (issue 56).

`OutlineWorker` runs the tasks of queued `Outline`s (app/outline.py) a round at a time: up to
`max_batch` summaries in one packed forward (engine/batch.py's `Batcher`, driven here round by
round), each in a session of its own over its own short prompt. Before every round it asks
`is_busy()` (the app: a reader's answer is being decoded or a book is being read); then it runs
nothing and the summaries wait, suspended between two forwards, to go on exactly where they
were. Cancel stops an outline at its next step (the summaries in progress start again on
resume); every finished summary is in the cache at once. The rate each summary cost (its share
of the rounds it ran in) gives the ETA, and is kept per model for the next book.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from app.outline import Outline, Prompter, SummaryCache, Task, next_pass
from engine.batch import Batcher, Job
from engine.config import SamplingConfig
from engine.session import Engine, Event, Session

POLL_S = 0.1  # how often a paused or idle worker looks again: well under a person's reaction
CLOSE_S = 30.0  # the longest a close waits for the round under way (one packed forward)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # workers with a thread: stopped before the interpreter exits


@dataclass
class Run:
    """A summary being made: its session, the tokens so far and its share of the rounds' time."""

    outline: Outline
    task: Task
    session: Session
    tokens: list[int] = field(default_factory=list)
    busy_s: float = 0.0
    finish_reason: str | None = None
    error: Exception | None = None


class OutlineWorker:
    """Runs outlines' summaries in packed rounds whenever `is_busy()` is false."""

    def __init__(self, engine: Engine, prompter: Prompter, cache: SummaryCache,
                 is_busy: Callable[[], bool] = lambda: False, max_batch: int = 4,
                 sampling: SamplingConfig | None = None, levels: str | None = None):
        self.engine, self.prompter, self.cache, self.is_busy = engine, prompter, cache, is_busy
        self.sampling = sampling or replace(engine.default_sampling, seed=0)
        self.levels = levels  # None: the engine's configured stack
        self.batcher = Batcher(max_active=max_batch, background=False)
        self.outlines: list[Outline] = []  # queued, oldest first
        self.runs: dict[Job, Run] = {}
        self.cancels: dict[int, threading.Event] = {}  # id(outline) -> its cancel flag
        self.n_rounds = self.n_paused = 0  # rounds run; rounds a reader's work took instead
        self.work = (0, 0.0)  # prompt tokens summarized here, and their share of the rounds' seconds
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()  # queue changes from the page's threads vs. the worker's
        self.closed = False

    @property
    def sampling_id(self) -> str:
        """The sampling settings as they enter every cache key (the length is the task's own)."""
        return repr(replace(self.sampling, max_new_tokens=1))

    def start(self, outline: Outline, background: bool = True) -> None:
        """Queue `outline` (again, after a cancel: it goes on from its cached summaries)."""
        with self.lock:
            self.cancels[id(outline)] = threading.Event()
            outline.stopped = ""
            if outline not in self.outlines:
                self.outlines.append(outline)
        self.wake.set()
        if background and (self.thread is None or not self.thread.is_alive()):
            self.thread = threading.Thread(target=self._loop, name="outline-worker", daemon=True)
            _LIVE.add(self)
            self.thread.start()

    def cancel(self, outline: Outline, why: str = "cancelled") -> None:
        """Stop `outline` at its next step; its finished summaries stay cached."""
        with self.lock:
            if outline in self.outlines:
                self.outlines.remove(outline)
            flag = self.cancels.get(id(outline))
        if flag is not None:
            flag.set()
        if not outline.is_complete:
            outline.stopped, outline.version = why, outline.version + 1

    def close(self, why: str = "the model changed", wait_s: float = CLOSE_S) -> None:
        """Stop every outline (the model changed, the app stops) and the thread, waiting for the
        round under way: a thread left inside a forward at exit aborts the process."""
        for outline in list(self.outlines):
            self.cancel(outline, why)
        self.closed = True
        self.wake.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _loop(self) -> None:
        while not self.closed:
            if self.advance() != "ran":
                self.wake.wait(POLL_S)
                self.wake.clear()

    def advance(self) -> str:
        """One round: "busy" (a reader goes first: nothing runs), "idle" (nothing to do) or "ran"."""
        if self.is_busy():
            self.n_paused += 1
            return "busy"
        self._admit()
        if not self.batcher.active and not self.batcher.waiting:
            return "idle"
        n_active, t0 = max(1, len(self.batcher.active) + len(self.batcher.waiting)), time.perf_counter()
        self.batcher.round()
        share = (time.perf_counter() - t0) / n_active
        self.n_rounds += 1
        for job, run in list(self.runs.items()):
            run.busy_s += share
            self._collect(job, run)
        return "ran"

    def _admit(self) -> None:
        """Start summaries while the batch has room, oldest outline first."""
        while len(self.runs) < self.batcher.max_active and (found := self._next_task()) is not None:
            self._begin(*found)

    def _next_task(self) -> tuple[Outline, Task] | None:
        with self.lock:
            outlines = list(self.outlines)
        running = {id(run.task) for run in self.runs.values()}
        for outline in outlines:
            tasks = outline.passes[-1] if outline.passes else outline.rows
            for task in tasks:
                if task.state == "waiting" and id(task) not in running:
                    return outline, task
            if any(run.outline is outline for run in self.runs.values()):
                continue  # the pass under way ends before the next one starts
            if outline.is_complete or not (tasks := next_pass(outline, self.prompter, self.engine.max_context,
                                                               self.cache)):
                self._finish(outline)
                continue
            outline.passes.append(tasks)
            outline.version += 1
            return self._next_task()
        return None

    def _finish(self, outline: Outline) -> None:
        with self.lock:
            if outline in self.outlines:
                self.outlines.remove(outline)
        outline.version += 1

    def _begin(self, outline: Outline, task: Task) -> None:
        ids = self.prompter.prompt_ids(task.text, task.instruction)
        task.n_prompt_tokens = len(ids)
        if len(ids) + task.max_new_tokens > self.engine.max_context:
            task.state, task.note = "failed", "longer than the model's context"
            outline.version += 1
            return
        session = self.engine.open(ids, n_first=1)  # the rest is read as the question: in rounds
        if self.levels is not None:
            session.set_levels(self.levels)
        sampling = replace(self.sampling, max_new_tokens=task.max_new_tokens)
        steps = session.answer_steps(ids[1:], sampling, self.cancels[id(outline)], self.prompter.stop_ids)
        task.state = "running"
        outline.version += 1
        self.runs[self.batcher.submit(steps)] = Run(outline, task, session)

    def _collect(self, job: Job, run: Run) -> None:
        """Take the job's events; once it ended, keep the summary (or put the task back)."""
        is_over = job.ended.is_set()  # set after its last item went in: drained below with the rest
        while True:
            try:
                item = job.out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Event):
                run.tokens += item.tokens
                run.finish_reason = item.finish_reason or run.finish_reason
            elif isinstance(item, Exception):
                run.error = item
        if not is_over:
            return
        del self.runs[job]
        task, outline = run.task, run.outline
        if run.error is not None:
            task.state, task.note = "failed", str(run.error)
        elif run.finish_reason == "cancelled":
            task.state = "waiting"  # made again from the start on resume
        else:
            task.summary, task.state, task.n_answer_tokens = self.prompter.decode(run.tokens), "done", len(run.tokens)
            self.cache.put(task.key, {"summary": task.summary, "label": task.label, "model": outline.model,
                                      "n_prompt_tokens": task.n_prompt_tokens, "n_answer_tokens": len(run.tokens),
                                      "busy_s": round(run.busy_s, 3)})
            self._measured(outline.model, task.n_prompt_tokens, run.busy_s)
        outline.version += 1

    def _measured(self, model: str, n_prompt_tokens: int, busy_s: float) -> None:
        """Fold one summary's cost into this machine's rate for `model` (seconds per prompt token)."""
        self.work = (self.work[0] + n_prompt_tokens, self.work[1] + busy_s)
        self.cache.set_rate(model, self.work[1] / max(1, self.work[0]))

    def seconds_left(self, outline: Outline) -> float | None:
        """The time the outline's waiting and running rows still take at the rate measured here
        (None: nothing measured for this model yet)."""
        rate = self.cache.rate(outline.model)
        if rate is None:
            return None
        busy = {id(run.task): run.busy_s for run in self.runs.values()}
        return sum(max(0.0, rate * t.n_prompt_tokens - busy.get(id(t), 0.0)) for t in outline.rows
                   if t.state in ("waiting", "running"))


@atexit.register
def _close_all() -> None:
    """At exit (also a test run's): every worker's round ends before the interpreter goes."""
    for worker in list(_LIVE):
        worker.close("the app stopped")
