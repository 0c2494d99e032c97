"""Tests for aiayn.train.stopping: a signal asks the loop to stop (a second gives up at once), and
early stopping counts validations without improvement. The loop's side, through `aiayn train`, is
in tests/train/test_trainer.py."""

from __future__ import annotations

import math
import os
import signal

import pytest

from aiayn.train.checkpoint import Progress
from aiayn.train.runlog import ValidRecord
from aiayn.train.stopping import EarlyStopping, StopFlag


def valid(step: int, nll: float, bleu: float | None = None) -> ValidRecord:
    return ValidRecord(step, nll + 0.1, nll, math.exp(nll), 100, valid_bleu=bleu)


def test_a_signal_asks_to_stop_and_a_second_gives_up_at_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopFlag() as flag:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert (flag.requested, flag.signum) == (True, signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are given back


def test_the_run_stops_after_patience_validations_without_a_strict_improvement() -> None:
    stopping, progress = EarlyStopping(patience=2, metric="loss"), Progress()
    assert stopping.observe(progress, valid(100, 2.0))
    assert not stopping.observe(progress, valid(200, 2.0))  # equal is no improvement
    assert not stopping.exhausted(progress)
    assert not stopping.observe(progress, valid(300, 2.5))
    assert stopping.exhausted(progress)
    assert (progress.best_step, progress.validations_since_best) == (100, 2)
    assert stopping.describe(progress) == (
        "valid perplexity has not improved for 2 validations (best 7.39 at step 100)"
    )


def test_bleu_decides_where_asked_and_both_bests_are_kept() -> None:
    stopping, progress = EarlyStopping(patience=1, metric="bleu"), Progress()
    assert stopping.observe(progress, valid(100, 2.0, bleu=10.0))
    assert not stopping.observe(progress, valid(200, 1.0, bleu=9.0))  # a lower NLL: not better
    assert stopping.exhausted(progress)
    assert (progress.best_valid_nll, progress.best_valid_bleu) == (1.0, 10.0)
    assert stopping.describe(progress).startswith("valid BLEU has not improved for 1 validations")


def test_patience_0_never_stops() -> None:
    stopping, progress = EarlyStopping(patience=0, metric="loss"), Progress()
    for step in range(1, 6):
        stopping.observe(progress, valid(step, 3.0))
    assert progress.validations_since_best == 4
    assert not stopping.exhausted(progress)
