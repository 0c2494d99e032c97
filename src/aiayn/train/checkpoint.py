"""Training checkpoints: a model directory (`aiayn.model_dir`) plus `training_state.pt`.

A checkpoint (`RUN_DIR/checkpoints/step_00001000/`) is a model directory plus
`training_state.pt`, a `TrainingState`: optimizer state, step, RNG states and data position.
It is read with `torch.load(weights_only=True)`, which refuses to run pickled code, and written
as a model directory is, atomically (`model_dir.save_model_dir`). `average_checkpoints` makes
the mean model of several (§6.1).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.model_dir import (
    CHECKSUMS_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CorruptCheckpointError,
    load_weights,
    read_model_config,
    save_model_dir,
    verify,
)

logger = logging.getLogger(__name__)

TRAINING_STATE_FILE = "training_state.pt"


def new_interval() -> dict[str, float]:
    """Sums over the updates since the last metrics record (loss and NLL are per token later)."""
    return {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "updates": 0.0}


@dataclass
class Progress:
    """Where the training loop is: what it must restore to continue exactly where it stopped."""

    step: int = 0
    epoch: int = 1
    position: int = 0  # updates already taken in this epoch
    best_valid_nll: float = math.inf
    tokens_seen: int = 0
    # Early stopping (aiayn.train.stopping); checkpoints of earlier releases load with the defaults.
    best_valid_bleu: float = -math.inf
    best_step: int = 0  # the validation that chose `best/`
    validations_since_best: int = 0
    interval: dict[str, float] = field(default_factory=new_interval)
    # The run's wall time up to this checkpoint, every process of it (aiayn.train.budget).
    elapsed_s: float = 0.0
    # The last update a decaying schedule was heading for, as foreseen from a time budget
    # (0 = none foreseen): a resumed run goes on from it until it has measured its own pace.
    schedule_end: int = 0
    # Which weights model/ holds with an average of them (aiayn.train.ema): "raw" or "ema", and
    # the validation that chose (0 = none yet).
    weights: str = "raw"
    weights_chosen_at: int = 0

    def count_update(self, tokens: int) -> None:
        """One update more: step, position in the epoch, tokens, the open metrics interval's
        tokens and updates (its loss sums wait on the device: `update.IntervalLossSums`)."""
        self.step += 1
        self.position += 1
        self.tokens_seen += tokens
        self.interval["tokens"] += tokens
        self.interval["updates"] += 1


@dataclass
class TrainingState:
    """`training_state.pt`: what a checkpoint holds besides the model directory.

    Saved as plain dicts, tensors and numbers (`to_dict`), the form of every earlier release,
    so that `torch.load(weights_only=True)` reads it and old checkpoints resume.

    Attributes:
        optimizer: The optimizer's `state_dict()`.
        progress: Step, epoch, data position, the open metrics interval, the best validation
            so far and the validations since it, the run's wall time.
        rng: Every rank's RNG states (`capture_rng`), indexed by rank.
        world_size, accumulate: The processes × batches of one update, which `position` counts.
        ema: The moving average of the weights by parameter name, float32
            (`ema.WeightAverage.state_dict`); None without one (and not saved then).
    """

    optimizer: dict[str, Any]
    progress: Progress
    rng: list[dict[str, Any]]
    world_size: int
    accumulate: int
    ema: dict[str, torch.Tensor] | None = None

    def to_dict(self) -> dict[str, Any]:
        values = {**vars(self), "progress": dataclasses.asdict(self.progress)}
        if self.ema is None:
            del values["ema"]  # as earlier releases wrote it
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainingState:
        return cls(**{**values, "progress": Progress(**values["progress"])})


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (CPU, and every CUDA device's if there is one)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])  # seen here


def save_checkpoint(
    run_dir: str | Path,
    model: nn.Module,
    *,
    step: int,
    training_state: TrainingState,
    tokenizer_file: str | Path,
    metadata: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write `checkpoints/step_XXXXXXXX` and delete all but the newest `keep_last`."""
    checkpoints = Path(run_dir) / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    path = checkpoints / f"step_{step:08d}"
    save_model_dir(
        path,
        model,
        tokenizer_file=tokenizer_file,
        metadata={**metadata, "step": step},
        extra_files={TRAINING_STATE_FILE: training_state.to_dict()},
    )
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete step checkpoints of a run, oldest first.

    Temporary directories and ones moved aside by hand (`step_00000400.corrupt`) are ignored.
    """
    return [path for path in _step_dirs(run_dir) if (path / CHECKSUMS_FILE).is_file()]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, naming any newer one that is skipped as incomplete.

    Saves rename a checkpoint into place only once its checksums.json is written, so a newer
    one without it was cut short or damaged by something else (a copy, a sync, a hand):
    continuing from an older one must not go unnoticed.
    """
    complete = list_checkpoints(run_dir)
    latest = complete[-1] if complete else None
    for path in _step_dirs(run_dir):
        if path not in complete and (latest is None or _step(path) > _step(latest)):
            logger.warning(
                "%s has no %s (cut short or damaged): skipped; the newest complete checkpoint "
                "is %s",
                path,
                CHECKSUMS_FILE,
                latest or "none",
            )
    return latest


_STEP_DIR = re.compile(r"step_\d+")


def _step_dirs(run_dir: str | Path) -> list[Path]:
    checkpoints = Path(run_dir) / "checkpoints"
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=_step)


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def load_training_state(checkpoint: Path) -> TrainingState:
    """The training state of a verified checkpoint; never executes pickled code."""
    verify(checkpoint)
    path = checkpoint / TRAINING_STATE_FILE
    try:
        values = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated/corrupt files
        raise CorruptCheckpointError(f"cannot read {path}: {error}") from None
    try:
        return TrainingState.from_dict(values)
    except (KeyError, TypeError) as error:
        raise CorruptCheckpointError(f"{path} is not a training state: {error!r}") from None


def check_same_architecture(checkpoint: Path, config: ModelConfig) -> None:
    """Refuse to resume a checkpoint whose `ModelConfig` differs from the run's."""
    saved = read_model_config(checkpoint)
    diffs = [
        f"{key}: checkpoint {value!r}, config {getattr(config, key)!r}"
        for key, value in saved.to_dict().items()
        if getattr(config, key) != value and key not in ("dropout", "attention_dropout")
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: it holds a different architecture ("
            + "; ".join(diffs)
            + ")"
        )


def average_checkpoints(paths: list[Path]) -> Transformer:
    """A model whose weights are the element-wise mean of several checkpoints' (§6.1).

    Sums are taken in float64, so the order of checkpoints does not matter.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    config = read_model_config(paths[0])
    model = Transformer(config)
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        if read_model_config(path) != config:
            raise CheckpointError(f"cannot average {path} with {paths[0]}: configs differ")
        verify(path)
        load_weights(model, path / WEIGHTS_FILE)
        for name, tensor in model.state_dict().items():
            total[name] = total.get(name, 0) + tensor.double()
    model.load_state_dict({name: (t / len(paths)).float() for name, t in total.items()})
    return model
