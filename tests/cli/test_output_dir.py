"""Tests for aiayn.cli.output_dir: the one rule of what `-o` may replace, for `average`, `export`
and `import` alike (`aiayn average` into a run is tested after a resume in
tests/train/test_trainer.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.cli.output_dir import KINDS, check_output_dir
from aiayn.model_dir import CheckpointError
from aiayn.train.rundir import OWN_DIRS
from model_dirs import tiny_model_dir


def _run_dir(path: Path) -> Path:
    (path / "checkpoints" / "step_00000001").mkdir(parents=True)
    (path / "train_config.yaml").write_text("max_steps: 1\n")
    return path


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_earlier_output_inside_a_run_passes_and_what_the_trainer_writes_does_not(
    kind: str, tmp_path: Path
) -> None:
    run = _run_dir(tmp_path / "run")
    earlier = run / "out"
    earlier.mkdir()
    for name in KINDS[kind].markers:
        (earlier / name).write_text("written by aiayn")
    check_output_dir(earlier, kind)
    check_output_dir(run / "new", kind)
    for name in (*OWN_DIRS, "checkpoints/step_00000001", "model/inside"):
        expected = re.escape(f"belongs to the training run {run} ({name} is written by")
        with pytest.raises(CheckpointError, match=expected):
            check_output_dir(run / name, kind)
    with pytest.raises(CheckpointError, match="is a training run directory; choose another"):
        check_output_dir(run, kind)


def test_an_export_into_a_run_directory_of_its_own_is_replaced_the_second_time(
    tmp_path: Path,
) -> None:
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    model_dir = tiny_model_dir(tmp_path / "model")
    run = _run_dir(tmp_path / "run")
    for quantization in ("int8", "int16"):
        argv = ["export", str(model_dir), "--to", "ctranslate2", "-o", str(run / "ct2")]
        assert main([*argv, "--quantization", quantization]) == 0
    assert '"quantization": "int16"' in (run / "ct2" / "aiayn.json").read_text()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "ct2", "train_config.yaml"]


def test_an_output_given_as_a_link_is_written_through_it_and_the_link_stays(
    tmp_path: Path,
) -> None:
    """Old `export`/`import`/`average`: the link itself was renamed away and replaced by a
    directory, and a dangling `.NAME.old-PID` link was left beside it."""
    pytest.importorskip("ctranslate2", reason="optional: pip install -e '.[export]'")
    model_dir = tiny_model_dir(tmp_path / "model")
    (tmp_path / "v1").mkdir()
    latest = tmp_path / "latest"
    latest.symlink_to("v1")
    for _ in range(2):  # into the empty target, then over the earlier export
        assert main(["export", str(model_dir), "--to", "ctranslate2", "-o", str(latest)]) == 0
        assert latest.is_symlink() and (tmp_path / "v1" / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "model", "v1"]


def test_the_current_directory_is_refused_as_an_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old `export -o .`: the current directory was renamed away and replaced, leaving the
    shell in a deleted directory."""
    inside = tmp_path / "out" / "here"
    inside.mkdir(parents=True)
    monkeypatch.chdir(inside)
    for given, which in ((".", "is the current"), (str(tmp_path / "out"), "holds the current")):
        with pytest.raises(CheckpointError, match=f"{re.escape(given)} {which} directory"):
            check_output_dir(Path(given), "ctranslate2")
    assert check_output_dir(Path("new"), "ctranslate2") == inside / "new"
