"""Tests for aiayn.train.finetune: `aiayn train --init-from MODEL_DIR` starts from the directory's
weights and vocabulary with a fresh Adam and schedule; what a fine-tuning run cannot change is
refused in one line before anything is written; `--resume` continues from the run's own
checkpoint without reading `init_from` again. Tiny models, a few updates (as
tests/train/test_trainer.py).
A fine-tuned imported Marian model (split tokenizer) is tested in tests/interop/test_marian.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.cli import main
from aiayn.model_dir import load_model_dir
from aiayn.optim import learning_rate
from aiayn.text.tokenizer import Tokenizer
from aiayn.train import trainer
from aiayn.train.runlog import read_metrics
from train.test_trainer import cli_args, make_config, weights, write_copy_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_copy_corpus(tmp_path_factory.mktemp("corpus"), 48)


@pytest.fixture(scope="module")
def base_run(corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 updates from a random initialisation: what the tests fine-tune."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(cli_args(make_config(corpus, run, max_steps=4))) == 0
    return run


def pieces(run: Path) -> int:
    return Tokenizer.load(run / "tokenizer.model").vocab_size


def finetune_args(
    corpus: tuple[Path, Path], run: Path, init: Path, vocab_size: int, **overrides: Any
) -> list[str]:
    """`aiayn train` flags of the base run's config, in `run`, starting from `init`."""
    config = make_config(corpus, run, vocab_size=vocab_size, **overrides)
    return [*cli_args(config), "--init-from", str(init)]


def first_update_weights(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Filled with the model's weights as the first update of the next run starts."""
    seen: dict[str, torch.Tensor] = {}
    optimizer_update = trainer.optimizer_update

    def record_then_update(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not seen:
            seen.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return optimizer_update(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "optimizer_update", record_then_update)
    return seen


def assert_weights_equal(actual: dict[str, torch.Tensor], directory: Path) -> None:
    expected = weights(directory)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_fine_tuning_starts_from_the_models_weights_with_a_fresh_schedule(
    base_run: Path,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    initial = first_update_weights(monkeypatch)
    run = tmp_path / "tuned"
    args = finetune_args(corpus, run, base_run, pieces(base_run), max_steps=3)
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        # init (how new weights would be drawn) may differ: the model's weights are loaded
        assert main([*args, "--model", "dropout=0.3", "--model", "init=fairseq"]) == 0

    assert_weights_equal(initial, base_run / "model")
    assert "start afresh at step 0" in caplog.text
    records = [r for r in read_metrics(run) if r["type"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["lr"] == learning_rate(1, d_model=16, warmup_steps=4)  # warm-up again
    assert (run / "tokenizer.model").read_bytes() == (base_run / "tokenizer.model").read_bytes()
    tuned = load_model_dir(run)
    base = load_model_dir(base_run)
    assert tuned.config == base.config.replace(dropout=0.3)  # init: the base's (xavier)
    base_weights = weights(base_run / "model")
    assert any(not torch.equal(t, base_weights[n]) for n, t in weights(run / "model").items())

    out = tmp_path / "out.txt"
    src = tmp_path / "in.txt"
    src.write_text("a b c\nd e f\n", encoding="utf-8")
    translate = ["translate", "-m", str(run), "-i", str(src), "-o", str(out), "--beam-size", "2"]
    assert main([*translate, "--max-len-b", "3", "--threads", "1"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2


def test_languages_left_at_their_placeholders_come_from_the_init_model(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """An imported OPUS-MT model knows its languages: a fine-tuning run that names none
    records the init model's, one that names them records its own."""
    base = tmp_path / "base"
    config = make_config(corpus, base, max_steps=2, src_lang="en", tgt_lang="de")
    assert main(cli_args(config)) == 0
    inherited = tmp_path / "inherited"
    assert main(finetune_args(corpus, inherited, base, pieces(base), max_steps=1)) == 0
    metadata = load_model_dir(inherited).metadata
    assert (metadata["src_lang"], metadata["tgt_lang"]) == ("en", "de")

    own = tmp_path / "own"
    args = finetune_args(corpus, own, base, pieces(base), max_steps=1, tgt_lang="nl")
    assert main(args) == 0
    metadata = load_model_dir(own).metadata
    assert (metadata["src_lang"], metadata["tgt_lang"]) == ("en", "nl")


def test_resume_continues_from_the_runs_checkpoint_without_init_from(
    base_run: Path,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    init = tmp_path / "init"
    shutil.copytree(base_run / "model", init)
    run = tmp_path / "tuned"
    assert main(finetune_args(corpus, run, init, pieces(base_run), max_steps=2)) == 0
    shutil.rmtree(init)  # a resume must not need it

    initial = first_update_weights(monkeypatch)
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        assert main(["train", "--resume", "--out-dir", str(run), "--max-steps", "4"]) == 0
    assert_weights_equal(initial, run / "checkpoints" / "step_00000002")
    assert "resumed from" in caplog.text and "fine-tuning from" not in caplog.text
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"] == [1, 2, 3, 4]
    assert load_model_dir(run).metadata["step"] == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": {"d_model": 32, "n_heads": 2}}, "model.d_model (32) differs from init_from's"),
        ({"preset": "small", "model": {}}, "preset ('small') has d_model (256) differs from"),
        ({"vocab_size": 400}, "vocab_size (400) differs from the"),
        ({"tokenizer": "OTHER"}, "is not the tokenizer of init_from's model"),
    ],
    ids=["model-field", "preset", "vocab-size", "tokenizer"],
)
def test_what_fine_tuning_cannot_change_is_refused_before_anything_is_written(
    change: dict[str, Any],
    message: str,
    base_run: Path,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    values = {"vocab_size": pieces(base_run), **change}
    if change.get("tokenizer") == "OTHER":  # another vocabulary of the same corpus
        model_file = tmp_path / "other.model"
        other = Tokenizer.train(list(corpus), model_file, vocab_size=300, model_type="unigram")
        values["tokenizer"] = str(other.model_file)
        assert other.sha256 != Tokenizer.load(base_run / "tokenizer.model").sha256
    args = finetune_args(corpus, tmp_path / "run", base_run / "model", **values)
    assert message in _fails(args, capsys)
    assert not (tmp_path / "run").exists()


def test_a_missing_or_unsound_init_from_is_one_line_and_writes_nothing(
    base_run: Path, corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "missing"
    args = finetune_args(corpus, tmp_path / "run", missing, pieces(base_run))
    assert f"init_from ('{missing}'): model directory not found" in _fails(args, capsys)
    (tmp_path / "empty").mkdir()
    args = finetune_args(corpus, tmp_path / "run", tmp_path / "empty", pieces(base_run))
    assert "is not a complete aiayn model directory: missing config.json" in _fails(args, capsys)
    assert not (tmp_path / "run").exists()


def _fails(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run `aiayn train`; expect exit status 2 and a one-line message (no traceback)."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("aiayn train: error: "), err
    return message
