"""Several readers at once: the answers of many sessions share one forward per model (MagicDec).

Every answer is a generator of forward requests and events (`Session.answer_steps`). A round
advances each active answer to its next request, packs the requests for the same model into one
`Transformer.forward_packed` (the weights are read once for all; each segment attends over its
own cache), and hands each its logits. On a memory-bound machine a forward over a few dozen tokens
costs about as much as one token's, so sessions decoding together share that cost, whether a
request is a top-level check, a middle-level check, a drafter step or a question's prefill.

Answers join and leave between rounds: one that finishes, fails or is stopped never stalls the
others. Each keeps its own caches, drafter state, sampling settings, coins and counters, so it
commits the same tokens it would commit alone. Answers beyond `max_active` wait in order.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Generator, Iterator

from engine.model import Forward

_DONE = object()


class Job:
    """One answer in the batch: its generator, the logits owed to it, and its consumer's queue."""

    def __init__(self, steps: Generator, wait_on_close: bool):
        self.steps, self.request, self.result = steps, None, None
        self.wait_on_close = wait_on_close  # a background batcher: the consumer waits for the close
        self.ended = threading.Event()
        self.out: queue.Queue = queue.Queue()
        self.abandoned = False  # the consumer went away: close at the next event boundary
        self.value = None  # the generator's return value

    def advance(self) -> Forward | None:
        """Run until the next forward request; None when the answer is over."""
        while True:
            try:
                item = self.steps.send(self.result)
            except StopIteration as stop:
                self.value = stop.value
                return self._end(_DONE)
            except Exception as error:  # a typed engine error: the consumer gets it, the batch goes on
                return self._end(error)
            self.result = None
            if isinstance(item, Forward):
                self.request = item
                return item
            self.out.put(item)
            if self.abandoned:  # between two steps the session's caches are consistent
                self.steps.close()
                return self._end(_DONE)

    def fail(self, error: Exception) -> None:
        self.steps.close()
        self._end(error)

    def _end(self, last) -> None:
        self.request = None
        self.out.put(last)
        self.ended.set()
        return None

    def stream(self) -> Iterator:
        """The items the answer yields, in order; re-raises its error."""
        try:
            while (item := self.out.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # on an early close: the session is consistent again once the batcher let it go
            self.abandoned = True
            if self.wait_on_close:
                self.ended.wait()


class Batcher:
    """Runs answers in rounds of packed forwards, on a background thread (or by `round` in tests)."""

    def __init__(self, max_active: int = 8, background: bool = True):
        self.max_active, self.background = max_active, background
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.n_rounds = 0
        self.n_forwards = 0
        self.n_segments = 0  # segments served: n_segments / n_forwards is the mean batch

    def submit(self, steps: Generator) -> Job:
        job = Job(steps, wait_on_close=self.background)
        with self.cond:
            self.waiting.append(job)
            self.cond.notify()
            if self.background and (self.thread is None or not self.thread.is_alive()):
                self.thread = threading.Thread(target=self._loop, name="engine-batcher", daemon=True)
                self.thread.start()
        return job

    def ask(self, session, question_ids: list[int], sampling, cancel=None, stop_ids=None) -> Iterator:
        """Like `Session.ask`, decoded in the batch with every other answer."""
        return self.submit(session.answer_steps(question_ids, sampling, cancel, stop_ids)).stream()

    def position(self, job: Job) -> int:
        """0 when decoding, else the place in the waiting line (1 = next)."""
        with self.cond:
            return self.waiting.index(job) + 1 if job in self.waiting else 0

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.active:
                    self.cond.wait()
            self.round()

    def round(self) -> None:
        """Admit waiting answers, advance every active one to its next forward, serve them packed."""
        with self.cond:
            while self.waiting and len(self.active) < self.max_active:
                job = self.waiting.popleft()
                if job.abandoned:  # stopped before it started
                    job.steps.close()
                    job._end(_DONE)
                    continue
                self.active.append(job)
            jobs = list(self.active)
        ready = [job for job in jobs if job.advance() is not None]
        with self.cond:
            self.active = [job for job in self.active if job in ready]
        by_model: dict[int, list[Job]] = {}
        for job in ready:
            by_model.setdefault(id(job.request.model), []).append(job)
        for group in by_model.values():
            try:
                outs = group[0].request.model.forward_packed([job.request.segment for job in group])
            except Exception as error:  # e.g. out of memory: every answer in this forward is told
                with self.cond:
                    self.active = [job for job in self.active if job not in group]
                for job in group:
                    job.fail(error)
                continue
            for job, logits in zip(group, outs):
                job.result = logits
            self.n_forwards += 1
            self.n_segments += len(group)
        self.n_rounds += 1
