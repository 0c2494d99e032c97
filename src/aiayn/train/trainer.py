"""Training for translation (§5): token-bucketed batches, Adam with Eq. 3, label smoothing.

`train` runs a whole job from a `TrainConfig` with a `Trainer`, whose parts follow the job:

1. `Trainer.setup`: the run directory (aiayn.train.rundir: locked against a second trainer, its
   settings kept on `--resume`), a joint SentencePiece vocabulary made once (§5.1), the
   binarised data, the model and Adam, restored from the last checkpoint on resume; with
   `init_from`, the model and its vocabulary come from a model directory (aiayn.train.finetune);
2. `Trainer.update`: one optimizer update (aiayn.train.update) over batches of about `max_tokens`
   tokens, grouped by length and shuffled per epoch from the seed, normalised by the true
   number of target tokens, so one process with `accumulate=k` and k data-parallel processes
   compute the same update;
3. `Trainer.validate` (aiayn.train.validation) and `Trainer.save`: checkpoints that resume exactly
   (weights, optimizer, step, RNG, data position: `checkpoint.TrainingState`), a `model/`
   directory that inference loads with no flags and a `best/` one;
4. `Trainer.run`: the loop; SIGINT/SIGTERM finish the current update, save and exit; with
   `patience`, the run ends once validation stops improving (aiayn.train.stopping); with
   `time_budget`, once the next update would leave too little time for the final validation
   and save (aiayn.train.budget), the end a decaying schedule heads for. With `ema_decay`, a
   moving average of the weights (aiayn.train.ema) is validated beside them, and model/ holds
   whichever validates better.

Multi-GPU / multi-node: launch with `torchrun ... -m aiayn train ...`; every rank takes its
share of the batches (DDP over NCCL on GPUs, gloo on CPUs) and rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from aiayn.acceleration import (
    ONEDNN_KERNELS_FOR_BF16_TRAINING,
    maybe_compile,
    native_bf16_cpu,
    onednn_products_wrong,
    use_cpu_attention,
)
from aiayn.config import TrainConfig
from aiayn.errors import UserError, UserValueError
from aiayn.extras import require
from aiayn.loss import perplexity
from aiayn.model import Transformer
from aiayn.model_dir import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CorruptCheckpointError,
    DiskFullError,
    load_weights,
    save_model_dir,
)
from aiayn.optim import DECAYING, build_optimizer
from aiayn.text.batching import accumulation, epoch_updates
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
from aiayn.train.budget import MARGIN_S, MARGIN_S_DISTRIBUTED, Pace, RunClock, TimeBudget
from aiayn.train.distributed import Distributed, device_type, init_distributed
from aiayn.train.ema import WEIGHTS_NAMES, WeightAverage, averaged_fields, better_weights
from aiayn.train.runlog import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsLog,
    ModelRecord,
    TensorBoardLog,
    TrainingDisplay,
    TrainRecord,
    ValidRecord,
    truncate_metrics,
)
from aiayn.train.stopping import EarlyStopping, StopFlag
from aiayn.train.update import (
    UpdateStats,
    cuda_computes_bf16,
    optimizer_update,
    uses_bf16,
    uses_onednn,
)
from aiayn.train.validation import validation_metrics

logger = logging.getLogger(__name__)


RUN_ESTIMATE_AFTER = 10
"""Measured updates after which `Trainer` estimates the run's length (`_warn_if_long`)."""
LONG_RUN_S = 86400.0
"""A run foreseen to take longer than this (a day) without a time budget is said so."""


class TrainingError(UserError, RuntimeError):
    """The run cannot start or continue (the message says why and what to do)."""


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path
    step: int
    interrupted: bool
    last_valid: dict[str, Any] | None
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM)
    early_stopped: bool = False  # validation stopped improving (`patience`)
    out_of_time: bool = False  # the time budget ended the run (`time_budget`)
    weights: str = "raw"  # what model/ holds: "raw", or "ema" (the moving average)


@dataclass(frozen=True)
class Decision:
    """What every rank does after an update, agreed on by all (`Trainer.should_stop`).

    Attributes:
        stop_now: A stop request (a signal) came: save and exit.
        timed: A timed save is due (`save_every_minutes`).
        out_of_time: The time budget has no room for another update: this one is the last.
        end: The last update the schedule heads for (`max_steps`, or foreseen by the budget).
    """

    stop_now: bool
    timed: bool
    out_of_time: bool
    end: int


# -- the job: `train`, and the `Trainer` it runs ---------------------------------------------


def train(
    config: TrainConfig, *, resume: bool = False, started: float | None = None
) -> TrainResult:
    """Run (or continue, with `resume`) the training job described by `config`.

    Args:
        started: When the run's time began in this process, a `time.monotonic()` value, for
            `time_budget` (and the run's wall time in metrics.jsonl): `aiayn train` gives its
            process's start (`budget.process_start`); by default, the call of `train`.
    """
    started = time.monotonic() if started is None else started
    distributed, device = init_distributed(config.device)
    trainer: Trainer | None = None
    try:
        with contextlib.ExitStack() as held:  # the run directory's lock, while training
            trainer = Trainer(
                config, resume=resume, distributed=distributed, device=device, started=started
            )
            trainer.setup(held)
            return trainer.run()
    except (DiskFullError, OSError) as error:
        message = rundir.disk_full_message(error, config.out_dir)
        if message is None:
            raise
        raise TrainingError(message) from None
    finally:
        if distributed.enabled and dist.is_initialized():
            # DDP's reducer holds the process group. Were it the last holder, freeing it
            # would join gloo's worker threads while holding the GIL, which a worker may be
            # waiting for to free the tensors of the last collective: a hang at exit, one run
            # in a few (pytorch#56297). So DDP goes first, while the group is still
            # registered, and the group is freed by destroy_process_group, without the GIL.
            if trainer is not None:
                trainer.release_model_wrapper()
            gc.collect()
            dist.destroy_process_group()


def runtime_settings(config: TrainConfig) -> dict[str, Any]:
    """What a program that trains with `config` sets for its whole process, as
    `aiayn.runtime.configure`'s arguments (`aiayn train` applies them before `train`, which
    changes none of them): `threads`; for bf16 on a CPU, oneDNN's kernel cache
    (`ONEDNN_KERNELS_FOR_BF16_TRAINING`: peak memory); with `compile`, the fallback to eager
    execution where compilation fails at the first update."""
    on_cpu = device_type(config.device) == "cpu"
    bf16_on_cpu = on_cpu and uses_bf16(torch.device("cpu"), config.precision)
    return {
        "threads": config.threads,
        "onednn_kernels": ONEDNN_KERNELS_FOR_BF16_TRAINING if bf16_on_cpu else None,
        "compile_errors_fall_back": True if config.compile else None,
    }


class Trainer:
    """One training job: the state the loop shares, and the steps of the loop as methods.

    Built in two steps, as torchtune's recipes are: `__init__` only keeps the settings;
    `setup` writes (the run directory, vocabulary, data cache) and builds (model, optimizer,
    resumed progress). `run` is then the loop; every other method is one part of it.

    Attributes:
        config: The job's settings.
        distributed: This process's rank and the world size (a single process outside torchrun).
        device: Where the model trains.
        run_dir: The run directory (aiayn.train.rundir).
        tokenizer: The joint vocabulary (or, fine-tuning an imported Marian model, its split
            one).
        init: The model directory a fine-tuning run starts from (`init_from`), else None.
        model: The `Transformer` (what is saved); `train_model` is what updates run through
            (the same, or it wrapped by torch.compile and/or DDP).
        optimizer: Adam (§5.3).
        progress: Step, epoch and data position, and the open metrics interval; saved and
            restored with every checkpoint.
        log: The metrics log (written by rank 0).
        clock: The run's wall time; `pace` what its updates, validations and saves cost;
            `budget` the time budget (None without one).
        average: The moving average of the weights (rank 0, with `ema_decay`; else None).
        schedule_end: The last update the learning-rate schedule heads for.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool,
        distributed: Distributed,
        device: torch.device,
        started: float | None = None,
    ) -> None:
        # "auto" is resolved once, and recorded so: a resume keeps the schedule it began with.
        self.config = config = replace(config, schedule=config.resolved_schedule)
        self.resume_requested = resume
        self.distributed = distributed
        self.device = device
        self.bf16 = uses_bf16(device, config.precision)
        self.onednn = uses_onednn(device, config.onednn, bf16=self.bf16, compile=config.compile)
        self.accumulate = accumulation(
            tokens_per_update=config.tokens_per_update,
            max_tokens=config.max_tokens,
            accumulate=config.accumulate,
            world_size=distributed.world_size,
        )
        self.run_dir = Path(config.out_dir)
        self.init: finetune.InitModel | None = None
        self.progress = ckpt.Progress()
        self.log = MetricsLog(self.run_dir / METRICS_FILE, distributed.is_main)
        self.last_valid: ValidRecord | None = None
        self.stop = StopFlag()
        self.early_stopping = EarlyStopping(config.patience, config.patience_metric)
        self._last_save_time = time.monotonic()
        self.display = TrainingDisplay(logger)
        self.clock = RunClock(time.monotonic() if started is None else started)
        self.pace = Pace(bleu=config.valid_bleu, validations=2 if config.ema_decay else 1)
        self.budget: TimeBudget | None = None
        if config.budget_seconds is not None:
            self.budget = TimeBudget(
                config.budget_seconds,
                self.clock,
                self.pace,
                valid_every=config.valid_every,
                save_every=config.save_every,
                save_every_minutes=config.save_every_minutes,
                exit_s=MARGIN_S_DISTRIBUTED if distributed.enabled else MARGIN_S,
            )
        self.average: WeightAverage | None = None
        self._saved_average: dict[str, torch.Tensor] | None = None
        self.schedule_end = config.max_steps
        self.out_of_time = False  # the budget ended the run (agreed on by every rank)
        self._validation_out_of_time = False  # rank 0 gave up a validation for the final save
        self._warned_short = False  # that the budget ends the run inside the warm-up

    # -- setup ----------------------------------------------------------------------------

    def setup(self, held: contextlib.ExitStack) -> None:
        """Everything before the first update; `held` keeps the run directory's lock."""
        self._check_inputs()
        self._open_run_dir(held)
        held.callback(self.log.close)
        self.tokenizer = self._prepare_tokenizer()
        self.train_data, self.valid_data = self._load_data()
        if self.init is not None:
            self.model_config = self.init.model_config
        else:
            self.model_config = self.config.model_config(self.tokenizer.vocab_size, pad_id=PAD_ID)
        torch.manual_seed(self.config.seed)
        self.model = Transformer(self.model_config).to(self.device)
        if self.device.type == "cpu":  # the CPU's fastest attention (bf16: in float32)
            use_cpu_attention(self.model)
        if self.onednn:
            wrong = onednn_products_wrong(self.model)
            if wrong is not None:
                raise UserValueError(
                    f"--onednn cannot train correctly on this CPU: {wrong}; train without --onednn"
                )
        if self.distributed.rank > 0:
            # Independent dropout masks on every rank; rank 0 keeps the single-process stream.
            torch.manual_seed(self.config.seed + self.distributed.rank)
        betas = (self.config.adam_beta1, self.config.adam_beta2)
        self.optimizer = build_optimizer(self.model, betas=betas, eps=self.config.adam_eps)
        self._resume_or_start()
        self._start_average()
        self._plan_the_end()
        self.train_model = self._wrap_model()
        self._log_setup()

    def _check_inputs(self) -> None:
        """What can be checked of the inputs without reading them whole, before the run
        directory is touched: the corpus files (missing, directories, UTF-16), a given
        tokenizer, the model directory to start from."""
        c = self.config
        files = (c.src, c.tgt, c.tsv, c.valid_src, c.valid_tgt, c.valid_tsv)
        check_corpus_files(*(Path(name) for name in files if name))
        if c.tensorboard:
            require("tensorboard", "tensorboard", needed_by="tensorboard: true (--tensorboard)")
        if c.init_from:
            # A resumed run continues from its own checkpoint and never reads init_from again.
            resumed = ckpt.list_checkpoints(self.run_dir)[-1:] if self.resume_requested else []
            if resumed:
                self.init = finetune.resumed_model(resumed[0])
            else:
                self.init = finetune.read_init_model(c, c.init_from)
            # The run's vocabulary is the model's: train_config.yaml records its true size.
            self.config = replace(c, vocab_size=self.init.vocab_size)
        elif c.tokenizer:
            check_given_tokenizer(Path(c.tokenizer), c.vocab_size)

    def _open_run_dir(self, held: contextlib.ExitStack) -> None:
        """Create and lock the run directory (rank 0 alone: the ranks of one run share it).

        The lock comes before anything is written and before the checkpoint check, so that a
        second trainer is told who is in the way and changes nothing.
        """
        if self.distributed.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(rundir.hold_run_lock(self.run_dir, self._check_run_dir))
            rundir.remove_debris(self.run_dir)  # before anything in the run directory is read
        self.distributed.barrier()

    def _check_run_dir(self) -> None:
        """A fresh run must not overwrite another; a resumed one keeps its settings, but for
        those it may change (logged)."""
        rundir.refuse_existing_run(self.run_dir, self.resume_requested)
        if self.resume_requested and ckpt.list_checkpoints(self.run_dir):
            for name, (before, after) in rundir.resume_overrides(self.run_dir, self.config).items():
                logger.info("resume: %s changed from %r to %r", name, before, after)

    def _prepare_tokenizer(self) -> Tokenizer | SplitTokenizer:
        """The joint vocabulary (§5.1), made by rank 0, or the init model's, copied; a resumed
        run keeps its own."""
        keep = self.resume_requested and bool(ckpt.list_checkpoints(self.run_dir))
        if self.init is not None:
            if self.distributed.is_main:
                finetune.copy_tokenizer(self.init, self.run_dir, keep=keep)
            self.distributed.barrier()
            return load_tokenizer(self.run_dir / self.init.tokenizer_file.name)
        model_file = self.run_dir / TOKENIZER_FILE
        if self.distributed.is_main:
            c = self.config
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
        self.distributed.barrier()
        return Tokenizer.load(model_file)

    def _load_data(self) -> tuple[ParallelDataset, ParallelDataset | None]:
        """Binarise once on rank 0 (cached by content), then every rank opens the memmaps."""
        c = self.config

        def build(src: str | None, tgt: str | None, tsv: str | None, name: str) -> Any:
            dataset, stats = load_or_build(
                *(Path(f) if f else None for f in (src, tgt, tsv)),
                self.tokenizer,
                self.run_dir / "data" / name,
                max_len=c.max_len,
                max_ratio=c.max_ratio or None,
            )
            if self.distributed.is_main:
                logger.info("%s data: %s", name, stats)
            return dataset

        if not self.distributed.is_main:
            self.distributed.barrier()  # rank 0 builds the cache first
        train_data = build(c.src, c.tgt, c.tsv, "train")
        valid_data = None
        if c.valid_tsv or c.valid_src:
            valid_data = build(c.valid_src, c.valid_tgt, c.valid_tsv, "valid")
        if self.distributed.is_main:
            self.distributed.barrier()
        return train_data, valid_data

    def _resume_or_start(self) -> None:
        """Restore the latest checkpoint on `--resume` (if there is one), else start afresh;
        then record the settings."""
        latest = ckpt.latest_checkpoint(self.run_dir) if self.resume_requested else None
        metrics_path = self.run_dir / METRICS_FILE
        if latest is not None:
            try:
                self.resume(latest)
            except CorruptCheckpointError as error:
                hint = rundir.earlier_checkpoint_hint(self.run_dir, latest)
                raise TrainingError(f"{error}; {hint}") from None
            if self.distributed.is_main:
                truncate_metrics(metrics_path, self.progress.step)
                logger.info("resumed from %s at step %d", latest, self.progress.step)
        elif self.resume_requested and self.distributed.is_main:
            logger.info("no checkpoint in %s yet: starting from scratch", self.run_dir)
        if latest is None and self.init is not None:
            self._start_from_init(self.init)
        if self.distributed.is_main:
            if latest is None:
                metrics_path.unlink(missing_ok=True)
                shutil.rmtree(self.run_dir / TENSORBOARD_DIR, ignore_errors=True)
            if self.config.tensorboard:
                purge_step = self.progress.step + 1 if latest is not None else None
                self.log.tensorboard = TensorBoardLog(
                    self.run_dir / TENSORBOARD_DIR, purge_step=purge_step
                )
            rundir.write_config(self.run_dir, self.config.to_dict())
        self.distributed.barrier()

    def resume(self, checkpoint: Path) -> None:
        """Weights, optimizer state, progress and this rank's RNG from `checkpoint`."""
        state = ckpt.load_training_state(checkpoint)  # verifies every file: corrupt comes first
        ckpt.check_same_architecture(checkpoint, self.model_config)
        load_weights(self.model, checkpoint / WEIGHTS_FILE)
        self.optimizer.load_state_dict(state.optimizer)
        world_size = self.distributed.world_size
        if state.world_size * state.accumulate != world_size * self.accumulate:
            # `position` counts updates, so it now points at different batches of the epoch.
            logger.warning(
                "%s was saved with %d process(es) × %d batch(es) per update, this run uses "
                "%d × %d: the rest of this epoch's batches will not be exactly those the run "
                "would have seen",
                checkpoint,
                state.world_size,
                state.accumulate,
                world_size,
                self.accumulate,
            )
        if self.distributed.rank < len(state.rng):
            ckpt.restore_rng(state.rng[self.distributed.rank])
        # else: a rank the checkpoint did not have keeps the stream `setup` seeded for it
        # (seed + rank), rather than drawing rank 0's dropout masks
        self.progress = state.progress
        self.clock.spent_before = state.progress.elapsed_s  # the budget is the run's
        self._saved_average = state.ema
        self.model.to(self.device)

    def _start_from_init(self, init: finetune.InitModel) -> None:
        """Fine-tuning: the weights of `init`; Adam and the schedule stay fresh (step 0)."""
        load_weights(self.model, init.weights_file)
        if self.distributed.is_main:
            logger.info(
                "fine-tuning from %s: its weights and vocabulary; the optimizer and the "
                "learning-rate schedule (warm-up included) start afresh at step 0",
                init.directory,
            )

    def _start_average(self) -> None:
        """The moving average of the weights (rank 0, which validates and saves): the saved
        one on resume, else the weights the run starts from."""
        c = self.config
        if not c.ema_decay or not self.distributed.is_main:
            return
        self.average = WeightAverage(self.model, c.ema_decay)
        if self._saved_average is not None:
            try:
                self.average.load_state_dict(self._saved_average)
            except ValueError as error:
                raise CorruptCheckpointError(f"cannot resume the average: {error}") from None
        elif self.progress.step > 0:
            logger.warning(
                "the checkpoint holds no average of the weights: it starts from the weights "
                "of step %d",
                self.progress.step,
            )
        elif self.valid_data is None:
            self.progress.weights = "ema"  # no validation will choose: the average asked for
        self._saved_average = None

    def _plan_the_end(self) -> None:
        """The last update the schedule heads for: `max_steps`, or the last of `max_epochs`
        if that comes first; with a time budget, the end a resumed run was heading for, until
        this process has measured its own pace."""
        c = self.config
        self.fixed_end = c.max_steps
        if c.max_epochs and c.schedule in DECAYING:
            lengths = (len(self._epoch_updates(epoch)) for epoch in range(1, c.max_epochs + 1))
            self.fixed_end = min(c.max_steps, sum(lengths))
        self.schedule_end = self.fixed_end
        if self.budget is not None and self.progress.schedule_end > 0:
            self.schedule_end = min(self.fixed_end, self.progress.schedule_end)
        if self.valid_data is not None:
            self.pace.valid_tokens = int(self.valid_data.tgt_lengths.sum()) + len(self.valid_data)
        weights = sum(p.numel() for p in self.model.parameters()) * 4  # float32
        self.pace.save_bytes = weights * (4 + (1 if c.ema_decay else 0))  # 2 copies, Adam's 2

    def _wrap_model(self) -> nn.Module:
        """The model that updates run through: compiled and/or under DDP when asked."""
        if self.bf16 and self.device.type == "cpu" and not native_bf16_cpu():
            logger.warning(
                "precision bf16: this CPU has no native bf16 arithmetic; steps will be slower"
            )
        if self.bf16 and self.device.type == "cuda" and not cuda_computes_bf16(self.device):
            logger.warning(
                "precision bf16: this GPU only emulates bf16 (slower than float32); "
                "precision auto trains it in float32"
            )
        train_model: nn.Module = self.model
        if self.config.compile:
            train_model = maybe_compile(train_model, self.device)
        if self.distributed.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            train_model = DistributedDataParallel(train_model, device_ids=device_ids)
        return train_model

    def release_model_wrapper(self) -> None:
        """Drop the DDP / compile wrapper (and with it DDP's reducer); `model` stays."""
        if hasattr(self, "train_model"):
            self.train_model = self.model

    def _log_setup(self) -> None:
        if not self.distributed.is_main:
            return
        c = self.config
        logger.info(
            "model: %s parameters, %d train pairs, %d device(s) × %d batch(es) of ≤ %d "
            "tokens per update, on %s%s",
            f"{sum(p.numel() for p in self.model.parameters()):,}",
            len(self.train_data),
            self.distributed.world_size,
            self.accumulate,
            c.max_tokens,
            self.device,
            " in bf16" if self.bf16 else "",
        )
        end = f", to 0 at update {self.fixed_end}" if c.schedule in DECAYING else ""
        if self.budget is not None and c.schedule in DECAYING:
            end = f", to 0 at the update the time budget foresees (≤ {self.fixed_end})"
        logger.info("learning-rate schedule: %s%s", c.schedule, end)
        if self.budget is not None:
            logger.info(
                "time budget %s: %.1f s spent by the run so far",
                c.time_budget,
                self.clock.elapsed(),
            )

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train until `max_steps` (or `max_epochs`, or the time budget), a stop request or an
        early stop; then validate and save. A stop request skips or abandons the final
        validation (resuming makes it up), an early stop has just validated; the last update is
        saved either way."""
        c, progress = self.config, self.progress
        self.display.open(
            bar=self.distributed.is_main and c.progress, total=c.max_steps, initial=progress.step
        )
        interrupted = early_stopped = False
        with self.stop:  # also around the final save: a signal cannot cut it in half
            if self.budget is not None and progress.step < c.max_steps:
                # A resumed run may find its budget spent already (rank 0's word counts).
                spent = self.distributed.is_main and self.budget.updates_left() == 0
                if self.distributed.sum([float(spent)], self.device)[0] > 0:
                    self._out_of_time()
            while progress.step < c.max_steps and not interrupted and not self.out_of_time:
                if c.max_epochs and progress.epoch > c.max_epochs:
                    break
                early_stopped = self.early_stopping.exhausted(progress)
                if early_stopped:
                    break
                interrupted = self._run_epoch()
            self.display.close()
            if not interrupted:
                if not early_stopped and not self._validation_out_of_time:
                    interrupted = not self.validate()
                self.save()
        if interrupted:
            logger.warning("stopped at step %d; continue with --resume", progress.step)
        elif self.distributed.is_main:
            if early_stopped:
                logger.info("early stop: %s", self.early_stopping.describe(progress))
            if self.average is not None:
                chosen_at = progress.weights_chosen_at or None
                self.log.write(ModelRecord(progress.step, progress.weights, chosen_at))
                logger.info("model/ holds the %s weights", WEIGHTS_NAMES[progress.weights])
            if self.budget is not None:
                logger.info(
                    "the run took %.1f s of its %s time budget", self.clock.elapsed(), c.time_budget
                )
        return TrainResult(
            self.run_dir,
            self.run_dir / "model",
            progress.step,
            interrupted,
            self.last_valid.metrics() if self.last_valid else None,
            self.stop.signum if interrupted else None,
            early_stopped,
            self.out_of_time,
            progress.weights,
        )

    def _epoch_updates(self, epoch: int) -> list[list[np.ndarray]]:
        """This rank's updates of `epoch` (aiayn.text.batching.epoch_updates)."""
        c = self.config
        return epoch_updates(
            self.train_data.src_lengths,
            self.train_data.tgt_lengths,
            max_tokens=c.max_tokens,
            seed=c.seed,
            epoch=epoch,
            accumulate=self.accumulate,
            rank=self.distributed.rank,
            world_size=self.distributed.world_size,
        )

    def _run_epoch(self) -> bool:
        """The rest of the current epoch; True if a stop request ended it."""
        c, progress = self.config, self.progress
        updates = self._epoch_updates(progress.epoch)
        if not updates:
            raise TrainingError(
                f"an epoch has no batches for {self.distributed.world_size} process(es): the "
                "training set is too small for this many processes; use fewer or more data"
            )
        for group in updates[progress.position :]:
            stats = self.update(group)
            decision = self.should_stop()
            stop_now = decision.stop_now
            done = progress.step >= c.max_steps or self.out_of_time
            self._log_update(stats, last=done)
            if c.valid_every and progress.step % c.valid_every == 0 and not done and not stop_now:
                stop_now = not self.validate()  # a stop during validation: save now
                done = self.out_of_time  # a validation given up for the final save
                if self.early_stopping.exhausted(progress) and not stop_now:
                    return False  # `run` saves this update
            periodic = c.save_every and progress.step % c.save_every == 0
            if (periodic or decision.timed or stop_now) and not done:
                self.save()
            if done:
                return False  # the final validation and save follow the loop
            if stop_now:
                return True
        progress.epoch += 1
        progress.position = 0
        return False

    def update(self, group: list[np.ndarray]) -> UpdateStats:
        """One optimizer update over the batches of `group`; advances `progress` and the
        average of the weights, and measures the pace."""
        c, progress = self.config, self.progress
        began = time.monotonic()
        stats = optimizer_update(
            self.train_model,
            self.optimizer,
            self.train_data,
            group,
            step=progress.step + 1,
            d_model=self.model_config.d_model,
            warmup_steps=c.warmup_steps,
            lr_scale=c.lr_scale,
            label_smoothing=c.label_smoothing,
            clip_norm=c.clip_norm,
            bf16=self.bf16,
            device=self.device,
            distributed=self.distributed,
            onednn=self.onednn,
            schedule=c.schedule,
            end_step=self.schedule_end,
        )
        progress.count_update(stats.loss, stats.nll, stats.tokens)
        if self.average is not None:
            self.average.update(progress.step)
        self.pace.count_update(time.monotonic() - began, stats.tokens)
        if self.pace.updates == RUN_ESTIMATE_AFTER and self.distributed.is_main:
            self._warn_if_long()
        self.display.count(stats.tokens)
        return stats

    def _warn_if_long(self) -> None:
        """Once the pace is measured: say what the run will take where that is more than a
        day and no time budget ends it sooner (the paper's `base` for 100k updates, a bare
        `aiayn train`, takes about a week on a 2-core CPU: docs/settings.md)."""
        if self.budget is not None:
            return
        left = self.fixed_end - self.progress.step
        seconds = left * self.pace.update_s
        if seconds > LONG_RUN_S:
            logger.warning(
                "at the pace measured, the %d updates left take about %.1f days on %s "
                "(%s preset); for a shorter run set --max-steps or --time-budget, or a smaller "
                "--preset (docs/settings.md)",
                left,
                seconds / 86400,
                self.device,
                self.config.preset,
            )

    def _log_update(self, stats: UpdateStats, *, last: bool) -> None:
        """A metrics record every `log_every` updates (and at the last); the progress bar."""
        progress = self.progress
        if progress.step % self.config.log_every == 0 or last:
            record = self._train_record(stats.lr)
            self.log.write(record)
            self.display.show(record, log=self.distributed.is_main)
            progress.interval = ckpt.new_interval()
        self.display.advance()

    def _train_record(self, lr: float) -> TrainRecord:
        progress, interval = self.progress, self.progress.interval
        tokens = max(interval["tokens"], 1.0)
        return TrainRecord(
            step=progress.step,
            epoch=progress.epoch,
            loss=interval["loss"] / tokens,
            nll=interval["nll"] / tokens,
            ppl=perplexity(interval["nll"], int(tokens)),
            lr=lr,
            tokens_per_s=self.display.tokens_per_s(),
            tokens_seen=progress.tokens_seen,
            elapsed_s=round(self.clock.elapsed(), 3),
        )

    def should_stop(self) -> Decision:
        """What to do after this update, the same on every rank.

        Every rank must take the same branch (`save` and `validate` hold barriers) and use
        the same learning rate, so the decision is agreed on: clocks and signals differ
        between processes. Rank 0's clock and pace decide the time budget and the end the
        schedule heads for.
        """
        c, step = self.config, self.progress.step
        minutes = (time.monotonic() - self._last_save_time) / 60
        every = c.save_every_minutes
        timed = every > 0 and minutes >= every
        out_of_time, end = False, 0
        if self.budget is not None and self.distributed.is_main:
            due = 0.0
            if c.valid_every and step % c.valid_every == 0:
                due += self.pace.validation_s
            if timed or (c.save_every and step % c.save_every == 0):
                due += self.pace.save_s
            left = self.budget.updates_left(due_s=due)
            out_of_time, end = left == 0, min(self.fixed_end, step + left)
            if end < c.warmup_steps and self.pace.updates >= 10 and not self._warned_short:
                self._warned_short = True
                logger.warning(
                    "the time budget foresees %d updates, fewer than warmup_steps (%d): the "
                    "learning rate will not reach its peak; a shorter warm-up suits this budget",
                    end,
                    c.warmup_steps,
                )
        flags = [float(self.stop.requested), float(timed), float(out_of_time), float(end)]
        stop_now, timed, out_of_time, end = self.distributed.sum(flags, self.device)
        if self.budget is not None:
            self.schedule_end = int(end)
        if out_of_time:
            self._out_of_time()
        return Decision(stop_now > 0, timed > 0, out_of_time > 0, self.schedule_end)

    def _out_of_time(self) -> None:
        """The time budget has no room for another update (every rank agreed)."""
        self.out_of_time = True
        if not self.distributed.is_main:  # every rank says where it stops: the same update
            logger.info("rank %d: step %d is the last", self.distributed.rank, self.progress.step)
        elif self.budget is not None:
            logger.info(
                "time budget: %.1f s of %s spent; step %d is the last (the final validation "
                "and save: ~%.1f s)",
                self.clock.elapsed(),
                self.config.time_budget,
                self.progress.step,
                self.budget.final_s(),
            )

    def validate(self) -> bool:
        """Validate (rank 0) unless a stop request comes first; False if one did, on every
        rank. An abandoned validation logs nothing and leaves `best/` alone; one given up for
        the time budget's final save (rank 0's word) makes this update the last."""
        if self.valid_data is None:
            return True
        began = time.monotonic()
        if self.distributed.is_main:
            self._validate_on_main()
        self.distributed.barrier()
        # Rank 0 counted the validation; every rank must agree on an early stop.
        main = self.distributed.is_main
        count = self.progress.validations_since_best if main else 0
        timed_out = float(self._validation_out_of_time and main)
        flags = [float(self.stop.requested), float(count), timed_out]
        stopped, count, timed_out = self.distributed.sum(flags, self.device)
        self.progress.validations_since_best = int(count)
        if timed_out:
            self._validation_out_of_time = True
            self.out_of_time = True
        elif not stopped:
            self.pace.last_validation = time.monotonic() - began
        return stopped == 0

    def _validate_on_main(self) -> None:
        assert self.valid_data is not None
        c, step, progress = self.config, self.progress.step, self.progress

        def give_up() -> bool:
            if self.stop.requested:
                return True
            if self.budget is not None and self.budget.must_save_now():
                self._validation_out_of_time = True
                return True
            return False

        def measure() -> dict[str, Any] | None:
            return validation_metrics(
                self.model,
                self.tokenizer,
                self.valid_data,
                bleu_files=(c.valid_tsv, c.valid_src, c.valid_tgt) if c.valid_bleu else None,
                max_tokens=c.max_tokens,
                device=self.device,
                label_smoothing=c.label_smoothing,
                bf16=self.bf16,
                should_stop=give_up,
            )

        valid = measure()
        if valid is not None and self.average is not None:
            with self.average.applied():
                averaged = measure()
            if averaged is None:
                valid = None
            else:
                valid.update(averaged_fields(averaged))
                valid["weights"] = better_weights(valid, c.patience_metric)
        if valid is None:
            why = (
                "the time budget's final save"
                if self._validation_out_of_time
                else "the stop request"
            )
            logger.warning("step %d: validation abandoned for %s", step, why)
            return
        record = self.last_valid = ValidRecord(step=step, **valid)
        self.log.write(record)
        if record.weights is not None:
            progress.weights, progress.weights_chosen_at = record.weights, step
        improved = self.early_stopping.observe(progress, record)
        more = "" if record.valid_bleu is None else f", BLEU {record.valid_bleu:.2f}"
        if record.valid_ema_ppl is not None:
            more += f"; average: ppl {record.valid_ema_ppl:.2f}"
            if record.valid_ema_bleu is not None:
                more += f", BLEU {record.valid_ema_bleu:.2f}"
            more += f" ({WEIGHTS_NAMES[record.weights or 'raw']} better)"
        if c.patience and not improved:
            more += f"; not better for {progress.validations_since_best}/{c.patience}"
        logger.info(
            "step %d: valid loss %.4f, ppl %.2f%s", step, record.valid_loss, record.valid_ppl, more
        )
        if improved:
            self._save_model_dir("best", {**self._metadata(), **record.metrics()})

    def save(self) -> None:
        """A checkpoint of this update, and `model/` (rank 0); every rank must call it."""
        began = time.monotonic()
        self.progress.elapsed_s = self.clock.elapsed()
        self.progress.schedule_end = self.schedule_end if self.budget is not None else 0
        rng = self.distributed.gather(ckpt.capture_rng())  # a collective: every rank takes part
        if self.distributed.is_main:
            state = ckpt.TrainingState(
                optimizer=self.optimizer.state_dict(),
                progress=self.progress,
                rng=rng,
                world_size=self.distributed.world_size,
                accumulate=self.accumulate,
                ema=self.average.state_dict() if self.average is not None else None,
            )
            path = ckpt.save_checkpoint(
                self.run_dir,
                self.model,
                step=self.progress.step,
                training_state=state,
                tokenizer_file=self.tokenizer.model_file,
                metadata=self._metadata(with_step=False),
                keep_last=self.config.keep_last,
            )
            self._save_model_dir("model", self._metadata())
            logger.info("saved %s", path)
        self.distributed.barrier()
        self._last_save_time = time.monotonic()
        self.pace.last_save = self._last_save_time - began

    def _metadata(self, with_step: bool = True) -> dict[str, Any]:
        languages = finetune.run_languages(self.config, self.init)
        return {**languages, "step": self.progress.step} if with_step else languages

    def _save_model_dir(self, name: str, metadata: dict[str, Any]) -> None:
        """`name`/ (model/ or best/) with the weights the run chose: its own, or with
        `ema_decay` the average where that validated better (`metadata` says which)."""
        tokenizer_file = self.tokenizer.model_file
        path = self.run_dir / name
        if self.average is None:
            save_model_dir(path, self.model, tokenizer_file=tokenizer_file, metadata=metadata)
            return
        weights = self.progress.weights
        held = self.average.applied() if weights == "ema" else contextlib.nullcontext()
        with held:
            metadata = {**metadata, "weights": weights}
            save_model_dir(path, self.model, tokenizer_file=tokenizer_file, metadata=metadata)
