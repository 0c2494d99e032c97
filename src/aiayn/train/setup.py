"""Setting up a training run (§5): everything before the first update, step by step.

`set_up` builds every part a run has and returns them (`RunParts`), as torchtune's recipes do;
`Trainer` (aiayn.train.trainer) receives them in one place and runs the loop. Every rank takes
these steps, bar the sixth (rank 0's); rank 0 alone writes:

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

Set-up seeds the process's RNG (`seed`: the weights' initialisation and the dropout masks) and
restores it from a checkpoint on resume; `aiayn.train.trainer.train` gives the caller's RNG
back afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from aiayn.acceleration import (
    maybe_compile,
    native_bf16_cpu,
    onednn_products_wrong,
    use_cpu_attention,
)
from aiayn.config import ModelConfig, TrainConfig
from aiayn.errors import UserError, UserValueError
from aiayn.extras import require
from aiayn.model import Transformer
from aiayn.model_dir import TOKENIZER_FILE, WEIGHTS_FILE, CorruptCheckpointError, load_weights
from aiayn.optim import DECAYING, build_optimizer
from aiayn.text.batching import BatchShapes, accumulation, epoch_updates
from aiayn.text.bpe_dropout import BPEDropout, EpochPairs, Merges
from aiayn.text.corpus import DataError, ParallelDataset, check_corpus_files, load_or_build
from aiayn.text.tokenizer import (
    EOS_ID,
    PAD_ID,
    VOCAB_FILE,
    SplitTokenizer,
    Tokenizer,
    check_given_tokenizer,
    load_tokenizer,
)
from aiayn.train import checkpoint as ckpt
from aiayn.train import finetune, rundir
from aiayn.train.distributed import Distributed
from aiayn.train.ema import WeightAverage
from aiayn.train.runlog import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsLog,
    TensorBoardLog,
    truncate_metrics,
)
from aiayn.train.update import cuda_computes_bf16, uses_bf16, uses_onednn

logger = logging.getLogger(__name__)


class TrainingError(UserError, RuntimeError):
    """The run cannot start or continue (the message says why and what to do)."""


@dataclass(frozen=True)
class RunParts:
    """Every part of a training run, as `set_up` built it and `Trainer` holds it.

    Attributes:
        config: The job's settings as the run records them: the schedule resolved ("auto"),
            and with `init_from` the model's vocabulary size.
        distributed: This process's rank and the world size (a single process outside torchrun).
        device: Where the model trains.
        bf16: Whether updates compute in bf16 (`precision`).
        onednn: Whether the CPU's products run on oneDNN (`onednn`).
        accumulate: Batches per update on this rank.
        run_dir: The run directory (aiayn.train.rundir), locked while the run holds it.
        init: The model directory a fine-tuning run starts from (`init_from`), else None.
        tokenizer: The joint vocabulary (or, fine-tuning an imported Marian model, its split
            one).
        train_data: The binarised training pairs; `valid_data` the validation pairs, if any.
        resegment: With `bpe_dropout`, each epoch's segmentation of the training pairs
            (aiayn.text.bpe_dropout), else None: `epoch_pairs` gives an epoch's pairs.
        model_config: The `Transformer`'s architecture.
        model: The `Transformer` (what is saved); `train_model` is what updates run through
            (the same, or it wrapped by torch.compile and/or DDP).
        optimizer: Adam (§5.3), with its state on resume.
        average: The moving average of the weights (rank 0, with `ema_decay`; else None).
        progress: Step, epoch, data position and the run's time so far: restored on resume,
            else fresh; the loop advances it.
        log: The metrics log (rank 0 writes it), with its TensorBoard writer when asked.
        fixed_end: The last update the schedule heads for without a time budget
            (`max_steps`, or the last of `max_epochs`); `schedule_end` the one it heads for
            now (a resumed run with a time budget: the end it was heading for).
    """

    config: TrainConfig
    distributed: Distributed
    device: torch.device
    bf16: bool
    onednn: bool
    accumulate: int
    run_dir: Path
    init: finetune.InitModel | None
    tokenizer: Tokenizer | SplitTokenizer
    train_data: ParallelDataset
    valid_data: ParallelDataset | None
    resegment: BPEDropout | None
    model_config: ModelConfig
    model: Transformer
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    average: WeightAverage | None
    progress: ckpt.Progress
    log: MetricsLog
    fixed_end: int
    schedule_end: int


def set_up(
    config: TrainConfig,
    *,
    resume: bool,
    distributed: Distributed,
    device: torch.device,
    held: contextlib.ExitStack,
) -> RunParts:
    """Everything before the first update (with `resume`, from the run's last checkpoint);
    `held` keeps the run directory's lock, and closes the metrics log, until the run ends."""
    # "auto" is resolved once, and recorded so: a resume keeps the schedule it began with.
    config = replace(config, schedule=config.resolved_schedule)
    run_dir = Path(config.out_dir)
    bf16 = uses_bf16(device, config.precision)
    onednn = uses_onednn(device, config.onednn, bf16=bf16, compile=config.compile)
    accumulate = accumulation(
        tokens_per_update=config.tokens_per_update,
        max_tokens=config.max_tokens,
        accumulate=config.accumulate,
        world_size=distributed.world_size,
    )
    config, init = _check_inputs(config, run_dir, resume)
    _open_run_dir(config, run_dir, resume, distributed, held)
    log = MetricsLog(run_dir / METRICS_FILE, distributed.is_main)
    held.callback(log.close)
    tokenizer = _prepare_tokenizer(config, run_dir, resume, init, distributed)
    train_data, valid_data = _load_data(config, run_dir, tokenizer, distributed)
    resegment = _bpe_dropout(config, train_data, tokenizer, distributed)
    if init is not None:
        model_config = init.model_config
    else:
        model_config = config.model_config(tokenizer.vocab_size, pad_id=PAD_ID)
    model = _build_model(model_config, config.seed, device, onednn, distributed.rank)
    optimizer = build_optimizer(
        model, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps
    )
    progress, saved_average = _resume_or_start(
        config, run_dir, resume, init, model, optimizer, log, distributed, accumulate
    )
    if model_config.target_side_output and progress.step == 0:
        _count_target_side(model, init, train_data, valid_data, distributed)
    elif model_config.target_side_output and valid_data is not None and distributed.is_main:
        _warn_outside_target_side(model, valid_data)
    average = _start_average(config, model, progress, saved_average, valid_data, distributed)
    fixed_end = _fixed_end(config, train_data, resegment, accumulate, distributed)
    schedule_end = fixed_end
    if config.budget_seconds is not None and progress.schedule_end > 0:
        schedule_end = min(fixed_end, progress.schedule_end)
    train_model = _wrap_model(model, config, device, bf16, distributed)
    parts = RunParts(
        config=config,
        distributed=distributed,
        device=device,
        bf16=bf16,
        onednn=onednn,
        accumulate=accumulate,
        run_dir=run_dir,
        init=init,
        tokenizer=tokenizer,
        train_data=train_data,
        valid_data=valid_data,
        resegment=resegment,
        model_config=model_config,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        average=average,
        progress=progress,
        log=log,
        fixed_end=fixed_end,
        schedule_end=schedule_end,
    )
    if distributed.is_main:
        _log_setup(parts)
    return parts


def epoch_pairs(
    data: ParallelDataset, resegment: BPEDropout | None, epoch: int
) -> ParallelDataset | EpochPairs:
    """The training pairs of `epoch`: the binarised ones, or with `bpe_dropout` their
    segmentation for that epoch."""
    return data if resegment is None else resegment.epoch(epoch)


def rank_updates(
    data: ParallelDataset | EpochPairs,
    config: TrainConfig,
    epoch: int,
    *,
    accumulate: int,
    distributed: Distributed,
) -> list[list[np.ndarray]]:
    """This rank's updates of `epoch` (aiayn.text.batching.epoch_updates): the batches of
    each, grouped by length and shuffled from `seed`."""
    return epoch_updates(
        data.src_lengths,
        data.tgt_lengths,
        max_tokens=config.max_tokens,
        seed=config.seed,
        epoch=epoch,
        accumulate=accumulate,
        rank=distributed.rank,
        world_size=distributed.world_size,
        shapes=batch_shapes(config),
    )


def batch_shapes(config: TrainConfig) -> BatchShapes | None:
    """The fixed batch shapes of `--static-shapes`, or None (batches of any shape)."""
    if not config.static_shapes:
        return None
    return BatchShapes.for_lengths(config.max_len, config.max_tokens)


def _check_inputs(
    config: TrainConfig, run_dir: Path, resume: bool
) -> tuple[TrainConfig, finetune.InitModel | None]:
    """What can be checked of the inputs without reading them whole, before the run
    directory is touched: the corpus files (missing, directories, UTF-16), a given
    tokenizer, the model directory to start from. Returns the config (with `init_from`, the
    model's vocabulary size) and the model to start from."""
    c = config
    files = (c.src, c.tgt, c.tsv, c.valid_src, c.valid_tgt, c.valid_tsv)
    check_corpus_files(*(Path(name) for name in files if name))
    if config.tensorboard:
        require("tensorboard", "tensorboard", needed_by="tensorboard: true (--tensorboard)")
    if config.init_from:
        # A resumed run continues from its own checkpoint and never reads init_from again.
        resumed = ckpt.list_checkpoints(run_dir)[-1:] if resume else []
        if resumed:
            init = finetune.resumed_model(resumed[0])
        else:
            init = finetune.read_init_model(config, config.init_from)
        if config.bpe_dropout and init.tokenizer_file.name == VOCAB_FILE:
            raise TrainingError(
                f"bpe_dropout ({config.bpe_dropout}) needs a joint BPE vocabulary; "
                f"{config.init_from} has a split one (an imported Marian model): set it to 0"
            )
        if config.bpe_dropout and init.model_config.target_side_output:
            raise TrainingError(
                f"bpe_dropout ({config.bpe_dropout}) cannot fine-tune {config.init_from}: its "
                "output layer scores only its target side's pieces (target_side_output), "
                "which BPE-dropout's segmentations leave: set it to 0"
            )
        # The run's vocabulary is the model's: train_config.yaml records its true size.
        return replace(config, vocab_size=init.vocab_size), init
    if config.tokenizer:
        check_given_tokenizer(Path(config.tokenizer), config.vocab_size)
    return config, None


def _open_run_dir(
    config: TrainConfig,
    run_dir: Path,
    resume: bool,
    distributed: Distributed,
    held: contextlib.ExitStack,
) -> None:
    """Create and lock the run directory (rank 0 alone: the ranks of one run share it).

    The lock comes before anything is written and before the checkpoint check, so that a
    second trainer is told who is in the way and changes nothing.
    """
    if distributed.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        check = functools.partial(_check_run_dir, config, run_dir, resume)
        held.enter_context(rundir.hold_run_lock(run_dir, check))
        rundir.remove_debris(run_dir)  # before anything in the run directory is read
    distributed.barrier()


def _check_run_dir(config: TrainConfig, run_dir: Path, resume: bool) -> None:
    """A fresh run must not overwrite another; a resumed one keeps its settings, but for
    those it may change (logged)."""
    rundir.refuse_existing_run(run_dir, resume)
    if resume and ckpt.list_checkpoints(run_dir):
        for name, (before, after) in rundir.resume_overrides(run_dir, config).items():
            logger.info("resume: %s changed from %r to %r", name, before, after)


def _prepare_tokenizer(
    config: TrainConfig,
    run_dir: Path,
    resume: bool,
    init: finetune.InitModel | None,
    distributed: Distributed,
) -> Tokenizer | SplitTokenizer:
    """The joint vocabulary (§5.1), made by rank 0, or the init model's, copied; a resumed
    run keeps its own."""
    keep = resume and bool(ckpt.list_checkpoints(run_dir))
    if init is not None:
        if distributed.is_main:
            finetune.copy_tokenizer(init, run_dir, keep=keep)
        distributed.barrier()
        return load_tokenizer(run_dir / init.tokenizer_file.name)
    model_file = run_dir / TOKENIZER_FILE
    if distributed.is_main:
        Tokenizer.train_or_reuse(
            model_file,
            src=Path(config.src) if config.src else None,
            tgt=Path(config.tgt) if config.tgt else None,
            tsv=Path(config.tsv) if config.tsv else None,
            copy_from=Path(config.tokenizer) if config.tokenizer else None,
            vocab_size=config.vocab_size,
            seed=config.seed,
            keep=keep,
        )
    distributed.barrier()
    return Tokenizer.load(model_file)


def _load_data(
    config: TrainConfig,
    run_dir: Path,
    tokenizer: Tokenizer | SplitTokenizer,
    distributed: Distributed,
) -> tuple[ParallelDataset, ParallelDataset | None]:
    """Binarise once on rank 0 (cached by content), then every rank opens the memmaps."""

    def build(src: str | None, tgt: str | None, tsv: str | None, name: str) -> Any:
        dataset, stats = load_or_build(
            *(Path(f) if f else None for f in (src, tgt, tsv)),
            tokenizer,
            run_dir / "data" / name,
            max_len=config.max_len,
            max_ratio=config.max_ratio or None,
        )
        if distributed.is_main:
            logger.info("%s data: %s", name, stats)
        return dataset

    if not distributed.is_main:
        distributed.barrier()  # rank 0 builds the cache first
    train_data = build(config.src, config.tgt, config.tsv, "train")
    valid_data = None
    if config.valid_tsv or config.valid_src:
        valid_data = build(config.valid_src, config.valid_tgt, config.valid_tsv, "valid")
    if distributed.is_main:
        distributed.barrier()
    return train_data, valid_data


def _build_model(
    model_config: ModelConfig, seed: int, device: torch.device, onednn: bool, rank: int
) -> Transformer:
    """The `Transformer`, its weights initialised from `seed`, on `device`; then this rank's
    dropout stream."""
    torch.manual_seed(seed)
    model = Transformer(model_config).to(device)
    if device.type == "cpu":  # the CPU's fastest attention (bf16: in float32)
        use_cpu_attention(model)
    if onednn:
        wrong = onednn_products_wrong(model)
        if wrong is not None:
            raise UserValueError(
                f"--onednn cannot train correctly on this CPU: {wrong}; train without --onednn"
            )
    if rank > 0:
        # Independent dropout masks on every rank; rank 0 keeps the single-process stream.
        torch.manual_seed(seed + rank)
    return model


def _resume_or_start(
    config: TrainConfig,
    run_dir: Path,
    resume: bool,
    init: finetune.InitModel | None,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    log: MetricsLog,
    distributed: Distributed,
    accumulate: int,
) -> tuple[ckpt.Progress, dict[str, torch.Tensor] | None]:
    """Restore the latest checkpoint on `--resume` (if there is one), else start afresh;
    then record the settings. Returns the progress and the checkpoint's average of the
    weights, if any."""
    latest = ckpt.latest_checkpoint(run_dir) if resume else None
    progress, saved_average = ckpt.Progress(), None
    metrics_path = run_dir / METRICS_FILE
    if latest is not None:
        try:
            progress, saved_average = _resume(latest, model, optimizer, distributed, accumulate)
        except CorruptCheckpointError as error:
            hint = rundir.earlier_checkpoint_hint(run_dir, latest)
            raise TrainingError(f"{error}; {hint}") from None
        if distributed.is_main:
            truncate_metrics(metrics_path, progress.step)
            logger.info("resumed from %s at step %d", latest, progress.step)
    elif resume and distributed.is_main:
        logger.info("no checkpoint in %s yet: starting from scratch", run_dir)
    if latest is None and init is not None:
        _start_from_init(model, init, distributed)
    if distributed.is_main:
        if latest is None:
            metrics_path.unlink(missing_ok=True)
            shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
        if config.tensorboard:
            purge_step = progress.step + 1 if latest is not None else None
            log.tensorboard = TensorBoardLog(run_dir / TENSORBOARD_DIR, purge_step=purge_step)
        rundir.write_config(run_dir, config.to_dict())
    distributed.barrier()
    return progress, saved_average


def _resume(
    checkpoint: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    distributed: Distributed,
    accumulate: int,
) -> tuple[ckpt.Progress, dict[str, torch.Tensor] | None]:
    """Weights, optimizer state and this rank's RNG from `checkpoint`; returns its progress
    (the run's time so far included) and its average of the weights."""
    state = ckpt.load_training_state(checkpoint)  # verifies every file: corrupt comes first
    ckpt.check_same_architecture(checkpoint, model.config)
    load_weights(model, checkpoint / WEIGHTS_FILE)
    optimizer.load_state_dict(state.optimizer)
    world_size = distributed.world_size
    if state.world_size * state.accumulate != world_size * accumulate:
        # `position` counts updates, so it now points at different batches of the epoch.
        logger.warning(
            "%s was saved with %d process(es) × %d batch(es) per update, this run uses "
            "%d × %d: the rest of this epoch's batches will not be exactly those the run "
            "would have seen",
            checkpoint,
            state.world_size,
            state.accumulate,
            world_size,
            accumulate,
        )
    if distributed.rank < len(state.rng):
        ckpt.restore_rng(state.rng[distributed.rank])
    # else: a rank the checkpoint did not have keeps the stream `_build_model` seeded for it
    # (seed + rank), rather than drawing rank 0's dropout masks
    return state.progress, state.ema


def _start_from_init(
    model: Transformer, init: finetune.InitModel, distributed: Distributed
) -> None:
    """Fine-tuning: the weights of `init`; Adam and the schedule stay fresh (step 0)."""
    load_weights(model, init.weights_file)
    if distributed.is_main:
        logger.info(
            "fine-tuning from %s: its weights and vocabulary; the optimizer and the "
            "learning-rate schedule (warm-up included) start afresh at step 0",
            init.directory,
        )


def _count_target_side(
    model: Transformer,
    init: finetune.InitModel | None,
    train_data: ParallelDataset,
    valid_data: ParallelDataset | None,
    distributed: Distributed,
) -> None:
    """`ModelConfig.target_side_output`: the pieces of the training and validation targets,
    and EOS, are those the pre-softmax projection scores; a fine-tuning run adds them to the
    init model's. Every rank counts the same data."""
    vocab = model.config.tgt_vocab_size
    used = np.zeros(vocab, dtype=bool)
    for data in (train_data, valid_data):
        if data is not None:
            used |= data.target_counts(vocab) > 0
    used[EOS_ID] = True
    ids = torch.from_numpy(np.flatnonzero(used))
    if init is not None:
        ids = torch.cat([ids, model.target_side().cpu()]).unique()
    model.set_target_side(ids)
    if distributed.is_main:
        scored = len(model.target_side())
        logger.info("target side: the output layer scores %d of %d pieces", scored, vocab)


def _warn_outside_target_side(model: Transformer, valid_data: ParallelDataset) -> None:
    """A resumed run keeps the target side counted at its start: pieces of validation targets
    (given anew) outside it count as padding in the validation loss, so say how many."""
    counts = valid_data.target_counts(model.config.tgt_vocab_size)
    side = model.target_side()
    if side is not None:
        counts[side.cpu().numpy()] = 0
    counts[model.config.pad_id] = 0
    if (outside := int(counts.sum())) > 0:
        logger.warning(
            "the validation targets hold %d tokens (%d distinct pieces) outside the target side "
            "the output layer scores, counted when the run started: the validation loss leaves "
            "them out",
            outside,
            int((counts > 0).sum()),
        )


def _start_average(
    config: TrainConfig,
    model: Transformer,
    progress: ckpt.Progress,
    saved: dict[str, torch.Tensor] | None,
    valid_data: ParallelDataset | None,
    distributed: Distributed,
) -> WeightAverage | None:
    """The moving average of the weights (rank 0, which validates and saves): the `saved`
    one on resume, else the weights the run starts from."""
    if not config.ema_decay or not distributed.is_main:
        return None
    average = WeightAverage(model, config.ema_decay)
    if saved is not None:
        try:
            average.load_state_dict(saved)
        except ValueError as error:
            raise CorruptCheckpointError(f"cannot resume the average: {error}") from None
    elif progress.step > 0:
        logger.warning(
            "the checkpoint holds no average of the weights: it starts from the weights of step %d",
            progress.step,
        )
    elif valid_data is None:
        progress.weights = "ema"  # no validation will choose: the average asked for
    return average


def _fixed_end(
    config: TrainConfig,
    data: ParallelDataset,
    resegment: BPEDropout | None,
    accumulate: int,
    distributed: Distributed,
) -> int:
    """The last update the schedule heads for without a time budget: `max_steps`, or the
    last of `max_epochs` if that comes first."""
    if not (config.max_epochs and config.schedule in DECAYING):
        return config.max_steps
    epochs = range(1, config.max_epochs + 1)
    updates = (
        rank_updates(
            epoch_pairs(data, resegment, e),
            config,
            e,
            accumulate=accumulate,
            distributed=distributed,
        )
        for e in epochs
    )
    return min(config.max_steps, sum(len(u) for u in updates))


def _bpe_dropout(
    config: TrainConfig,
    data: ParallelDataset,
    tokenizer: Tokenizer | SplitTokenizer,
    distributed: Distributed,
) -> BPEDropout | None:
    """With `bpe_dropout`, every distinct word of the training pairs segmented `samples` ways
    (the same on every rank: drawn from the seed)."""
    if not config.bpe_dropout:
        return None
    if not isinstance(tokenizer, Tokenizer):
        raise TrainingError(f"bpe_dropout ({config.bpe_dropout}) needs a joint BPE vocabulary")
    began = time.monotonic()
    try:
        resegment = BPEDropout(
            data,
            Merges.of(*tokenizer.piece_table()),
            dropout=config.bpe_dropout,
            seed=config.seed,
            max_len=config.max_len,
        )
    except DataError as error:
        raise TrainingError(f"{tokenizer.model_file}: {error}") from None
    if distributed.is_main:
        logger.info(
            "BPE-dropout %g: %d segmentations of each word, %.0f%% of the words vary (%.1f s)",
            config.bpe_dropout,
            resegment.samples,
            100 * resegment.resegmented,
            time.monotonic() - began,
        )
    return resegment


def _wrap_model(
    model: Transformer,
    config: TrainConfig,
    device: torch.device,
    bf16: bool,
    distributed: Distributed,
) -> nn.Module:
    """The model that updates run through: compiled and/or under DDP when asked."""
    if bf16 and device.type == "cpu" and not native_bf16_cpu():
        logger.warning(
            "precision bf16: this CPU has no native bf16 arithmetic; steps will be slower"
        )
    if bf16 and device.type == "cuda" and not cuda_computes_bf16(device):
        logger.warning(
            "precision bf16: this GPU only emulates bf16 (slower than float32); "
            "precision auto trains it in float32"
        )
    train_model: nn.Module = model
    if config.compile:
        # CUDA graphs record one graph per input shape: only for the few of fixed shapes,
        # compiled once for all of them.
        graphs = config.static_shapes and device.type == "cuda"
        mode = "reduce-overhead" if graphs else None
        train_model = maybe_compile(train_model, device, mode, dynamic=True if graphs else None)
    if distributed.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        train_model = DistributedDataParallel(train_model, device_ids=device_ids)
    return train_model


def _log_setup(parts: RunParts) -> None:
    """What the run trains, on what, and towards which end (rank 0)."""
    c = parts.config
    logger.info(
        "model: %s parameters, %d train pairs, %d device(s) × %d batch(es) of ≤ %d "
        "tokens per update, on %s%s",
        f"{sum(p.numel() for p in parts.model.parameters()):,}",
        len(parts.train_data),
        parts.distributed.world_size,
        parts.accumulate,
        c.max_tokens,
        parts.device,
        " in bf16" if parts.bf16 else "",
    )
    end = f", to 0 at update {parts.fixed_end}" if c.schedule in DECAYING else ""
    if c.budget_seconds is not None and c.schedule in DECAYING:
        end = f", to 0 at the update the time budget foresees (≤ {parts.fixed_end})"
    logger.info("learning-rate schedule: %s%s", c.schedule, end)
