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
from interop_models import tiny_model_dir


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
