"""Dynamic batching for the HTTP server: concurrent requests share model calls, fairly.

A model call on a batch of sentences costs little more than a call on one sentence (the matrix
products are wider, the Python loop of the search is the same), so a server that translates
each request on its own wastes most of the hardware under load. :class:`Batcher` sits between
the asyncio event loop that answers requests and one worker thread that runs the model:

1. ``await batcher.submit(texts, options)`` puts a job on a queue and waits on an
   ``asyncio.Future``; the event loop stays free to accept more requests.
2. The unit of work is one **text**, not one request. The worker waits until ``max_wait_ms``
   have passed since the oldest job *arrived* (or the waiting texts fill the budget), then
   takes texts **round-robin** over the waiting jobs (the first text of every job, then the
   second of every job, ...), until the next would pass ``max_batch_cost``; the jobs served go
   to the back of the queue, so the next call starts with those that were not, including
   those that arrived while the call ran. A request of
   64 long texts therefore holds up a one-text request that arrives behind it for at most one
   call (one per costly request ahead of it), whose work the budget bounds; the rest of the
   long request is interleaved with whatever arrives meanwhile. When the previous call held a
   single job the next does not wait at all: one client at a time has nobody to wait for.
3. Texts with equal options are translated by **one** call (the translator then sorts them by
   length and cuts its own sub-batches); different options get one call each, in arrival
   order, within the same budget.
4. A job's results are gathered text by text; its future gets them, in order, through
   ``loop.call_soon_threadsafe`` once the last one is done (or the first exception).

Work for a client that has gone away is dropped: the caller cancels the job's future (the
server does when the connection closes), and the worker skips the texts of a done future when it
collects a call, so an abandoned request costs at most the call it is in.

A failing call does not take its neighbours down: when a call over several jobs raises, each
job's texts are retried alone, so only the job that causes the error gets it. The worker itself
never dies from a model error. The queue is bounded (``max_queue`` waiting jobs): beyond it
``submit`` raises :class:`QueueFull` at once instead of letting latency grow without bound.

The batcher knows nothing about HTTP or models: ``translate(texts, options)`` and
``cost(texts, options)`` are plain callables, and ``options`` any hashable value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["Batcher", "BatcherClosed", "QueueFull"]

R = TypeVar("R")


class QueueFull(RuntimeError):
    """``max_queue`` jobs are already waiting; the caller should retry later."""


class BatcherClosed(RuntimeError):
    """The batcher is shutting down and takes no more work."""


@dataclass(eq=False)
class _Job:
    texts: list[str]
    options: Hashable
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrival: float  # time.monotonic() when submitted
    costs: list[int] | None = None  # one per text; computed by the worker when not given
    taken: int = 0  # texts handed to calls so far
    results: list[Any] = field(default_factory=list)
    done: int = 0  # texts whose results are in
    failed: bool = False  # a call raised for it; the rest of its texts are not translated

    @property
    def abandoned(self) -> bool:
        # Reading done() from the worker thread is a benign race: at worst the text of a
        # client that has just gone away is translated for nothing.
        return self.failed or self.future.done()


@dataclass
class _Stats:
    model_calls: int = 0
    requests: int = 0  # requests answered
    sentences: int = 0  # texts translated
    failed_calls: int = 0
    largest_call: int = 0  # requests in the biggest call so far
    rejected: int = 0  # submits refused because the queue was full
    dropped: int = 0  # requests dropped because their client went away


class Batcher(Generic[R]):
    """Collects the texts of concurrent requests into fair model calls on one worker thread."""

    def __init__(
        self,
        translate: Callable[[list[str], Any], Sequence[R]],
        cost: Callable[[list[str], Any], int],
        *,
        max_wait_ms: float = 5.0,
        max_batch_cost: int = 4096,
        max_queue: int = 256,
        batching: bool = True,
    ) -> None:
        """
        Args:
            translate: ``translate(texts, options) -> results``, one result per text, in
                order; runs on the worker thread only.
            cost: ``cost([text], options) -> int``, one text's work in the unit of
                ``max_batch_cost``; runs on the worker thread, for jobs submitted without
                their costs.
            max_wait_ms: How long the oldest job of a call may wait for company, counted from
                its arrival; no wait after a call that held one job. 0 still batches what has
                already queued up.
            max_batch_cost: A call stops taking texts when the next would pass this budget. A
                text that alone exceeds it is translated alone (the server refuses such texts
                before they get here).
            max_queue: Most jobs waiting (not yet wholly taken by the worker); more raise
                QueueFull.
            batching: False translates one job at a time, in arrival order (for comparison).
        """
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms ({max_wait_ms}) must be >= 0")
        for name, value in (("max_batch_cost", max_batch_cost), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        self.translate = translate
        self.cost = cost
        self.max_wait_ms = max_wait_ms
        self.max_batch_cost = max_batch_cost
        self.max_queue = max_queue
        self.batching = batching
        self._pending: deque[_Job] = deque()  # jobs with texts not yet taken, oldest first
        self._arrivals = 0  # jobs ever submitted: a snapshot's mark of what it has seen
        self._unanswered: dict[int, _Job] = {}  # every job not yet answered, by id
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stats = _Stats()
        self._expect_company = True  # did the last call hold more than one job?
        self._last_served: list[_Job] = []  # the jobs of the last call take their turn last

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the worker thread (again after :meth:`close`); does nothing if it runs."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._closing = False
            self._thread = threading.Thread(target=self._work, name="aiayn-batcher", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 30.0) -> None:
        """Lets the current call finish, fails the waiting jobs with BatcherClosed, stops."""
        with self._cond:
            self._closing = True
            waiting = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        for job in waiting:
            _resolve(job, error=BatcherClosed("the server is shutting down"))
        if thread is not None:
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The worker thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """Counters since start, and the queue now: ``queued`` requests (with texts not yet
        taken, whose clients are still there), ``queued_texts``, and ``oldest_wait_s``, the
        age of the oldest request not yet answered (0 when none)."""
        with self._cond:
            self._prune()
            now = time.monotonic()
            unanswered = [j for j in self._unanswered.values() if not j.abandoned]
            oldest = max((now - job.arrival for job in unanswered), default=0.0)
            return {
                **asdict(self._stats),
                "queued": len(self._pending),
                "queued_texts": sum(len(job.texts) - job.taken for job in self._pending),
                "oldest_wait_s": round(oldest, 3),
            }

    # -- the event loop side -----------------------------------------------------------------

    async def submit(
        self, texts: Sequence[str], options: Hashable, costs: Sequence[int] | None = None
    ) -> list[R]:
        """Translates ``texts`` with ``options``; returns their results in order.

        ``costs`` (one per text, in the unit of ``max_batch_cost``) saves the worker from
        computing them when the caller already has. Cancelling the returned awaitable drops
        the texts not yet translated.

        Raises:
            QueueFull: ``max_queue`` jobs are already waiting.
            BatcherClosed: The batcher is shutting down.
            Exception: Whatever ``translate`` raised for this job.
        """
        self.start()
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        job = _Job(
            list(texts),
            options,
            loop.create_future(),
            loop,
            time.monotonic(),
            costs=None if costs is None else list(costs),
            results=[None] * len(texts),
        )
        with self._cond:
            if self._closing:
                raise BatcherClosed("the server is shutting down")
            self._prune()  # the jobs of clients that have gone hold no place in the queue
            if len(self._pending) >= self.max_queue:
                self._stats.rejected += 1
                raise QueueFull(
                    f"the server is busy: {len(self._pending)} requests are waiting "
                    f"(limit {self.max_queue}, --max-queue); retry later"
                )
            self._pending.append(job)
            self._arrivals += 1
            self._unanswered[id(job)] = job
            self._cond.notify()
        try:
            return await job.future
        finally:
            with self._cond:
                self._unanswered.pop(id(job), None)

    # -- the worker side -------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            try:
                units = self._collect()
                if units is None:
                    return
                groups: dict[Hashable, list[tuple[_Job, int]]] = {}
                for job, index in units:
                    groups.setdefault(job.options, []).append((job, index))
                for options, group in groups.items():
                    self._run(group, options)
            except Exception:  # a bug here must not leave every later request hanging
                logger.exception("batcher: unexpected error; the worker carries on")

    def _collect(self) -> list[tuple[_Job, int]] | None:
        """The (job, text index) units of the next call (see the module docstring), or None
        when closing."""
        with self._cond:
            while not self._prune():
                if self._closing:
                    return None
                self._cond.wait()
            self._take_turns()
            wait = self.max_wait_ms / 1000 if self.batching and self._expect_company else 0.0
            deadline = self._pending[0].arrival + wait
        while True:  # costs are computed outside the lock; wait for company meanwhile
            jobs, seen = self._snapshot()
            queued = sum(
                self._text_cost(job, i) for job in jobs for i in range(job.taken, len(job.texts))
            )
            remaining = deadline - time.monotonic()
            if remaining <= 0 or queued >= self.max_batch_cost:
                break
            with self._cond:
                if self._closing:
                    return None
                # A job that arrived while the costs were computed, outside the lock, notified
                # nobody: count again rather than wait (up to max_wait_ms) for another.
                if self._arrivals == seen:
                    self._cond.wait(remaining)
        with self._cond:
            if not self._prune():
                return [] if not self._closing else None
            self._take_turns()  # again: jobs may have arrived while the worker waited
            candidates = list(self._pending) if self.batching else [self._pending[0]]
            units: list[tuple[_Job, int]] = []
            used = 0
            full = False
            while not full:
                progressed = False
                for job in candidates:
                    if job.taken >= len(job.texts):
                        continue
                    cost = self._text_cost(job, job.taken)
                    if units and used + cost > self.max_batch_cost:
                        full = True
                        break
                    units.append((job, job.taken))
                    job.taken += 1
                    used += cost
                    progressed = True
                if not progressed:
                    break
            self._pending = deque(j for j in self._pending if j.taken < len(j.texts))
        self._expect_company = len({id(job) for job, _ in units}) > 1
        self._last_served = list({id(job): job for job, _ in units}.values())
        return units

    def _take_turns(self) -> None:
        """Round-robin across calls (lock held): the jobs the last call served go behind every
        other waiting job, those that arrived while it ran included."""
        last = {id(job) for job in self._last_served}
        self._pending = deque(
            [j for j in self._pending if id(j) not in last]
            + [j for j in self._pending if id(j) in last]
        )

    def _snapshot(self) -> tuple[list[_Job], int]:
        """The waiting jobs, and how many jobs had arrived when they were read."""
        with self._cond:
            return list(self._pending), self._arrivals

    def _prune(self) -> bool:
        """Drops the jobs whose client went away (lock held); True if any job waits. The
        worker prunes before each call, and :meth:`stats` and :meth:`submit` too, so that
        while a call runs the queue they see holds live jobs only."""
        kept: deque[_Job] = deque()
        for job in self._pending:
            if job.abandoned:
                self._stats.dropped += not job.failed
                self._unanswered.pop(id(job), None)
            else:
                kept.append(job)
        self._pending = kept
        return bool(kept)

    def _text_cost(self, job: _Job, index: int) -> int:
        if job.costs is None:
            costs = []
            for text in job.texts:
                try:
                    costs.append(self.cost([text], job.options))
                except Exception:  # the translate call will raise and report it properly
                    costs.append(0)
            job.costs = costs
        return job.costs[index]

    def _run(self, units: list[tuple[_Job, int]], options: Hashable) -> None:
        """One call over ``units``; on failure, each job's units alone."""
        units = [(job, i) for job, i in units if not job.abandoned]
        if not units:
            return
        texts = [job.texts[i] for job, i in units]
        jobs = list({id(job): job for job, _ in units}.values())
        try:
            results = list(self.translate(texts, options))
            if len(results) != len(texts):
                raise RuntimeError(f"translate returned {len(results)} results for {len(texts)}")
        except Exception as error:
            with self._cond:
                self._stats.failed_calls += 1
            if len(jobs) > 1:
                logger.warning(
                    "batcher: a call over %d requests failed (%r); retrying each alone",
                    len(jobs),
                    error,
                )
                for job in jobs:
                    self._run([(j, i) for j, i in units if j is job], options)
            else:
                logger.exception("batcher: translation failed")
                jobs[0].failed = True
                _resolve(jobs[0], error=error)
            return
        finished = []
        with self._cond:
            for (job, i), result in zip(units, results, strict=True):
                job.results[i] = result
                job.done += 1
                if job.done == len(job.texts):
                    finished.append(job)
            self._stats.model_calls += 1
            self._stats.requests += len(finished)
            self._stats.sentences += len(texts)
            self._stats.largest_call = max(self._stats.largest_call, len(jobs))
        for job in finished:
            _resolve(job, result=job.results)


def _resolve(job: _Job, result: Any = None, error: BaseException | None = None) -> None:
    """Completes a job's future on its own event loop (futures are not thread-safe)."""

    def complete() -> None:
        if job.future.done():  # the client went away and the future was cancelled
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        job.loop.call_soon_threadsafe(complete)
