"""Tests for aiayn.train.trainer: the run directory, updates, checkpoints, resume and user errors.

Set-up (aiayn.train.setup: the run directory, vocabulary, data, resume) is tested here too,
through `train()`. Every run here is a 1+1-layer, d_model=16 model on a few dozen copy pairs,
so that a whole `train()` takes a fraction of a second; learning, resume after SIGKILL and
data-parallel runs are tested end to end in tests/integration/test_train_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model

from aiayn import runtime
from aiayn.acceleration import ONEDNN_KERNELS_FOR_BF16_TRAINING, compiler_missing
from aiayn.cli import main
from aiayn.config import TrainConfig
from aiayn.decode.shortlist import SHORTLIST_FILE, model_shortlist
from aiayn.decode.translator import Translator
from aiayn.model import Transformer
from aiayn.model_dir import CHECKSUMS_FILE, WEIGHTS_FILE, load_model_dir
from aiayn.optim import DECAYING, learning_rate, scheduled_rate
from aiayn.text.corpus import load_or_build
from aiayn.text.tokenizer import Tokenizer
from aiayn.train import checkpoint as ckpt
from aiayn.train import runlog, setup, trainer, update, validation
from aiayn.train.runlog import read_metrics

LETTERS = "abcdefgh"
TINY_MODEL = {
    "d_model": 16,
    "d_ff": 32,
    "n_heads": 2,
    "n_encoder_layers": 1,
    "n_decoder_layers": 1,
    "max_positions": 32,
}


def write_copy_corpus(
    directory: Path, n_pairs: int, seed: int = 0, longest: int = 6
) -> tuple[Path, Path]:
    """`n_pairs` lines of 3 to `longest` random letters, and the same lines as the target (a
    copy task)."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choices(LETTERS, k=rng.randint(3, longest))) for _ in range(n_pairs)]
    directory.mkdir(parents=True, exist_ok=True)
    src, tgt = directory / "train.src", directory / "train.tgt"
    for path in (src, tgt):
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return src, tgt


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_copy_corpus(tmp_path_factory.mktemp("corpus"), 48)


def make_config(corpus: tuple[Path, Path], out_dir: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = dict(
        out_dir=str(out_dir),
        src=str(corpus[0]),
        tgt=str(corpus[1]),
        vocab_size=300,  # the smallest with byte fallback: 256 bytes + specials + letters
        preset="tiny",
        model=dict(TINY_MODEL),
        max_len=16,
        max_tokens=64,
        max_steps=6,
        warmup_steps=4,
        log_every=1,
        valid_every=0,
        save_every=0,
        threads=1,
        progress=False,
    )
    if not {"bf16", "cpu_bf16"} & overrides.keys():  # keys of earlier releases name their own
        values["precision"] = "fp32"  # the same numbers on every CPU ("auto": bf16 if native)
    values.update(overrides)
    return TrainConfig.from_dict(values)  # keys of earlier releases too (cpu_bf16)


def cli_args(config: TrainConfig) -> list[str]:
    """`aiayn train` flags for `config` (every field spelled out)."""
    args = ["train"]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        if f.name == "model":
            for key, item in value.items():
                args += ["--model", f"{key}={item}"]
        elif isinstance(value, bool):
            args.append(f"--{'' if value else 'no-'}{f.name.replace('_', '-')}")
        else:
            args += [f"--{f.name.replace('_', '-')}", str(value)]
    return args


def train_losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["nll"]) for r in read_metrics(run_dir) if r["type"] == "train"]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / WEIGHTS_FILE)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in ckpt.list_checkpoints(run_dir)]


def run_dir_snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but the data cache, with its bytes. The lock file counts
    only as present: a refusal found once the lock is held (a checkpoint of another
    architecture) records its holder, which is not a change to the run."""
    return {
        str(p.relative_to(run_dir)): b"" if p.name == "train.lock" else p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and "data" not in p.relative_to(run_dir).parts
    }


def stop_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Deliver SIGTERM to this process during update `step` (as `kill` or a scheduler would)."""
    optimizer_update = trainer.optimizer_update

    def update_then_signal(*args: Any, **kwargs: Any) -> Any:
        result = optimizer_update(*args, **kwargs)
        if kwargs["step"] == step:
            signal.raise_signal(signal.SIGTERM)
        return result

    monkeypatch.setattr(trainer, "optimizer_update", update_then_signal)


@pytest.mark.parametrize(("flags", "expected"), [([], False), (["--onednn"], True)])
def test_aiayn_train_runs_float32_cpu_updates_with_onednn_products_when_asked(
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    expected: bool,
) -> None:
    """What `aiayn train` hands each update: oneDNN products only with --onednn (opt-in: more
    memory), and then where `update.uses_onednn` allows (x86-64, float32)."""
    from aiayn.acceleration import onednn_linear_missing

    if onednn_linear_missing():
        pytest.skip(onednn_linear_missing())
    seen: list[bool] = []
    optimizer_update = trainer.optimizer_update

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["onednn"])
        return optimizer_update(*args, **kwargs)

    monkeypatch.setattr(trainer, "optimizer_update", record)
    config = make_config(corpus, tmp_path / "run", max_steps=2)
    args = [a for a in cli_args(config) if a not in ("--onednn", "--no-onednn")]
    assert main(args + flags) == 0
    assert seen == [expected, expected]


# -- a whole run ----------------------------------------------------------------------------


def test_run_directory_contents(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    config = make_config(
        corpus,
        tmp_path / "run",
        max_steps=6,
        log_every=2,
        save_every=3,
        valid_every=3,
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
    )
    result = trainer.train(config)

    run_dir = tmp_path / "run"
    assert (result.run_dir, result.model_dir, result.step) == (run_dir, run_dir / "model", 6)
    assert not result.interrupted
    recorded = TrainConfig(**yaml.safe_load((run_dir / "train_config.yaml").read_text()))
    assert recorded == dataclasses.replace(config, schedule="inverse_sqrt")  # "auto", resolved
    assert checkpoint_steps(run_dir) == [3, 6]
    records = read_metrics(run_dir)
    assert [(r["type"], r["step"]) for r in records] == [
        ("train", 2),
        ("valid", 3),
        ("train", 4),
        ("train", 6),
        ("valid", 6),
    ]
    for r in records:
        if r["type"] == "train":
            assert r["lr"] == learning_rate(r["step"], d_model=16, warmup_steps=4)
            assert r["ppl"] == pytest.approx(math.exp(r["nll"]))
            assert r["loss"] > r["nll"] > 0  # label smoothing adds to the NLL
        else:
            assert r["valid_ppl"] == pytest.approx(math.exp(r["valid_nll"]))
    assert result.last_valid == {k: v for k, v in records[-1].items() if k.startswith("valid")}

    model = load_model_dir(run_dir)  # the run directory is enough for inference
    assert model.metadata["step"] == 6
    assert model.config.d_model == 16 and model.config.dropout == 0.1  # preset + overrides
    assert load_model_dir(run_dir / "best").metadata["step"] in (3, 6)
    assert_same_weights(run_dir / "model", run_dir / "checkpoints" / "step_00000006")
    state = ckpt.load_training_state(run_dir / "checkpoints" / "step_00000006")
    assert state.progress.step == 6
    assert state.progress.tokens_seen == records[-2]["tokens_seen"]


def test_model_and_best_hold_the_shortlist_of_the_training_data(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """model/ and best/ hold the lexical shortlist of the training data (the checkpoints do
    not); on this copy task every source piece is among its own targets."""
    valid = dict(valid_src=str(corpus[0]), valid_tgt=str(corpus[1]))
    trainer.train(make_config(corpus, tmp_path / "run", max_steps=3, valid_every=1, **valid))
    run_dir = tmp_path / "run"
    for name in ("model", "best"):
        loaded = load_model_dir(run_dir / name)  # every file checked against checksums.json
        shortlist = model_shortlist(loaded.directory, loaded.config.tgt_vocab_size)
        assert shortlist is not None, name
        seen = [s for s in range(shortlist.src_vocab_size) if shortlist.targets_of(s).size]
        assert seen and all(s in shortlist.targets_of(s) for s in seen)
    assert not (run_dir / "checkpoints" / "step_00000003" / SHORTLIST_FILE).exists()


def test_keep_last_and_timed_checkpoints(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    trainer.train(make_config(corpus, tmp_path / "a", max_steps=5, save_every=1, keep_last=2))
    assert checkpoint_steps(tmp_path / "a") == [4, 5]
    # save_every_minutes: a tiny period means a checkpoint after every update.
    config = make_config(corpus, tmp_path / "b", max_steps=3, save_every_minutes=1e-9)
    trainer.train(config)
    assert checkpoint_steps(tmp_path / "b") == [1, 2, 3]


def test_max_epochs_stops_at_the_end_of_an_epoch(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    result = trainer.train(make_config(corpus, tmp_path / "run", max_steps=1000, max_epochs=2))
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    per_epoch = [sum(r["epoch"] == e for r in records) for e in (1, 2)]
    assert result.step == len(records) == sum(per_epoch)
    assert per_epoch[0] > 1 and per_epoch[1] > 1
    # Every pair is seen once per epoch: the target tokens of epoch 1 are the whole corpus.
    tokenizer = Tokenizer.load(tmp_path / "run" / "tokenizer.model")
    lines = corpus[1].read_text().splitlines()
    corpus_tokens = sum(len(tokenizer.encode(line)) + 1 for line in lines)  # + EOS
    assert records[per_epoch[0] - 1]["tokens_seen"] == corpus_tokens


# -- stopping and resuming ------------------------------------------------------------------


def test_sigterm_saves_and_resume_is_exact(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop after update 5 of 10 and resume: the same weights and losses as without the stop.

    log_every 4 leaves update 5 in a half-filled metrics interval, which must be carried over;
    the run crosses an epoch boundary after resuming, and dropout draws from the restored RNG.
    """
    config = make_config(corpus, tmp_path / "whole", max_steps=10, log_every=4, save_every=4)
    trainer.train(config)

    stopped_config = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 5)
        stopped = trainer.train(stopped_config)
    assert (stopped.interrupted, stopped.step) == (True, 5)
    assert checkpoint_steps(tmp_path / "stopped") == [4, 5]
    assert load_model_dir(stopped.model_dir).metadata["step"] == 5
    assert [s for s, _, _ in train_losses(tmp_path / "stopped")] == [4]

    resumed = trainer.train(stopped_config, resume=True)
    assert (resumed.interrupted, resumed.step) == (False, 10)
    assert_same_weights(tmp_path / "whole" / "model", tmp_path / "stopped" / "model")
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "stopped")
    whole = read_metrics(tmp_path / "whole")
    assert whole[-1]["epoch"] > 1  # the comparison covers an epoch boundary
    assert [r["tokens_seen"] for r in whole] == [
        r["tokens_seen"] for r in read_metrics(tmp_path / "stopped")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_fixed_batch_shapes_train_and_a_resume_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compile: bool
) -> None:
    """`static_shapes` (and, compiled, the loss inside the graph; CUDA graphs on a GPU): every
    batch one of the few fixed shapes, the same target tokens in an epoch as without, and a run
    stopped after update 3 of 6 and resumed ends with the weights and losses of the run that
    was not stopped."""
    if compile and compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler")
    corpus = write_copy_corpus(tmp_path / "corpus", 48, longest=12)  # two widths: 8 and 17
    config = make_config(
        corpus, tmp_path / "whole", static_shapes=True, compile=compile, save_every=3,
        max_tokens=40, max_steps=6,
    )  # fmt: skip
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # what earlier tests of this process compiled
    shapes = set()
    collate = update.collate

    def collate_and_note(*args: Any, **kwargs: Any) -> Any:
        batch = collate(*args, **kwargs)
        shapes.add((*batch.src.shape, *batch.tgt_in.shape))
        return batch

    with monkeypatch.context() as patch:
        patch.setattr(update, "collate", collate_and_note)
        trainer.train(config)
    assert {width for _, width, _, _ in shapes} == {8, 17}  # max_len 16: widths 8 and 17
    assert all(rows == 40 // width for rows, width, _, _ in shapes)
    assert all(shape[:2] == shape[2:] for shape in shapes)  # source and target alike
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled >= 1 if compile else compiled == 0

    stopped_config = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 3)
        assert trainer.train(stopped_config).step == 3
    assert trainer.train(stopped_config, resume=True).step == 6
    assert_same_weights(tmp_path / "whole" / "model", tmp_path / "stopped" / "model")
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "stopped")


def test_bpe_dropout_resegments_each_epoch_and_a_resume_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `bpe_dropout` the epochs' pairs differ from the plain ones and from each other,
    yet a run stopped within its second epoch and resumed ends with the same weights."""
    rng = random.Random(3)
    words = ["".join(rng.choices(LETTERS, k=rng.randint(2, 5))) for _ in range(12)]
    lines = [" ".join(rng.choices(words, k=rng.randint(2, 4))) for _ in range(20)]
    corpus = (tmp_path / "train.src", tmp_path / "train.tgt")
    for path in corpus:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    plain = make_config(corpus, tmp_path / "plain", max_steps=10, log_every=1)
    trainer.train(plain)
    config = dataclasses.replace(plain, out_dir=str(tmp_path / "whole"), bpe_dropout=0.3)
    trainer.train(config)

    def tokens_seen(run: str) -> list[int]:
        return [r["tokens_seen"] for r in read_metrics(tmp_path / run) if r["type"] == "train"]

    assert tokens_seen("whole") != tokens_seen("plain")

    stopped = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"), save_every=4)
    with monkeypatch.context() as patch:
        stop_at(patch, 7)
        assert trainer.train(stopped).interrupted
    resumed = trainer.train(stopped, resume=True)
    assert resumed.step == 10
    assert read_metrics(tmp_path / "whole")[-1]["epoch"] > 1  # a new epoch after the resume
    assert_same_weights(tmp_path / "whole" / "model", tmp_path / "stopped" / "model")
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "stopped")


def test_tokens_per_second_after_a_resume_counts_only_the_resumed_updates(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after update 4 with log_every 3, the interval of the record at step 6 holds
    updates 4-6, but only 5 and 6 ran (and were timed) in the resumed process. A clock that
    advances one second per update makes tokens/s the mean target tokens of the timed
    updates: what the run measured before the stop, not 1.5 times it (#15)."""
    clock = [0.0]
    tokens: dict[int, int] = {}
    optimizer_update = trainer.optimizer_update

    def timed_update(*args: Any, **kwargs: Any) -> update.UpdateStats:
        stats = optimizer_update(*args, **kwargs)
        clock[0] += 1.0
        tokens[kwargs["step"]] = stats.tokens
        return stats

    fake_clock = type("Clock", (), {"monotonic": lambda: clock[0]})
    monkeypatch.setattr(trainer, "time", fake_clock)
    monkeypatch.setattr(runlog, "time", fake_clock)  # the throughput's clock
    monkeypatch.setattr(trainer, "optimizer_update", timed_update)
    config = make_config(corpus, tmp_path / "run", max_steps=6, log_every=3)
    with monkeypatch.context() as patch:
        stop_at(patch, 4)
        assert main(cli_args(config)) == 128 + signal.SIGTERM
    clock[0] += 1000.0  # the time between the stop and the resume
    assert main([*cli_args(config), "--resume"]) == 0
    before, after = [r["tokens_per_s"] for r in read_metrics(tmp_path / "run")]
    assert before == sum(tokens[s] for s in (1, 2, 3)) / 3
    assert after == (tokens[5] + tokens[6]) / 2
    assert 0.5 < after / before < 2


def test_validation_records_of_a_resumed_run_equal_an_uninterrupted_one(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Through the CLI: validation every 2 updates, stopped after update 5 and resumed. Every
    validation record, before and after the stop, equals the uninterrupted run's, and the last
    one equals a fresh validation of the saved model: no validation reuses stale weights."""
    config = make_config(
        corpus,
        tmp_path / "whole",
        max_steps=8,
        valid_every=2,
        save_every=4,
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
    )
    assert main(cli_args(config)) == 0
    stopped = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 5)
        main(cli_args(stopped))
    assert main([*cli_args(stopped), "--resume"]) == 0
    capsys.readouterr()

    def valid_records(run_dir: Path) -> list[dict[str, Any]]:
        return [r for r in read_metrics(run_dir) if r["type"] == "valid"]

    whole = valid_records(tmp_path / "whole")
    assert [r["step"] for r in whole] == [2, 4, 6, 8]
    assert valid_records(tmp_path / "stopped") == whole
    loaded = load_model_dir(tmp_path / "whole" / "model")
    tokenizer = Tokenizer.load(tmp_path / "whole" / "tokenizer.model")
    dataset, _ = load_or_build(
        corpus[0], corpus[1], None, tokenizer, tmp_path / "data", max_len=config.max_len
    )
    fresh = validation.validation_loss(
        loaded.model,
        dataset,
        max_tokens=config.max_tokens,
        device=torch.device("cpu"),
        label_smoothing=config.label_smoothing,
    )
    assert {k: whole[-1][k] for k in fresh} == pytest.approx(fresh, rel=1e-6)


@pytest.mark.parametrize("phase", ["loss", "bleu"])
def test_sigterm_during_validation_abandons_it_saves_once_and_exits_143(
    phase: str,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """SIGTERM while validating at step 2: no waiting for the rest of the validation (0.3 s a
    batch here, a whole dev set in real life), no valid record, no `best/`, no update 3, and
    one save of update 2 (where `save_every` also falls)."""
    signalled: list[int] = []  # the items handed out after the signal

    def slowly(items: list[Any]) -> Iterator[Any]:
        for i, item in enumerate(items):
            if i == 1 and not signalled:
                signalled.append(0)
                signal.raise_signal(signal.SIGTERM)
            elif signalled:
                signalled[0] += 1
            yield item

    if phase == "loss":
        make_batches = validation.make_batches

        def slow_batches(*args: Any, shuffle: bool = True, **kwargs: Any) -> Any:
            batches = make_batches(*args, shuffle=shuffle, **kwargs)
            return batches if shuffle else slowly(batches)  # validation does not shuffle

        monkeypatch.setattr(validation, "make_batches", slow_batches)
    else:
        translate = Translator.translate
        calls = iter(slowly(list(range(1000))))

        def slow_translate(self: Translator, *args: Any, **kwargs: Any) -> Any:
            next(calls)
            return translate(self, *args, **kwargs)

        monkeypatch.setattr(Translator, "translate", slow_translate)
    saves: list[int] = []
    save_checkpoint = ckpt.save_checkpoint

    def counted_save(*args: Any, **kwargs: Any) -> Path:
        saves.append(kwargs["step"])
        return save_checkpoint(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", counted_save)
    config = make_config(
        corpus,
        tmp_path / "run",
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
        valid_every=2,
        save_every=2,
        valid_bleu=phase == "bleu",
    )
    assert main(cli_args(config)) == 128 + signal.SIGTERM
    assert signalled[0] <= 1, f"{signalled[0]} more batches validated after the signal"
    assert "interrupted at step 2; continue with: aiayn train --resume" in capsys.readouterr().err
    assert saves == [2]
    assert [(r["type"], r["step"]) for r in read_metrics(tmp_path / "run")] == [
        ("train", 1),
        ("train", 2),
    ]
    assert not (tmp_path / "run" / "best").exists()


def test_a_stop_request_during_the_last_update_still_saves_it(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop_at(monkeypatch, 4)
    result = trainer.train(make_config(corpus, tmp_path / "run", max_steps=4, save_every=3))
    assert (result.interrupted, result.step) == (False, 4)  # the run is complete
    assert checkpoint_steps(tmp_path / "run") == [3, 4]
    assert load_model_dir(tmp_path / "run").metadata["step"] == 4


def test_resume_without_a_checkpoint_starts_from_scratch(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=3)
    result = trainer.train(config, resume=True)
    assert result.step == 3
    trainer.train(dataclasses.replace(config, out_dir=str(tmp_path / "fresh")))
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "fresh")


def test_resume_can_extend_a_finished_run(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    config = make_config(corpus, tmp_path / "short", max_steps=3)
    trainer.train(config)
    trainer.train(dataclasses.replace(config, max_steps=6), resume=True)
    trainer.train(dataclasses.replace(config, out_dir=str(tmp_path / "long"), max_steps=6))
    assert_same_weights(tmp_path / "short" / "model", tmp_path / "long" / "model")
    assert train_losses(tmp_path / "short") == train_losses(tmp_path / "long")


def test_resume_with_another_batch_layout_warns(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=2)
    trainer.train(config)
    with caplog.at_level(logging.WARNING, logger="aiayn.train"):
        trainer.train(dataclasses.replace(config, max_steps=3, accumulate=2), resume=True)
    assert "saved with 1 process(es) × 1 batch(es) per update, this run uses 1 × 2" in caplog.text


def test_average_into_the_run_again_after_a_resume_replaces_only_its_earlier_output(
    corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """README's `aiayn average RUN --last 5 -o RUN/averaged`, once, then again after the run
    went on: the second replaces the first and touches nothing else; what the trainer writes
    (the run directory, its model/, best/, checkpoints/, data/) stays refused, present or not."""
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=2, save_every=1)
    trainer.train(config)
    average = ["average", str(run), "--last", "5", "-o", str(run / "averaged")]
    assert main(average) == 0
    steps = ["step_00000001", "step_00000002"]
    assert load_model_dir(run / "averaged").metadata["averaged"] == steps
    assert main([*cli_args(dataclasses.replace(config, max_steps=4)), "--resume"]) == 0
    before = run_dir_snapshot(run)

    assert main(average) == 0
    after = run_dir_snapshot(run)
    assert load_model_dir(run / "averaged").metadata["averaged"] == [
        f"step_{step:08d}" for step in (1, 2, 3, 4)
    ]
    assert {k: v for k, v in after.items() if not k.startswith("averaged/")} == {
        k: v for k, v in before.items() if not k.startswith("averaged/")
    }
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []
    capsys.readouterr()

    owned = ["model", "best", "checkpoints", "checkpoints/step_00000004", "data"]
    for target in [run, *(run / name for name in owned)]:
        assert main(["average", str(run), "-o", str(target)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        if target == run:
            assert f"error: {run} is a training run directory;" in err
        else:
            assert f"error: {target} belongs to the training run {run} (" in err
        assert "(nothing was changed)" in err
    assert run_dir_snapshot(run) == after
    assert not (run / "best").exists()


# -- errors a user can fix: one clear line, exit status 2, nothing half-done -------------------


def _fails(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run `aiayn train`; expect exit status 2 and a one-line message (no traceback)."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("aiayn train: error: "), err
    return message


def test_existing_run_is_not_overwritten(
    corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=2)
    assert main(cli_args(config)) == 0
    before = run_dir_snapshot(tmp_path / "run")
    err = _fails(cli_args(config), capsys)
    assert f"{tmp_path / 'run'} already holds checkpoints; pass --resume" in err
    assert run_dir_snapshot(tmp_path / "run") == before


def test_misaligned_files(corpus: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    short = tmp_path / "short.tgt"
    short.write_text("".join(corpus[1].read_text().splitlines(keepends=True)[:5]))
    config = make_config(corpus, tmp_path / "run", tgt=str(short))
    err = _fails(cli_args(config), capsys)
    assert f"{corpus[0]} has 48 lines but {short} has 5 lines" in err
    assert not (tmp_path / "run" / "tokenizer.model").exists()  # no vocabulary of bad data
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_invalid_utf8(corpus: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.src"
    lines = corpus[0].read_bytes().splitlines(keepends=True)
    bad.write_bytes(b"".join(lines[:6]) + b"a \xff b\n" + b"".join(lines[7:]))
    err = _fails(cli_args(make_config(corpus, tmp_path / "run", src=str(bad))), capsys)
    assert f"{bad}:7: invalid UTF-8" in err
    assert not (tmp_path / "run" / "tokenizer.model").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_invalid_utf8_in_the_validation_set(
    corpus: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    bad = tmp_path / "valid.tgt"
    bad.write_bytes(b"a b\n\xc3\x28\n")
    src = tmp_path / "valid.src"
    src.write_text("a b\nc d\n")
    config = make_config(corpus, tmp_path / "run", valid_src=str(src), valid_tgt=str(bad))
    assert f"{bad}:2: invalid UTF-8" in _fails(cli_args(config), capsys)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        (None, "is a directory, not a file"),
        ("a b\nc d\n".encode("utf-16"), "looks like UTF-16; convert it to UTF-8"),
        (b"a b\nc\0d\n", ":2: NUL byte at byte 1 of the line"),
    ],
    ids=["directory", "utf-16", "nul"],
)
def test_unusable_corpus_files_are_named_before_anything_is_written(
    content: bytes | None, cause: str, corpus: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    bad = tmp_path / "valid.src"
    if content is None:
        bad.mkdir()
    else:
        bad.write_bytes(content)
    (tmp_path / "valid.tgt").write_text("a b\nc d\n")
    for overrides in (
        {"src": str(bad), "tgt": str(tmp_path / "valid.tgt")},
        {"valid_src": str(bad), "valid_tgt": str(tmp_path / "valid.tgt")},
    ):
        config = make_config(corpus, tmp_path / "run", **overrides)
        err = _fails(cli_args(config), capsys)
        assert f"{bad}{'' if cause.startswith(':') else ' '}{cause}" in err
        assert "does not exist" not in err and "lines but" not in err
        if content is None or b"\0" not in content:  # seen in the first bytes: before the lock
            assert not (tmp_path / "run").exists()
        else:  # seen when the text is read: before BPE training for the training set
            assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_tokenizer_that_disagrees_with_vocab_size_is_refused(
    corpus: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    model_file = tmp_path / "other" / "tokenizer.model"
    pieces = Tokenizer.train(list(corpus), model_file, vocab_size=300).vocab_size
    config = make_config(corpus, tmp_path / "run", tokenizer=str(model_file), vocab_size=400)
    err = _fails(cli_args(config), capsys)
    assert f"tokenizer {model_file} has {pieces} pieces but vocab_size is 400" in err
    assert not (tmp_path / "run").exists()
    assert main(cli_args(dataclasses.replace(config, vocab_size=pieces))) == 0


def test_empty_after_filtering(corpus: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    config = make_config(corpus, tmp_path / "run", max_len=2, max_tokens=8)
    err = _fails(cli_args(config), capsys)
    assert "is empty after filtering: kept 0 of 48 pairs" in err
    assert str(corpus[0]) in err and "max_len=2" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_config_value_out_of_range(corpus: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    args = [*cli_args(make_config(corpus, tmp_path / "run")), "--max-tokens", "0"]
    assert "max_tokens (0) must be >= 1" in _fails(args, capsys)
    assert not (tmp_path / "run").exists()


def test_unknown_yaml_key(corpus: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "train.yaml"
    config_file.write_text("max_steps: 3\nwarmup_step: 10\n")
    args = [*cli_args(make_config(corpus, tmp_path / "run")), "--config", str(config_file)]
    err = _fails(args, capsys)
    assert f"{config_file}: unknown key(s) warmup_step; valid keys:" in err
    assert not (tmp_path / "run").exists()


def test_resume_with_another_architecture(
    corpus: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=2)
    trainer.train(config)
    before = run_dir_snapshot(tmp_path / "run")
    wider = dataclasses.replace(config, model={**TINY_MODEL, "d_model": 32})
    err = _fails([*cli_args(wider), "--resume"], capsys)
    assert (
        "model.d_model: the run in" in err
        and "was trained with 16, this resume was given 32" in err
    )
    assert run_dir_snapshot(tmp_path / "run") == before
    # A train_config.yaml changed by hand does not get past the checkpoint's own config.
    settings = tmp_path / "run" / "train_config.yaml"
    settings.write_text(yaml.safe_dump(wider.to_dict()))
    before = run_dir_snapshot(tmp_path / "run")
    err = _fails([*cli_args(wider), "--resume"], capsys)
    assert (
        "step_00000002: it holds a different architecture (d_model: checkpoint 16, config 32" in err
    )
    assert run_dir_snapshot(tmp_path / "run") == before


def test_resume_with_the_run_directory_alone_keeps_the_runs_settings(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`aiayn train --out-dir RUN --resume`: no data flags, and the run's 6 steps, not the
    default 100k; the result is the uninterrupted run's."""
    config = make_config(corpus, tmp_path / "whole", max_steps=6, save_every=2)
    assert main(cli_args(config)) == 0
    stopped = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 3)
        assert main(cli_args(stopped)) == 128 + signal.SIGTERM
    recorded = (tmp_path / "stopped" / "train_config.yaml").read_text()
    assert main(["train", "--out-dir", str(tmp_path / "stopped"), "--resume"]) == 0, capsys
    assert checkpoint_steps(tmp_path / "stopped")[-1] == 6
    assert_same_weights(tmp_path / "whole" / "model", tmp_path / "stopped" / "model")
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "stopped")
    assert (tmp_path / "stopped" / "train_config.yaml").read_text() == recorded


def test_resume_overrides_a_setting_that_may_change_and_records_it(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    assert main(cli_args(make_config(corpus, run, max_steps=2))) == 0
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        assert main(["train", "--out-dir", str(run), "--resume", "--max-steps", "4"]) == 0
    assert "resume: max_steps changed from 2 to 4" in caplog.text
    assert checkpoint_steps(run)[-1] == 4
    recorded = TrainConfig(**yaml.safe_load((run / "train_config.yaml").read_text()))
    assert recorded == make_config(corpus, run, max_steps=4, schedule="inverse_sqrt")


@pytest.mark.parametrize(
    ("flags", "name", "before", "after"),
    [
        (["--seed", "2"], "seed", "1", "2"),
        (["--max-tokens", "128"], "max_tokens", "64", "128"),
        (["--model", "n_heads=4"], "model.n_heads", "2", "4"),
        (["--vocab-size", "400"], "vocab_size", "300", "400"),
    ],
)
def test_resume_refuses_a_setting_that_changes_what_is_trained(
    flags: list[str],
    name: str,
    before: str,
    after: str,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    run = tmp_path / "run"
    assert main(cli_args(make_config(corpus, run, max_steps=2))) == 0
    snapshot = run_dir_snapshot(run)
    err = _fails(["train", "--out-dir", str(run), "--resume", *flags], capsys)
    assert (
        f"error: {name}: the run in {run} was trained with {before}, this resume was given {after}"
        in err
    )
    assert run_dir_snapshot(run) == snapshot


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "d_modle=16"], "model: unknown model config key(s): d_modle"),
        (["--model", "d_model=63"], "model: d_model (63) must be divisible by n_heads (2)"),
        (["--src", "missing.src"], "missing.src"),
    ],
    ids=["unknown-model-key", "invalid-model-value", "missing-src"],
)
def test_a_bad_config_fails_before_any_directory_is_written(
    flags: list[str],
    message: str,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "new"
    assert message in _fails([*cli_args(make_config(corpus, run)), *flags], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [WEIGHTS_FILE, ckpt.TRAINING_STATE_FILE])
def test_resume_from_a_truncated_checkpoint(
    name: str, corpus: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=2)
    trainer.train(config)
    damaged = tmp_path / "run" / "checkpoints" / "step_00000002" / name
    damaged.write_bytes(damaged.read_bytes()[:100])
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    err = _fails([*cli_args(dataclasses.replace(config, max_steps=4)), "--resume"], capsys)
    assert f"{damaged} is corrupt or truncated" in err
    assert checkpoint_steps(tmp_path / "run") == [2]
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics


FREE_BYTES = 1024  # what the full file system reports free


def _fill_the_disk(monkeypatch: pytest.MonkeyPatch, writer: str, after: int) -> None:
    """Make the `after`+1-th write by `writer` fail half-way as on a full disk, with the error
    that writer raises there, while the file system reports `FREE_BYTES` free.

    torch's zip writer swallows the OSError(ENOSPC) of the file it writes to and raises
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    (test_a_real_full_disk_is_one_line checks this on a real file system); safetensors
    raises a SafetensorError whose text ends in "(os error 28)".
    """
    calls = 0
    original = torch.save if writer == "torch" else save_model

    def full(obj: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls <= after:
            return original(obj, target, *args, **kwargs)
        if isinstance(target, (str, Path)):
            Path(target).write_bytes(b"partial")
        else:
            target.write(b"partial")
        if writer == "torch":
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    if writer == "torch":
        monkeypatch.setattr(torch, "save", full)
    else:
        monkeypatch.setattr("safetensors.torch.save_model", full)
    usage = shutil.disk_usage(".")
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: usage._replace(free=FREE_BYTES, used=usage.total)
    )


@pytest.mark.parametrize("writer", ["torch", "safetensors"])
def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(
    writer: str,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=4, save_every=2)
    with monkeypatch.context() as patch:
        # safetensors writes each save twice (checkpoint, model/): the second save fails
        _fill_the_disk(patch, writer, after=1 if writer == "torch" else 2)
        for args in (cli_args(config), [*cli_args(config), "--resume"]):  # still full
            err = _fails(args, capsys)
            assert "No space left on device writing " in err and ".step_00000004.tmp-" in err
            assert re.search(r": the checkpoint needs about \d+\.\d KiB, 1\.0 KiB free;", err), err
            assert "partial checkpoint removed" in err
            assert f"last good checkpoint: {run / 'checkpoints' / 'step_00000002'}" in err
            assert [p.name for p in run.rglob("*") if ".tmp" in p.name] == []
            assert checkpoint_steps(run) == [2]

    assert main([*cli_args(config), "--resume"]) == 0
    assert checkpoint_steps(run) == [2, 4]
    assert load_model_dir(run).metadata["step"] == 4


def _can_mount_a_tmpfs() -> bool:
    """Whether this user may mount a tmpfs in a user namespace of its own (`unshare -rm`)."""
    if shutil.which("unshare") is None:
        return False
    command = "mount -t tmpfs -o size=64k tmpfs /mnt || mount -t tmpfs -o size=64k tmpfs /tmp"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True)
    return probe.returncode == 0


def _bytes_on_tmpfs(directory: Path) -> int:
    """What the files under `directory` take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in directory.rglob("*") if p.is_file())


@pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="needs unshare -rm and a tmpfs mount")
def test_a_real_full_disk_is_one_line(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    """The run is copied onto a tmpfs with room for one more checkpoint but half its training
    state, which torch's zip writer then fails to write: the resume fails at its first save
    with one line; so does a second resume once not a byte is free."""
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=2, save_every=2)
    trainer.train(config)
    checkpoint = run / "checkpoints" / "step_00000002"
    state = (checkpoint / ckpt.TRAINING_STATE_FILE).stat().st_size
    size = _bytes_on_tmpfs(run) + _bytes_on_tmpfs(checkpoint) - state // 2
    mount = tmp_path / "small"
    mount.mkdir()
    moved = dataclasses.replace(config, out_dir=str(mount / "run"), max_steps=4)
    resume = shlex.join([sys.executable, "-m", "aiayn", *cli_args(moved), "--resume"])
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount))} || exit 99\n"
        f"cp -a {shlex.quote(str(run))} {shlex.quote(str(mount))}/ || exit 98\n"
        f"{resume}; echo status=$?\n"
        f"cat /dev/zero > {shlex.quote(str(mount / 'filler'))} 2>/dev/null\n"
        f"{resume}; echo status=$?\n"
        f"ls -A {shlex.quote(str(mount / 'run' / 'checkpoints'))}\n"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True)
    # exit status 2 twice, and no partial checkpoint left
    assert done.stdout.split() == ["status=2", "status=2", "step_00000002"], done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("aiayn train:")]
    assert len(errors) == 2, done.stderr
    last_good = f"last good checkpoint: {mount / 'run' / 'checkpoints' / 'step_00000002'}"
    for line in errors:
        assert line.startswith("aiayn train: error: No space left on device writing "), line
        assert line.endswith(last_good), line
    assert re.search(r"the checkpoint needs about [\d.]+ KiB, [\d.]+ KiB free", errors[0])
    assert "partial checkpoint removed" in errors[0], errors[0]


# -- what killed runs leave behind ------------------------------------------------------------


def _dead_pid() -> int:
    """The id of a process that has exited (so its temporary files are nobody's)."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_OUT)
    return int(process.stdout)


_OUT: dict[str, Any] = dict(capture_output=True, text=True, check=True)


def _kill_while_replacing_model(run: Path, pid: int) -> None:
    """The state a kill between `parts.swap_in`'s two renames leaves: no `model/`, the old one
    moved aside and the new one complete under its temporary name."""
    old = run / f".model.old-{pid}"
    shutil.copytree(run / "checkpoints" / "step_00000001", old)
    os.utime(old / CHECKSUMS_FILE, (0, 0))
    os.replace(run / "model", run / f".model.tmp-{pid}")


def test_a_kill_while_replacing_model_leaves_the_run_translatable(
    corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    trainer.train(make_config(corpus, run, max_steps=2, save_every=1))
    _kill_while_replacing_model(run, _dead_pid())
    (tmp_path / "in.txt").write_text("a b c\n")
    args = ["-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt"), "--beam-size", "1"]
    assert main(["translate", "-m", str(run), *args, "--max-len-b", "2"]) == 0, capsys.readouterr()
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 1


def test_resume_restores_what_an_interrupted_save_moved_aside_and_removes_debris(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=2, save_every=1)
    trainer.train(config)
    pid = _dead_pid()
    _kill_while_replacing_model(run, pid)
    os.replace(
        run / "checkpoints" / "step_00000002", run / "checkpoints" / f".step_00000002.old-{pid}"
    )
    partial = run / "checkpoints" / f".step_00000003.tmp-{pid}"
    partial.mkdir()
    (partial / WEIGHTS_FILE).write_bytes(b"half")
    (run / f".best.tmp-{pid}").mkdir()
    (run / "metrics.tmp").write_text("{}\n")
    live = run / f".best.tmp-{os.getppid()}"  # a process that is still running: not ours
    live.mkdir()

    with caplog.at_level(logging.INFO):
        assert main([*cli_args(dataclasses.replace(config, max_steps=3)), "--resume"]) == 0
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in caplog.text
    assert checkpoint_steps(run) == [1, 2, 3]
    leftovers = [p.name for p in run.rglob("*") if ".tmp" in p.name or ".old" in p.name]
    assert leftovers == [live.name]
    assert load_model_dir(run).metadata["step"] == 3


def test_a_save_killed_before_its_rename_is_put_in_place_and_resumed_from(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kill after a checkpoint was written in full, before it was renamed into place: it is
    complete and verified, so the resume puts it in place and loses no update."""
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=3, save_every=1)
    trainer.train(config)
    pid = _dead_pid()
    written = run / "checkpoints" / f".step_00000003.tmp-{pid}"
    os.replace(run / "checkpoints" / "step_00000003", written)

    with caplog.at_level(logging.INFO):
        assert main([*cli_args(dataclasses.replace(config, max_steps=4)), "--resume"]) == 0
    assert f"restored it from {written.name}" in caplog.text
    assert f"resumed from {run / 'checkpoints' / 'step_00000003'} at step 3" in caplog.text
    assert checkpoint_steps(run) == [1, 2, 3, 4]
    assert not written.exists()


def test_a_corrupt_latest_checkpoint_names_the_previous_one_and_how_to_use_it(
    corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture, caplog
) -> None:
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=4, save_every=2)
    trainer.train(config)
    latest, previous = run / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000002"
    (latest / WEIGHTS_FILE).write_bytes(b"truncated")
    resume = [*cli_args(dataclasses.replace(config, max_steps=5)), "--resume"]
    err = _fails(resume, capsys)
    assert f"{latest / WEIGHTS_FILE} is corrupt or truncated" in err
    assert f"to resume from the previous checkpoint {previous}, move this one aside" in err
    assert f"(mv {latest} {latest}.corrupt) and run again with --resume" in err

    os.replace(latest, f"{latest}.corrupt")  # what the message says to do
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        assert main(resume) == 0
    assert f"resumed from {previous} at step 2" in caplog.text
    assert checkpoint_steps(run) == [2, 4, 5]  # step 4 trained and saved again
    assert (run / "checkpoints" / "step_00000004.corrupt" / WEIGHTS_FILE).read_bytes() == (
        b"truncated"
    )


def test_a_latest_checkpoint_without_checksums_is_named_when_skipped(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=4, save_every=2)
    trainer.train(config)
    latest = run / "checkpoints" / "step_00000004"
    (latest / CHECKSUMS_FILE).unlink()
    with caplog.at_level(logging.INFO):
        assert main([*cli_args(dataclasses.replace(config, max_steps=5)), "--resume"]) == 0
    assert f"{latest} has no checksums.json (cut short or damaged): skipped" in caplog.text
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in caplog.text


# -- early stopping -------------------------------------------------------------------------


def fake_validation(
    monkeypatch: pytest.MonkeyPatch, nlls: list[float], bleus: list[float] | None = None
) -> None:
    """Validations that report the next of `nlls` (and of `bleus`), in the order they run."""

    def validation_loss(*args: Any, **kwargs: Any) -> dict[str, float]:
        nll = nlls.pop(0)
        return {"valid_loss": nll + 0.5, "valid_nll": nll, "valid_ppl": math.exp(nll),
                "valid_tokens": 100}  # fmt: skip

    def validation_bleu(*args: Any, **kwargs: Any) -> dict[str, Any]:
        assert bleus is not None
        return {"valid_bleu": bleus.pop(0), "valid_chrf": 50.0, "bleu_signature": "fake"}

    monkeypatch.setattr(validation, "validation_loss", validation_loss)
    monkeypatch.setattr(validation, "validation_bleu", validation_bleu)


def test_early_stopping_keeps_the_best_model_and_a_resume_keeps_counting(
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """patience 3, a validation after every update. Stopped by SIGTERM during update 4 (after
    validations 1-3: best at step 2, then one worse) and resumed: validations 5 and 6 are
    worse than step 2's too, so the run stops after update 6, not at max_steps, and `best/`
    is step 2's. A resume that forgot the count would have made step 5 the new best."""
    config = make_config(
        corpus,
        tmp_path / "run",
        max_steps=20,
        valid_every=1,
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
        patience=3,
    )
    nlls = [3.0, 2.0, 2.5]
    fake_validation(monkeypatch, nlls)
    with monkeypatch.context() as patch:
        stop_at(patch, 4)
        assert main(cli_args(config)) == 128 + signal.SIGTERM
    assert nlls == []
    state = ckpt.load_training_state(tmp_path / "run" / "checkpoints" / "step_00000004")
    assert (state.progress.best_step, state.progress.validations_since_best) == (2, 1)

    nlls += [2.4, 2.1, 1.0]  # 1.0 is never reached
    with caplog.at_level(logging.INFO, logger="aiayn.train.trainer"):
        assert main([*cli_args(config), "--resume"]) == 0
    assert nlls == [1.0]
    assert (
        "early stop: valid perplexity has not improved for 3 validations (best 7.39 at step 2)"
        in caplog.text  # e² = 7.39
    )
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if r["type"] == "valid"] == [1, 2, 3, 5, 6]
    assert max(r["step"] for r in records) == 6
    assert checkpoint_steps(tmp_path / "run")[-1] == 6
    best = load_model_dir(tmp_path / "run" / "best").metadata
    assert (best["step"], best["valid_nll"]) == (2, 2.0)
    assert load_model_dir(tmp_path / "run").metadata["step"] == 6

    # Resumed again, the run has nothing left to do: it stops before any update.
    assert main([*cli_args(config), "--resume"]) == 0
    assert max(r["step"] for r in read_metrics(tmp_path / "run")) == 6


def test_early_stopping_on_bleu_chooses_best_by_bleu(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NLL improves at every validation, BLEU peaks at step 2: `best/` is step 2's, and
    with patience 2 the run stops after update 4."""
    config = make_config(
        corpus,
        tmp_path / "run",
        max_steps=20,
        valid_every=1,
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
        valid_bleu=True,
        patience=2,
        patience_metric="bleu",
    )
    fake_validation(monkeypatch, [4.0, 3.0, 2.0, 1.0, 0.5], [10.0, 30.0, 20.0, 25.0, 40.0])
    result = trainer.train(config)
    assert (result.step, result.early_stopped, result.interrupted) == (4, True, False)
    best = load_model_dir(tmp_path / "run" / "best").metadata
    assert (best["step"], best["valid_bleu"], best["valid_nll"]) == (2, 30.0, 3.0)


# -- the metrics log ------------------------------------------------------------------------


def test_tensorboard_scalars_are_the_metrics_log_and_a_resume_writes_no_step_twice(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """Every number of metrics.jsonl is a scalar of RUN/tensorboard/ at its step. A resume from
    step 3 after updates 4-6 had been logged (their checkpoint lost, as in a kill before the
    save) logs them again; TensorBoard shows each step once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    config = make_config(
        corpus,
        run,
        max_steps=6,
        save_every=3,
        valid_every=3,
        valid_src=str(corpus[0]),
        valid_tgt=str(corpus[1]),
        tensorboard=True,
    )
    assert main(cli_args(config)) == 0
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    assert main([*cli_args(config), "--resume"]) == 0
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per process

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    records = read_metrics(run)
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        kind = record["type"]
        for name, value in record.items():
            if name not in ("type", "step") and isinstance(value, (int, float)):
                tag = f"{kind}/{name.removeprefix(kind + '_')}"
                expected.setdefault(tag, []).append((record["step"], value))
    assert {"train/loss", "train/lr", "valid/loss", "valid/ppl"} <= set(expected)
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in got] == [step for step, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), tag


def test_tensorboard_without_its_extra_is_one_line_before_anything_is_written(
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    config = make_config(corpus, tmp_path / "run", tensorboard=True)
    assert main(cli_args(config)) == 2
    err = capsys.readouterr().err
    assert "needs tensorboard, which is not installed: pip install -e '.[tensorboard]'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_tsv_training_and_validation_bleu(tmp_path: Path, corpus: tuple[Path, Path]) -> None:
    """A TSV corpus trains its vocabulary on the text columns (no tab pieces), and validation
    reports sacreBLEU BLEU/chrF with a signature in metrics.jsonl."""
    lines = corpus[0].read_text(encoding="utf-8").splitlines()
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{line}\t{line}\n" for line in lines), encoding="utf-8")
    config = make_config(
        corpus,
        tmp_path / "run",
        src=None,
        tgt=None,
        tsv=str(tsv),
        valid_tsv=str(tsv),
        valid_bleu=True,
        max_steps=2,
    )
    result = trainer.train(config)
    tokenizer = Tokenizer.load(result.run_dir / "tokenizer.model")
    pieces = {tokenizer.pieces([i])[0] for i in range(tokenizer.vocab_size)}
    assert not any("\t" in piece for piece in pieces)
    [valid] = [r for r in read_metrics(result.run_dir) if r["type"] == "valid"]
    assert 0.0 <= valid["valid_bleu"] <= 100.0
    assert 0.0 <= valid["valid_chrf"] <= 100.0
    assert valid["bleu_signature"].startswith("nrefs:1|")


def test_a_fresh_run_remakes_a_vocabulary_made_from_other_settings(
    tmp_path: Path, corpus: tuple[Path, Path]
) -> None:
    """A run directory without checkpoints keeps its tokenizer only for the same settings."""
    run_dir = tmp_path / "run"
    trainer.train(make_config(corpus, run_dir, max_steps=1, save_every=0))
    shutil.rmtree(run_dir / "checkpoints")  # as if the first run died before saving
    first = (run_dir / "tokenizer.model").read_bytes()
    trainer.train(make_config(corpus, run_dir, max_steps=1))  # same settings: reused
    assert (run_dir / "tokenizer.model").read_bytes() == first
    shutil.rmtree(run_dir / "checkpoints")
    other = tmp_path / "other"
    other.mkdir()
    for name in ("train.src", "train.tgt"):
        (other / name).write_text("xyz uvw qrs\n" * 20, encoding="utf-8")
    trainer.train(make_config((other / "train.src", other / "train.tgt"), run_dir, max_steps=1))
    record = json.loads((run_dir / "tokenizer.json").read_text())
    assert record["files"][0][0] == str((other / "train.src").resolve())
    assert (run_dir / "tokenizer.model").read_bytes() != first


def test_cpu_bf16_training_runs_in_bf16_and_learns(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With precision bf16 on a CPU the forward runs under bf16 autocast; weights and losses
    stay float32; and oneDNN's kernel cache, a setting of the process, is left to the program
    (`aiayn train` limits it: test_aiayn_train_makes_the_process_settings_before_training)."""
    seen: list[tuple[torch.dtype | None, torch.dtype]] = []
    forward = Transformer.forward

    def recording_forward(self: Transformer, *args: Any, **kwargs: Any) -> Any:
        sums = forward(self, *args, **kwargs)
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        seen.append((autocast, sums.loss.dtype))
        return sums

    monkeypatch.setattr(Transformer, "forward", recording_forward)
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)  # and restored afterwards
    result = trainer.train(make_config(corpus, tmp_path / "run", max_steps=8, precision="bf16"))
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    assert seen and set(seen) == {(torch.bfloat16, torch.float32)}
    assert all(w.dtype == torch.float32 for w in weights(result.model_dir).values())
    losses = [loss for _, loss, _ in train_losses(result.run_dir)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_runtime_settings_are_what_aiayn_train_set_before(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """Threads as given; oneDNN's kernel cache limited for bf16 on a CPU only; the compile
    fallback with `compile` only; freed memory kept for reuse always."""
    config = make_config(corpus, tmp_path / "run", threads=3, device="cpu")
    assert trainer.runtime_settings(config) == {
        "threads": 3,
        "onednn_kernels": None,
        "compile_errors_fall_back": None,
        "reuse_freed_memory": True,
    }
    bf16 = trainer.runtime_settings(dataclasses.replace(config, precision="bf16", compile=True))
    assert bf16["onednn_kernels"] == ONEDNN_KERNELS_FOR_BF16_TRAINING
    assert bf16["compile_errors_fall_back"] is True
    on_gpu = dataclasses.replace(config, precision="bf16", device="cuda")  # not oneDNN's bf16
    assert trainer.runtime_settings(on_gpu)["onednn_kernels"] is None


def test_aiayn_train_makes_the_process_settings_before_training(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`aiayn train` (and so every torchrun worker) applies `runtime_settings` through
    `runtime.configure` before `train` starts: the same threads, oneDNN kernel limit and compile
    fallback that the trainer used to set itself, and freed memory kept for reuse."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)  # tests/conftest.py gives the suite's back afterwards
    seen = {}
    kept = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: kept.append(1) or True)

    def fake_train(config: TrainConfig, *, resume: bool, started: float) -> trainer.TrainResult:
        seen.update(
            threads=torch.get_num_threads(),
            kernels=os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
            fall_back=torch._dynamo.config.suppress_errors,
        )
        raise SystemExit(0)

    monkeypatch.setattr(trainer, "train", fake_train)
    config = make_config(
        corpus, tmp_path / "run", threads=1, precision="bf16", compile=True, device="cpu"
    )
    with pytest.raises(SystemExit):
        main(cli_args(config))
    assert seen == {
        "threads": 1,
        "kernels": str(ONEDNN_KERNELS_FOR_BF16_TRAINING),
        "fall_back": True,
    }
    assert kept == [1]  # the allocator keeps freed memory for the next update


def test_training_refuses_onednn_where_its_products_are_wrong(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `acceleration.onednn_products_wrong` finds oneDNN's products off at the model's
    shapes, `--onednn` stops the run before its first update, saying why."""
    monkeypatch.setattr(setup, "uses_onednn", lambda *args, **kwargs: True)
    monkeypatch.setattr(setup, "onednn_products_wrong", lambda model: "off by 0.03")
    config = make_config(corpus, tmp_path / "run", onednn=True)
    with pytest.raises(ValueError, match="--onednn cannot train correctly on this CPU: off by"):
        trainer.train(config)
    assert not (tmp_path / "run" / "model").exists()


# -- schedules that know their end, and the precision keys of earlier releases --------------


@pytest.mark.parametrize("schedule", DECAYING)
@pytest.mark.parametrize("max_steps", [5, 9])
def test_a_decaying_schedule_reaches_zero_at_max_steps(
    corpus: tuple[Path, Path], tmp_path: Path, schedule: str, max_steps: int
) -> None:
    """The rate of every update is the schedule's for an end at max_steps: 0 at the last."""
    config = make_config(corpus, tmp_path / "run", max_steps=max_steps, schedule=schedule)
    trainer.train(config)
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert [r["step"] for r in records] == list(range(1, max_steps + 1))
    for r in records:
        expected = scheduled_rate(schedule, r["step"], d_model=16, warmup_steps=4, end=max_steps)
        assert r["lr"] == expected
    assert records[-1]["lr"] == 0.0 and all(r["lr"] > 0 for r in records[:-1])


def test_a_decaying_schedule_resumes_exactly(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after update 5 of 10 and resumed: the same rates, losses and weights."""
    config = make_config(corpus, tmp_path / "whole", max_steps=10, schedule="linear")
    trainer.train(config)
    stopped = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 5)
        assert trainer.train(stopped).interrupted
    assert trainer.train(stopped, resume=True).step == 10

    def rates(run_dir: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["lr"]) for r in read_metrics(run_dir) if r["type"] == "train"]

    assert rates(tmp_path / "whole") == rates(tmp_path / "stopped")
    assert rates(tmp_path / "whole")[-1] == (10, 0.0)
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "stopped")
    assert_same_weights(tmp_path / "whole" / "model", tmp_path / "stopped" / "model")


def test_with_max_epochs_a_decaying_schedule_ends_at_the_last_epochs_last_update(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = make_config(corpus, tmp_path / "run", max_steps=1000, max_epochs=2, schedule="cosine")
    result = trainer.train(config)
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert records[-1]["step"] == result.step < 1000
    assert records[-1]["lr"] == 0.0 and records[-2]["lr"] > 0


def test_a_run_directory_of_an_earlier_release_resumes_with_its_precision_and_eq3(
    corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Its train_config.yaml has bf16/cpu_bf16 and no schedule: they are read as precision and
    Eq. 3 (the only schedule it had), even when the resume adds a time budget (for which
    "auto" would pick another schedule), and the file is written again with today's keys."""
    run = tmp_path / "run"
    config = make_config(corpus, run, max_steps=2)
    assert main(cli_args(config)) == 0
    settings = run / "train_config.yaml"
    values = yaml.safe_load(settings.read_text())
    del values["precision"], values["schedule"], values["time_budget"], values["ema_decay"]
    values.update(bf16=False, cpu_bf16=False)  # as `--no-bf16` wrote it
    settings.write_text(yaml.safe_dump(values, sort_keys=False))
    # In this process `aiayn train` counts the budget from pytest's start: a week, then.
    args = ["train", "--out-dir", str(run), "--resume", "--max-steps", "4", "--time-budget", "7d"]
    assert main(args) == 0
    assert "error" not in capsys.readouterr().err
    recorded = yaml.safe_load(settings.read_text())
    assert (recorded["precision"], recorded["schedule"]) == ("fp32", "inverse_sqrt")
    assert "bf16" not in recorded and "cpu_bf16" not in recorded
    records = [r for r in read_metrics(run) if r["type"] == "train"]
    assert [r["lr"] for r in records] == [
        learning_rate(step, d_model=16, warmup_steps=4) for step in (1, 2, 3, 4)
    ]


def test_a_run_foreseen_to_take_more_than_a_day_says_so(
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After ten measured updates the trainer knows its pace: a run longer than LONG_RUN_S
    (a day; here 0 s) without a time budget is warned about, with what to change."""
    monkeypatch.setattr(trainer, "LONG_RUN_S", 0.0)
    config = make_config(corpus, tmp_path / "run", max_steps=14)
    with caplog.at_level(logging.WARNING, logger="aiayn.train.trainer"):
        trainer.train(config)
    [warning] = [r.getMessage() for r in caplog.records if "updates left take about" in r.message]
    assert "the 3 updates left" in warning and "--max-steps or --time-budget" in warning


def test_the_loop_reads_the_device_only_at_its_records(
    corpus: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`aiayn train` with an average of the weights and clipping, a record every 4 updates:
    the loop's updates and its decisions read no tensor back to the host (on a GPU, each such
    read waits for the device), the source mask's padding check included (`Batch.src_padded`)."""
    reads: list[str] = []
    counting = [False]
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(tensor: torch.Tensor, *args: Any, _name=name, _original=original) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if counting[0] and caller.startswith("aiayn"):
                reads.append(f"{caller}: {_name}")
            return _original(tensor, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def counting_during(method: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counting[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                counting[0] = False

        return wrapped

    for name in ("update", "should_stop"):
        monkeypatch.setattr(trainer.Trainer, name, counting_during(getattr(trainer.Trainer, name)))
    config = make_config(corpus, tmp_path / "run", max_steps=8, log_every=4, ema_decay=0.9)
    assert main([*cli_args(config), "--clip-norm", "1.0"]) == 0
    assert reads == []
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["type"] == "train"] == [4, 8]
