"""Setting up a training run (§5): everything before the first update, step by step.

`set_up` is the first of a `Trainer`'s two steps (aiayn.train.trainer: `Trainer.setup`; `run`
is the second). Every rank takes these steps, bar the sixth (rank 0's); rank 0 alone writes:

1. the inputs, checked as far as that needs no reading them whole, before anything is written:
   the corpus files, a given tokenizer, the model directory to start from (`init_from`);
2. the run directory (aiayn.train.rundir), locked against a second trainer; a fresh run will
   not overwrite another, a resumed one keeps its settings but for those it may change;
3. the joint SentencePiece vocabulary, made once (§5.1), or with `init_from` the model
   directory's (aiayn.train.finetune);
4. the binarised data, cached by content (aiayn.text.corpus);
5. the `Transformer` and Adam (§5.3), restored from the last checkpoint on `--resume`
   (aiayn.train.checkpoint), else fresh, or with `init_from` the model directory's weights;
6. with `ema_decay`, the moving average of the weights (aiayn.train.ema), on rank 0;
7. the end the learning-rate schedule heads for: `max_steps`, the last update of
   `max_epochs`, or with `time_budget` what the budget foresees (aiayn.train.budget);
8. the model that updates run through: compiled and/or under DDP when asked.

Set-up logs as the trainer does: its lines read "aiayn.train.trainer: model: ...".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from aiayn.acceleration import (
    maybe_compile,
    native_bf16_cpu,
    onednn_products_wrong,
    use_cpu_attention,
)
from aiayn.errors import UserError, UserValueError
from aiayn.extras import require
from aiayn.model import Transformer
from aiayn.model_dir import TOKENIZER_FILE, WEIGHTS_FILE, CorruptCheckpointError, load_weights
from aiayn.optim import DECAYING, build_optimizer
from aiayn.text.corpus import ParallelDataset, check_corpus_files, load_or_build
from aiayn.text.tokenizer import (
    PAD_ID,
    SplitTokenizer,
    Tokenizer,
    check_given_tokenizer,
    load_tokenizer,
)
from aiayn.train import checkpoint as ckpt
from aiayn.train import finetune, rundir
from aiayn.train.ema import WeightAverage
from aiayn.train.runlog import METRICS_FILE, TENSORBOARD_DIR, TensorBoardLog, truncate_metrics
from aiayn.train.update import cuda_computes_bf16

if TYPE_CHECKING:
    from aiayn.train.trainer import Trainer

# The trainer's logger: a run's lines, set-up's included, read "aiayn.train.trainer: ...".
logger = logging.getLogger("aiayn.train.trainer")


class TrainingError(UserError, RuntimeError):
    """The run cannot start or continue (the message says why and what to do)."""


def set_up(trainer: Trainer, held: contextlib.ExitStack) -> None:
    """Everything before the first update (`Trainer.setup`); `held` keeps the run directory's
    lock.

    Fills in what the loop needs of `trainer`: `tokenizer`, `train_data` and `valid_data`,
    `model_config`, `model`, `optimizer`, `average`, `fixed_end` and `schedule_end`, and
    `train_model`; on resume, `progress` and the time the run spent before (`clock`); with
    `init_from`, `init` and the model's vocabulary size in `config`.
    """
    _check_inputs(trainer)
    _open_run_dir(trainer, held)
    held.callback(trainer.log.close)
    trainer.tokenizer = _prepare_tokenizer(trainer)
    trainer.train_data, trainer.valid_data = _load_data(trainer)
    c, distributed = trainer.config, trainer.distributed
    if trainer.init is not None:
        trainer.model_config = trainer.init.model_config
    else:
        trainer.model_config = c.model_config(trainer.tokenizer.vocab_size, pad_id=PAD_ID)
    torch.manual_seed(c.seed)
    model = trainer.model = Transformer(trainer.model_config).to(trainer.device)
    if trainer.device.type == "cpu":  # the CPU's fastest attention (bf16: in float32)
        use_cpu_attention(model)
    if trainer.onednn:
        wrong = onednn_products_wrong(model)
        if wrong is not None:
            raise UserValueError(
                f"--onednn cannot train correctly on this CPU: {wrong}; train without --onednn"
            )
    if distributed.rank > 0:
        # Independent dropout masks on every rank; rank 0 keeps the single-process stream.
        torch.manual_seed(c.seed + distributed.rank)
    trainer.optimizer = build_optimizer(model, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
    saved_average = _resume_or_start(trainer)
    trainer.average = _start_average(trainer, saved_average)
    _plan_the_end(trainer)
    trainer.train_model = _wrap_model(trainer)
    _log_setup(trainer)


def _check_inputs(trainer: Trainer) -> None:
    """What can be checked of the inputs without reading them whole, before the run
    directory is touched: the corpus files (missing, directories, UTF-16), a given
    tokenizer, the model directory to start from."""
    c = trainer.config
    files = (c.src, c.tgt, c.tsv, c.valid_src, c.valid_tgt, c.valid_tsv)
    check_corpus_files(*(Path(name) for name in files if name))
    if c.tensorboard:
        require("tensorboard", "tensorboard", needed_by="tensorboard: true (--tensorboard)")
    if c.init_from:
        # A resumed run continues from its own checkpoint and never reads init_from again.
        resumed = ckpt.list_checkpoints(trainer.run_dir)[-1:] if trainer.resume_requested else []
        if resumed:
            trainer.init = finetune.resumed_model(resumed[0])
        else:
            trainer.init = finetune.read_init_model(c, c.init_from)
        # The run's vocabulary is the model's: train_config.yaml records its true size.
        trainer.config = replace(c, vocab_size=trainer.init.vocab_size)
    elif c.tokenizer:
        check_given_tokenizer(Path(c.tokenizer), c.vocab_size)


def _open_run_dir(trainer: Trainer, held: contextlib.ExitStack) -> None:
    """Create and lock the run directory (rank 0 alone: the ranks of one run share it).

    The lock comes before anything is written and before the checkpoint check, so that a
    second trainer is told who is in the way and changes nothing.
    """
    if trainer.distributed.is_main:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        check = functools.partial(_check_run_dir, trainer)
        held.enter_context(rundir.hold_run_lock(trainer.run_dir, check))
        rundir.remove_debris(trainer.run_dir)  # before anything in the run directory is read
    trainer.distributed.barrier()


def _check_run_dir(trainer: Trainer) -> None:
    """A fresh run must not overwrite another; a resumed one keeps its settings, but for
    those it may change (logged)."""
    run_dir, resume = trainer.run_dir, trainer.resume_requested
    rundir.refuse_existing_run(run_dir, resume)
    if resume and ckpt.list_checkpoints(run_dir):
        for name, (before, after) in rundir.resume_overrides(run_dir, trainer.config).items():
            logger.info("resume: %s changed from %r to %r", name, before, after)


def _prepare_tokenizer(trainer: Trainer) -> Tokenizer | SplitTokenizer:
    """The joint vocabulary (§5.1), made by rank 0, or the init model's, copied; a resumed
    run keeps its own."""
    keep = trainer.resume_requested and bool(ckpt.list_checkpoints(trainer.run_dir))
    if trainer.init is not None:
        if trainer.distributed.is_main:
            finetune.copy_tokenizer(trainer.init, trainer.run_dir, keep=keep)
        trainer.distributed.barrier()
        return load_tokenizer(trainer.run_dir / trainer.init.tokenizer_file.name)
    model_file = trainer.run_dir / TOKENIZER_FILE
    if trainer.distributed.is_main:
        c = trainer.config
        Tokenizer.train_or_reuse(
            model_file,
            src=Path(c.src) if c.src else None,
            tgt=Path(c.tgt) if c.tgt else None,
            tsv=Path(c.tsv) if c.tsv else None,
            copy_from=Path(c.tokenizer) if c.tokenizer else None,
            vocab_size=c.vocab_size,
            seed=c.seed,
            keep=keep,
        )
    trainer.distributed.barrier()
    return Tokenizer.load(model_file)


def _load_data(trainer: Trainer) -> tuple[ParallelDataset, ParallelDataset | None]:
    """Binarise once on rank 0 (cached by content), then every rank opens the memmaps."""
    c = trainer.config

    def build(src: str | None, tgt: str | None, tsv: str | None, name: str) -> Any:
        dataset, stats = load_or_build(
            *(Path(f) if f else None for f in (src, tgt, tsv)),
            trainer.tokenizer,
            trainer.run_dir / "data" / name,
            max_len=c.max_len,
            max_ratio=c.max_ratio or None,
        )
        if trainer.distributed.is_main:
            logger.info("%s data: %s", name, stats)
        return dataset

    if not trainer.distributed.is_main:
        trainer.distributed.barrier()  # rank 0 builds the cache first
    train_data = build(c.src, c.tgt, c.tsv, "train")
    valid_data = None
    if c.valid_tsv or c.valid_src:
        valid_data = build(c.valid_src, c.valid_tgt, c.valid_tsv, "valid")
    if trainer.distributed.is_main:
        trainer.distributed.barrier()
    return train_data, valid_data


def _resume_or_start(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """Restore the latest checkpoint on `--resume` (if there is one), else start afresh;
    then record the settings. Returns the checkpoint's average of the weights, if any."""
    latest = ckpt.latest_checkpoint(trainer.run_dir) if trainer.resume_requested else None
    saved_average = None
    metrics_path = trainer.run_dir / METRICS_FILE
    if latest is not None:
        try:
            saved_average = _resume(trainer, latest)
        except CorruptCheckpointError as error:
            hint = rundir.earlier_checkpoint_hint(trainer.run_dir, latest)
            raise TrainingError(f"{error}; {hint}") from None
        if trainer.distributed.is_main:
            truncate_metrics(metrics_path, trainer.progress.step)
            logger.info("resumed from %s at step %d", latest, trainer.progress.step)
    elif trainer.resume_requested and trainer.distributed.is_main:
        logger.info("no checkpoint in %s yet: starting from scratch", trainer.run_dir)
    if latest is None and trainer.init is not None:
        _start_from_init(trainer, trainer.init)
    if trainer.distributed.is_main:
        if latest is None:
            metrics_path.unlink(missing_ok=True)
            shutil.rmtree(trainer.run_dir / TENSORBOARD_DIR, ignore_errors=True)
        if trainer.config.tensorboard:
            purge_step = trainer.progress.step + 1 if latest is not None else None
            trainer.log.tensorboard = TensorBoardLog(
                trainer.run_dir / TENSORBOARD_DIR, purge_step=purge_step
            )
        rundir.write_config(trainer.run_dir, trainer.config.to_dict())
    trainer.distributed.barrier()
    return saved_average


def _resume(trainer: Trainer, checkpoint: Path) -> dict[str, torch.Tensor] | None:
    """Weights, optimizer state, progress and this rank's RNG from `checkpoint`; returns its
    average of the weights (for `_start_average`)."""
    state = ckpt.load_training_state(checkpoint)  # verifies every file: corrupt comes first
    ckpt.check_same_architecture(checkpoint, trainer.model_config)
    load_weights(trainer.model, checkpoint / WEIGHTS_FILE)
    trainer.optimizer.load_state_dict(state.optimizer)
    world_size = trainer.distributed.world_size
    if state.world_size * state.accumulate != world_size * trainer.accumulate:
        # `position` counts updates, so it now points at different batches of the epoch.
        logger.warning(
            "%s was saved with %d process(es) × %d batch(es) per update, this run uses "
            "%d × %d: the rest of this epoch's batches will not be exactly those the run "
            "would have seen",
            checkpoint,
            state.world_size,
            state.accumulate,
            world_size,
            trainer.accumulate,
        )
    if trainer.distributed.rank < len(state.rng):
        ckpt.restore_rng(state.rng[trainer.distributed.rank])
    # else: a rank the checkpoint did not have keeps the stream `set_up` seeded for it
    # (seed + rank), rather than drawing rank 0's dropout masks
    trainer.progress = state.progress
    trainer.clock.spent_before = state.progress.elapsed_s  # the budget is the run's
    trainer.model.to(trainer.device)
    return state.ema


def _start_from_init(trainer: Trainer, init: finetune.InitModel) -> None:
    """Fine-tuning: the weights of `init`; Adam and the schedule stay fresh (step 0)."""
    load_weights(trainer.model, init.weights_file)
    if trainer.distributed.is_main:
        logger.info(
            "fine-tuning from %s: its weights and vocabulary; the optimizer and the "
            "learning-rate schedule (warm-up included) start afresh at step 0",
            init.directory,
        )


def _start_average(trainer: Trainer, saved: dict[str, torch.Tensor] | None) -> WeightAverage | None:
    """The moving average of the weights (rank 0, which validates and saves): the `saved`
    one on resume, else the weights the run starts from."""
    c = trainer.config
    if not c.ema_decay or not trainer.distributed.is_main:
        return None
    average = WeightAverage(trainer.model, c.ema_decay)
    if saved is not None:
        try:
            average.load_state_dict(saved)
        except ValueError as error:
            raise CorruptCheckpointError(f"cannot resume the average: {error}") from None
    elif trainer.progress.step > 0:
        logger.warning(
            "the checkpoint holds no average of the weights: it starts from the weights of step %d",
            trainer.progress.step,
        )
    elif trainer.valid_data is None:
        trainer.progress.weights = "ema"  # no validation will choose: the average asked for
    return average


def _plan_the_end(trainer: Trainer) -> None:
    """The last update the schedule heads for: `max_steps`, or the last of `max_epochs`
    if that comes first; with a time budget, the end a resumed run was heading for, until
    this process has measured its own pace."""
    c = trainer.config
    trainer.fixed_end = c.max_steps
    if c.max_epochs and c.schedule in DECAYING:
        lengths = (len(trainer.updates_in(epoch)) for epoch in range(1, c.max_epochs + 1))
        trainer.fixed_end = min(c.max_steps, sum(lengths))
    trainer.schedule_end = trainer.fixed_end
    if trainer.budget is not None and trainer.progress.schedule_end > 0:
        trainer.schedule_end = min(trainer.fixed_end, trainer.progress.schedule_end)
    valid_data = trainer.valid_data
    if valid_data is not None:
        trainer.pace.valid_tokens = int(valid_data.tgt_lengths.sum()) + len(valid_data)
    weights = sum(p.numel() for p in trainer.model.parameters()) * 4  # float32
    trainer.pace.save_bytes = weights * (4 + (1 if c.ema_decay else 0))  # 2 copies, Adam's 2


def _wrap_model(trainer: Trainer) -> nn.Module:
    """The model that updates run through: compiled and/or under DDP when asked."""
    if trainer.bf16 and trainer.device.type == "cpu" and not native_bf16_cpu():
        logger.warning(
            "precision bf16: this CPU has no native bf16 arithmetic; steps will be slower"
        )
    if trainer.bf16 and trainer.device.type == "cuda" and not cuda_computes_bf16(trainer.device):
        logger.warning(
            "precision bf16: this GPU only emulates bf16 (slower than float32); "
            "precision auto trains it in float32"
        )
    train_model: nn.Module = trainer.model
    if trainer.config.compile:
        train_model = maybe_compile(train_model, trainer.device)
    if trainer.distributed.enabled:
        device_ids = [trainer.device.index] if trainer.device.type == "cuda" else None
        train_model = DistributedDataParallel(train_model, device_ids=device_ids)
    return train_model


def _log_setup(trainer: Trainer) -> None:
    """What the run trains, on what, and towards which end (rank 0)."""
    if not trainer.distributed.is_main:
        return
    c = trainer.config
    logger.info(
        "model: %s parameters, %d train pairs, %d device(s) × %d batch(es) of ≤ %d "
        "tokens per update, on %s%s",
        f"{sum(p.numel() for p in trainer.model.parameters()):,}",
        len(trainer.train_data),
        trainer.distributed.world_size,
        trainer.accumulate,
        c.max_tokens,
        trainer.device,
        " in bf16" if trainer.bf16 else "",
    )
    end = f", to 0 at update {trainer.fixed_end}" if c.schedule in DECAYING else ""
    if trainer.budget is not None and c.schedule in DECAYING:
        end = f", to 0 at the update the time budget foresees (≤ {trainer.fixed_end})"
    logger.info("learning-rate schedule: %s%s", c.schedule, end)
    if trainer.budget is not None:
        logger.info(
            "time budget %s: %.1f s spent by the run so far",
            c.time_budget,
            trainer.clock.elapsed(),
        )
