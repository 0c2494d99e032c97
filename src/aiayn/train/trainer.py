"""Training for translation (§5): token-bucketed batches, Adam with Eq. 3, label smoothing.

`train` runs a whole job from a `TrainConfig` with a `Trainer`, whose parts follow the job:

1. `set_up`, in its own module (aiayn.train.setup), builds the parts of the run that
   `Trainer` receives (`RunParts`): the run directory (aiayn.train.rundir: locked against a
   second trainer, its settings kept on `--resume`), a joint SentencePiece vocabulary made
   once (§5.1), the binarised data, the model and Adam, restored from the last checkpoint on
   resume; with `init_from`, the model and its vocabulary come from a model directory
   (aiayn.train.finetune);
2. `Trainer.update`: one optimizer update (aiayn.train.update) over batches of about `max_tokens`
   tokens, grouped by length and shuffled per epoch from the seed, normalised by the true
   number of target tokens, so one process with `accumulate=k` and k data-parallel processes
   compute the same update;
3. `Trainer.validate` (aiayn.train.validation) and `Trainer.save`: checkpoints that resume exactly
   (weights, optimizer, step, RNG, data position: `checkpoint.TrainingState`), a `model/`
   directory that inference loads with no flags and a `best/` one, both with the lexical
   shortlist of the training data (aiayn.decode.shortlist), counted as the run starts;
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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from aiayn.acceleration import ONEDNN_KERNELS_FOR_BF16_TRAINING
from aiayn.config import TrainConfig
from aiayn.decode.shortlist import SHORTLIST_FILE, build_shortlist
from aiayn.loss import perplexity
from aiayn.model_dir import DiskFullError, save_model_dir
from aiayn.runtime import device_type
from aiayn.text.bpe_dropout import EpochPairs
from aiayn.text.corpus import ParallelDataset
from aiayn.train import checkpoint as ckpt
from aiayn.train import finetune, rundir
from aiayn.train.budget import MARGIN_S, MARGIN_S_DISTRIBUTED, Pace, RunClock, TimeBudget
from aiayn.train.distributed import init_distributed
from aiayn.train.ema import WEIGHTS_NAMES, averaged_fields, better_weights
from aiayn.train.runlog import (
    ModelRecord,
    TrainingDisplay,
    TrainRecord,
    ValidRecord,
)
from aiayn.train.setup import (
    RunParts,
    TrainingError,
    batch_shapes,
    epoch_pairs,
    rank_updates,
    set_up,
)
from aiayn.train.stopping import EarlyStopping, StopFlag
from aiayn.train.update import IntervalLossSums, UpdateStats, optimizer_update, uses_bf16
from aiayn.train.validation import validation_metrics

logger = logging.getLogger(__name__)


RUN_ESTIMATE_AFTER = 10
"""Measured updates after which `Trainer` estimates the run's length (`_warn_if_long`)."""
LONG_RUN_S = 86400.0
"""A run foreseen to take longer than this (a day) without a time budget is said so."""
SHORTLIST_PAIRS = 200_000
"""Training pairs the lexical shortlist is counted from as a run starts: all of a smaller
corpus, else this many spread evenly over it (a few seconds per 30,000 pairs). Counted before
the first update, not at the end, so that a time budget's final save has no more to do and every
save of model/ and best/ holds it."""


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
    with _run_rng_and_device(device):
        trainer: Trainer | None = None
        try:
            with contextlib.ExitStack() as held:  # the run directory's lock, while training
                # The trainer alone holds the parts (and DDP): see `finally`.
                trainer = Trainer(
                    set_up(
                        config, resume=resume, distributed=distributed, device=device, held=held
                    ),
                    started=started,
                )
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
                # Nothing else may hold DDP then: no local here keeps the `RunParts`.
                if trainer is not None:
                    trainer.release_model_wrapper()
                gc.collect()
                dist.destroy_process_group()


@contextlib.contextmanager
def _run_rng_and_device(device: torch.device) -> Iterator[None]:
    """The run's own RNG streams and CUDA device, and the caller's back afterwards.

    PyTorch draws the weights' initialisation and the dropout masks from the process's
    generators, so set-up seeds them (`seed`) and a resume restores them from the checkpoint;
    the run's kernels and collectives (NCCL's barrier) use CUDA's current device. A program
    that calls `train` finds its RNG (the CPU's, and the run's GPU's) and current GPU as they
    were (tests/test_runtime.py). Not the generators of a machine's other GPUs, which
    set-up's `torch.manual_seed` (and a resume's restore) set too: forking them would start
    CUDA on every GPU of the machine, for a run on one GPU or on the CPU.
    """
    on_cuda = device.type == "cuda"
    current = torch.cuda.device(device) if on_cuda else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[device] if on_cuda else []), current:
        yield


def _target_tokens(data: ParallelDataset | None) -> int:
    """Target tokens of a validation pass over `data`, end-of-sentence tokens included."""
    return 0 if data is None else int(data.tgt_lengths.sum()) + len(data)


def _peak_memory_gib(device: torch.device) -> float | None:
    """The most memory the tensors of this process took on `device` so far, in GiB, as CUDA's
    allocator counts it (it asks nothing of the GPU); None on other devices."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def _save_bytes(model: nn.Module, *, ema: bool) -> int:
    """About what a save writes: the float32 weights twice (checkpoint and model/), Adam's
    two moments, and with `ema` the average."""
    weights = sum(p.numel() for p in model.parameters()) * 4
    return weights * (4 + (1 if ema else 0))


def runtime_settings(config: TrainConfig) -> dict[str, Any]:
    """What a program that trains with `config` sets for its whole process, as
    `aiayn.runtime.configure`'s arguments (`aiayn train` applies them before `train`, which
    changes none of them): `threads`; for bf16 on a CPU, oneDNN's kernel cache
    (`ONEDNN_KERNELS_FOR_BF16_TRAINING`: peak memory); with `compile`, the fallback to eager
    execution where compilation fails at the first update; and freed memory kept for the next
    update's tensors (`aiayn.runtime.keep_freed_memory`: on two CPU cores the recipe's updates
    ran 1.02–1.21× faster, with 0.23 million page faults in 60 updates instead of 0.8–1.5
    million)."""
    on_cpu = device_type(config.device) == "cpu"
    bf16_on_cpu = on_cpu and uses_bf16(torch.device("cpu"), config.precision)
    return {
        "threads": config.threads,
        "onednn_kernels": ONEDNN_KERNELS_FOR_BF16_TRAINING if bf16_on_cpu else None,
        "compile_errors_fall_back": True if config.compile else None,
        "reuse_freed_memory": True,
    }


class Trainer:
    """One training job: the parts of the run, the state the loop shares, and the steps of
    the loop as methods.

    Built as torchtune's recipes are: `set_up` (aiayn.train.setup) writes (the run directory,
    vocabulary, data cache) and builds every part of the run (model, optimizer, resumed
    progress: `RunParts`, whose attributes `Trainer` takes as its own); `run` is then the
    loop, and every other method is one part of it.

    Attributes:
        config, distributed, device, bf16, onednn, accumulate, run_dir, init, tokenizer,
        train_data, valid_data, resegment, model_config, model, train_model, optimizer, average,
        progress, log, fixed_end: The parts of the run (`RunParts`).
        schedule_end: The last update the learning-rate schedule heads for (with a time
            budget, what the budget foresees; else `fixed_end`).
        clock: The run's wall time; `pace` what its updates, validations and saves cost;
            `budget` the time budget (None without one).
    """

    def __init__(self, parts: RunParts, *, started: float | None = None) -> None:
        """Every part of the run as set-up built it (aiayn.train.setup.set_up), and the loop's
        own state; `started` is when the run's time began in this process."""
        # The parts of the run (`RunParts`), as set up.
        self.config = config = parts.config
        self.distributed = parts.distributed
        self.device = parts.device
        self.bf16, self.onednn, self.accumulate = parts.bf16, parts.onednn, parts.accumulate
        self.shapes = batch_shapes(config)
        self.run_dir = parts.run_dir
        self.init = parts.init
        self.tokenizer = parts.tokenizer
        self.train_data, self.valid_data = parts.train_data, parts.valid_data
        self.resegment = parts.resegment
        self.model_config = parts.model_config
        self.model, self.train_model = parts.model, parts.train_model
        self.optimizer = parts.optimizer
        self.average = parts.average
        self.progress = parts.progress
        self.log = parts.log
        self.fixed_end, self.schedule_end = parts.fixed_end, parts.schedule_end
        # What the run costs: its time (the processes before this one included) and pace.
        started = time.monotonic() if started is None else started
        self.clock = RunClock(started, spent_before=self.progress.elapsed_s)
        self.pace = Pace(
            valid_tokens=_target_tokens(self.valid_data),
            validations=2 if config.ema_decay else 1,
            bleu=config.valid_bleu,
            save_bytes=_save_bytes(self.model, ema=bool(config.ema_decay)),
        )
        self.budget: TimeBudget | None = None
        if config.budget_seconds is not None:
            self.budget = TimeBudget(
                config.budget_seconds,
                self.clock,
                self.pace,
                valid_every=config.valid_every,
                save_every=config.save_every,
                save_every_minutes=config.save_every_minutes,
                exit_s=MARGIN_S_DISTRIBUTED if self.distributed.enabled else MARGIN_S,
            )
            if self.distributed.is_main:
                logger.info(
                    "time budget %s: %.1f s spent by the run so far",
                    config.time_budget,
                    self.clock.elapsed(),
                )
        # The loop's own state.
        self.last_valid: ValidRecord | None = None
        self.stop = StopFlag()
        self.early_stopping = EarlyStopping(config.patience, config.patience_metric)
        self._last_save_time = time.monotonic()
        self.display = TrainingDisplay(logger)
        self.loss_sums = IntervalLossSums()  # the open interval's, on the device
        self.out_of_time = False  # the budget ended the run (agreed on by every rank)
        self._validation_out_of_time = False  # rank 0 gave up a validation for the final save
        self._files: dict[str, bytes] = {}  # written into model/ and best/ beside the weights
        self._warned_short = False  # that the budget ends the run inside the warm-up

    def release_model_wrapper(self) -> None:
        """Drop the DDP / compile wrapper (and with it DDP's reducer); `model` stays."""
        self.train_model = self.model

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
        if self.distributed.is_main:
            self._files[SHORTLIST_FILE] = self._shortlist()
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

    def _run_epoch(self) -> bool:
        """The rest of the current epoch; True if a stop request ended it."""
        c, progress = self.config, self.progress
        data = epoch_pairs(self.train_data, self.resegment, progress.epoch)
        updates = rank_updates(
            data,
            c,
            progress.epoch,
            accumulate=self.accumulate,
            distributed=self.distributed,
        )
        if not updates:
            raise TrainingError(
                f"an epoch has no batches for {self.distributed.world_size} process(es): the "
                "training set is too small for this many processes; use fewer or more data"
            )
        for group in updates[progress.position :]:
            stats = self.update(group, data)
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

    def update(self, group: list[np.ndarray], data: ParallelDataset | EpochPairs) -> UpdateStats:
        """One optimizer update over the batches of `group` (indices into the epoch's pairs,
        `data`); advances `progress` and the average of the weights, and measures the pace."""
        c, progress = self.config, self.progress
        began = time.monotonic()
        stats = optimizer_update(
            self.train_model,
            self.optimizer,
            data,
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
            shapes=self.shapes,
        )
        progress.count_update(stats.tokens)
        self.loss_sums.add(stats.sums, progress.interval)
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
            self.loss_sums.settle(progress.interval)
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
            peak_memory_gib=_peak_memory_gib(self.device),
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
        self.loss_sums.settle(self.progress.interval)
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

    def _shortlist(self) -> bytes:
        """The lexical shortlist of the training data (`aiayn.decode.shortlist`), as the bytes
        of its file: from `SHORTLIST_PAIRS` pairs at most."""
        began = time.monotonic()
        data, c = self.train_data, self.model_config
        picked = np.unique(np.linspace(0, len(data) - 1, min(len(data), SHORTLIST_PAIRS)).round())
        shortlist = build_shortlist(
            (data[int(i)] for i in picked),
            src_vocab_size=c.src_vocab_size,
            tgt_vocab_size=c.tgt_vocab_size,
        )
        logger.info(
            "lexical shortlist of %d training pairs: %.1f s", len(picked), time.monotonic() - began
        )
        return shortlist.to_bytes()

    def _metadata(self, with_step: bool = True) -> dict[str, Any]:
        languages = finetune.run_languages(self.config, self.init)
        return {**languages, "step": self.progress.step} if with_step else languages

    def _save_model_dir(self, name: str, metadata: dict[str, Any]) -> None:
        """`name`/ (model/ or best/) with the weights the run chose: its own, or with
        `ema_decay` the average where that validated better (`metadata` says which)."""
        tokenizer_file = self.tokenizer.model_file
        path = self.run_dir / name
        files = self._files
        if self.average is None:
            save_model_dir(
                path, self.model, tokenizer_file=tokenizer_file, metadata=metadata, files=files
            )
            return
        weights = self.progress.weights
        held = self.average.applied() if weights == "ema" else contextlib.nullcontext()
        with held:
            metadata = {**metadata, "weights": weights}
            save_model_dir(
                path, self.model, tokenizer_file=tokenizer_file, metadata=metadata, files=files
            )
