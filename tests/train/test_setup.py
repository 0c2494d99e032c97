"""Tests for aiayn.train.setup: `set_up` returns every part of a run (`RunParts`) and writes only
the run directory; what the loop then does with them is tested in tests/train/test_trainer.py."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

import aiayn.train.setup
from aiayn.optim import DECAYING
from aiayn.train import checkpoint as ckpt
from aiayn.train.distributed import Distributed
from aiayn.train.rundir import TRAIN_CONFIG_FILE, RunDirectoryLocked
from aiayn.train.setup import RunParts, rank_updates, set_up
from aiayn.train.trainer import train
from train.test_trainer import make_config, write_copy_corpus

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_copy_corpus(tmp_path_factory.mktemp("corpus"), 48)


def parts_of(config, *, resume: bool = False) -> tuple[RunParts, contextlib.ExitStack]:
    held = contextlib.ExitStack()
    parts = set_up(config, resume=resume, distributed=Distributed(), device=CPU, held=held)
    return parts, held


def test_set_up_returns_every_part_of_a_fresh_run(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(corpus, tmp_path / "run", schedule="auto", max_steps=5)
    with caplog.at_level(logging.INFO, logger="aiayn.train.setup"):
        parts, held = parts_of(config)
    with held:
        assert dataclasses.is_dataclass(parts) and parts.config.schedule == "inverse_sqrt"
        assert parts.run_dir == tmp_path / "run"
        assert (parts.run_dir / TRAIN_CONFIG_FILE).is_file()
        assert parts.tokenizer.vocab_size == parts.model_config.src_vocab_size
        assert len(parts.train_data) == 48 and parts.valid_data is None
        assert parts.model.config == parts.model_config and parts.train_model is parts.model
        assert parts.optimizer.param_groups[0]["params"][0] is next(parts.model.parameters())
        assert (parts.average, parts.init) == (None, None)
        assert (parts.progress.step, parts.fixed_end, parts.schedule_end) == (0, 5, 5)
        assert (parts.bf16, parts.accumulate) == (False, 1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            parts.model = None  # type: ignore[misc]
    [model] = [r for r in caplog.records if r.getMessage().startswith("model: ")]
    assert model.name == "aiayn.train.setup"  # set-up's lines are its own


def test_the_run_directory_stays_locked_until_the_run_lets_go(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = make_config(corpus, tmp_path / "run")
    _, held = parts_of(config)
    with held, pytest.raises(RunDirectoryLocked):
        parts_of(config)
    parts_of(config)[1].close()


def test_the_weights_come_from_the_seed(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    first, held = parts_of(make_config(corpus, tmp_path / "a"))
    held.close()
    second, held = parts_of(make_config(corpus, tmp_path / "b"))
    held.close()
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_max_epochs_ends_a_decaying_schedule_at_the_last_update_of_the_last_epoch(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = make_config(corpus, tmp_path / "run", max_epochs=2, schedule="linear")
    assert config.schedule in DECAYING
    parts, held = parts_of(config)
    held.close()
    per_epoch = [
        len(
            rank_updates(parts.train_data, parts.config, e, accumulate=1, distributed=Distributed())
        )
        for e in (1, 2)
    ]
    assert parts.fixed_end == min(config.max_steps, sum(per_epoch))


def test_a_resume_returns_the_checkpoints_progress_and_weights(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=2)
    train(config)
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert latest is not None
    parts, held = parts_of(dataclasses.replace(config, max_steps=4), resume=True)
    held.close()
    assert parts.progress.step == 2 and parts.progress.elapsed_s > 0
    saved = ckpt.load_training_state(latest)
    assert parts.optimizer.state_dict()["state"].keys() == saved.optimizer["state"].keys()


def test_set_up_knows_nothing_of_the_trainer() -> None:
    """Set-up builds parts and returns them: it neither imports the `Trainer` nor fills one."""
    tree = ast.parse(Path(aiayn.train.setup.__file__).read_text(encoding="utf-8"))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "aiayn.train.trainer" not in imported
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    assert not {"trainer", "Trainer", "TYPE_CHECKING"} & names
