"""The run log: one JSON object per line in RUN_DIR/metrics.jsonl, what a run measured as it went.

Named for what it holds (a log), not ``metrics``: the metrics themselves (BLEU, chrF) are in
:mod:`aiayn.decode.evaluation`.

Records are `TrainRecord`s (`type` "train") and `ValidRecord`s (`type` "valid"), written as
flat JSON objects; with an average of the weights (`ema_decay`), a `ModelRecord` (`type`
"model") at the end says which weights the run's model/ holds. Readers stop at the last
complete line, so a log that a running job is writing can be read. With `tensorboard: true` the
same train and valid records also go to RUN_DIR/tensorboard/ as TensorBoard scalars
(`TensorBoardLog`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from aiayn.errors import UserFileNotFoundError
from aiayn.extras import require

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


@dataclass(frozen=True)
class TrainRecord:
    """Training measured over the updates since the previous record (per target token)."""

    type: ClassVar[str] = "train"
    step: int
    epoch: int
    loss: float  # label-smoothed
    nll: float
    ppl: float
    lr: float
    tokens_per_s: float  # target tokens of every process, per second of this process
    tokens_seen: int  # target tokens of the whole run so far
    elapsed_s: float | None = None  # the run's wall time (aiayn.train.budget.RunClock)
    peak_memory_gib: float | None = None  # the GPU memory this process's tensors peaked at

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; `elapsed_s` and `peak_memory_gib` only when measured (as in logs of
        earlier releases; the peak on a CUDA GPU)."""
        values = dataclasses.asdict(self)
        return {"type": self.type, **{k: v for k, v in values.items() if v is not None}}


@dataclass(frozen=True)
class ValidRecord:
    """A validation pass at `step`; BLEU and chrF only with `valid_bleu`.

    With an average of the weights (`ema_decay`), the `valid_*` fields are the raw weights',
    the `valid_ema_*` ones the average's, and `weights` names the better of the two by the
    run's `patience_metric` ("raw" or "ema"): what `best/` and early stopping take.
    """

    type: ClassVar[str] = "valid"
    step: int
    valid_loss: float
    valid_nll: float
    valid_ppl: float
    valid_tokens: int
    valid_bleu: float | None = None
    valid_chrf: float | None = None
    bleu_signature: str | None = None
    valid_ema_loss: float | None = None
    valid_ema_nll: float | None = None
    valid_ema_ppl: float | None = None
    valid_ema_bleu: float | None = None
    valid_ema_chrf: float | None = None
    weights: str | None = None

    def score(self, metric: str) -> float:
        """The validation NLL (`metric` "loss") or BLEU ("bleu") of the weights it chose."""
        ema = self.weights == "ema"
        if metric == "bleu":
            value = self.valid_ema_bleu if ema else self.valid_bleu
            assert value is not None, "patience_metric bleu needs valid_bleu"
            return value
        value = self.valid_ema_nll if ema else self.valid_nll
        assert value is not None
        return value

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; BLEU fields only when measured (as in logs of earlier releases)."""
        values = dataclasses.asdict(self)
        return {"type": self.type, **{k: v for k, v in values.items() if v is not None}}

    def metrics(self) -> dict[str, Any]:
        """The measured values, without `type` and `step` (what `TrainResult` reports)."""
        return {k: v for k, v in self.to_dict().items() if k not in ("type", "step")}


@dataclass(frozen=True)
class ModelRecord:
    """Which weights the run's model/ holds at `step`: "raw" or "ema" (the moving average), as
    the validation at `chosen_at` found them better (None: no validation chose, so the
    average, which the run was asked to keep, is taken)."""

    type: ClassVar[str] = "model"
    step: int
    weights: str
    chosen_at: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **dataclasses.asdict(self)}


Record = TrainRecord | ValidRecord


def parse_record(values: dict[str, Any]) -> Record | None:
    """A record from its JSON form; None for a record of another or unknown type. Keys that
    a record type does not have are ignored, missing ones are None (logs of older releases)."""
    kinds: dict[str, type[TrainRecord] | type[ValidRecord]] = {
        "train": TrainRecord,
        "valid": ValidRecord,
    }
    kind = kinds.get(values.get("type", ""))
    if kind is None:
        return None
    names = [f.name for f in dataclasses.fields(kind)]
    return kind(**{name: values.get(name) for name in names})


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics log up to its last complete line (a run may still be writing)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise UserFileNotFoundError(f"metrics log not found: {path}")
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # partly written last line
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, forget records written after the checkpoint (they will be written again)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


def scalars(record: Record) -> dict[str, float]:
    """A record's numbers as TensorBoard tags: `train/loss`, `train/lr`, ..., `valid/loss`,
    `valid/bleu`, ... (the step is TensorBoard's own axis; the BLEU signature is no number)."""
    kind = record.type
    values = dataclasses.asdict(record)
    return {
        f"{kind}/{name.removeprefix(kind + '_')}": float(value)
        for name, value in values.items()
        if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardLog:
    """The records of a metrics log as TensorBoard scalars, at the record's step.

    Args:
        directory: Where the event files go (RUN_DIR/tensorboard).
        purge_step: On resume, the first step after the checkpoint: TensorBoard hides what an
            earlier process wrote from this step on (updates that are done again), as
            `truncate_metrics` drops those records from metrics.jsonl.
    """

    def __init__(self, directory: Path, *, purge_step: int | None = None) -> None:
        require("tensorboard", "tensorboard", needed_by="tensorboard: true (--tensorboard)")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory), purge_step=purge_step)

    def write(self, record: Record) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record.step)
        self.writer.flush()  # as metrics.jsonl: a crash loses no record written before it

    def close(self) -> None:
        self.writer.close()


class MetricsLog:
    """Appends records to a run's metrics log; disabled on all but the main process of a job.

    Attributes:
        tensorboard: Also writes every record there, when set (by the trainer, on rank 0).
    """

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled
        self.tensorboard: TensorBoardLog | None = None

    def write(self, record: Record | ModelRecord | dict[str, Any]) -> None:
        """Appends one record as a line and closes the file: a crash loses at most that line."""
        numbers = isinstance(record, (TrainRecord, ValidRecord))
        if self.enabled and self.tensorboard is not None and numbers:
            self.tensorboard.write(record)
        if isinstance(record, (TrainRecord, ValidRecord, ModelRecord)):
            record = record.to_dict()
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


class TrainingDisplay:
    """What a person sees while training runs: a tqdm bar on a terminal, else a log line per
    train record; and the throughput they show, measured by this process from the updates it
    ran since the last record (not from `Progress.interval`, which after a resume also holds
    the tokens of updates before the stop)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger  # the trainer's: its lines read "aiayn.train.trainer: step ..."
        self.bar: Any = None
        self.restart()

    def open(self, *, bar: bool, total: int, initial: int) -> None:
        """Start showing: a bar where `bar` is asked for and stderr is a terminal."""
        if bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.restart()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def restart(self) -> None:
        """A new throughput interval."""
        self._start, self._tokens = time.monotonic(), 0

    def count(self, tokens: int) -> None:
        """Target tokens of an update this process ran."""
        self._tokens += tokens

    def tokens_per_s(self) -> float:
        return self._tokens / max(time.monotonic() - self._start, 1e-9)

    def show(self, record: TrainRecord, *, log: bool) -> None:
        """`record` on the bar, or as a log line where `log`; then a new interval."""
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record.loss:.3f}",
                ppl=f"{record.ppl:.1f}",
                lr=f"{record.lr:.2e}",
                tok_s=f"{record.tokens_per_s:.0f}",
                **({} if record.peak_memory_gib is None else {"gib": record.peak_memory_gib}),
            )
        elif log:
            peak = record.peak_memory_gib
            self._logger.info(
                "step %d: loss %.4f ppl %.2f lr %.3g %.0f tok/s%s",
                record.step,
                record.loss,
                record.ppl,
                record.lr,
                record.tokens_per_s,
                "" if peak is None else f", peak {peak:.1f} GiB",
            )
        self.restart()

    def advance(self) -> None:
        """One update done."""
        if self.bar is not None:
            self.bar.update(1)
