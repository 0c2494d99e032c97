"""`aiayn train` against `fairseq-train`: the real training loops, same data, model, settings.

`make bench-train`. Both trainers run as the commands users run, in child processes, in
interleaved rounds (aiayn, fairseq, aiayn, fairseq, ...: noise from other processes hits both
alike), each for the same wall time (`--seconds`), and each is measured by its *own* log:

- aiayn: `tokens_per_s` of the "train" records of its `metrics.jsonl`, one per `--log-every`
  updates: the interval's target tokens (non-padding, EOS included) / its wall time, batching
  and collation included;
- fairseq: `wps` of its `--log-format json` "train_inner" lines, one per `--log-interval`
  updates: `metrics.log_speed("wps", ntokens)` (`FairseqTask.reduce_metrics`, fairseq 0.12.2),
  the same target tokens over the time since the previous line. (The meter is created by the
  first update, whose tokens it does not count: the first line's `wps` is low.)

The first interval of every run is left out (the first steps' one-time costs), and so is one
logged after the window closed; the rest are pooled per trainer: median and range, the ratio
aiayn / fairseq of the medians, the updates each run logged, and the peak resident memory
(`VmHWM` of the trainer process just before it is stopped; fairseq's data-loader worker
separately). A run is stopped at the end of its window with SIGTERM to its process group (aiayn
then saves a checkpoint and exits, outside the window), or ends by itself at `--max-updates`.

The same work on both sides, by construction (the record's notes give the figures):

- **Data.** aiayn's joint BPE vocabulary is trained once from the recipe
  (`Tokenizer.train_or_reuse`) and given to aiayn as `--tokenizer`; the corpus is binarised
  once through aiayn's cache, copied into each aiayn run (no side prepares data in its window).
  fairseq gets exactly the cached pairs as piece strings and aiayn's vocabulary as its
  dictionary (`fairseq_preprocess`, which checks that both count the same tokens).
- **Model.** The recipe's `ModelConfig` as fairseq `transformer` flags (`fairseq_model_flags`;
  fairseq's parameter count holds unused copies, `fairseq_inference_copies`). fairseq's
  LayerNorm epsilon is 1e-5 (aiayn's 1e-6): no effect on speed.
- **Training.** The recipe's batches, accumulation, loss, Adam and Eq. 3 as fairseq flags
  (`fairseq_training_flags`; fairseq's first update runs at lr 0, aiayn's at peak/warmup: no
  effect on speed). The recipe's `time_budget` and `schedule` are set aside (aiayn gets
  `--time-budget none --schedule inverse_sqrt`), and both stop at `--max-updates`, else at the
  recipe's `max_steps`. No validation (fairseq still loads a valid split), no checkpoint within
  the window, the CPU, the same threads; fairseq keeps its one data-loader worker process
  (`--fairseq-workers`), aiayn collates in the training process.
- **Precision**, as each side's users train (not the same arithmetic): aiayn the recipe's own
  (`auto`: bf16 autocast on a CPU that computes bf16 natively, else float32; its row's name
  says which, `aiayn_trainer`), fairseq float32: fairseq 0.12's `--bf16` implies `--tpu` and
  stops on a CPU. `--with-other-precision` adds aiayn at the other one.

    python bench/train.py --data DATA --fairseq-bin FAIRSEQ_BIN    # ~16 min (2 × 2 × 210 s)
    python bench/train.py --data DATA --fairseq-bin FAIRSEQ_BIN --with-other-precision
    python bench/train.py --data DATA --variant onednn="--precision fp32 --onednn" \\
        --variant spin=OMP_WAIT_POLICY=ACTIVE                       # aiayn's settings beside
    python bench/train.py --data DATA --rounds 1 --seconds 60 --max-updates 3 --log-every 1 \\
        --no-record                                                  # a smoke run

DATA is a folder made by `aiayn prepare bible-en-es` (train.en, train.es; valid.* for fairseq's
valid split). The run appends one record to bench/results/train.jsonl (bench/runner.py).

fairseq is a tool here, never a dependency: without `--fairseq-bin` (a directory holding
`fairseq-preprocess` and `fairseq-train`, e.g. the venv made by an install script) its rows say
"not measured".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import runner
from aiayn.acceleration import native_bf16_cpu
from aiayn.config import ModelConfig, TrainConfig, load_yaml_config
from aiayn.optim import learning_rate
from aiayn.text.corpus import ParallelDataset, load_or_build, read_parallel
from aiayn.text.tokenizer import SPECIAL_PIECES, Tokenizer
from aiayn.train.runlog import read_metrics
from aiayn.train.update import uses_bf16

FAIRSEQ = "fairseq-train (float32)"
STOP_GRACE_S = 120  # after SIGTERM: aiayn finishes its update and saves

FAIRSEQ_INNER = re.compile(r"\| train_inner \| (\{.*\})\s*$")
FAIRSEQ_PARAMS = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
FAIRSEQ_PAIRS = re.compile(r"loaded ([\d,]+) examples from: \S*train\.")
FAIRSEQ_DICT = re.compile(r"\[(\S+)\] Dictionary: (\d+) types")
FAIRSEQ_UNK = re.compile(r"\[(\S+)\] (\S+): (\d+) sents, (\d+) tokens, ([\d.]+)% replaced")
AIAYN_CACHE = re.compile(r"(building|reusing) data cache")
MODEL_LINE = re.compile(r"model: ([\d,]+) parameters, (\d+) train pairs.* on (\S+)( in bf16)?$")


@dataclass
class Interval:
    """One logged interval of a run, as the trainer reported it."""

    updates: int
    tokens: float  # target tokens
    tokens_per_s: float


@dataclass
class Run:
    """One trainer's run in one round."""

    updates: int
    intervals: list[Interval]
    peak_rss_mib: float | None
    worker_rss_mib: float | None
    params: int | None
    pairs: int | None

    @property
    def steady(self) -> list[Interval]:
        return self.intervals[1:]


@dataclass
class Trainer:
    name: str
    system: str  # "aiayn" or "fairseq"
    precision: str | None = None  # aiayn's --precision; None: the recipe's own
    bf16: bool = False  # whether its updates compute in bf16
    flags: list[str] = field(default_factory=list)  # aiayn's, after the benchmark's own
    env: dict[str, str] = field(default_factory=dict)  # set in aiayn's environment
    missing: str | None = None
    runs: list[Run] = field(default_factory=list)

    def rates(self) -> list[float]:
        return [i.tokens_per_s for run in self.runs for i in run.steady]


def aiayn_trainer(precision: str | None, recipe_precision: str, native_bf16: bool) -> Trainer:
    """`aiayn train` at the recipe's precision (`precision` None: as users run it) or with
    `--precision PRECISION`, named by what its updates compute in on this CPU
    (`uses_bf16`): "aiayn train (bf16: native on this CPU)", "aiayn train (float32)"."""
    bf16 = uses_bf16(torch.device("cpu"), precision or recipe_precision)
    how = f"bf16: {'native' if native_bf16 else 'emulated'} on this CPU" if bf16 else "float32"
    command = "aiayn train" if precision is None else f"aiayn train --precision {precision}"
    return Trainer(f"{command} ({how})", "aiayn", precision, bf16)


def variant_trainer(spec: str, recipe_precision: str, native_bf16: bool) -> Trainer:
    """`--variant NAME=FLAGS`: `aiayn train` with FLAGS after the benchmark's own flags; words
    of the form VAR=VALUE before them set its environment, as in a shell
    (`--variant spin="OMP_WAIT_POLICY=ACTIVE"`, `--variant onednn="--precision fp32
    --onednn"`). Named by its flags and what its updates compute in, as `aiayn_trainer`."""
    words, env = runner.variant_words(spec)
    precision = None
    if "--precision" in words[:-1]:
        precision = words[words.index("--precision") + 1]
    trainer = aiayn_trainer(precision, recipe_precision, native_bf16)
    how = trainer.name[trainer.name.rindex(" (") :]
    command = runner.shell_line(env, ["aiayn", "train", *words])
    return Trainer(f"{command}{how}", "aiayn", None, trainer.bf16, flags=words, env=env)


# --------------------------------------------------------------------------------------------
# Settings, from the recipe
# --------------------------------------------------------------------------------------------


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The recipe with the benchmark's data (absolute paths: the cache key holds them), Eq. 3
    and no time budget (`run_aiayn` passes the same as flags; fairseq has only Eq. 3)."""
    values = load_yaml_config(args.config)
    for key in ("valid_src", "valid_tgt", "valid_tsv", "tsv", "tokenizer"):
        if values.get(key):
            raise SystemExit(f"{args.config}: sets {key}; the benchmark gives the data itself")
    if values.get("tokens_per_update"):  # sets accumulate from the world size at run time
        raise SystemExit(f"{args.config}: sets tokens_per_update; give accumulate instead")
    values.update(src=str(Path(args.src).resolve()), tgt=str(Path(args.tgt).resolve()))
    values.update(time_budget=None, schedule="inverse_sqrt")
    return TrainConfig.from_dict(values, source=args.config)


def peak_lr(c: TrainConfig, d_model: int) -> float:
    """Eq. 3 at the end of the warm-up: lr_scale · d_model^-0.5 · warmup^-0.5."""
    return learning_rate(
        c.warmup_steps, d_model=d_model, warmup_steps=c.warmup_steps, scale=c.lr_scale
    )


def fairseq_model_flags(m: ModelConfig) -> list[str]:
    """fairseq `transformer` flags for the same model; refuses what it cannot express."""
    if m.d_k * m.n_heads != m.d_model or m.d_v * m.n_heads != m.d_model:
        raise SystemExit(f"fairseq needs d_k = d_v = d_model / n_heads (d_k {m.d_k}, d_v {m.d_v})")
    flags = ["--arch", "transformer", "--activation-fn", m.activation]
    for side, layers in (("encoder", m.n_encoder_layers), ("decoder", m.n_decoder_layers)):
        flags += [f"--{side}-embed-dim", str(m.d_model), f"--{side}-ffn-embed-dim", str(m.d_ff)]
        flags += [f"--{side}-attention-heads", str(m.n_heads), f"--{side}-layers", str(layers)]
        if m.norm_first:
            flags.append(f"--{side}-normalize-before")
        if m.positional_encoding == "learned":
            flags.append(f"--{side}-learned-pos")
    flags += {
        "all": ["--share-all-embeddings"],
        "decoder": ["--share-decoder-input-output-embed"],
        "none": [],
    }[m.share_embeddings]
    flags += ["--dropout", str(m.dropout), "--attention-dropout", str(m.attention_dropout)]
    flags += ["--activation-dropout", "0.0"]
    positions = str(m.max_positions)
    return [*flags, "--max-source-positions", positions, "--max-target-positions", positions]


# --------------------------------------------------------------------------------------------
# Data: one vocabulary, one binarised corpus, the same pairs as piece strings for fairseq
# --------------------------------------------------------------------------------------------


def fairseq_training_flags(c: TrainConfig, m: ModelConfig) -> list[str]:
    """The recipe's loss, optimizer, Eq. 3 and batching as fairseq-train flags (see the module
    docstring: the same settings on both sides)."""
    return [
        *["--criterion", "label_smoothed_cross_entropy"],
        *["--label-smoothing", str(c.label_smoothing)],
        *["--optimizer", "adam", "--adam-betas", f"({c.adam_beta1}, {c.adam_beta2})"],
        *["--adam-eps", str(c.adam_eps), "--weight-decay", "0.0"],
        *["--clip-norm", str(c.clip_norm), "--lr", repr(peak_lr(c, m.d_model))],
        *["--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(c.warmup_steps)],
        *["--warmup-init-lr", "0", "--max-tokens", str(c.max_tokens)],
        *["--required-batch-size-multiple", "1"],  # aiayn rounds no batch to a multiple of 8
        *["--update-freq", str(c.accumulate)],
    ]


@dataclass
class Prepared:
    """What both trainers train on, made once before the first run."""

    tokenizer: Tokenizer
    cache_root: Path  # aiayn's data cache, copied into each run directory as data/train
    pairs: int
    fairseq_data: Path | None = None
    fairseq_dict: dict[str, int] = field(default_factory=dict)  # language -> types
    fairseq_check: str = ""


def prepare(
    args: argparse.Namespace, c: TrainConfig, work: Path, fairseq_bin: Path | None
) -> Prepared:
    """The vocabulary, aiayn's data cache and (with fairseq) fairseq's binarised data."""
    src, tgt = Path(c.src), Path(c.tgt)
    print(f"vocabulary: joint BPE, {c.vocab_size} pieces requested, seed {c.seed}", flush=True)
    tokenizer = Tokenizer.train_or_reuse(
        work / "tokenizer.model", src=src, tgt=tgt, vocab_size=c.vocab_size, seed=c.seed
    )
    cache_root = work / "aiayn-data"
    dataset, stats = load_or_build(
        src, tgt, None, tokenizer, cache_root / "train", max_len=c.max_len,
        max_ratio=c.max_ratio or None,
    )  # fmt: skip
    print(f"aiayn vocabulary: {tokenizer.vocab_size} pieces; train data: {stats}", flush=True)
    prepared = Prepared(tokenizer, cache_root, len(dataset))
    if fairseq_bin is not None:
        prepared.fairseq_data = work / "fairseq-data"
        fairseq_preprocess(args, c, tokenizer, dataset, work, fairseq_bin, prepared)
    return prepared


def fairseq_preprocess(
    args: argparse.Namespace,
    c: TrainConfig,
    tokenizer: Tokenizer,
    dataset: ParallelDataset,
    work: Path,
    fairseq_bin: Path,
    prepared: Prepared,
) -> None:
    """The cached pairs as piece strings, aiayn's pieces as the joint dictionary, binarised."""
    names = tokenizer.pieces(range(tokenizer.vocab_size))
    odd = [p for p in names if len(p.split()) != 1]
    if odd:
        raise SystemExit(f"pieces that fairseq would split on whitespace: {odd[:5]}")
    text = work / "fairseq-text"
    text.mkdir(parents=True, exist_ok=True)
    specials = set(SPECIAL_PIECES.values())  # fairseq adds its own <s>, <pad>, </s>, <unk>
    (text / "dict.txt").write_text(
        "".join(f"{p} 1\n" for p in names if p not in specials), encoding="utf-8"
    )
    sl, tl = c.src_lang, c.tgt_lang

    def write(split: str, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Source and target ids as piece strings, `split`.SL and `split`.TL."""
        with (
            open(text / f"{split}.{sl}", "w", encoding="utf-8") as src_out,
            open(text / f"{split}.{tl}", "w", encoding="utf-8") as tgt_out,
        ):
            for src_ids, tgt_ids in pairs:
                src_out.write(" ".join(names[t] for t in src_ids) + "\n")
                tgt_out.write(" ".join(names[t] for t in tgt_ids) + "\n")

    write("train", (dataset[i] for i in range(len(dataset))))
    # fairseq-train loads a valid split even with --disable-validation; it is never evaluated.
    # The dev set if given (encoded whole), else the first training pairs.
    if args.valid_src:
        dev = read_parallel(Path(args.valid_src), Path(args.valid_tgt))
        write("valid", ((tokenizer.encode(s), tokenizer.encode(t)) for s, t in dev))
    else:
        write("valid", (dataset[i] for i in range(min(100, len(dataset)))))
    command = [str(fairseq_bin / "fairseq-preprocess"), "--source-lang", sl, "--target-lang", tl]
    command += ["--trainpref", str(text / "train"), "--destdir", str(prepared.fairseq_data)]
    command += ["--validpref", str(text / "valid")]
    command += ["--joined-dictionary", "--srcdict", str(text / "dict.txt"), "--workers", "1"]
    print("running: " + shlex.join(command), flush=True)
    log = work / "fairseq-preprocess.log"
    code, output = runner.run_logged(command, log, env=child_env(args.threads))
    if code != 0:
        raise SystemExit(f"fairseq-preprocess failed:\n{output[-3000:]}")
    prepared.fairseq_dict = {lang: int(n) for lang, n in FAIRSEQ_DICT.findall(output)}
    # The check that both sides train on the same tokens: fairseq's counts of the train files
    # (EOS included) against aiayn's cache.
    expected = {
        sl: int(dataset.src_lengths.sum()) + len(dataset),
        tl: int(dataset.tgt_lengths.sum()) + len(dataset),
    }
    counted = {
        lang: (int(tokens), float(unk))
        for lang, name, _, tokens, unk in FAIRSEQ_UNK.findall(output)
        if Path(name).name.startswith("train.")
    }
    for lang, tokens in expected.items():
        found, unk = counted.get(lang, (None, None))
        if found != tokens or unk != 0.0:
            raise SystemExit(
                f"fairseq-preprocess counted {found} {lang} tokens ({unk}% <unk>), aiayn's cache "
                f"{tokens}: the segmentations differ"
            )
    prepared.fairseq_check = (
        f"fairseq-preprocess counted the same tokens as aiayn's cache ({expected[sl]} source, "
        f"{expected[tl]} target, EOS included), none replaced by <unk>"
    )
    print(f"  {prepared.fairseq_check}", flush=True)


# --------------------------------------------------------------------------------------------
# Running one trainer for a window
# --------------------------------------------------------------------------------------------


def child_env(threads: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _children(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


@dataclass
class Window:
    wall_s: float
    lines: list[tuple[float, str]]
    peak_rss_kib: int | None
    worker_rss_kib: int | None
    stopped: bool  # by the benchmark at the end of the window (else it ended by itself)


def run_window(command: list[str], env: dict[str, str], seconds: float, log: Path) -> Window:
    """Run `command` for at most `seconds`; its output, timestamped, also goes to `log`."""
    lines: list[tuple[float, str]] = []
    started = time.perf_counter()
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # its own process group: the stop reaches data-loader workers
        preexec_fn=runner.ends_with_benchmark,
    )  # fmt: skip

    def read() -> None:
        assert child.stdout is not None
        with open(log, "w", encoding="utf-8") as out:
            for line in child.stdout:
                elapsed = time.perf_counter() - started
                lines.append((elapsed, line.rstrip("\n")))
                out.write(f"[{elapsed:8.2f}] {line}")
                out.flush()  # the log follows the run, for whoever watches it

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = worker = None
    deadline = started + seconds
    try:
        while child.poll() is None and time.perf_counter() < deadline:
            # VmHWM only grows: the last read is the peak
            peak = runner.proc_kib(child.pid, "VmHWM") or peak
            workers = [runner.proc_kib(p, "VmHWM") or 0 for p in _children(child.pid)]
            worker = max([*workers, worker or 0]) or None
            time.sleep(0.5)
        stopped = child.poll() is None
        if stopped:
            peak = runner.proc_kib(child.pid, "VmHWM") or peak
            os.killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # then killed below
                child.wait(timeout=STOP_GRACE_S)
    finally:  # past the grace, or the benchmark itself stopped (Ctrl-C, SIGTERM)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    wall = time.perf_counter() - started
    reader.join(timeout=10)
    if not stopped and child.returncode != 0:
        tail = "\n".join(line for _, line in lines[-30:])
        raise SystemExit(f"{command[0]} exited with status {child.returncode}:\n{tail}")
    return Window(wall, lines, peak, worker, stopped)


def _mib(kib: int | None) -> float | None:
    return None if kib is None else kib / 1024


def _first_match(pattern: re.Pattern[str], lines: list[tuple[float, str]]) -> re.Match | None:
    return next((m for _, line in lines if (m := pattern.search(line))), None)


def run_aiayn(
    args: argparse.Namespace, c: TrainConfig, prepared: Prepared, run_dir: Path, trainer: Trainer
) -> tuple[Window, list[Interval], int | None, int | None]:
    # The binarised corpus, as if this run had built it (its key: paths, sizes, tokenizer).
    shutil.copytree(prepared.cache_root, run_dir / "data")
    command = [*runner.AIAYN, "train", "-c", args.config, "--src", c.src, "--tgt", c.tgt]
    command += ["--tokenizer", str(prepared.tokenizer.model_file), "--out-dir", str(run_dir)]
    command += ["--time-budget", "none", "--schedule", c.schedule]
    command += ["--max-steps", str(args.max_updates or c.max_steps), "--log-every"]
    command += [str(args.log_every), "--save-every", str(10**9), "--save-every-minutes", "0"]
    command += ["--valid-every", "0", "--device", "cpu", "--threads", str(args.threads)]
    command += ["--no-progress"]
    if trainer.precision is not None:  # else the recipe's own, as users run it
        command += ["--precision", trainer.precision]
    command += trainer.flags
    env = {**child_env(args.threads), **trainer.env}
    print("  " + runner.shell_line(trainer.env, command), flush=True)
    window = run_window(command, env, args.seconds, run_dir / "train.log")
    cache = _first_match(AIAYN_CACHE, window.lines)
    if cache is None or cache.group(1) != "reusing":
        print("  warning: aiayn did not reuse the prepared data cache", flush=True)
    intervals, seen, step = [], 0, 0
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    for r in (r for r in records if r.get("type") == "train"):
        intervals.append(Interval(r["step"] - step, r["tokens_seen"] - seen, r["tokens_per_s"]))
        seen, step = r["tokens_seen"], r["step"]
    model = _first_match(MODEL_LINE, window.lines)
    if model and bool(model.group(4)) != trainer.bf16:
        raise SystemExit(f"{trainer.name}: its log says {model.group(0)!r}")
    params = int(model.group(1).replace(",", "")) if model else None
    return window, intervals, params, int(model.group(2)) if model else None


def run_fairseq(
    args: argparse.Namespace, c: TrainConfig, prepared: Prepared, run_dir: Path
) -> tuple[Window, list[Interval], int | None, int | None]:
    m = c.model_config(prepared.tokenizer.vocab_size)
    command = [str(args.fairseq_bin / "fairseq-train"), str(prepared.fairseq_data)]
    command += ["--task", "translation", "--source-lang", c.src_lang, "--target-lang", c.tgt_lang]
    command += fairseq_model_flags(m)
    command += fairseq_training_flags(c, m)
    command += ["--max-update", str(args.max_updates or c.max_steps), "--seed", str(c.seed)]
    command += ["--max-epoch", str(c.max_epochs)]  # 0: no limit, on both sides
    command += ["--cpu", "--num-workers", str(args.fairseq_workers), "--disable-validation"]
    command += ["--no-save", "--save-dir", str(run_dir / "checkpoints")]
    command += ["--log-format", "json", "--log-interval", str(args.log_every)]
    print("  " + shlex.join(command), flush=True)
    run_dir.mkdir(parents=True)
    window = run_window(command, child_env(args.threads), args.seconds, run_dir / "train.log")
    intervals, step = [], 0
    for _, line in window.lines:
        if (found := FAIRSEQ_INNER.search(line)) is None:
            continue
        record = json.loads(found.group(1))
        updates = int(float(record["num_updates"])) - step
        step += updates
        wpb = float(record["wpb"])  # target tokens per update, averaged over the interval
        intervals.append(Interval(updates, wpb * updates, float(record["wps"])))
    params = _first_match(FAIRSEQ_PARAMS, window.lines)
    pairs = _first_match(FAIRSEQ_PAIRS, window.lines)
    return (
        window,
        intervals,
        int(params.group(1).replace(",", "")) if params else None,
        int(pairs.group(1).replace(",", "")) if pairs else None,
    )


def one_run(
    args: argparse.Namespace,
    c: TrainConfig,
    prepared: Prepared,
    trainer: Trainer,
    round_: int,
    work: Path,
) -> Run:
    slug = re.sub(r"[^a-z0-9]+", "-", trainer.name.lower()).strip("-")
    run_dir = work / f"round{round_}-{slug}"
    print(f"[round {round_}] {trainer.name}, {args.seconds:.0f} s", flush=True)
    if trainer.system == "fairseq":
        window, intervals, params, pairs = run_fairseq(args, c, prepared, run_dir)
    else:
        window, intervals, params, pairs = run_aiayn(args, c, prepared, run_dir, trainer)
    logged = [t for t, line in window.lines if _is_interval_line(trainer.system, line)]
    if len(logged) == len(intervals):  # an update under way at SIGTERM ends outside the window
        intervals = [i for i, t in zip(intervals, logged, strict=True) if t <= args.seconds]
    if not intervals:
        tail = "\n".join(line for _, line in window.lines[-30:])
        raise SystemExit(f"{trainer.name} logged no interval in {window.wall_s:.0f} s:\n{tail}")
    run = Run(
        updates=sum(i.updates for i in intervals),
        intervals=intervals,
        peak_rss_mib=_mib(window.peak_rss_kib),
        worker_rss_mib=_mib(window.worker_rss_kib),
        params=params,
        pairs=pairs,
    )
    rates = [f"{i.tokens_per_s:.0f}" for i in intervals]
    print(
        f"  {run.updates} updates logged, tok/s per interval: {' '.join(rates)} (first left "
        f"out); peak RSS {_fmt_mib(run.peak_rss_mib)}; "
        f"{'stopped at the window' if window.stopped else 'ended by itself'}",
        flush=True,
    )
    return run


def _is_interval_line(system: str, line: str) -> bool:
    if system == "fairseq":
        return FAIRSEQ_INNER.search(line) is not None
    return re.search(r"aiayn\.train\.trainer: step \d+: loss", line) is not None


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _fmt_mib(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} MiB"


COLUMNS = [
    ("trainer", "trainer"), ("tokens_per_s", "target tok/s: median of intervals (per run)"),
    ("range", "min–max"), ("vs_fairseq", "× fairseq-train"), ("updates", "updates per run"),
    ("peak_rss", "peak RSS"),
]  # fmt: skip


def rows(trainers: list[Trainer]) -> list[dict[str, Any]]:
    """The record's rows: each trainer's tokens/s (pooled intervals' median, each run's median),
    range, ratio to fairseq-train's median, updates and peak memory."""
    fairseq = next((t for t in trainers if t.system == "fairseq" and t.rates()), None)
    reference = statistics.median(fairseq.rates()) if fairseq else None
    found = []
    for t in trainers:
        rates = t.rates()
        if t.missing is not None or not rates:
            why = t.missing or "no steady interval: raise --seconds"
            found.append({"trainer": t.name, "tokens_per_s": f"not measured: {why}"})
            continue
        median = statistics.median(rates)
        per_run = [statistics.median(i.tokens_per_s for i in r.steady) for r in t.runs if r.steady]
        peaks = [r.peak_rss_mib for r in t.runs if r.peak_rss_mib is not None]
        workers = [r.worker_rss_mib for r in t.runs if r.worker_rss_mib]
        rss = _fmt_mib(max(peaks) if peaks else None)
        if workers:
            rss += f" (+ worker {max(workers):.0f} MiB)"
        found.append({
            "trainer": t.name,
            "tokens_per_s": {"median": round(median), "rounds": [round(x) for x in per_run]},
            "range": f"{min(rates):.0f}–{max(rates):.0f}",
            "vs_fairseq": f"{median / reference:.2f}×" if reference else None,
            "updates": ", ".join(str(r.updates) for r in t.runs),
            "peak_rss": rss,
        })  # fmt: skip
    return found


def summary_line(ours: dict[str, Any], theirs: dict[str, Any], trainer: Trainer) -> str:
    """aiayn's default row against fairseq's, each with what it computes in."""
    how = "bf16" if trainer.bf16 else "float32"
    text = f"`aiayn train` {ours['tokens_per_s']['median']:,} target tokens/s in {how}"
    if isinstance(theirs["tokens_per_s"], dict):
        text += (
            f" against `fairseq-train`'s {theirs['tokens_per_s']['median']:,} in float32 "
            f"({ours['vs_fairseq']})"
        )
    return text


def fairseq_inference_copies(m: ModelConfig) -> int:
    """Parameters fairseq 0.12's encoder layers hold for the inference-only BetterTransformer
    path: zero-initialised copies of the attention and feed-forward weights (`in_proj_weight`,
    `fc1_weight`, ...), counted in its parameter total but unused in training (no gradient)."""
    d, d_ff = m.d_model, m.d_ff
    return m.n_encoder_layers * (3 * d * d + 3 * d + d * d + d + 2 * d * d_ff + d_ff + d)


def _params_note(trainers: list[Trainer], m: ModelConfig) -> str:
    ours = {r.params for t in trainers if t.system == "aiayn" for r in t.runs} - {None}
    theirs = {r.params for t in trainers if t.system == "fairseq" for r in t.runs} - {None}
    parts = [f"{name} {', '.join(f'{p:,}' for p in sorted(v))}"
             for name, v in (("aiayn", ours), ("fairseq", theirs)) if v]  # fmt: skip
    text = "; ".join(parts) or "?"
    if len(ours) == 1 and len(theirs) == 1:
        (a,), (f,) = ours, theirs
        if f - a == fairseq_inference_copies(m):
            text += (
                f", of which {f - a:,} are fairseq's zero-initialised copies of the encoder "
                "layers' weights for its inference-only BetterTransformer path (no gradient, "
                f"not updated): the same {a:,} trained on both sides"
            )
    return text


def precision_note(c: TrainConfig, default: Trainer) -> str:
    """What each side computes in here, and why fairseq has no bf16 row."""
    native = native_bf16_cpu()
    return (
        f"native bf16 on this CPU (AVX512-BF16 or AMX): {'yes' if native else 'no'}; "
        f"`aiayn train` at the recipe's `precision: {c.precision}` computes in "
        f"{'bf16 (autocast)' if default.bf16 else 'float32'} here; "
        "`fairseq-train` in float32: fairseq 0.12's `--bf16` implies `--tpu` and stops on a "
        "CPU (no XLA device)."
    )


def notes(
    args: argparse.Namespace,
    c: TrainConfig,
    prepared: Prepared,
    trainers: list[Trainer],
) -> list[str]:
    m = c.model_config(prepared.tokenizer.vocab_size)
    pairs = {t.name: {r.pairs for r in t.runs} - {None} for t in trainers}
    vocab = f"aiayn {prepared.tokenizer.vocab_size} pieces"
    if prepared.fairseq_dict:
        vocab += ", fairseq dictionary " + " / ".join(
            f"{n} types ({lang})" for lang, n in prepared.fairseq_dict.items()
        )
    loaded = (
        "each trainer loaded all of them"
        if any(pairs.values()) and all(v == {prepared.pairs} for v in pairs.values() if v)
        else "the pairs each trainer loaded: "
        + ", ".join(f"{k} {', '.join(map(str, v)) or '?'}" for k, v in pairs.items() if v)
    )
    out = [
        f"- Data: `{Path(args.src).name}` → `{Path(args.tgt).name}`, "
        f"{prepared.pairs} training pairs after the recipe's length filter "
        f"(max_len {c.max_len}); {loaded}. Joint BPE vocabulary, one segmentation for both: "
        f"{vocab}" + (f"; {prepared.fairseq_check}." if prepared.fairseq_check else "."),
        f"- Model: recipe `{args.config}`, preset `{c.preset}` (d_model {m.d_model}, d_ff "
        f"{m.d_ff}, {m.n_heads} heads, {m.n_encoder_layers}+{m.n_decoder_layers} layers, "
        f"{'pre' if m.norm_first else 'post'}-norm, share_embeddings: {m.share_embeddings}, "
        f"dropout {m.dropout}); parameters: {_params_note(trainers, m)}.",
        f"- Training: ≤ {c.max_tokens} tokens a side per batch, accumulate {c.accumulate}, "
        f"label smoothing {c.label_smoothing}, Adam β ({c.adam_beta1}, {c.adam_beta2}), "
        f"Eq. 3's inverse-sqrt schedule on both sides (aiayn `--time-budget none --schedule "
        f"inverse_sqrt`, whatever the recipe's), warm-up {c.warmup_steps}, peak lr "
        f"{peak_lr(c, m.d_model):.6g} (Eq. 3 × {c.lr_scale}); no validation, no checkpoint "
        f"in the window; {args.threads} threads each; fairseq with {args.fairseq_workers} "
        "data-loader worker(s).",
        "- Method: rounds of equal wall time per trainer, interleaved (the command's `--rounds` "
        "and `--seconds`); each trainer's own tokens/s (aiayn `metrics.jsonl` `tokens_per_s`, "
        "fairseq `wps`: target tokens / interval wall time) every `--log-every` updates, the "
        "first interval of each run left out; peak RSS = `VmHWM` of the trainer process at the "
        "end of its window (max over runs).",
        f"- Precision: {precision_note(c, trainers[0])}",
    ]
    return [line.removeprefix("- ") for line in out]


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def fairseq_missing(fairseq_bin: Path | None) -> str | None:
    if fairseq_bin is None:
        return "no --fairseq-bin given"
    for tool in ("fairseq-preprocess", "fairseq-train"):
        if not os.access(fairseq_bin / tool, os.X_OK):
            return f"no {tool} in {fairseq_bin}"
    return None


def fairseq_version(fairseq_bin: Path) -> str:
    python = fairseq_bin / "python"
    code = "import fairseq; print(fairseq.__version__)"
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120
        )
    except OSError:
        return "?"
    return done.stdout.strip() or "?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="an `aiayn prepare` folder: train.*, valid.*")
    parser.add_argument("--src", help="training source text (default DATA/train.en)")
    parser.add_argument("--tgt", help="training target text, line-aligned (DATA/train.es)")
    parser.add_argument("--valid-src", help="dev source, fairseq's valid split (never evaluated)")
    parser.add_argument("--valid-tgt", help="dev target, likewise")
    parser.add_argument("-c", "--config", default=runner.RECIPE, help="training recipe (YAML)")
    parser.add_argument("--fairseq-bin", type=Path, help="folder of fairseq-preprocess, -train")
    parser.add_argument("--fairseq-workers", type=int, default=1, help="fairseq --num-workers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=210, help="wall time per run")
    parser.add_argument("--log-every", type=int, default=10, help="updates per logged interval")
    parser.add_argument("--max-updates", type=int, help="also stop a run here (smoke runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--with-other-precision", action="store_true",
        help="add aiayn at the other precision: --precision fp32 where the recipe's resolves "
        "to bf16 on this CPU, else --precision bf16",
    )  # fmt: skip
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="add aiayn with these flags (leading VAR=VALUE words: its environment), e.g. "
        "onednn='--precision fp32 --onednn' or spin=OMP_WAIT_POLICY=ACTIVE; repeatable",
    )  # fmt: skip
    parser.add_argument("--work-dir", type=Path, help="keep the runs here (default: temporary)")
    runner.add_arguments(parser)
    args = parser.parse_args(argv)
    if (data := args.data) is not None:
        args.src, args.tgt = args.src or str(data / "train.en"), args.tgt or str(data / "train.es")
        if args.valid_src is None and (data / "valid.en").is_file():
            args.valid_src, args.valid_tgt = str(data / "valid.en"), str(data / "valid.es")
    if args.src is None or args.tgt is None:
        parser.error("give --data DIR (an `aiayn prepare` folder), or --src and --tgt")
    if (args.valid_src is None) != (args.valid_tgt is None):
        parser.error("--valid-src and --valid-tgt go together")
    if args.rounds < 1 or args.seconds <= 0 or args.log_every < 1 or args.threads < 1:
        parser.error("--rounds, --seconds, --log-every and --threads must be positive")
    for spec in args.variant:
        try:
            runner.variant_words(spec)
        except ValueError as e:
            parser.error(str(e))
    if not args.no_record and (args.max_updates or args.seconds < 60):
        parser.error("a smoke run (--max-updates, or --seconds < 60) is not recorded: --no-record")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    c = train_config(args)
    runner.stop_children_on_sigterm()
    load = runner.check_idle(args.busy_ok)
    missing = fairseq_missing(args.fairseq_bin)
    native = native_bf16_cpu()
    ours = aiayn_trainer(None, c.precision, native)
    trainers = [ours, Trainer(FAIRSEQ, "fairseq", missing=missing)]
    if args.with_other_precision:
        trainers.append(aiayn_trainer("fp32" if ours.bf16 else "bf16", c.precision, native))
    trainers += [variant_trainer(spec, c.precision, native) for spec in args.variant]
    if missing:
        print(f"fairseq-train: not measured ({missing})", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepared = prepare(args, c, work, None if missing else args.fairseq_bin)
        live = [t for t in trainers if t.missing is None]
        for round_ in range(1, args.rounds + 1):
            for trainer in live:
                trainer.runs.append(one_run(args, c, prepared, trainer, round_, work))
    found = rows(trainers)
    # Without the peer, a run compares aiayn's own settings: a table of its own, and no line
    # in the page's summary, which the comparison with fairseq-train keeps.
    summary = "" if missing else summary_line(found[0], found[1], ours)
    what = "`aiayn train`'s settings side by side" if missing else "the recipe's model and settings"
    m = c.model_config(prepared.tokenizer.vocab_size)
    rec = runner.record(
        "train",
        table=what,
        setup=args.setup
        or f"`{Path(args.config).name}`, {m.n_encoder_layers}+"
        f"{m.n_decoder_layers} layers, ≤ {c.max_tokens} tokens, Eq. 3's schedule on both sides",
        columns=COLUMNS,
        rows=found,
        summary=summary,
        notes=notes(args, c, prepared, trainers),
        machine_name=args.machine,
        load=load,
    )
    rec["load_average_after"] = runner.load_average()
    if not missing:
        rec["versions"]["fairseq"] = fairseq_version(args.fairseq_bin)
    runner.write(rec, args)


if __name__ == "__main__":
    main()
