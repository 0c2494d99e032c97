"""Tests for aiayn.train.rundir: the run directory's lock, whose directory an output is, what a
resume may change, and the one-line messages a stopped run gives. Through `aiayn train` they are
tested in tests/train/test_trainer.py."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import yaml

from aiayn.config import TrainConfig
from aiayn.model_dir import CHECKSUMS_FILE
from aiayn.train import rundir
from aiayn.train.rundir import RunDirectoryError, RunDirectoryLocked

pytestmark = pytest.mark.skipif(rundir.fcntl is None, reason="no fcntl: no lock")


def checkpoints(run: Path, *steps: int) -> list[Path]:
    """Complete checkpoints of `steps` in `run`, as far as `list_checkpoints` looks."""
    paths = [run / "checkpoints" / f"step_{step:08d}" for step in steps]
    for path in paths:
        path.mkdir(parents=True)
        (path / CHECKSUMS_FILE).write_text("{}")
    return paths


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    with rundir.hold_run_lock(tmp_path):
        holder = json.loads((tmp_path / rundir.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with (
            pytest.raises(
                RunDirectoryLocked, match=rf"in use by another trainer \(PID {os.getpid()} on "
            ),
            rundir.hold_run_lock(tmp_path),
        ):
            pass
    with rundir.hold_run_lock(tmp_path):  # released with the block
        pass


def test_a_refused_check_leaves_the_lock_file_as_it_was(tmp_path: Path) -> None:
    lock = tmp_path / rundir.LOCK_FILE
    lock.write_text("an earlier holder\n")

    def refuse() -> None:
        raise RunDirectoryError("no")

    with pytest.raises(RunDirectoryError, match="no"), rundir.hold_run_lock(tmp_path, refuse):
        pass
    assert lock.read_text() == "an earlier holder\n"


def test_owning_run_names_the_run_and_the_path_below_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    checkpoints(run, 1)
    assert rundir.owning_run(run) == (run.resolve(), None)
    assert rundir.owning_run(run / "model") == (run.resolve(), "model")
    assert rundir.owning_run(run / "best" / "x") == (run.resolve(), "best/x")
    assert rundir.owning_run(run / "averaged") is None  # not a directory the trainer writes
    assert rundir.owning_run(tmp_path / "elsewhere") is None


def test_a_fresh_run_does_not_overwrite_checkpoints(tmp_path: Path) -> None:
    rundir.refuse_existing_run(tmp_path, resume=False)  # none yet
    checkpoints(tmp_path, 1)
    with pytest.raises(RunDirectoryError, match="already holds checkpoints; pass --resume"):
        rundir.refuse_existing_run(tmp_path, resume=False)
    rundir.refuse_existing_run(tmp_path, resume=True)


def test_a_corrupt_checkpoint_points_to_the_one_before(tmp_path: Path) -> None:
    first, second = checkpoints(tmp_path, 2, 4)
    assert rundir.earlier_checkpoint_hint(tmp_path, second) == (
        f"to resume from the previous checkpoint {first}, move this one aside "
        f"(mv {second} {second}.corrupt) and run again with --resume"
    )
    assert "no earlier checkpoint" in rundir.earlier_checkpoint_hint(tmp_path / "x", first)


def config(run: Path, **values: object) -> TrainConfig:
    return TrainConfig.from_dict({"out_dir": str(run), "src": "a.txt", "tgt": "b.txt", **values})


def test_a_resume_may_change_how_the_run_goes_on_not_what_it_trains(tmp_path: Path) -> None:
    rundir.write_config(tmp_path, config(tmp_path, max_steps=10).to_dict())
    same_file = f"{tmp_path}/../{tmp_path.name}"  # another spelling of the run's path
    assert rundir.resume_overrides(tmp_path, config(Path(same_file), max_steps=10)) == {}
    assert rundir.resume_overrides(tmp_path, config(tmp_path, max_steps=20)) == {
        "max_steps": (10, 20)
    }
    with pytest.raises(RunDirectoryError, match=r"^seed: the run in .* was trained with 1"):
        rundir.resume_overrides(tmp_path, config(tmp_path, max_steps=10, seed=2))
    with pytest.raises(RunDirectoryError, match=r"^model\.d_model: "):
        rundir.resume_overrides(tmp_path, config(tmp_path, max_steps=10, model={"d_model": 64}))


def test_an_earlier_releases_settings_are_read_as_todays(tmp_path: Path) -> None:
    values = config(tmp_path).to_dict()
    del values["schedule"], values["precision"]
    values |= {"bf16": False}  # before `precision`
    (tmp_path / rundir.TRAIN_CONFIG_FILE).write_text(yaml.safe_dump(values))
    read = rundir.read_config(tmp_path)
    assert read is not None
    assert (read["schedule"], read["precision"]) == ("inverse_sqrt", "fp32")
    assert rundir.read_config(tmp_path / "none") is None


def test_a_full_disk_is_one_line_naming_the_last_good_checkpoint(tmp_path: Path) -> None:
    [last] = checkpoints(tmp_path, 3)
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "model"))
    assert rundir.disk_full_message(full, tmp_path) == (
        f"No space left on device writing {tmp_path / 'model'}; last good checkpoint: {last}"
    )
    assert rundir.disk_full_message(OSError(errno.EACCES, "denied"), tmp_path) is None
