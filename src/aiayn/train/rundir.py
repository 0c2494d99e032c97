"""The run directory of a training job: its layout, one trainer at a time, what a kill leaves.

    RUN_DIR/
        train_config.yaml   the resolved `TrainConfig` (written once the run starts)
        tokenizer.model     the joint vocabulary (+ tokenizer.json: what it was made from)
                            (fine-tuning an imported Marian model, `init_from`: its
                            source.spm + target.spm + vocab.json instead)
        data/               the binarised corpus cache
        metrics.jsonl       the run log (aiayn.train.runlog)
        tensorboard/        the same records as TensorBoard scalars (with `tensorboard: true`)
        checkpoints/        step_XXXXXXXX/ (aiayn.train.checkpoint)
        model/, best/       the latest and the best model directory
        train.lock          who is training here

One trainer per run directory. Two trainers writing one run directory interleave their metrics
and mix their checkpoints and `model/`; a second `--resume` while the first still runs loses the
first's records. So the trainer holds `flock` on `train.lock` for as long as it runs. The kernel
releases the lock when the process exits, however it exits (SIGKILL, OOM killer, power-off of a
node does not matter: a lock never outlives its process), so a crashed run never blocks the
next one, and no stale-lock guessing by PID is needed. The file itself stays; it holds the
holder's PID, host and start time only to say who is in the way. Where `fcntl` does not exist
(Windows) or the file system refuses locks, training goes on unlocked, with a warning.

A resume continues the run as it was set up: `resume_overrides` allows a changed setting only
where it does not change what is trained (`RESUMABLE`), and names the one that would.

A killed save leaves temporary and moved-aside directories (aiayn.train.checkpoint); `remove_debris`
puts back what they were replacing and removes the rest when the run starts again.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from aiayn.config import TrainConfig, load_yaml_config, upgrade_train_values
from aiayn.errors import UserError
from aiayn.model_dir import DiskFullError, stranded_copy
from aiayn.parts import dead_parts, remove
from aiayn.train import checkpoint as ckpt
from aiayn.train.runlog import METRICS_FILE

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

LOCK_FILE = "train.lock"
TRAIN_CONFIG_FILE = "train_config.yaml"
# The directories of the layout above: the trainer's, never another command's output.
OWN_DIRS = ("checkpoints", "data", "model", "best", "tensorboard")


class RunDirectoryError(UserError, RuntimeError):
    """The run directory cannot be used as asked (the message says why and what to do)."""


class RunDirectoryLocked(RunDirectoryError):
    """Another live process is training in this run directory."""


@contextlib.contextmanager
def hold_run_lock(run_dir: Path, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Holds the run directory's lock for the `with` block.

    Args:
        run_dir: An existing directory.
        check: Run once the lock is held, before the holder is recorded: a run it refuses
            (by raising) leaves the lock file as it was.

    Raises:
        RunDirectoryLocked: Another process holds it; the message names its PID, host and
            start time.
    """
    path = Path(run_dir) / LOCK_FILE
    if fcntl is None:
        logger.warning("no fcntl here: %s is not protected from a second trainer", run_dir)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("cannot lock %s (%s): no protection from a second run", path, err)
            else:
                raise RunDirectoryLocked(
                    f"{run_dir} is in use by another trainer ({_describe_holder(path)}; "
                    f"lock file {path}): wait for it to end or stop it, or choose another "
                    "--out-dir"
                ) from None
        else:
            check()
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"PID {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: it is still starting"


def is_run_dir(directory: Path) -> bool:
    """Whether `directory` is a training run's (it holds checkpoints/ or its train config)."""
    return (directory / "checkpoints").is_dir() or (directory / TRAIN_CONFIG_FILE).is_file()


def owning_run(directory: Path) -> tuple[Path, str | None] | None:
    """The run directory that `directory` is, or that writes it: (run, None) for a run
    directory, (run, the path below it) for one of its `OWN_DIRS` or anything inside one,
    present or not; None for any other directory, `RUN/averaged` included."""
    directory = directory.resolve()
    if is_run_dir(directory):
        return directory, None
    for parent in directory.parents:
        below = directory.relative_to(parent)
        if below.parts[0] in OWN_DIRS and is_run_dir(parent):
            return parent, str(below)
    return None


def refuse_existing_run(run_dir: Path, resume: bool) -> None:
    """A fresh run must not overwrite one that has checkpoints."""
    if ckpt.list_checkpoints(run_dir) and not resume:
        raise RunDirectoryError(
            f"{run_dir} already holds checkpoints; pass --resume to continue that run or "
            "choose another --out-dir (nothing was overwritten)"
        )


def earlier_checkpoint_hint(run_dir: Path, corrupt: Path) -> str:
    """How to continue from the checkpoint before a corrupt one (the run has no other way)."""
    earlier = [path for path in ckpt.list_checkpoints(run_dir) if path != corrupt]
    if not earlier:
        return "there is no earlier checkpoint to resume from"
    return (
        f"to resume from the previous checkpoint {earlier[-1]}, move this one aside "
        f"(mv {corrupt} {corrupt}.corrupt) and run again with --resume"
    )


# -- the run's settings ---------------------------------------------------------------------


def write_config(run_dir: Path, values: dict[str, Any]) -> None:
    """Record the resolved config; only once the run starts, so that a refused `--resume`
    does not leave a config in the directory that its checkpoints do not match."""
    text = yaml.safe_dump(values, sort_keys=False, allow_unicode=True)
    (run_dir / TRAIN_CONFIG_FILE).write_text(text, encoding="utf-8")


# What a resume may change: how the run goes on (length, saving, logging, validation, where
# and how fast it computes), not what it trains on or how. Everything else (architecture,
# vocabulary, training data and its filters, batch size, optimizer and schedule, seed) is
# refused. `accumulate` may change because the number of processes may: it is how an update
# keeps its size on other hardware (the trainer warns that the epoch's batches then differ);
# `out_dir` because a run directory may be moved. `patience` may change (the count goes on), not
# `patience_metric`: `best/` and the count would mix two metrics. The run's length
# (`max_steps`, `max_epochs`, `time_budget`) may change: with a decaying schedule the decay then
# follows the new end (logged). `schedule` and `ema_decay` may not.
RESUMABLE = frozenset(
    {
        "max_steps", "max_epochs", "time_budget", "save_every", "save_every_minutes",
        "keep_last", "valid_every", "valid_bleu", "valid_src", "valid_tgt", "valid_tsv",
        "log_every", "threads", "progress", "device", "precision", "onednn", "compile",
        "accumulate", "src_lang", "tgt_lang", "out_dir", "patience", "tensorboard",
    }
)  # fmt: skip
_PATHS = ("out_dir", "src", "tgt", "tsv", "tokenizer", "valid_src", "valid_tgt", "valid_tsv")


def resume_overrides(run_dir: Path, config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The settings of `config` that differ from the run's `train_config.yaml`, as
    {name: (run's value, given value)}; a model field is named `model.FIELD`.

    Raises:
        RunDirectoryError: A setting that a resume may not change (not in `RESUMABLE`) differs;
            the message names it, the run's value and the given one.
    """
    saved_values = read_config(run_dir)
    if saved_values is None:
        return {}
    saved = TrainConfig.from_dict(saved_values, source=str(run_dir / TRAIN_CONFIG_FILE))
    # A schedule is compared as the run uses it ("auto" resolved), as it records it.
    saved, config = (replace(c, schedule=c.resolved_schedule) for c in (saved, config))
    changed = {
        name: (getattr(saved, name), getattr(config, name))
        for name in saved.to_dict()
        if name != "model" and not _same_setting(name, getattr(saved, name), getattr(config, name))
    }
    # Compared as built (preset + overrides), so that spelling a preset's value out is no change.
    vocab = saved.vocab_size
    run_model, given_model = (c.model_config(vocab).to_dict() for c in (saved, config))
    for key, value in run_model.items():
        if given_model[key] != value:
            changed[f"model.{key}"] = (value, given_model[key])
    for name, (before, after) in changed.items():
        if name not in RESUMABLE:
            raise RunDirectoryError(
                f"{name}: the run in {run_dir} was trained with {before!r}, this resume was given "
                f"{after!r}; a resume keeps the run's settings ({TRAIN_CONFIG_FILE}) except "
                f"{', '.join(sorted(RESUMABLE))}: drop the setting, or start a new run in "
                "another --out-dir"
            )
    return changed


def _same_setting(name: str, a: Any, b: Any) -> bool:
    """Equal, or (for a file) two spellings of one path."""
    if a == b:
        return True
    return (
        name in _PATHS
        and a is not None
        and b is not None
        and Path(a).resolve() == Path(b).resolve()
    )


def read_config(run_dir: Path) -> dict[str, Any] | None:
    """The settings the run recorded (`write_config`), or None if it recorded none.

    A run of an earlier release is read as today's: `bf16`/`cpu_bf16` as `precision`
    (`config.upgrade_train_values`), and no `schedule` as Eq. 3's, the only one it had (so that
    a resume given a `time_budget` does not turn "auto" into another schedule mid-run).
    """
    path = run_dir / TRAIN_CONFIG_FILE
    if not path.is_file():
        return None
    values = upgrade_train_values(load_yaml_config(path), source=str(path), warn=False)
    values.setdefault("schedule", "inverse_sqrt")
    return values


def disk_full_message(error: DiskFullError | OSError, run_dir: str | Path) -> str | None:
    """One line for a run stopped by a full disk (or quota), naming where it can continue
    from once space is freed; None for any other error."""
    if isinstance(error, DiskFullError):
        message = str(error)
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = error.filename or run_dir  # a failed write() names no file
        message = f"{error.strerror} writing {where}"
    else:
        return None
    last = ckpt.list_checkpoints(run_dir)[-1:]
    return f"{message}; last good checkpoint: {last[0] if last else 'none'}"


# -- what killed runs leave -----------------------------------------------------------------


def remove_debris(run_dir: str | Path) -> None:
    """Clean up after saves that were killed, first putting back what they were replacing.

    A save writes `.NAME.tmp-PID` and, to replace an existing NAME, moves it to
    `.NAME.old-PID` for an instant (`aiayn.parts`): a kill there leaves no NAME at all (no
    `model/` for `aiayn translate`, or no latest checkpoint). The newest complete, verified copy
    is moved back into place; every other part is deleted, since nothing reads them and they
    grow with the model. Parts of another live process (a concurrent writer) are kept.
    """
    run_dir = Path(run_dir)
    for parent in (run_dir, run_dir / "checkpoints"):
        for name in sorted({name for _, name in dead_parts(parent)}):
            target = parent / name
            if not target.exists() and (copy := stranded_copy(target)) is not None:
                os.replace(copy, target)
                logger.warning(
                    "%s was missing (a save was killed while replacing it): restored it from %s",
                    target,
                    copy.name,
                )
        for path, _ in dead_parts(parent):
            logger.info("removing %s, left by a killed save", path)
            remove(path)
    (run_dir / METRICS_FILE).with_suffix(".tmp").unlink(missing_ok=True)
