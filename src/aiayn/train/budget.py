"""The time budget of a run (`TrainConfig.time_budget`): its clock, the pace of the run, and the
rule that ends it inside the budget with its final validation and save done.

The clock (`RunClock`) counts the run's wall time: what the processes of the run spent up to
the checkpoint this one resumed from (saved in it, `checkpoint.Progress.elapsed_s`), plus this
process's time since it started (`process_start`: the OS's record, for `aiayn train`; under
torchrun, the launcher's).

The pace (`Pace`) is what the run has measured of itself: seconds per update (a running mean
that leaves out a process's first update, which pays for warm-up), per validation and per save.
Until a validation or a save has been measured, it is guessed from the update's cost and the
model's size, on the safe side (`Pace.validation_s`, `Pace.save_s`).

The rule (`TimeBudget.updates_left`): after every update, how many more updates fit in what is
left, once the validation and save due now, the periodic ones to come (spread over the updates)
and the final validation and save are paid for, with a margin (`margin_s`). The run stops when
none fits; the same number foresees its last update, which a decaying learning-rate schedule
ends at (aiayn.optim.scheduled_rate). A validation that runs past the time the final save needs
is abandoned (`TimeBudget.must_save_now`), so a bad guess costs the validation, never the save.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The margin left unspent: 1% of the budget, two updates and the exit (what comes after the
# final save: the process's end, about a second with PyTorch loaded; under torchrun also the
# process group's and the launcher's, a second more).
MARGIN_FRACTION = 0.01
MARGIN_S = 2.0
MARGIN_S_DISTRIBUTED = 3.0
# Guesses for what has not been measured yet, on the safe side. A validation's loss pass costs
# about a third of an update per target token (forward, no backward): half is guessed. Decoding
# the validation set for BLEU (beam search, one position at a time) is guessed at 20 loss passes.
VALID_COST_PER_TOKEN = 0.5
BLEU_COST = 20.0
# A save writes the weights (checkpoint and model/), Adam's two moments and the average, if kept.
SAVE_BYTES_PER_S = 100e6
# The running mean of an update's seconds: the plain mean of the first 100 updates, then an
# exponential one over about the last 100 (the schedule's end follows it: a jumpy mean would
# make a jumpy learning rate).
UPDATE_MEAN_WEIGHT = 0.01


def process_start() -> float | None:
    """When this process started, on the `time.monotonic()` clock, from what the OS recorded
    (Linux: the start time in /proc/PID/stat, against the uptime in /proc/uptime, both since
    boot), so that Python's start-up and its imports are counted; None where there is no /proc.

    A torchrun worker (TORCHELASTIC_RUN_ID set) counts from its launcher's start, its parent
    process, which began a second or more earlier and ends after it.
    """
    started = _start_of("self")
    if started is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = _start_of(str(os.getppid()))
        if launcher is not None:
            started = min(started, launcher)
    return started


def _start_of(pid: str) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Fields after the command name (which may hold spaces): state is field 3, starttime 22.
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if not 0 <= age < 30 * 86400:  # a clock that disagrees with itself: not to be trusted
        return None
    return time.monotonic() - age


class RunClock:
    """The run's wall time: `spent_before` (the processes of the run up to the checkpoint this
    one resumed from), plus this process's since `started` (a `time.monotonic()` value)."""

    def __init__(
        self,
        started: float,
        spent_before: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.started, self.spent_before, self._clock = started, spent_before, clock

    def elapsed(self) -> float:
        return self.spent_before + self._clock() - self.started


@dataclass
class Pace:
    """What the run measured of its own costs, in seconds, and the guesses that stand in for
    what it has not measured yet.

    Attributes:
        valid_tokens: Target tokens of the validation set (0: no validation set).
        validations: Passes over it per validation (2 with an average of the weights: the raw
            and the averaged weights are both measured).
        bleu: Whether a validation also decodes for BLEU.
        save_bytes: What a save writes, about.
    """

    valid_tokens: int = 0
    validations: int = 1
    bleu: bool = False
    save_bytes: int = 0
    update_mean: float | None = None
    first_update: float | None = None
    updates: int = 0  # in the mean
    tokens_per_update: float | None = None
    last_validation: float | None = None
    last_save: float | None = None

    def count_update(self, seconds: float, tokens: int) -> None:
        """An update took `seconds` and held `tokens` target tokens. A process's first update
        (allocations, kernel choices, compilation) stays out of the mean once there is another."""
        if self.first_update is None:
            self.first_update = seconds
        else:
            self.updates += 1
            weight = max(1 / self.updates, UPDATE_MEAN_WEIGHT)
            mean = self.update_mean or 0.0
            self.update_mean = mean + weight * (seconds - mean)
        mean_tokens = self.tokens_per_update or 0.0
        self.tokens_per_update = mean_tokens + max(1 / (self.updates + 1), 0.01) * (
            tokens - mean_tokens
        )

    @property
    def update_s(self) -> float:
        """Seconds an update takes (0 before any was measured)."""
        if self.update_mean is not None:
            return self.update_mean
        return self.first_update or 0.0

    @property
    def validation_s(self) -> float:
        """Seconds a validation takes: the last one measured, else a guess from the update's
        cost per token (0 without a validation set)."""
        if self.valid_tokens == 0:
            return 0.0
        if self.last_validation is not None:
            return self.last_validation
        per_token = self.update_s / max(self.tokens_per_update or 1.0, 1.0)
        loss_pass = self.valid_tokens * per_token * VALID_COST_PER_TOKEN
        return self.validations * loss_pass * (1.0 + (BLEU_COST if self.bleu else 0.0))

    @property
    def save_s(self) -> float:
        """Seconds a save takes: the longest of the last measured and a size-based guess
        before any was; at least the guess's floor of a quarter second."""
        guess = 0.25 + self.save_bytes / SAVE_BYTES_PER_S
        return self.last_save if self.last_save is not None else guess


class TimeBudget:
    """The run's `seconds` of wall time, spent as `clock` counts, at the pace `pace` measures.

    Args:
        seconds: The budget (`TrainConfig.time_budget`).
        clock: The run's wall time.
        pace: The costs measured so far.
        valid_every, save_every, save_every_minutes: When periodic validations and saves come
            (`TrainConfig`); their cost is spread over the updates to come.
        exit_s: What the run needs after its final save (`MARGIN_S`, `MARGIN_S_DISTRIBUTED`).
    """

    def __init__(
        self,
        seconds: float,
        clock: RunClock,
        pace: Pace,
        *,
        valid_every: int = 0,
        save_every: int = 0,
        save_every_minutes: float = 0.0,
        exit_s: float = MARGIN_S,
    ) -> None:
        self.seconds, self.clock, self.pace, self.exit_s = seconds, clock, pace, exit_s
        self.valid_every, self.save_every = valid_every, save_every
        self.save_every_minutes = save_every_minutes

    def left(self) -> float:
        return self.seconds - self.clock.elapsed()

    def margin_s(self) -> float:
        return MARGIN_FRACTION * self.seconds + 2 * self.pace.update_s + self.exit_s

    def final_s(self) -> float:
        """The run's end: a validation (if there is a validation set) and a save."""
        return self.pace.validation_s + self.pace.save_s

    def per_update_s(self) -> float:
        """An update, with its share of the periodic validations and saves."""
        pace, cost = self.pace, self.pace.update_s
        if self.valid_every:
            cost += pace.validation_s / self.valid_every
        if self.save_every:
            cost += pace.save_s / self.save_every
        if self.save_every_minutes:
            cost += pace.save_s * pace.update_s / (60 * self.save_every_minutes)
        return cost

    def updates_left(self, *, due_s: float = 0.0) -> int:
        """How many more updates fit, once `due_s` (the validation and save due now), the
        final validation and save and the margin are paid for; 0 = stop now. Before any
        update was measured, as many as the time left allows at all (0 if none is)."""
        left = self.left() - due_s - self.final_s() - self.margin_s()
        if left < 0:
            return 0
        per_update = self.per_update_s()
        if per_update <= 0:
            return 2**62
        return math.floor(left / per_update)

    def must_save_now(self) -> bool:
        """Whether a validation under way must give up so that the final save still fits."""
        return self.left() < self.pace.save_s + self.exit_s
