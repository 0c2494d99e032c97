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
   `patience`, the run ends once validation stops improving (aiayn.train.stopping).

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
)
from aiayn.config import TrainConfig
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
from aiayn.optim import build_optimizer
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
from aiayn.train.distributed import Distributed, device_type, init_distributed
from aiayn.train.runlog import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsLog,
    TensorBoardLog,
    TrainingDisplay,
    TrainRecord,
    ValidRecord,
    truncate_metrics,
)
from aiayn.train.stopping import EarlyStopping, StopFlag
from aiayn.train.update import UpdateStats, optimizer_update, uses_bf16, uses_onednn
from aiayn.train.validation import validation_metrics

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
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


# -- the job: `train`, and the `Trainer` it runs ---------------------------------------------


def train(config: TrainConfig, *, resume: bool = False) -> TrainResult:
    """Run (or continue, with `resume`) the training job described by `config`."""
    distributed, device = init_distributed(config.device)
    trainer: Trainer | None = None
    try:
        with contextlib.ExitStack() as held:  # the run directory's lock, while training
            trainer = Trainer(config, resume=resume, distributed=distributed, device=device)
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
    bf16_on_cpu = on_cpu and uses_bf16(
        torch.device("cpu"), bf16=config.bf16, cpu_bf16=config.cpu_bf16
    )
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
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool,
        distributed: Distributed,
        device: torch.device,
    ) -> None:
        self.config = config
        self.resume_requested = resume
        self.distributed = distributed
        self.device = device
        self.bf16 = uses_bf16(device, bf16=config.bf16, cpu_bf16=config.cpu_bf16)
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
        if self.onednn:
            wrong = onednn_products_wrong(self.model)
            if wrong is not None:
                raise ValueError(
                    f"--onednn cannot train correctly on this CPU: {wrong}; train without --onednn"
                )
        if self.distributed.rank > 0:
            # Independent dropout masks on every rank; rank 0 keeps the single-process stream.
            torch.manual_seed(self.config.seed + self.distributed.rank)
        betas = (self.config.adam_beta1, self.config.adam_beta2)
        self.optimizer = build_optimizer(self.model, betas=betas, eps=self.config.adam_eps)
        self._resume_or_start()
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

    def _wrap_model(self) -> nn.Module:
        """The model that updates run through: compiled and/or under DDP when asked."""
        if self.bf16 and self.device.type == "cpu" and not native_bf16_cpu():
            logger.warning("cpu_bf16: this CPU has no native bf16 arithmetic; steps will be slower")
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
        if self.distributed.is_main:
            logger.info(
                "model: %s parameters, %d train pairs, %d device(s) × %d batch(es) of ≤ %d "
                "tokens per update, on %s",
                f"{sum(p.numel() for p in self.model.parameters()):,}",
                len(self.train_data),
                self.distributed.world_size,
                self.accumulate,
                self.config.max_tokens,
                self.device,
            )

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train until `max_steps` (or `max_epochs`), a stop request or an early stop; then
        validate and save. A stop request skips or abandons the final validation (resuming
        makes it up), an early stop has just validated; the last update is saved either way."""
        c, progress = self.config, self.progress
        self.display.open(
            bar=self.distributed.is_main and c.progress, total=c.max_steps, initial=progress.step
        )
        interrupted = early_stopped = False
        with self.stop:  # also around the final save: a signal cannot cut it in half
            while progress.step < c.max_steps and not interrupted:
                if c.max_epochs and progress.epoch > c.max_epochs:
                    break
                early_stopped = self.early_stopping.exhausted(progress)
                if early_stopped:
                    break
                interrupted = self._run_epoch()
            self.display.close()
            if not interrupted:
                interrupted = not early_stopped and not self.validate()
                self.save()
        if interrupted:
            logger.warning("stopped at step %d; continue with --resume", progress.step)
        elif early_stopped and self.distributed.is_main:
            logger.info("early stop: %s", self.early_stopping.describe(progress))
        return TrainResult(
            self.run_dir,
            self.run_dir / "model",
            progress.step,
            interrupted,
            self.last_valid.metrics() if self.last_valid else None,
            self.stop.signum if interrupted else None,
            early_stopped,
        )

    def _run_epoch(self) -> bool:
        """The rest of the current epoch; True if a stop request ended it."""
        c, progress = self.config, self.progress
        updates = epoch_updates(
            self.train_data.src_lengths,
            self.train_data.tgt_lengths,
            max_tokens=c.max_tokens,
            seed=c.seed,
            epoch=progress.epoch,
            accumulate=self.accumulate,
            rank=self.distributed.rank,
            world_size=self.distributed.world_size,
        )
        if not updates:
            raise TrainingError(
                f"an epoch has no batches for {self.distributed.world_size} process(es): the "
                "training set is too small for this many processes; use fewer or more data"
            )
        for group in updates[progress.position :]:
            self._log_update(self.update(group))
            stop_now, timed = self.should_stop()
            done = progress.step >= c.max_steps
            if c.valid_every and progress.step % c.valid_every == 0 and not done and not stop_now:
                stop_now = not self.validate()  # a stop during validation: save now
                if self.early_stopping.exhausted(progress) and not stop_now:
                    return False  # `run` saves this update
            periodic = c.save_every and progress.step % c.save_every == 0
            if (periodic or timed or stop_now) and not done:
                self.save()
            if done:
                return False  # the final validation and save follow the loop
            if stop_now:
                return True
        progress.epoch += 1
        progress.position = 0
        return False

    def update(self, group: list[np.ndarray]) -> UpdateStats:
        """One optimizer update over the batches of `group`; advances `progress`."""
        c, progress = self.config, self.progress
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
        )
        progress.count_update(stats.loss, stats.nll, stats.tokens)
        self.display.count(stats.tokens)
        return stats

    def _log_update(self, stats: UpdateStats) -> None:
        """A metrics record every `log_every` updates (and at the last); the progress bar."""
        progress = self.progress
        if progress.step % self.config.log_every == 0 or progress.step == self.config.max_steps:
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
        )

    def should_stop(self) -> tuple[bool, bool]:
        """(stop now, a timed save is due), the same on every rank.

        Every rank must take the same branch (`save` and `validate` hold barriers), so the
        flags are agreed on: clocks and signals differ between processes.
        """
        minutes = (time.monotonic() - self._last_save_time) / 60
        every = self.config.save_every_minutes
        timed = every > 0 and minutes >= every
        flags = self.distributed.sum([float(self.stop.requested), float(timed)], self.device)
        stop_now, timed = (flag > 0 for flag in flags)
        return stop_now, timed

    def validate(self) -> bool:
        """Validate (rank 0) unless a stop request comes first; False if one did, on every
        rank. An abandoned validation logs nothing and leaves `best/` alone."""
        if self.valid_data is None:
            return True
        if self.distributed.is_main:
            self._validate_on_main()
        self.distributed.barrier()
        # Rank 0 counted the validation; every rank must agree on an early stop.
        count = self.progress.validations_since_best if self.distributed.is_main else 0
        flags = self.distributed.sum([float(self.stop.requested), float(count)], self.device)
        self.progress.validations_since_best = int(flags[1])
        return flags[0] == 0

    def _validate_on_main(self) -> None:
        assert self.valid_data is not None
        c, step = self.config, self.progress.step
        valid = validation_metrics(
            self.model,
            self.tokenizer,
            self.valid_data,
            bleu_files=(c.valid_tsv, c.valid_src, c.valid_tgt) if c.valid_bleu else None,
            max_tokens=c.max_tokens,
            device=self.device,
            label_smoothing=c.label_smoothing,
            bf16=self.bf16,
            should_stop=lambda: self.stop.requested,
        )
        if valid is None:
            logger.warning("step %d: validation abandoned on the stop request", step)
            return
        record = self.last_valid = ValidRecord(step=step, **valid)
        self.log.write(record)
        improved = self.early_stopping.observe(self.progress, record)
        more = "" if record.valid_bleu is None else f", BLEU {record.valid_bleu:.2f}"
        if c.patience and not improved:
            more += f"; not better for {self.progress.validations_since_best}/{c.patience}"
        logger.info(
            "step %d: valid loss %.4f, ppl %.2f%s", step, record.valid_loss, record.valid_ppl, more
        )
        if improved:
            self._save_model_dir("best", {**self._metadata(), **record.metrics()})

    def save(self) -> None:
        """A checkpoint of this update, and `model/` (rank 0); every rank must call it."""
        rng = self.distributed.gather(ckpt.capture_rng())  # a collective: every rank takes part
        if self.distributed.is_main:
            state = ckpt.TrainingState(
                optimizer=self.optimizer.state_dict(),
                progress=self.progress,
                rng=rng,
                world_size=self.distributed.world_size,
                accumulate=self.accumulate,
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

    def _metadata(self, with_step: bool = True) -> dict[str, Any]:
        languages = finetune.run_languages(self.config, self.init)
        return {**languages, "step": self.progress.step} if with_step else languages

    def _save_model_dir(self, name: str, metadata: dict[str, Any]) -> None:
        tokenizer_file = self.tokenizer.model_file
        save_model_dir(
            self.run_dir / name, self.model, tokenizer_file=tokenizer_file, metadata=metadata
        )
