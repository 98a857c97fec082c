"""Several readers at once: the answers of many sessions share one forward per model (MagicDec).

A round packs the answers' forward requests (`Session.answer_steps`) by model: engine/README.md
"The request protocol". Each answer keeps its own caches, drafter state, sampling, coins and
counters, so it commits the tokens it would commit alone; answers beyond `max_active` wait in order.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Generator, Iterator

from engine.config import EngineError
from engine.model import Forward

_DONE = object()


class Job:
    """One answer in the batch: its generator, the logits owed to it, and its consumer's queue."""

    def __init__(self, steps: Generator, wait_on_close: bool, origin: tuple | None = None):
        self.steps, self.request, self.result = steps, None, None
        self.wait_on_close = wait_on_close  # a background batcher: the consumer waits for the close
        self.origin = origin  # tensor parallel: how the other ranks make the same answer
        self.ended = threading.Event()
        self.out: queue.Queue = queue.Queue()
        self.abandoned = False  # the consumer went away: close at the next event boundary ...
        self.is_closing = False  # ... of the next round (rank 0 decides it for every rank)

    def advance(self, in_step: bool) -> Forward | None:
        """Run until the next forward request; None when the answer is over. `in_step` (tensor
        parallel): an untyped error means the ranks are out of step; it ends the round, not the answer."""
        while True:
            try:
                item = self.steps.send(self.result)
            except StopIteration:
                return self.end()
            except Exception as error:  # a typed engine error: the consumer gets it, the batch goes on
                if in_step and not isinstance(error, (EngineError, ValueError)):
                    raise
                return self.end(error)
            self.result = None
            if isinstance(item, Forward):
                self.request = item
                return item
            self.out.put(item)
            if self.is_closing:  # between two steps the session's caches are consistent
                return self.end()

    def end(self, last=_DONE) -> None:
        """Close the answer (a no-op once it returned or raised); its consumer gets `last`: the end or the error."""
        self.steps.close()
        self.request = None
        self.out.put(last)
        self.ended.set()

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

    def __init__(self, max_active: int = 8, background: bool = True, in_step: bool = False):
        self.max_active, self.background = max_active, background
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.leader = None  # tensor parallel: the `parallel.Leader` that runs each round on every rank
        self.in_step = in_step  # rounds run on every rank (rank 0's batcher, or a rank's copy of it)
        self.n_rounds = 0
        self.n_forwards = 0
        self.n_segments = 0  # segments served: n_segments / n_forwards is the mean batch

    def submit(self, steps: Generator, origin: tuple | None = None) -> Job:
        job = Job(steps, self.background, origin)
        with self.cond:
            self.waiting.append(job)
            self.cond.notify()
            if self.background and (self.thread is None or not self.thread.is_alive()):
                self.thread = threading.Thread(target=self._loop, name="engine-batcher", daemon=True)
                self.thread.start()
        return job

    def ask(self, session, question_ids: list[int], sampling, cancel=None, stop_ids=None) -> Iterator:
        """Like `Session.ask`, decoded in the batch with every other answer."""
        if session.leader is not None:  # tensor parallel: the sessions of one engine, one leader
            self.leader, self.in_step = session.leader, True
        origin = (session.sid, list(question_ids), sampling, stop_ids)
        return self.submit(session.answer_steps(question_ids, sampling, cancel, stop_ids), origin).stream()

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.waiting or self.active)
            self.round()

    def round(self) -> None:
        """Admit waiting answers, advance every active one to its next forward, serve them packed."""
        admitted = self._admit()
        if self.leader is None:
            self.step()
        elif self.active:
            plan = [job.origin for job in admitted], [i for i, job in enumerate(self.active) if job.is_closing]
            try:
                self.leader.call(round_on_every_rank, *plan, batcher=self)
            except Exception as error:  # noqa: BLE001 (parallel.RankFailed: every answer is told)
                self._drop(self.active, error)

    def _admit(self) -> list[Job]:
        with self.cond:
            admitted = []
            while self.waiting and len(self.active) + len(admitted) < self.max_active:
                job = self.waiting.popleft()
                if job.abandoned:  # stopped before it started
                    job.end()
                    continue
                admitted.append(job)
            self.active += admitted
            for job in self.active:
                job.is_closing = job.abandoned
            return admitted

    def step(self) -> None:
        """Advance every active answer to its next forward and serve the forwards packed by model."""
        ready = [job for job in self.active if job.advance(self.in_step) is not None]
        with self.cond:
            self.active = ready
        by_model: dict[int, list[Job]] = {}
        for job in ready:
            by_model.setdefault(id(job.request.model), []).append(job)
        for group in by_model.values():
            self._serve(group)
        self.n_rounds += 1

    def _serve(self, group: list[Job]) -> None:
        try:
            outs = group[0].request.model.forward_packed([job.request.segment for job in group])
        except Exception as error:  # e.g. out of memory: every answer in this forward is told
            if self.in_step:
                raise
            self._drop(group, error)
            return
        for job, logits in zip(group, outs):
            job.result = logits
        self.n_forwards += 1
        self.n_segments += len(group)

    def _drop(self, jobs: list[Job], error: Exception) -> None:
        """End `jobs` with `error` (each consumer gets it); the other answers go on."""
        with self.cond:
            self.active = [job for job in self.active if job not in jobs]
        for job in jobs:
            job.end(error)


def round_on_every_rank(ranks, admitted: list[tuple], closing: list[int], batcher: Batcher | None = None) -> None:
    """One tensor-parallel round (`parallel.Leader.call`): rank 0 passes its batcher; the other ranks
    start rank 0's new answers on their copies of the sessions (`origin`), stop the ones rank 0 stops
    (by place: every rank's active answers are in the same order) and run the same round."""
    if batcher is None:
        batcher = ranks.batcher
        for sid, question_ids, sampling, stop_ids in admitted:
            batcher.active.append(Job(ranks.sessions[sid].answer_steps(question_ids, sampling, None, stop_ids), False))
        for i, job in enumerate(batcher.active):
            job.is_closing = i in closing
    batcher.step()
