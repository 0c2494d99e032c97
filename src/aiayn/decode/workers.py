"""Decoding on several CPU cores at once: worker processes that each decode whole batches.

A decoding step on a CPU is many small operations: the matrix products of a `small` model
over a few hundred rows, then the search's selections and copies. A second PyTorch thread
helps only the products; everything else runs on one core while the other waits. So, as Marian
does (``--cpu-threads N``: N workers of one thread each) and CTranslate2 offers
(``inter_threads``), a translator can decode W batches at once instead, each in a process of
its own with one thread (BENCHMARKS.md measures both ways on a trained model and a real test
set).

How. For a call with more than one batch, :class:`Workers` forks W processes from the
calling one (POSIX ``fork``): they start with the model already loaded, sharing its memory
copy-on-write, so nothing is loaded again and only batches and results are pickled. Each worker
sets its own thread count (the worker process is the library's own, so that is its to set;
the caller's process keeps its settings) and decodes the batches handed to it; results come
back in the order of the batches, so the output is exactly what one process decodes (the same
search on the same batches, a test checks). The workers live for one call (``translate``, or
the whole stream of ``translate_iterable``): a later call forks again and sees the model as it
is then.

Processes, not threads: the search's Python holds the interpreter lock, and two threads of one
process decoding side by side measured barely faster than one (1.17x against 1.3x for two
processes, BENCHMARKS.md).

A worker that dies (killed for memory, say) fails the call with an error naming it rather than
leaving the caller waiting; an error in a worker is raised in the caller; on any of these,
and on Ctrl-C, the workers are stopped at once. A caller that dies, however (``kill -9``
included), takes its workers with it: each asks Linux (``prctl(PR_SET_PDEATHSIG)``) to kill it
when the thread that forked it, the one that called :meth:`map`, ends, and a worker whose caller
died before it could ask ends at its start.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from aiayn.errors import KilledError

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")

__all__ = ["WorkerDiedError", "Workers", "fork_missing"]


class WorkerDiedError(KilledError):
    """A decoding worker process died, killed from outside (for memory, most often): the
    machine's limit, which a smaller batch or fewer workers respects."""


def fork_missing() -> str | None:
    """Why worker processes cannot be forked here, or None if they can (Linux).

    Only Linux: macOS allows ``fork`` but its system libraries (Accelerate, Objective-C) are not
    safe to use in a forked child, and Windows has none.
    """
    if not sys.platform.startswith("linux"):
        return f"forking worker processes is supported on Linux only, not {sys.platform}"
    if "fork" not in multiprocessing.get_all_start_methods():
        return "this Python cannot fork processes"
    return None


_run: Callable[[Any], Any] | None = None
"""In a worker: what it runs for each item (inherited through the fork, never pickled)."""


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _start_worker(run: Callable[[Any], Any], threads: int, caller: int) -> None:
    """A worker's start: killed when its caller (process ``caller``) dies; its own PyTorch
    threads; Ctrl-C is the caller's to handle (it stops the workers), so that a worker waiting
    for its next batch prints no traceback."""
    global _run
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning(
            "a decoding worker cannot ask to end with its caller: %s",
            os.strerror(ctypes.get_errno()),
        )
    if os.getppid() != caller:  # the caller died before the request above: nothing to do
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(threads)
    _run = run


def _run_in_worker(item: Any) -> Any:
    assert _run is not None, "not in a worker started by Workers"
    return _run(item)


class Workers:
    """``run(item)`` in ``workers`` processes forked from this one, each with ``threads``
    PyTorch threads, for as long as the object is open (``with Workers(...) as pool``).

    The processes are forked at the first :meth:`map` that has more than one item (until then
    nothing runs), so that ``run`` and what it refers to (a loaded model) reach them as they
    are then; items and results are pickled. After an error, Ctrl-C or a :meth:`map` stopped
    early, the workers are killed and a later :meth:`map` forks new ones.
    """

    def __init__(self, run: Callable[[Item], Result], *, workers: int, threads: int = 1) -> None:
        reason = fork_missing()
        if reason is not None:
            raise RuntimeError(reason)
        self.run, self.workers, self.threads = run, workers, threads
        self._pool: ProcessPoolExecutor | None = None

    def map(self, items: Sequence[Item]) -> Iterator[Result]:
        """The results of ``run`` on ``items``, in their order (in this process for a single
        item, there being nothing to share out).

        Raises:
            WorkerDiedError: A worker died (killed for memory, say).
            Whatever ``run`` raised in a worker.
        """
        if len(items) < 2 and self._pool is None:
            yield from map(self.run, items)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("fork"),
                initializer=_start_worker,
                initargs=(self.run, self.threads, os.getpid()),
            )
        # Not Executor.map: stopped early, it cancels the futures left while the pool's own
        # thread may be failing them for a dead worker, and before Python 3.12 that thread then
        # dies printing InvalidStateError. Here only the pool settles its futures.
        finished = False
        try:
            try:
                futures = [self._pool.submit(_run_in_worker, item) for item in items][::-1]
                while futures:
                    yield futures.pop().result()  # popped: a result is not kept once given
            except BrokenProcessPool:
                raise WorkerDiedError(
                    "a decoding worker process died (killed for memory? try a smaller "
                    "--max-tokens, or --workers 1)"
                ) from None
            finished = True
        finally:
            if not finished:  # an error, Ctrl-C or an early stop: no result is worth waiting for
                self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: after their current items, or at once with ``kill``."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if kill:
            _kill(pool)
        pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)


def _kill(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's processes (the executor has no public way before Python 3.14)."""
    processes = getattr(pool, "_processes", None) or {}
    for process in list(processes.values()):
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
