"""Dynamic batching for the HTTP server: concurrent requests share one model call.

A model call on a batch of sentences costs little more than a call on one sentence (the matrix
products are wider, the Python loop of the search is the same), so a server that translates
each request on its own wastes most of the hardware under load. :class:`Batcher` sits between
the asyncio event loop that answers requests and one worker thread that runs the model:

1. ``await batcher.submit(texts, options)`` puts a job on a queue and waits on an
   ``asyncio.Future``; the event loop stays free to accept more requests.
2. The worker takes the oldest job, then keeps taking jobs until ``max_wait_ms`` have passed
   since that job *arrived* or the jobs hold ``max_batch_tokens`` (a job that would overflow the
   budget waits for the next call). Under load the wait has usually passed already when the
   worker gets to a job, so a call takes what has queued up meanwhile and adds no latency.
   And when the previous call held a single job, the next does not wait at all: one client
   at a time has nobody to wait for, and the wait would be pure latency. Once requests
   overlap, jobs queue up during a call, the next call holds several, and waiting resumes.
3. Jobs with equal options are translated by **one** call over all their sentences (the
   translator then sorts them by length and cuts its own sub-batches); jobs with different
   options get one call per distinct options, in arrival order.
4. Each job's future gets its own slice of the results (or the call's exception) through
   ``loop.call_soon_threadsafe``.

A failing call does not take its neighbours down: when a call over several jobs raises, each
job is retried alone, so only the job that causes the error gets it. The worker itself never
dies from a model error. The queue is bounded (``max_queue`` waiting jobs): beyond it
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
from dataclasses import asdict, dataclass
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
    cost: int | None = None  # computed by the worker, outside the lock


@dataclass
class _Stats:
    model_calls: int = 0
    requests: int = 0
    sentences: int = 0
    failed_calls: int = 0
    largest_call: int = 0  # requests in the biggest call so far
    rejected: int = 0  # submits refused because the queue was full


class Batcher(Generic[R]):
    """Collects concurrent requests into model calls on one worker thread."""

    def __init__(
        self,
        translate: Callable[[list[str], Any], Sequence[R]],
        cost: Callable[[list[str], Any], int],
        *,
        max_wait_ms: float = 5.0,
        max_batch_tokens: int = 4096,
        max_queue: int = 256,
        batching: bool = True,
    ) -> None:
        """
        Args:
            translate: ``translate(texts, options) -> results``, one result per text, in
                order; runs on the worker thread only.
            cost: ``cost(texts, options) -> int``, a job's size in the unit of
                ``max_batch_tokens``; runs on the worker thread.
            max_wait_ms: How long the oldest job of a call may wait for company, counted from
                its arrival; no wait after a call that held one job. 0 still batches what has
                already queued up.
            max_batch_tokens: A call stops taking jobs when the next would pass this budget. A
                job that alone exceeds it is translated alone.
            max_queue: Most jobs waiting (not yet taken by the worker); more raise QueueFull.
            batching: False translates each job on its own, in arrival order (for comparison).
        """
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms ({max_wait_ms}) must be >= 0")
        for name, value in (("max_batch_tokens", max_batch_tokens), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        self.translate = translate
        self.cost = cost
        self.max_wait_ms = max_wait_ms
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.batching = batching
        self._pending: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stats = _Stats()
        self._expect_company = True  # did the last call hold more than one job?

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

    def stats(self) -> dict[str, int]:
        """Counters since start: model calls, requests, sentences, failures, queue length."""
        with self._cond:
            return {**asdict(self._stats), "queued": len(self._pending)}

    # -- the event loop side -----------------------------------------------------------------

    async def submit(self, texts: Sequence[str], options: Hashable) -> list[R]:
        """Translates ``texts`` with ``options`` in some batch; returns their results in order.

        Raises:
            QueueFull: ``max_queue`` jobs are already waiting.
            BatcherClosed: The batcher is shutting down.
            Exception: Whatever ``translate`` raised for this job.
        """
        self.start()
        loop = asyncio.get_running_loop()
        job = _Job(list(texts), options, loop.create_future(), loop, time.monotonic())
        with self._cond:
            if self._closing:
                raise BatcherClosed("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                self._stats.rejected += 1
                raise QueueFull(
                    f"the server is busy: {len(self._pending)} requests are waiting "
                    f"(limit {self.max_queue}, --max-queue); retry later"
                )
            self._pending.append(job)
            self._cond.notify()
        return await job.future

    # -- the worker side -------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            try:
                jobs = self._collect()
                if jobs is None:
                    return
                groups: dict[Hashable, list[_Job]] = {}
                for job in jobs:
                    groups.setdefault(job.options, []).append(job)
                for options, group in groups.items():
                    self._run(group, options)
            except Exception:  # a bug here must not leave every later request hanging
                logger.exception("batcher: unexpected error; the worker carries on")

    def _collect(self) -> list[_Job] | None:
        """The jobs of the next call (see the module docstring), or None when closing."""
        first = self._take(deadline=None)
        if first is None:
            return None
        jobs = [first]
        if not self.batching:
            return jobs
        used = self._cost(first)
        wait = self.max_wait_ms / 1000 if self._expect_company else 0.0
        deadline = first.arrival + wait
        while used < self.max_batch_tokens:
            job = self._take(deadline=deadline)
            if job is None:
                break
            cost = self._cost(job)
            if used + cost > self.max_batch_tokens:
                with self._cond:
                    self._pending.appendleft(job)  # first in line for the next call
                break
            jobs.append(job)
            used += cost
        self._expect_company = len(jobs) > 1
        return jobs

    def _take(self, deadline: float | None) -> _Job | None:
        """The oldest waiting job whose client still waits; blocks until ``deadline``
        (``time.monotonic()``; None: forever, until closing). Past the deadline it only
        takes a job that is already there."""
        with self._cond:
            while True:
                while self._pending:
                    job = self._pending.popleft()
                    # Reading done() from this thread is a benign race: at worst a job whose
                    # client has just gone away is translated for nothing.
                    if not job.future.done():
                        return job
                if self._closing:
                    return None
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._cond.wait(remaining)

    def _cost(self, job: _Job) -> int:
        if job.cost is None:
            try:
                job.cost = self.cost(job.texts, job.options)
            except Exception:  # the translate call will raise and report it properly
                job.cost = 0
        return job.cost

    def _run(self, jobs: list[_Job], options: Hashable) -> None:
        """One call over the sentences of ``jobs``; on failure, each job alone."""
        texts = [text for job in jobs for text in job.texts]
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
                    self._run([job], options)
            else:
                logger.exception("batcher: translation failed")
                _resolve(jobs[0], error=error)
            return
        with self._cond:
            self._stats.model_calls += 1
            self._stats.requests += len(jobs)
            self._stats.sentences += len(texts)
            self._stats.largest_call = max(self._stats.largest_call, len(jobs))
        start = 0
        for job in jobs:
            _resolve(job, result=results[start : start + len(job.texts)])
            start += len(job.texts)


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
