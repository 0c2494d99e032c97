"""Training for translation (§5): token-bucketed batches, Adam with Eq. 3, label smoothing.

One function, `train`, runs a whole job from a `TrainConfig`:

1. the run directory (resolved config, tokenizer, binarised data cache, metrics, checkpoints),
   locked against a second trainer while this one runs (aiayn.runlock);
2. a joint SentencePiece vocabulary, trained once (§5.1);
3. batches of about `max_tokens` tokens, grouped by length, shuffled per epoch from the seed;
4. updates that accumulate batches and normalise by the true number of target tokens, so one
   process with `accumulate=k` and k data-parallel processes compute the same update;
5. validation, checkpoints that resume exactly (weights, optimizer, step, RNG, data position),
   a `model/` directory that inference loads with no flags and a `best/` one;
6. SIGINT/SIGTERM finish the current update, save and exit.

Multi-GPU / multi-node: launch with `torchrun ... -m aiayn train ...`; every rank takes its
share of the batches (DDP over NCCL on GPUs, gloo on CPUs) and rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from aiayn import checkpoint as ckpt
from aiayn.acceleration import maybe_compile, native_bf16_cpu
from aiayn.batching import collate, make_batches, shard_batches
from aiayn.config import TrainConfig
from aiayn.data import (
    ParallelDataset,
    check_corpus_files,
    load_or_build,
    read_parallel,
    read_tsv,
)
from aiayn.distributed import Distributed, init_distributed
from aiayn.loss import label_smoothed_loss, perplexity
from aiayn.model import Transformer
from aiayn.optim import build_optimizer, learning_rate, set_learning_rate
from aiayn.runlock import hold_run_lock
from aiayn.runlog import METRICS_FILE, MetricsLog, truncate_metrics
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot start or continue (the message says why and what to do)."""


# -- training state -------------------------------------------------------------------------


def _all_rng_states(ctx: Distributed) -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (each rank draws its own dropout masks)."""
    states = ckpt.capture_rng()
    if not ctx.enabled:
        return [states]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, states)
    return gathered


# -- the run directory ----------------------------------------------------------------------


def _prepare_run_dir(
    config: TrainConfig, resume: bool, ctx: Distributed, held: contextlib.ExitStack
) -> Path:
    """Create and lock the run directory (rank 0 alone: the ranks of one run share it).

    The lock comes before anything is written and before the checkpoint check, so that a
    second trainer is told who is in the way and changes nothing.
    """
    run_dir = Path(config.out_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        held.enter_context(hold_run_lock(run_dir, lambda: _refuse_existing_run(run_dir, resume)))
    ctx.barrier()
    return run_dir


def _refuse_existing_run(run_dir: Path, resume: bool) -> None:
    if ckpt.list_checkpoints(run_dir) and not resume:
        raise TrainingError(
            f"{run_dir} already holds checkpoints; pass --resume to continue that run or "
            "choose another --out-dir (nothing was overwritten)"
        )


def _check_inputs(config: TrainConfig) -> None:
    """What can be checked of the inputs without reading them whole, before the run directory
    is touched: the corpus files (missing, directories, UTF-16) and a given tokenizer."""
    files = (config.src, config.tgt, config.tsv, config.valid_src, config.valid_tgt)
    check_corpus_files(*(Path(name) for name in (*files, config.valid_tsv) if name))
    if config.tokenizer:
        source = Path(config.tokenizer)
        if not source.is_file():
            raise TrainingError(f"tokenizer not found: {source}")
        pieces = Tokenizer.load(source).vocab_size
        if pieces != config.vocab_size:
            # The model's vocabulary is the tokenizer's: a silent mismatch would train another
            # model than train_config.yaml records.
            raise TrainingError(
                f"tokenizer {source} has {pieces} pieces but vocab_size is "
                f"{config.vocab_size}; set vocab_size to {pieces} to use it"
            )


def _write_config(config: TrainConfig, run_dir: Path) -> None:
    """Record the resolved config; only once the run starts, so that a refused `--resume`
    does not leave a config in the directory that its checkpoints do not match."""
    text = yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)
    (run_dir / "train_config.yaml").write_text(text, encoding="utf-8")


TOKENIZER_RECORD = "tokenizer.json"


def _tokenizer_recipe(config: TrainConfig) -> dict[str, Any]:
    """What the run's vocabulary was made from; a fresh run with other settings makes a new one."""
    if config.tokenizer:
        return {"copied_from": str(Path(config.tokenizer).resolve())}
    files = [config.tsv] if config.tsv else [config.src, config.tgt]
    return {
        "vocab_size": config.vocab_size,
        "seed": config.seed,
        "files": [[str(Path(f).resolve()), Path(f).stat().st_size] for f in files],
    }


def _prepare_tokenizer(
    config: TrainConfig, run_dir: Path, ctx: Distributed, resume: bool
) -> Tokenizer:
    """The joint vocabulary: reuse the run's, copy a given one, or train one (§5.1).

    A resumed run always keeps its vocabulary (its weights depend on it). A fresh run reuses one
    left in the run directory only if it was made from the same settings and files.
    """
    model_file = run_dir / ckpt.TOKENIZER_FILE
    record = run_dir / TOKENIZER_RECORD
    if ctx.is_main and model_file.exists() and not (resume and ckpt.list_checkpoints(run_dir)):
        saved = json.loads(record.read_text()) if record.is_file() else None
        if saved != _tokenizer_recipe(config):
            logger.info("the vocabulary in %s was made from other settings: remaking it", run_dir)
            model_file.unlink()
    if ctx.is_main and not model_file.exists():
        if config.tokenizer:
            source = Path(config.tokenizer)
            if not source.is_file():
                raise TrainingError(f"tokenizer not found: {source}")
            Tokenizer.load(source)  # validate before copying
            shutil.copyfile(source, model_file)
        else:
            # A misaligned or undecodable corpus must fail before BPE training, not after it:
            # else the error costs minutes, and a vocabulary learned from the bad files stays
            # in the run directory, where the next run would reuse it. (A TSV corpus is
            # checked by the one pass that splits its columns, below.)
            logger.info("training a joint BPE vocabulary of %d pieces", config.vocab_size)
            with tempfile.TemporaryDirectory(dir=run_dir) as tmp:
                if config.tsv:  # SentencePiece reads lines: give it the two columns, not tabs
                    files = [Path(tmp) / "src.txt", Path(tmp) / "tgt.txt"]
                    with (
                        open(files[0], "w", encoding="utf-8") as src,
                        open(files[1], "w", encoding="utf-8") as tgt,
                    ):
                        for source, target in read_tsv(Path(config.tsv)):
                            src.write(source + "\n")
                            tgt.write(target + "\n")
                else:
                    _check_training_text(config)
                    files = [Path(config.src), Path(config.tgt)]
                Tokenizer.train(files, model_file, vocab_size=config.vocab_size, seed=config.seed)
        record.write_text(json.dumps(_tokenizer_recipe(config), indent=2) + "\n")
    ctx.barrier()
    return Tokenizer.load(model_file)


def _check_training_text(config: TrainConfig) -> None:
    """Read the training files once: line counts and UTF-8 (raises DataError, naming the file)."""
    for _ in read_parallel(Path(config.src), Path(config.tgt)):
        pass


def _load_data(
    config: TrainConfig, tokenizer: Tokenizer, run_dir: Path, ctx: Distributed
) -> tuple[ParallelDataset, ParallelDataset | None]:
    """Binarise once on rank 0 (cached by content), then every rank opens the memmaps."""

    def build(src: str | None, tgt: str | None, tsv: str | None, name: str) -> ParallelDataset:
        dataset, stats = load_or_build(
            Path(src) if src else None,
            Path(tgt) if tgt else None,
            Path(tsv) if tsv else None,
            tokenizer,
            run_dir / "data" / name,
            max_len=config.max_len,
            max_ratio=config.max_ratio or None,
        )
        if ctx.is_main:
            logger.info("%s data: %s", name, stats)
        return dataset

    def both() -> tuple[ParallelDataset, ParallelDataset | None]:
        train = build(config.src, config.tgt, config.tsv, "train")
        valid = None
        if config.valid_tsv or config.valid_src:
            valid = build(config.valid_src, config.valid_tgt, config.valid_tsv, "valid")
        return train, valid

    if ctx.is_main:
        result = both()
        ctx.barrier()
        return result
    ctx.barrier()
    return both()


# -- one update -----------------------------------------------------------------------------


def uses_bf16(device: torch.device, config: TrainConfig) -> bool:
    """bf16 autocast: on CUDA unless `bf16` is off; on a CPU only with `cpu_bf16` (opt-in)."""
    if device.type == "cuda":
        return config.bf16
    return device.type == "cpu" and config.cpu_bf16


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """Mixed precision: matrix products in bf16, weights, optimizer and loss in float32."""
    if bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: ParallelDataset,
    group: list[np.ndarray],
    *,
    step: int,
    config: TrainConfig,
    d_model: int,
    device: torch.device,
    ctx: Distributed,
) -> tuple[float, float, int, float]:
    """One optimizer update over the batches in `group` (gradient accumulation).

    The loss of every batch is divided by the number of target tokens in the whole update
    across all ranks, and multiplied by the world size because DDP averages gradients: the
    update is the same however the tokens are split over batches and processes.

    Returns:
        Summed label-smoothed loss, summed NLL, target tokens (all ranks), learning rate.
    """
    model.train()
    batches = [
        collate([dataset[int(i)] for i in indices], pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID)
        for indices in group
    ]
    local_tokens = sum(b.n_tgt_tokens for b in batches)
    (n_tokens,) = ctx.sum([float(local_tokens)], device)
    sums_per_batch = []
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if last or not ctx.enabled else model.no_sync()
        with sync:
            with _autocast(device, uses_bf16(device, config)):
                logits = model(batch.src, batch.tgt_in)
            sums = label_smoothed_loss(
                logits, batch.tgt_out, epsilon=config.label_smoothing, pad_id=PAD_ID
            )
            (sums.loss * (ctx.world_size / n_tokens)).backward()
        sums_per_batch.append(torch.stack([sums.loss.detach(), sums.nll]))
    lr = learning_rate(
        step, d_model=d_model, warmup_steps=config.warmup_steps, scale=config.lr_scale
    )
    set_learning_rate(optimizer, lr)
    if config.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # One device-to-host copy per update (not per batch); summed in float64 as before.
    local_sums = torch.stack(sums_per_batch).double().sum(dim=0).tolist()
    loss_sum, nll_sum = ctx.sum(local_sums, device)
    return loss_sum, nll_sum, int(n_tokens), lr


@torch.no_grad()
def validate(
    model: nn.Module,
    dataset: ParallelDataset,
    *,
    max_tokens: int,
    device: torch.device,
    label_smoothing: float,
    bf16: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, float] | None:
    """Loss, NLL per token and perplexity on a validation set (eval mode, no dropout).

    Returns None, abandoning the pass, as soon as `should_stop()` says so between batches: a
    real dev set takes longer than a scheduler waits between SIGTERM and SIGKILL.
    """
    model.eval()
    batches = make_batches(
        dataset.src_lengths,
        dataset.tgt_lengths,
        max_tokens=max_tokens,
        seed=0,
        epoch=0,
        shuffle=False,
    )
    loss = nll = 0.0
    tokens = 0
    for indices in batches:
        if should_stop():
            return None
        batch = collate(
            [dataset[int(i)] for i in indices], pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID
        ).to(device)
        with _autocast(device, bf16):
            logits = model(batch.src, batch.tgt_in)
        sums = label_smoothed_loss(logits, batch.tgt_out, epsilon=label_smoothing, pad_id=PAD_ID)
        loss += float(sums.loss)
        nll += float(sums.nll)
        tokens += sums.n_tokens
    return {
        "valid_loss": loss / tokens,
        "valid_nll": nll / tokens,
        "valid_ppl": perplexity(nll, tokens),
        "valid_tokens": tokens,
    }


def validation_bleu(
    model: nn.Module,
    tokenizer: Tokenizer,
    config: TrainConfig,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any] | None:
    """Decode the validation sources with the paper's beam search (§6.1) and score them with
    sacreBLEU, through the same code as `aiayn evaluate`.

    The sources go to the translator longest first, about one beam batch at a time (the
    batches it would make itself from the whole set), so that `should_stop()` is asked
    between batches; None when it said stop.
    """
    from aiayn.evaluation import score
    from aiayn.translator import Translator

    if config.valid_tsv:
        pairs = list(read_tsv(Path(config.valid_tsv)))
    else:
        pairs = list(read_parallel(Path(config.valid_src), Path(config.valid_tgt)))
    sources = [src for src, _ in pairs]
    translator = Translator.from_model(model, tokenizer, max_tokens=config.max_tokens)
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch(sources)]  # + EOS
    order = sorted(range(len(sources)), key=lambda i: -lengths[i])
    beam_size = 4
    hypotheses = [""] * len(sources)
    start = 0
    while start < len(order):
        if should_stop():
            return None
        per_batch = max(1, config.max_tokens // (beam_size * lengths[order[start]]))
        chunk = order[start : start + per_batch]
        results = translator.translate(
            [sources[i] for i in chunk], beam_size=beam_size, length_penalty=0.6
        )
        for i, result in zip(chunk, results, strict=True):
            hypotheses[i] = result.text
        start += len(chunk)
    scores = score(hypotheses, [[tgt for _, tgt in pairs]])
    return {
        "valid_bleu": scores.bleu,
        "valid_chrf": scores.chrf,
        "bleu_signature": scores.bleu_signature,
    }


# -- the loop -------------------------------------------------------------------------------


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves and exits after the current update, or
    abandons a validation under way."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not in the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum
        logger.warning(
            "received %s: saving a checkpoint after this update", signal.strsignal(signum)
        )

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path
    step: int
    interrupted: bool
    last_valid: dict[str, float] | None
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM)


def _updates(batches: list[np.ndarray], accumulate: int) -> list[list[np.ndarray]]:
    return [batches[i : i + accumulate] for i in range(0, len(batches), accumulate)]


def _epoch_updates(
    dataset: ParallelDataset, config: TrainConfig, epoch: int, accumulate: int, ctx: Distributed
) -> list[list[np.ndarray]]:
    batches = make_batches(
        dataset.src_lengths,
        dataset.tgt_lengths,
        max_tokens=config.max_tokens,
        seed=config.seed,
        epoch=epoch,
    )
    return _updates(shard_batches(batches, ctx.rank, ctx.world_size), accumulate)


def _accumulation(config: TrainConfig, world_size: int) -> int:
    if config.tokens_per_update > 0:
        return max(1, math.ceil(config.tokens_per_update / (config.max_tokens * world_size)))
    return config.accumulate


def train(config: TrainConfig, *, resume: bool = False) -> TrainResult:
    """Run (or continue, with `resume`) the training job described by `config`."""
    ctx, device = init_distributed(config.device)
    try:
        with contextlib.ExitStack() as held:  # the run directory's lock, while training
            return _train(config, resume, ctx, device, held)
    except (ckpt.DiskFullError, OSError) as error:
        if isinstance(error, ckpt.DiskFullError):
            message = str(error)
        elif error.errno in (errno.ENOSPC, errno.EDQUOT):
            where = error.filename or config.out_dir  # a failed write() names no file
            message = f"no space left on device writing {where}: {error.strerror}"
        else:
            raise
        # What matters now is where the run can continue from once space is freed.
        last = ckpt.list_checkpoints(config.out_dir)[-1:]
        raise TrainingError(
            f"{message}; last good checkpoint: {last[0] if last else 'none'}"
        ) from None
    finally:
        if ctx.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    config: TrainConfig,
    resume: bool,
    ctx: Distributed,
    device: torch.device,
    held: contextlib.ExitStack,
) -> TrainResult:
    if config.threads:
        torch.set_num_threads(config.threads)
    _check_inputs(config)
    run_dir = _prepare_run_dir(config, resume, ctx, held)
    if ctx.is_main:
        ckpt.remove_debris(run_dir)  # before anything in the run directory is read
    tokenizer = _prepare_tokenizer(config, run_dir, ctx, resume)
    train_data, valid_data = _load_data(config, tokenizer, run_dir, ctx)
    model_config = config.model_config(tokenizer.vocab_size, pad_id=PAD_ID)

    torch.manual_seed(config.seed)
    model = Transformer(model_config).to(device)
    if ctx.rank > 0:
        # Independent dropout masks on every rank; rank 0 keeps the single-process stream.
        torch.manual_seed(config.seed + ctx.rank)
    accumulate = _accumulation(config, ctx.world_size)
    optimizer = build_optimizer(
        model, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps
    )
    progress = ckpt.Progress()
    metrics_path = run_dir / METRICS_FILE
    latest = [found] if resume and (found := ckpt.latest_checkpoint(run_dir)) else []
    if latest:
        try:
            progress = _resume(latest[0], model, optimizer, model_config, device, ctx, accumulate)
        except ckpt.CorruptCheckpointError as error:
            raise TrainingError(
                f"{error}; {_earlier_checkpoint_hint(run_dir, latest[0])}"
            ) from None
        if ctx.is_main:
            truncate_metrics(metrics_path, progress.step)
            logger.info("resumed from %s at step %d", latest[0], progress.step)
    elif resume and ctx.is_main:
        logger.info("no checkpoint in %s yet: starting from scratch", run_dir)
    if ctx.is_main and not latest and metrics_path.exists():
        metrics_path.unlink()
    if ctx.is_main:
        _write_config(config, run_dir)
    ctx.barrier()

    if uses_bf16(device, config) and device.type == "cpu" and not native_bf16_cpu():
        logger.warning("cpu_bf16: this CPU has no native bf16 arithmetic; steps will be slower")
    train_model: nn.Module = model
    if config.compile:
        train_model = maybe_compile(train_model, device)
    if ctx.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        train_model = DistributedDataParallel(train_model, device_ids=device_ids)

    metadata = {"src_lang": config.src_lang, "tgt_lang": config.tgt_lang}
    n_params = sum(p.numel() for p in model.parameters())
    if ctx.is_main:
        logger.info(
            "model: %s parameters, %d train pairs, %d device(s) × %d batch(es) of ≤ %d tokens "
            "per update, on %s",
            f"{n_params:,}",
            len(train_data),
            ctx.world_size,
            accumulate,
            config.max_tokens,
            device,
        )
    log = MetricsLog(metrics_path, ctx.is_main)
    bar = _progress_bar(config, progress.step, ctx)
    last_save_time = time.monotonic()
    interval_start = time.monotonic()
    last_valid: dict[str, float] | None = None
    interrupted = False

    def save() -> None:
        nonlocal last_save_time
        rng_states = _all_rng_states(ctx)  # a collective: every rank takes part
        if ctx.is_main:
            state = ckpt.TrainingState(
                optimizer=optimizer.state_dict(),
                progress=progress,
                rng=rng_states,
                world_size=ctx.world_size,
                accumulate=accumulate,
            )
            path = ckpt.save_checkpoint(
                run_dir,
                model,
                step=progress.step,
                training_state=state,
                tokenizer_file=tokenizer.model_file,
                metadata=metadata,
                keep_last=config.keep_last,
            )
            ckpt.save_model_dir(
                run_dir / "model",
                model,
                tokenizer_file=tokenizer.model_file,
                metadata={**metadata, "step": progress.step},
            )
            logger.info("saved %s", path)
        ctx.barrier()
        last_save_time = time.monotonic()

    def run_validation(stop: _StopFlag) -> bool:
        """Validate (rank 0) unless a stop request comes first; False if one did, on every
        rank. An abandoned validation logs nothing and leaves `best/` alone."""
        if valid_data is None:
            return True
        if ctx.is_main:
            _validate(stop)
        ctx.barrier()
        (stopped,) = ctx.sum([float(stop.requested)], device)
        return stopped == 0

    def _validate(stop: _StopFlag) -> None:
        nonlocal last_valid
        valid = validate(
            model,
            valid_data,
            max_tokens=config.max_tokens,
            device=device,
            label_smoothing=config.label_smoothing,
            bf16=uses_bf16(device, config),
            should_stop=lambda: stop.requested,
        )
        if valid is not None and config.valid_bleu:
            bleu = validation_bleu(model, tokenizer, config, lambda: stop.requested)
            valid = None if bleu is None else {**valid, **bleu}
        if valid is None:
            logger.warning("step %d: validation abandoned on the stop request", progress.step)
            return
        last_valid = valid
        record = {"type": "valid", "step": progress.step, **last_valid}
        log.write(record)
        logger.info(
            "step %d: valid loss %.4f, ppl %.2f%s",
            progress.step,
            last_valid["valid_loss"],
            last_valid["valid_ppl"],
            f", BLEU {last_valid['valid_bleu']:.2f}" if "valid_bleu" in last_valid else "",
        )
        if last_valid["valid_nll"] < progress.best_valid_nll:
            progress.best_valid_nll = last_valid["valid_nll"]
            ckpt.save_model_dir(
                run_dir / "best",
                model,
                tokenizer_file=tokenizer.model_file,
                metadata={**metadata, "step": progress.step, **last_valid},
            )

    with _StopFlag() as stop:
        while progress.step < config.max_steps and not interrupted:
            if config.max_epochs and progress.epoch > config.max_epochs:
                break
            updates = _epoch_updates(train_data, config, progress.epoch, accumulate, ctx)
            if not updates:
                raise TrainingError(
                    f"an epoch has no batches for {ctx.world_size} process(es): the training "
                    "set is too small for this many processes; use fewer or more data"
                )
            for group in updates[progress.position :]:
                loss, nll, tokens, lr = _update(
                    train_model,
                    optimizer,
                    train_data,
                    group,
                    step=progress.step + 1,
                    config=config,
                    d_model=model_config.d_model,
                    device=device,
                    ctx=ctx,
                )
                progress.step += 1
                progress.position += 1
                progress.tokens_seen += tokens
                for key, value in (("loss", loss), ("nll", nll), ("tokens", tokens)):
                    progress.interval[key] += value
                progress.interval["updates"] += 1
                if progress.step % config.log_every == 0 or progress.step == config.max_steps:
                    elapsed = time.monotonic() - interval_start
                    record = _train_record(progress, lr, elapsed)
                    log.write(record)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{record['loss']:.3f}",
                            ppl=f"{record['ppl']:.1f}",
                            lr=f"{lr:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}",
                        )
                    elif ctx.is_main:
                        logger.info(
                            "step %d: loss %.4f ppl %.2f lr %.3g %.0f tok/s",
                            progress.step,
                            record["loss"],
                            record["ppl"],
                            lr,
                            record["tokens_per_s"],
                        )
                    progress.interval = ckpt.new_interval()
                    interval_start = time.monotonic()
                if bar is not None:
                    bar.update(1)
                minutes = (time.monotonic() - last_save_time) / 60
                timed = config.save_every_minutes > 0 and minutes >= config.save_every_minutes
                # Every rank must take the same branch (save() and validation hold barriers),
                # so the flags are agreed on: clocks and signals differ between processes.
                stop_now, timed = (
                    flag > 0 for flag in ctx.sum([float(stop.requested), float(timed)], device)
                )
                done = progress.step >= config.max_steps
                due = config.valid_every and progress.step % config.valid_every == 0
                if due and not done and not stop_now:
                    # A stop during validation abandons it: save now, not after one more update.
                    stop_now = not run_validation(stop)
                periodic = config.save_every and progress.step % config.save_every == 0
                if (periodic or timed or stop_now) and not done:
                    save()
                if done:
                    break  # the final validation and save follow the loop
                if stop_now:
                    interrupted = True
                    break
            else:
                progress.epoch += 1
                progress.position = 0
        if bar is not None:
            bar.close()
        if not interrupted:
            # A stop request skips or abandons the final validation (resuming makes it up);
            # the last update is saved either way. Still under the stop flag, so that a
            # signal here cannot kill the process halfway through the save.
            interrupted = not run_validation(stop)
            save()
    if interrupted:
        logger.warning("stopped at step %d; continue with --resume", progress.step)
    return TrainResult(
        run_dir,
        run_dir / "model",
        progress.step,
        interrupted,
        last_valid,
        stop.signum if interrupted else None,
    )


def _train_record(progress: ckpt.Progress, lr: float, elapsed: float) -> dict[str, Any]:
    interval = progress.interval
    tokens = max(interval["tokens"], 1.0)
    return {
        "type": "train",
        "step": progress.step,
        "epoch": progress.epoch,
        "loss": interval["loss"] / tokens,
        "nll": interval["nll"] / tokens,
        "ppl": perplexity(interval["nll"], int(tokens)),
        "lr": lr,
        "tokens_per_s": interval["tokens"] / max(elapsed, 1e-9),
        "tokens_seen": progress.tokens_seen,
    }


def _earlier_checkpoint_hint(run_dir: Path, corrupt: Path) -> str:
    """How to continue from the checkpoint before a corrupt one (the run has no other way)."""
    earlier = [path for path in ckpt.list_checkpoints(run_dir) if path != corrupt]
    if not earlier:
        return "there is no earlier checkpoint to resume from"
    return (
        f"to resume from the previous checkpoint {earlier[-1]}, move this one aside "
        f"(mv {corrupt} {corrupt}.corrupt) and run again with --resume"
    )


def _resume(
    checkpoint: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    model_config: Any,
    device: torch.device,
    ctx: Distributed,
    accumulate: int,
) -> ckpt.Progress:
    state = ckpt.load_training_state(checkpoint)  # verifies every file: corrupt comes first
    ckpt.check_same_architecture(checkpoint, model_config)
    ckpt.load_weights(model, checkpoint / ckpt.WEIGHTS_FILE)
    optimizer.load_state_dict(state.optimizer)
    saved_batches = state.world_size * state.accumulate
    if saved_batches != ctx.world_size * accumulate:
        # `position` counts updates, so it now points at different batches of the epoch.
        logger.warning(
            "%s was saved with %d process(es) × %d batch(es) per update, this run uses %d × %d: "
            "the rest of this epoch's batches will not be exactly those the run would have seen",
            checkpoint,
            state.world_size,
            state.accumulate,
            ctx.world_size,
            accumulate,
        )
    if ctx.rank < len(state.rng):
        ckpt.restore_rng(state.rng[ctx.rank])
    # else: a rank the checkpoint did not have keeps the stream `_train` seeded for it
    # (seed + rank), rather than drawing rank 0's dropout masks
    progress = state.progress
    model.to(device)
    return progress


def _progress_bar(config: TrainConfig, initial: int, ctx: Distributed) -> Any:
    if not (config.progress and ctx.is_main and sys.stderr.isatty()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.max_steps, initial=initial, unit="step", dynamic_ncols=True)
