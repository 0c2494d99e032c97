"""When a training run stops before `max_steps`: on a signal, or early, on validation.

`StopFlag`: SIGINT/SIGTERM (Ctrl-C, `kill`, a scheduler's notice) ask the loop to save after
the current update and exit; a second signal gives up at once.

`EarlyStopping` (not in the paper, which trains a fixed number of steps): the run
ends once the validation metric has not improved for `patience` validations in a row. The same
metric chooses `best/`. Its state (the best value, the step it came from, the validations since)
lives in `checkpoint.Progress`, so a resumed run goes on counting where the stopped one was.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
from dataclasses import dataclass
from typing import Any

from aiayn.train.checkpoint import Progress
from aiayn.train.runlog import ValidRecord

logger = logging.getLogger(__name__)


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves and exits after the current update, or
    abandons a validation under way."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not in the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum
        logger.warning(
            "received %s: saving a checkpoint after this update", signal.strsignal(signum)
        )

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class EarlyStopping:
    """Which validation is the best so far, and whether the run has waited long enough.

    Attributes:
        patience: Validations without improvement before the run stops (0 = never stop).
        metric: "loss" (the validation NLL per token: lower is better) or "bleu" (higher).
    """

    patience: int
    metric: str

    def observe(self, progress: Progress, record: ValidRecord) -> bool:
        """Count the validation `record` into `progress`; True if it is the new best.

        Improvement is strict: a validation that only equals the best one does not reset the
        count. The best NLL and BLEU are both kept, whichever metric decides. With an average
        of the weights, the values are those of the weights the validation chose
        (`ValidRecord.score`): the ones `best/` would hold.
        """
        score = record.score(self.metric)
        if self.metric == "bleu":
            improved = score > progress.best_valid_bleu
        else:
            improved = score < progress.best_valid_nll
        progress.best_valid_nll = min(progress.best_valid_nll, record.score("loss"))
        if record.valid_bleu is not None:
            progress.best_valid_bleu = max(progress.best_valid_bleu, record.score("bleu"))
        if improved:
            progress.best_step, progress.validations_since_best = record.step, 0
        else:
            progress.validations_since_best += 1
        return improved

    def exhausted(self, progress: Progress) -> bool:
        """Whether the run should stop: `patience` validations in a row without improvement."""
        return 0 < self.patience <= progress.validations_since_best

    def describe(self, progress: Progress) -> str:
        """Why the run stopped, e.g. "valid perplexity has not improved for 3 validations
        (best 4.12 at step 600)": perplexity, as the validation log lines show it (not the
        label-smoothed loss), ranks validations as the NLL does."""
        if self.metric == "bleu":
            what, best = "valid BLEU", progress.best_valid_bleu
        else:
            what, best = "valid perplexity", math.exp(min(progress.best_valid_nll, 100.0))
        return (
            f"{what} has not improved for {progress.validations_since_best} validations "
            f"(best {best:.2f} at step {progress.best_step})"
        )
