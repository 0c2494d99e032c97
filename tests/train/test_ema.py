"""Tests for aiayn.train.ema and `ema_decay` in training: Marian's exponential smoothing, a
resume that goes on with the same average bit for bit, and a model/ that holds whichever of the
raw and averaged weights validated better, as metrics.jsonl records."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.model_dir import load_model_dir
from aiayn.train import checkpoint as ckpt
from aiayn.train import trainer
from aiayn.train.ema import WeightAverage, better_weights
from aiayn.train.runlog import ValidRecord, read_metrics
from train.test_trainer import (
    assert_same_weights,
    make_config,
    stop_at,
    write_copy_corpus,
)


def test_the_decay_is_marians_smaller_early_in_the_run() -> None:
    """Marian: decay = max(α, 1 - (t + 1) / (t + 10)) of the new weights, i.e. the average keeps
    min(1 - α, (t + 1) / (t + 10)) of itself; its 1e-4 is ema_decay 0.9999."""
    average = WeightAverage(torch.nn.Linear(2, 2), decay=0.9999)
    assert average.decay_at(1) == pytest.approx(2 / 11)
    assert average.decay_at(1000) == pytest.approx(1001 / 1010)
    assert average.decay_at(10**6) == 0.9999
    with pytest.raises(ValueError, match=r"ema_decay \(1.0\) must be in \(0, 1\)"):
        WeightAverage(torch.nn.Linear(2, 2), decay=1.0)


def test_the_average_follows_the_formula_and_is_float32() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    average = WeightAverage(model, decay=0.5)
    expected = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update(step)
        d = min(0.5, (1 + step) / (10 + step))
        for name, p in model.named_parameters():
            expected[name] = d * expected[name] + (1 - d) * p.detach().double()
    state = average.state_dict()
    assert set(state) == {"weight", "bias"}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor.double(), expected[name], rtol=1e-6, atol=1e-6)


def test_applied_holds_the_average_and_gives_the_weights_back_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    average = WeightAverage(model, decay=0.9)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    raw = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="inside"), average.applied():
        for name, p in model.named_parameters():
            assert torch.equal(p, before[name])  # the average (of the first weights only)
        raise RuntimeError("inside")
    for name, p in model.named_parameters():
        assert torch.equal(p, raw[name])


def test_a_saved_average_loads_only_into_the_model_it_fits() -> None:
    model = torch.nn.Linear(4, 3)
    average = WeightAverage(model, decay=0.9)
    other = WeightAverage(torch.nn.Linear(4, 3), decay=0.9)
    other.load_state_dict(average.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.average, average.average, strict=True))
    with pytest.raises(ValueError, match="does not fit the model"):
        other.load_state_dict({"weight": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match=r"the saved average of weight has shape \(2, 4\)"):
        other.load_state_dict({"weight": torch.zeros(2, 4), "bias": torch.zeros(3)})


def test_a_validation_chooses_by_the_runs_metric() -> None:
    record = ValidRecord(step=3, valid_loss=2.0, valid_nll=1.5, valid_ppl=4.5, valid_tokens=9,
                         valid_bleu=10.0, valid_ema_nll=1.4, valid_ema_bleu=9.0)  # fmt: skip
    values = dataclasses.asdict(record)
    assert better_weights(values, "loss") == "ema"
    assert better_weights(values, "bleu") == "raw"
    assert dataclasses.replace(record, weights="ema").score("loss") == 1.4
    assert dataclasses.replace(record, weights="raw").score("loss") == 1.5
    assert dataclasses.replace(record, weights="ema").score("bleu") == 9.0
    tie = {**values, "valid_ema_nll": 1.5}
    assert better_weights(tie, "loss") == "raw"  # strictly better, or the raw ones


# -- in training ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_copy_corpus(tmp_path_factory.mktemp("corpus"), 48)


def ema_config(corpus: tuple[Path, Path], out_dir: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = dict(
        max_steps=8,
        ema_decay=0.9,
        valid_every=3,
        save_every=3,
        log_every=2,
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
    )
    return make_config(corpus, out_dir, **{**values, **overrides})


def saved_average(run_dir: Path) -> dict[str, torch.Tensor]:
    state = ckpt.load_training_state(ckpt.latest_checkpoint(run_dir))
    assert state.ema is not None
    return state.ema


def assert_holds_the_average(model_dir: Path, average: dict[str, torch.Tensor]) -> None:
    parameters = dict(load_model_dir(model_dir).model.named_parameters())
    assert parameters.keys() == average.keys()
    for name, tensor in average.items():
        assert torch.equal(parameters[name].detach(), tensor), name


def test_a_resumed_run_goes_on_with_the_same_average_bit_for_bit(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after update 5 (its checkpoint holds the average) and resumed: the same average,
    weights, validations (raw and averaged) and choice as a run never stopped."""
    config = ema_config(corpus, tmp_path / "whole")
    whole = trainer.train(config)
    stopped = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 5)
        assert trainer.train(stopped).interrupted
    resumed = trainer.train(stopped, resume=True)
    assert (resumed.step, resumed.weights) == (8, whole.weights)

    first, second = saved_average(tmp_path / "whole"), saved_average(tmp_path / "stopped")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert_same_weights(tmp_path / "whole" / "checkpoints" / "step_00000008",
                        tmp_path / "stopped" / "checkpoints" / "step_00000008")  # fmt: skip
    assert_same_weights(tmp_path / "whole" / "model", tmp_path / "stopped" / "model")

    def measured(run_dir: Path) -> list[dict[str, Any]]:  # but the clock's readings
        timing = ("tokens_per_s", "elapsed_s")
        return [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(run_dir)]

    records = measured(tmp_path / "whole")
    assert records == measured(tmp_path / "stopped")
    valid = [r for r in records if r["type"] == "valid"]
    assert [r["step"] for r in valid] == [3, 6, 8]
    assert all({"valid_ema_loss", "valid_ema_nll", "valid_ema_ppl", "weights"} <= set(r)
               for r in valid)  # fmt: skip


@pytest.mark.parametrize("better", ["ema", "raw"])
def test_model_holds_the_weights_that_validated_better_and_the_log_says_which(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, better: str
) -> None:
    monkeypatch.setattr(trainer, "better_weights", lambda valid, metric: better)
    result = trainer.train(ema_config(corpus, tmp_path / "run", max_steps=6))
    run = tmp_path / "run"
    assert result.weights == better
    records = read_metrics(run)
    assert records[-1] == {"type": "model", "step": 6, "weights": better, "chosen_at": 6}
    assert [r["weights"] for r in records if r["type"] == "valid"] == [better, better]
    if better == "ema":
        assert_holds_the_average(run / "model", saved_average(run))
    else:  # the checkpoint holds the raw weights (what a resume continues from)
        assert_same_weights(run / "model", run / "checkpoints" / "step_00000006")
    for name in ("model", "best"):
        assert load_model_dir(run / name).metadata["weights"] == better


def test_without_a_validation_set_model_holds_the_average(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = ema_config(corpus, tmp_path / "run", max_steps=4, valid_src=None, valid_tgt=None)
    result = trainer.train(config)
    assert result.weights == "ema"
    assert read_metrics(tmp_path / "run")[-1] == {
        "type": "model",
        "step": 4,
        "weights": "ema",
        "chosen_at": None,
    }
    assert_holds_the_average(tmp_path / "run" / "model", saved_average(tmp_path / "run"))


def test_a_run_without_an_average_writes_what_it_wrote_before(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """ema_decay 0 (the default): no average in the checkpoint, no `valid_ema_*` fields or
    model record in the log, no `weights` in model/'s metadata."""
    trainer.train(ema_config(corpus, tmp_path / "run", ema_decay=0.0, max_steps=3))
    assert ckpt.load_training_state(ckpt.latest_checkpoint(tmp_path / "run")).ema is None
    records = read_metrics(tmp_path / "run")
    assert {r["type"] for r in records} == {"train", "valid"}
    assert not any(k.startswith("valid_ema") or k == "weights" for r in records for k in r)
    assert "weights" not in load_model_dir(tmp_path / "run" / "model").metadata
