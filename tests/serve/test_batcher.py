"""Tests for aiayn.serve.batcher with a fake translate function (no model): which jobs share a call,
that every job gets its own results, and that failures, full queues, cancelled clients and
shutdown are each answered without stopping the worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from aiayn.serve.batcher import Batcher, BatcherClosed, QueueFull


class FakeModel:
    """Records each call; translates by upper-casing; ``gate`` can hold the worker in a call."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[list[str], object]] = []
        self.fail_on = fail_on
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def translate(self, texts: list[str], options: object) -> list[str]:
        self.calls.append((list(texts), options))
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if self.fail_on is not None and self.fail_on in texts:
            raise RuntimeError(f"cannot translate {self.fail_on!r}")
        return [f"{text.upper()}/{options}" for text in texts]


def one_per_text(texts: list[str], options: object) -> int:
    return len(texts)


def make_batcher(model: FakeModel, cost: Callable = one_per_text, **kwargs) -> Batcher[str]:
    return Batcher(model.translate, cost, **kwargs)


async def submit_all(batcher: Batcher[str], jobs: list[tuple[list[str], object]]) -> list:
    """Submits every job at once (one event loop turn) and gathers results or exceptions."""
    tasks = [asyncio.ensure_future(batcher.submit(texts, options)) for texts, options in jobs]
    return await asyncio.gather(*tasks, return_exceptions=True)


def run(coroutine):
    return asyncio.run(coroutine)


async def submit_while_held(
    model: FakeModel, batcher: Batcher[str], jobs: list[tuple[list[str], object]]
) -> list:
    """Submits the jobs while the worker is held inside a first call (of the text "z"), so
    that all of them wait when it collects the next call; gathers their results or
    exceptions. (Submitted one by one to a free worker, it could wake between them.)"""
    model.gate.clear()
    first = asyncio.ensure_future(batcher.submit(["z"], 0))
    while not model.entered.is_set():  # the worker is now inside the first call
        await asyncio.sleep(0.001)
    tasks = [asyncio.ensure_future(batcher.submit(texts, options)) for texts, options in jobs]
    while batcher.stats()["queued"] < len(jobs):
        await asyncio.sleep(0.001)
    model.gate.set()
    await first
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_concurrent_jobs_share_one_call_and_get_their_own_results() -> None:
    model = FakeModel()
    # the call starts when the six texts fill the budget (the wait for company is no bound)
    batcher = make_batcher(model, max_wait_ms=600_000, max_batch_cost=6)
    jobs = [(["a", "b"], 1), (["c"], 1), (["d", "e", "f"], 1)]
    try:
        results = run(submit_all(batcher, jobs))
    finally:
        batcher.close()
    # texts round-robin over the jobs: the first of each, then the second of each, ...
    assert model.calls == [(["a", "c", "d", "b", "e", "f"], 1)]
    assert results == [["A/1", "B/1"], ["C/1"], ["D/1", "E/1", "F/1"]]
    stats = batcher.stats()
    assert (stats["model_calls"], stats["requests"], stats["sentences"]) == (1, 3, 6)
    assert stats["largest_call"] == 3


def test_jobs_with_different_options_get_separate_calls_in_arrival_order() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=600_000, max_batch_cost=3)  # as above
    try:
        results = run(submit_all(batcher, [(["a"], "x"), (["b"], "y"), (["c"], "x")]))
    finally:
        batcher.close()
    assert model.calls == [(["a", "c"], "x"), (["b"], "y")]
    assert results == [["A/x"], ["B/y"], ["C/x"]]


def test_a_job_that_arrives_while_the_worker_counts_costs_wakes_it() -> None:
    """The worker counts the queued texts' costs outside its lock, then waits for company: a
    job submitted in between, whose notice found nobody waiting, must still end that wait
    (a lost wake-up once held a call for the whole of max_wait_ms)."""
    model = FakeModel()
    counting, submitted = threading.Event(), threading.Event()

    def slow_cost(texts: list[str], options: object) -> int:
        if texts == ["a"]:  # the worker, outside its lock: let "b" arrive now
            counting.set()
            assert submitted.wait(10), "the test never submitted the second job"
        return len(texts)

    batcher = make_batcher(model, slow_cost, max_wait_ms=120_000, max_batch_cost=2)

    async def scenario() -> tuple[list, float]:
        first = asyncio.ensure_future(batcher.submit(["a"], 0))
        while not counting.is_set():
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(batcher.submit(["b"], 0))
        while batcher.stats()["queued"] < 2:
            await asyncio.sleep(0.001)
        start = time.monotonic()
        submitted.set()
        results = await asyncio.wait_for(asyncio.gather(first, second), timeout=60)
        return results, time.monotonic() - start

    try:
        results, seconds = run(scenario())
    finally:
        batcher.close()
    assert results == [["A/0"], ["B/0"]]
    assert model.calls == [(["a", "b"], 0)]  # the two texts fill the budget: one call
    assert seconds < 30  # not max_wait_ms (120 s): the second job's arrival was seen


def test_a_call_stops_at_the_budget_and_takes_texts_round_robin() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=200, max_batch_cost=3)
    jobs = [(["a", "b"], 0), (["c"], 0), (["d"], 0), (["e", "f", "g", "h"], 0)]
    try:
        results = run(submit_while_held(model, batcher, jobs))
    finally:
        batcher.close()
    # the first text of every job comes before the second of any; 3 texts fill the budget
    calls = [texts for texts, _ in model.calls]
    assert calls == [["z"], ["a", "c", "d"], ["e", "b", "f"], ["g", "h"]]  # "e" waited longest
    assert results == [["A/0", "B/0"], ["C/0"], ["D/0"], ["E/0", "F/0", "G/0", "H/0"]]


def test_jobs_take_turns_across_calls() -> None:
    """Calls alternate between the jobs, also when the second arrives while the first call
    runs (held here until it is queued): it goes before the rest of the job just served."""
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=200, max_batch_cost=1)

    async def scenario() -> list:
        model.gate.clear()
        jobs = [(["x0", "x1", "x2"], 0), (["y0", "y1"], 0)]
        tasks = [asyncio.ensure_future(batcher.submit(texts, options)) for texts, options in jobs]
        while not model.entered.is_set() or batcher.stats()["queued"] < 2:
            await asyncio.sleep(0.001)
        model.gate.set()
        return await asyncio.gather(*tasks)

    try:
        results = run(scenario())
    finally:
        batcher.close()
    assert results == [["X0/0", "X1/0", "X2/0"], ["Y0/0", "Y1/0"]]
    calls = [texts for texts, _ in model.calls]
    assert calls == [["x0"], ["y0"], ["x1"], ["y1"], ["x2"]]


def test_a_text_over_the_budget_is_translated_alone() -> None:
    model = FakeModel()
    batcher = make_batcher(model, lambda texts, _: 10 * len(texts), max_batch_cost=3)
    try:
        results = run(submit_all(batcher, [(["a", "b"], 0)]))
    finally:
        batcher.close()
    assert [texts for texts, _ in model.calls] == [["a"], ["b"]]
    assert results == [["A/0", "B/0"]]


def test_a_short_request_behind_a_long_one_waits_for_one_call_only() -> None:
    """The long request's texts are interleaved with the short one's, which goes into the
    very next call; the long one is answered once all its texts are done."""
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=0, max_batch_cost=2)

    async def scenario() -> tuple[list, list]:
        model.gate.clear()
        long = asyncio.ensure_future(batcher.submit([f"l{i}" for i in range(8)], 0))
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        short = asyncio.ensure_future(batcher.submit(["s"], 0))
        while batcher.stats()["queued"] < 2:
            await asyncio.sleep(0.001)
        model.gate.set()
        return await long, await short

    try:
        long, short = run(scenario())
    finally:
        batcher.close()
    assert short == ["S/0"] and long == [f"L{i}/0" for i in range(8)]
    # the short one arrived during the first call, so it goes before the long one's next text
    assert [texts for texts, _ in model.calls[:2]] == [["l0", "l1"], ["s", "l2"]]


def test_the_rest_of_an_abandoned_request_is_dropped_between_calls() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=0, max_batch_cost=1)

    async def scenario() -> dict:
        model.gate.clear()
        gone = asyncio.ensure_future(batcher.submit(["a", "b", "c", "d"], 0))
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        assert batcher.stats()["queued_texts"] == 3
        assert batcher.stats()["oldest_wait_s"] >= 0
        gone.cancel()
        model.gate.set()
        await asyncio.sleep(0)
        return await asyncio.to_thread(_wait_until_idle, batcher)

    try:
        stats = run(scenario())
    finally:
        batcher.close()
    assert [texts for texts, _ in model.calls] == [["a"]]
    assert stats["dropped"] == 1 and stats["queued"] == 0 and stats["oldest_wait_s"] == 0


def _wait_until_idle(batcher: Batcher) -> dict:
    deadline = time.monotonic() + 10
    while batcher.stats()["queued"] or batcher.stats()["dropped"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return batcher.stats()


def test_without_batching_each_job_is_its_own_call() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=200, batching=False)
    try:
        results = run(submit_all(batcher, [(["a"], 0), (["b", "c"], 0), (["d"], 0)]))
    finally:
        batcher.close()
    assert [texts for texts, _ in model.calls] == [["a"], ["b", "c"], ["d"]]
    assert results == [["A/0"], ["B/0", "C/0"], ["D/0"]]


def test_with_no_wait_jobs_that_queued_during_a_call_share_the_next() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=0)

    async def scenario() -> list:
        model.gate.clear()
        first = asyncio.ensure_future(batcher.submit(["a"], 0))
        while not model.entered.is_set():  # the worker is now inside the first call
            await asyncio.sleep(0.001)
        later = [asyncio.ensure_future(batcher.submit([t], 0)) for t in ("b", "c", "d")]
        while batcher.stats()["queued"] < 3:
            await asyncio.sleep(0.001)
        model.gate.set()
        return await asyncio.gather(first, *later)

    try:
        results = run(scenario())
    finally:
        batcher.close()
    assert [texts for texts, _ in model.calls] == [["a"], ["b", "c", "d"]]
    assert results == [["A/0"], ["B/0"], ["C/0"], ["D/0"]]


def test_after_a_call_with_one_job_the_next_does_not_wait() -> None:
    """A wait for company of ten minutes: a call that waited would show as a hang (the guard
    below), not as a few milliseconds more on a clock."""
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=600_000, max_batch_cost=2)

    async def scenario() -> None:
        await batcher.submit(["a", "a2"], 0)  # fills the budget: a call of one job, no wait
        for text in ("b", "c", "d"):  # one client, one request at a time
            await batcher.submit([text], 0)

    try:
        run(asyncio.wait_for(scenario(), timeout=60))  # guards a hang only
    finally:
        batcher.close()
    assert [texts for texts, _ in model.calls] == [["a", "a2"], ["b"], ["c"], ["d"]]


def test_a_failing_job_fails_alone_and_the_worker_carries_on() -> None:
    model = FakeModel(fail_on="bad")
    batcher = make_batcher(model, max_wait_ms=200)
    try:
        results = run(submit_while_held(model, batcher, [(["a"], 0), (["bad"], 0), (["c"], 0)]))
        assert batcher.alive
        after = run(submit_all(batcher, [(["d"], 0)]))
    finally:
        batcher.close()
    assert results[0] == ["A/0"] and results[2] == ["C/0"]
    assert isinstance(results[1], RuntimeError) and "cannot translate 'bad'" in str(results[1])
    # the shared call failed, then each job was retried alone
    calls = [texts for texts, _ in model.calls]
    assert calls == [["z"], ["a", "bad", "c"], ["a"], ["bad"], ["c"], ["d"]]
    assert after == [["D/0"]]
    assert batcher.stats()["failed_calls"] == 2


def test_a_wrong_number_of_results_is_an_error_not_a_hang() -> None:
    batcher = Batcher(lambda texts, options: ["only one"], one_per_text)
    try:
        [result] = run(submit_all(batcher, [(["a", "b"], 0)]))
    finally:
        batcher.close()
    assert isinstance(result, RuntimeError) and "returned 1 results for 2" in str(result)


def test_a_full_queue_refuses_at_once_and_says_which_limit() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_queue=2)

    async def scenario() -> tuple[list, Exception]:
        model.gate.clear()
        busy = asyncio.ensure_future(batcher.submit(["a"], 0))
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        queued = [asyncio.ensure_future(batcher.submit([t], 0)) for t in ("b", "c")]
        while batcher.stats()["queued"] < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(QueueFull) as refused:
            await batcher.submit(["d"], 0)
        model.gate.set()
        return await asyncio.gather(busy, *queued), refused.value

    try:
        results, error = run(scenario())
    finally:
        batcher.close()
    assert results == [["A/0"], ["B/0"], ["C/0"]]
    assert "2 requests are waiting" in str(error) and "--max-queue" in str(error)
    assert batcher.stats()["rejected"] == 1


def test_a_job_whose_client_went_away_is_not_translated() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=0)

    async def scenario() -> list:
        model.gate.clear()
        busy = asyncio.ensure_future(batcher.submit(["a"], 0))
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        gone = asyncio.ensure_future(batcher.submit(["gone"], 0))
        kept = asyncio.ensure_future(batcher.submit(["kept"], 0))
        while batcher.stats()["queued"] < 2:
            await asyncio.sleep(0.001)
        gone.cancel()
        model.gate.set()
        return await asyncio.gather(busy, kept)

    try:
        results = run(scenario())
    finally:
        batcher.close()
    assert results == [["A/0"], ["KEPT/0"]]
    assert [texts for texts, _ in model.calls] == [["a"], ["kept"]]


def test_jobs_whose_clients_went_away_are_not_queued_any_more() -> None:
    """While the worker is inside a call, abandoned jobs still wait in its queue: /health's
    ``queued`` counted them, and so did ``max_queue``, refusing live requests for them."""
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=0, max_queue=2)

    async def scenario() -> tuple[dict, list]:
        model.gate.clear()
        busy = asyncio.ensure_future(batcher.submit(["a"], 0))
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        gone = [asyncio.ensure_future(batcher.submit(["x", "y"], 0)) for _ in range(2)]
        while batcher.stats()["queued"] < 2:
            await asyncio.sleep(0.001)
        for job in gone:
            job.cancel()
        await asyncio.sleep(0)  # the cancellations reach the jobs' futures
        stats = batcher.stats()
        kept = asyncio.ensure_future(batcher.submit(["kept"], 0))  # not QueueFull
        await asyncio.sleep(0)
        model.gate.set()
        return stats, await asyncio.gather(busy, kept)

    try:
        stats, results = run(scenario())
    finally:
        batcher.close()
    assert (stats["queued"], stats["queued_texts"], stats["dropped"]) == (0, 0, 2)
    assert results == [["A/0"], ["KEPT/0"]] and batcher.stats()["rejected"] == 0


def test_close_fails_waiting_jobs_and_stops_the_worker() -> None:
    model = FakeModel()
    batcher = make_batcher(model, max_wait_ms=0)

    async def scenario() -> list:
        model.gate.clear()
        busy = asyncio.ensure_future(batcher.submit(["a"], 0))
        while not model.entered.is_set():
            await asyncio.sleep(0.001)
        waiting = asyncio.ensure_future(batcher.submit(["b"], 0))
        while batcher.stats()["queued"] < 1:
            await asyncio.sleep(0.001)
        closing = asyncio.ensure_future(asyncio.to_thread(batcher.close))
        deadline = time.monotonic() + 10
        while not waiting.done():  # close() fails the waiting jobs before it joins the worker
            assert time.monotonic() < deadline, "close() never failed the waiting job"
            await asyncio.sleep(0.001)
        model.gate.set()  # the call in progress finishes normally
        await closing
        return await asyncio.gather(busy, waiting, return_exceptions=True)

    busy, waiting = run(scenario())
    assert busy == ["A/0"]
    assert isinstance(waiting, BatcherClosed)
    assert not batcher.alive


def test_a_failing_cost_function_does_not_stop_the_worker() -> None:
    model = FakeModel()

    def broken_cost(texts: list[str], options: object) -> int:
        raise ValueError("no cost")

    batcher = make_batcher(model, cost=broken_cost, max_wait_ms=50)
    try:
        results = run(submit_all(batcher, [(["a"], 0), (["b"], 0)]))
    finally:
        batcher.close()
    assert results == [["A/0"], ["B/0"]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_wait_ms": -1}, "max_wait_ms (-1) must be >= 0"),
        ({"max_batch_cost": 0}, "max_batch_cost (0) must be an integer >= 1"),
        ({"max_queue": True}, "max_queue (True) must be an integer >= 1"),
    ],
)
def test_invalid_settings_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_batcher(FakeModel(), **kwargs)
