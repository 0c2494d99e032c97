"""Prove aiayn's GPU path on a freshly lent GPU with one command: `make gpu-check OUT=DIR`.

For a machine with Python, a CUDA build of PyTorch (any 2.x), numpy, PyYAML, sentencepiece,
safetensors and sacrebleu, and no network. Nothing is installed: the working tree's aiayn runs
from `src/` (`PYTHONPATH=src`, inherited by its subprocesses); a missing module is named in one
line, with what to carry. Within `--budget` seconds (default 480) it runs, in order, each stage
in the time the earlier ones left (each stage's function says how):

1. **tests**: `pytest tests/cuda` (skipped, saying so, without pytest);
2. **peak**: the bf16 matrix-product rate, the yardstick of the model FLOPs utilisation (MFU);
   TF32 and float32 beside it;
3. **train**: `base` updates at the paper's ~25,000 target tokens (§5.1) on sentences of real
   lengths, in bf16, TF32 and float32: aiayn as `aiayn train` runs it by default, aiayn with
   `--static-shapes --compile` (every batch one of ~16 fixed shapes, the update replayed as CUDA
   graphs; in bf16 only, its compile time left to the later stages), and
   `torch.nn.Transformer` wrapped to the same model: target tokens/s, peak memory,
   MFU, how busy the GPU is (its kernels' time over the wall time of 10 updates after the timed
   ones, torch.profiler), and the paper's base run (100k updates) on this GPU against its 12
   hours on 8 P100s (§5.2);
4. **torchrun**: `torchrun --nproc_per_node=1 -m aiayn train`, then the same run through NCCL
   and DistributedDataParallel (`ddp_worker`); both runs' losses must agree;
5. **job**: `aiayn demo` (needs `num2words`), then `aiayn translate` of its 500 held-out numbers
   in float32 and `--bf16`, and with `--backend ctranslate2` where `ctranslate2` imports: whole
   commands timed from launch to exit, which pay what every new shape costs.

It prints a line per stage and the training and job tables as BENCHMARKS.md shows them, the
checks in their notes; it writes their records to DIR/records.jsonl (`--record` also appends
them to bench/results/gpu.jsonl), every number to DIR/gpu-check.json, and the logs
pytest.log, torchrun.log, torchrun-ddp.log, demo.log and translate.log (every `aiayn
translate` run: a lent machine gives back at most 8 files). The exit status is 0 when every
stage ran and passed.

Without CUDA it says so in one line and exits 0, after a smoke run of every stage's code at the
smallest sizes on the CPU (pytest and the job aside; ~20 s on 2 cores), so that CI proves the
script still runs (tests/test_gpu_check.py):

    PYTHONPATH=src python3 bench/gpu_check.py --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

try:  # what is missing is named by main(), in one line, rather than raised here
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import page
    import runner
    from aiayn.acceleration import maybe_compile
    from aiayn.cli import main as aiayn_main
    from aiayn.config import preset
    from aiayn.model import Transformer
    from aiayn.optim import build_optimizer, learning_rate, set_learning_rate
    from aiayn.text.batching import BatchShapes, accumulation, collate, epoch_updates
    from aiayn.text.tokenizer import PAD_ID
    from aiayn.train import distributed, setup
    from aiayn.train.runlog import read_metrics
    from aiayn.train.update import autocast, optimizer_update
    from peers import ReferenceTransformer, forward_flops
except ImportError as error:
    IMPORT_ERROR: ImportError | None = error
else:
    IMPORT_ERROR = None

STAGES = ("tests", "peak", "train", "torchrun", "job")
REQUIRED = {  # module → where it comes from
    "aiayn": "this tree's src/: run with PYTHONPATH=src, as `make gpu-check` does",
    "torch": "pip: torch, a CUDA build",
    "numpy": "pip: numpy",
    "yaml": "pip: PyYAML",
    "sentencepiece": "pip: sentencepiece",
    "safetensors": "pip: safetensors",
    "sacrebleu": "pip: sacrebleu",
}
PAPER_TOKENS_PER_UPDATE = 25_000  # §5.1: ~25000 source and 25000 target tokens per batch
PAPER_UPDATES = 100_000  # §5.2: the base models trained for 100,000 steps ...
PAPER_HOURS = 12.0  # ... or 12 hours, on 8 P100 GPUs
# bf16 autocast (aiayn's default on CUDA), float32 products on TF32 tensor cores, IEEE float32
MATMUL_PRECISION = {"bf16": "highest", "tf32": "high", "fp32": "highest"}
DEMO_EXACT_MATCH = re.compile(r"exact match ([\d.]+)%")  # in `aiayn demo`'s report
CT2_ROW = "CTranslate2 (--backend ctranslate2 --device auto)"  # a row of the job stage
GRAPHS_ROW = "aiayn --static-shapes --compile"  # a row of the train stage: CUDA graphs
PYTEST_SUMMARY = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")


@dataclass(frozen=True)
class Sizes:
    """How much each stage does: the measurement's, or the CPU smoke's (`SMOKE`)."""

    preset: str = "base"
    vocab: int = 37_000  # §5.1: a shared source-target vocabulary of about 37000 tokens
    tokens_per_update: int = PAPER_TOKENS_PER_UPDATE
    max_tokens: int = 12_500
    warmup: int = 3
    updates: int = 8
    profiled: int = 10  # after the timed updates: how busy the GPU is (`device_busy`)
    precisions: tuple[str, ...] = ("bf16", "tf32", "fp32")
    peak_n: int = 8192
    torchrun_steps: int = 6
    job_rounds: int = 2
    job_precisions: tuple[str, ...] = ("fp32", "bf16")


SMOKE = Sizes(
    preset="tiny", vocab=64, tokens_per_update=256, max_tokens=128, warmup=1, updates=1,
    precisions=("bf16", "fp32"), peak_n=64, torchrun_steps=2,
)  # fmt: skip
SIZE_FLAGS = ("vocab", "tokens_per_update", "max_tokens", "warmup", "updates")
"""The fields of `Sizes` that flags set."""


@dataclass
class Context:
    """What every stage shares."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    smoke: bool
    deadline: float  # time.monotonic() when the budget is spent
    work: Path  # scratch
    say: Callable[[str], None]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run_logged(self, command: list[str], log: str, timeout: float, *, append: bool = False,
                   env: dict[str, str] | None = None) -> tuple[int | None, str]:  # fmt: skip
        """`runner.run_logged` in the tree's root under its src/, the log OUT/`log`; `env`:
        variables set for the command beside the process's own."""
        env = {**runner.with_src_on_path(os.environ), **(env or {}), "PYTHONUNBUFFERED": "1"}
        return runner.run_logged(command, self.args.out / log, env=env, timeout=timeout,
                                 append=append, cwd=runner.ROOT)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Arguments, and the two ways to run: measuring on a GPU, or the CPU smoke
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for records and logs")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for everything")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N")
    parser.add_argument("--vocab", type=int, default=Sizes.vocab)
    parser.add_argument("--tokens-per-update", type=int, default=Sizes.tokens_per_update)
    parser.add_argument("--max-tokens", type=int, default=Sizes.max_tokens, help="per batch")
    parser.add_argument("--updates", type=int, default=Sizes.updates, help="timed, per row")
    parser.add_argument("--warmup", type=int, default=Sizes.warmup, help="untimed, per row")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke run, even on a GPU")
    parser.add_argument(
        "--record", action="store_true", help="also append the records to bench/results/gpu.jsonl"
    )
    args = parser.parse_args(argv)
    for name in ("budget", *SIZE_FLAGS):
        value, least = getattr(args, name), 0 if name == "warmup" else 1
        if value < least:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be >= {least}")
    if not re.fullmatch(r"cuda(:\d+)?", args.device):
        parser.error(f"--device ({args.device!r}) must be cuda or cuda:N")
    return args


def missing_modules() -> list[str]:
    """The modules of `REQUIRED` that are not installed here, and where they come from."""
    return [f"{m} ({p})" for m, p in REQUIRED.items() if importlib.util.find_spec(m) is None]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ddp-worker"]:
        return ddp_worker(argv[1:])
    args = parse_args(argv)
    if missing := missing_modules():
        print(
            f"gpu_check: missing Python module(s): {'; '.join(missing)}. Without network, "
            "carry the wheels and `python3 -m pip install --no-index --no-deps WHEEL...`."
        )
        return 2
    if IMPORT_ERROR is not None:
        raise IMPORT_ERROR
    if args.smoke or not torch.cuda.is_available():
        return smoke_run(args)
    device = torch.device(args.device)
    if (device.index or 0) >= torch.cuda.device_count():
        print(f"gpu_check: {device} does not exist ({torch.cuda.device_count()} GPU(s) here)")
        return 2
    sizes = replace(Sizes(), **{name: getattr(args, name) for name in SIZE_FLAGS})
    report = run_stages(args, sizes, device, say=lambda line: print(line, flush=True))
    finish(args, report)
    return 0 if all(s["status"] in ("ok", "skipped") for s in report["stages"].values()) else 1


def smoke_run(args: argparse.Namespace) -> int:
    """No CUDA: every stage's code at `SMOKE` sizes on the CPU, quietly, and one line."""
    why = "no CUDA device here" if not torch.cuda.is_available() else "--smoke"
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and spares a busy machine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_stages(args, SMOKE, torch.device("cpu"), say=lambda _: None)
    stages = report["stages"]
    failed = [f"{n}: {s.get('error', s['status'])}" for n, s in stages.items()
              if s["status"] not in ("ok", "skipped")]  # fmt: skip
    if failed:
        print(f"gpu_check: {why} (torch {torch.__version__}); the CPU smoke FAILED: "
              + "; ".join(failed))  # fmt: skip
        return 1
    print(
        f"gpu_check: {why} (torch {torch.__version__}): nothing measured; the CPU smoke of "
        f"every stage passed in {report['seconds']:.0f} s"
    )
    return 0


def run_stages(
    args: argparse.Namespace, sizes: Sizes, device: torch.device, say: Callable[[str], None]
) -> dict[str, Any]:
    """Every stage asked for, in order, each in the time the earlier ones left; the report,
    also written to OUT/gpu-check.json."""
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"smoke": device.type != "cuda", "machine": machine(device)}
    report["stages"] = stages = {}
    say(f"gpu_check on {report['machine'].get('gpu')}: {args.budget:.0f} s for {args.stages}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = Context(args, sizes, device, report["smoke"], start + args.budget, Path(work), say)
        for name in args.stages:
            say(f"[{name}] {time.monotonic() - start:.0f} s elapsed, {ctx.left():.0f} s left")
            began = time.monotonic()
            try:
                stages[name] = STAGE_FUNCTIONS[name](ctx, report)
            except Exception as error:  # a stage that breaks must not lose the others
                stages[name] = {"status": "error", "error": f"{type(error).__name__}: {error}"}
                say(f"  {name} broke: {stages[name]['error']}")
            stages[name]["seconds"] = round(time.monotonic() - began, 1)
    report["seconds"] = round(time.monotonic() - start, 1)
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def machine(device: torch.device) -> dict[str, Any]:
    info = {
        **runner.machine(),
        **runner.versions(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
        if drivers := runner.nvidia_smi("driver_version"):
            info["driver"] = drivers[0]
    return info


def timed(device: torch.device, run: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of `run()`, a CUDA device synchronised before and after."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """float32 matrix products at `precision` ("high": TF32) inside, PyTorch's restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# --------------------------------------------------------------------------------------------
# Stages 1 and 2: the CUDA tests, and the matrix-product rate
# --------------------------------------------------------------------------------------------


def stage_tests(ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
    if importlib.util.find_spec("pytest") is None:
        why = "not run: pytest is not installed here (carry its wheel, with pluggy and iniconfig)"
        return {"status": "skipped", "summary": why}
    if ctx.smoke:
        return {"status": "skipped", "summary": "not run in the CPU smoke"}
    timeout = max(30.0, min(300.0, ctx.left() - 250))  # what the measurements need after it
    command = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-p", "no:cacheprovider"]
    code, output = ctx.run_logged(command, "pytest.log", timeout)
    summaries = [line.strip("= ") for line in output.splitlines() if PYTEST_SUMMARY.search(line)]
    summary = summaries[-1] if summaries else "no summary"
    summary += " (timed out)" if code is None else ""
    ctx.say(f"  pytest tests/cuda: {summary}")
    return {"status": "ok" if code == 0 else "failed", "summary": f"{summary}; pytest.log"}


def stage_peak(ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
    """TFLOP/s of n×n by n×n products (median of 10, after 3): bf16, the yardstick of MFU;
    TF32 and float32 beside it."""
    n, result = ctx.sizes.peak_n, {"status": "ok", "n": ctx.sizes.peak_n}
    for name, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32), ("fp32", torch.float32)):
        generator = torch.Generator(device=ctx.device).manual_seed(0)
        a, b = (torch.randn(n, n, generator=generator, device=ctx.device).to(dtype) for _ in "ab")
        with matmul_precision(MATMUL_PRECISION[name]):
            seconds = [timed(ctx.device, lambda a=a, b=b: a @ b)[0] for _ in range(13)][3:]
        result[f"{name}_tflops"] = 2 * n**3 / statistics.median(seconds) / 1e12
        ctx.say(f"  {name} {n}³ products: {result[f'{name}_tflops']:.0f} TFLOP/s")
    return result


# --------------------------------------------------------------------------------------------
# Stage 3: training throughput at the paper's 25k tokens per update
# --------------------------------------------------------------------------------------------


def real_lengths(rng: np.random.Generator, n: int, max_len: int = 250) -> tuple[Any, Any]:
    """Source and target lengths in subword tokens, shaped like WMT14 EN-DE under a 37k BPE (an
    assumption, not a measurement): log-normal, median 24, mean ~28; targets ~5% longer."""
    src = np.clip(np.rint(rng.lognormal(math.log(24), 0.55, n)), 1, max_len).astype(np.int64)
    tgt = np.clip(np.rint(src * rng.lognormal(0.05, 0.15, n)), 1, max_len).astype(np.int64)
    return src, tgt


def max_len(sizes: Sizes) -> int:
    """The longest sentence of `training_updates`, in tokens."""
    return min(250, sizes.max_tokens - 1)


def training_updates(
    sizes: Sizes, shapes: BatchShapes | None = None
) -> tuple[list[tuple[Any, Any]], list[list[Any]]]:
    """Random pairs of `real_lengths` (`optimizer_update`'s dataset protocol: data[i] → source
    and target ids), and the first updates of an epoch as the trainer makes them: batches of at
    most `max_tokens` (padding counted) grouped by length, cut for `shapes` where given, enough
    of them per update for `tokens_per_update`. The same pairs whatever `shapes`."""
    rng = np.random.default_rng(1)
    needed = sizes.warmup + sizes.updates
    n = int(1.2 * needed * sizes.tokens_per_update / 28) + 64
    src_len, tgt_len = real_lengths(rng, n, max_len=max_len(sizes))
    data = [
        (rng.integers(4, sizes.vocab, s), rng.integers(4, sizes.vocab, t))
        for s, t in zip(src_len, tgt_len, strict=True)
    ]
    accumulate = accumulation(tokens_per_update=sizes.tokens_per_update,
                              max_tokens=sizes.max_tokens, accumulate=1, world_size=1)  # fmt: skip
    updates = epoch_updates(src_len, tgt_len, max_tokens=sizes.max_tokens, seed=1, epoch=1,
                            accumulate=accumulate, rank=0, world_size=1, shapes=shapes)  # fmt: skip
    return data, [u for u in updates if len(u) == accumulate][:needed]


def update_flops(config: Any, data: list, group: list[Any]) -> int:
    """FLOPs of one update: 3 × the forward pass (peers.forward_flops) of every batch padded to
    its longest sentence (as computed, but for the fixed shapes' padding, which counts as no
    work)."""
    total = 0
    for indices in group:
        s = max(len(data[int(i)][0]) for i in indices) + 1  # + EOS
        t = max(len(data[int(i)][1]) for i in indices) + 1  # + BOS / EOS
        total += 3 * forward_flops(config, len(indices), s, t)
    return total


def aiayn_update(
    config: Any, data: list, device: torch.device, bf16: bool, shapes: BatchShapes | None = None
) -> Callable:
    """run(group, step): one update as `aiayn train` runs it, `optimizer_update` (collate,
    autocast, the chunked loss, fused Adam at Eq. 3's rate); returns its target tokens. With
    `shapes`, as `aiayn train --static-shapes --compile` runs it: every batch padded to them,
    the model compiled (on a GPU into CUDA graphs, torch.compile's "reduce-overhead"; on a CPU,
    the smoke, eager)."""
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    optimizer = build_optimizer(model)
    train_model = model
    if shapes is not None and device.type == "cuda":  # as `aiayn train` compiles it
        train_model = maybe_compile(model, device, "reduce-overhead", dynamic=True)

    def run(group: list, step: int) -> int:
        return optimizer_update(
            train_model, optimizer, data, group, step=step, d_model=config.d_model,
            warmup_steps=4000, lr_scale=1.0, label_smoothing=0.1, clip_norm=0.0, bf16=bf16,
            device=device, distributed=distributed.Distributed(), shapes=shapes,
        ).tokens  # fmt: skip

    return run


def each_shape_twice(data: list, updates: list, shapes: BatchShapes) -> list[list[Any]]:
    """Two updates of one batch for each fixed shape that `updates` hold: run before the timed
    updates, they compile and record every CUDA graph the timed ones replay (CUDA graph trees
    run a new shape once as it is and record it at its second call)."""
    widths: dict[int, Any] = {}
    for batch in (b for group in updates for b in group):
        longest = max(max(len(data[int(i)][0]), len(data[int(i)][1])) for i in batch) + 1
        widths.setdefault(shapes.width(longest), batch)
    return [[batch] for _, batch in sorted(widths.items()) for _ in range(2)]


def reference_update(config: Any, data: list, device: torch.device, bf16: bool) -> Callable:
    """The same update of `torch.nn.Transformer` wrapped to the same model: the same batches,
    autocast and fused Adam; `F.cross_entropy` on the full logits."""
    torch.manual_seed(0)
    model = ReferenceTransformer(config).to(device).train()
    optimizer = build_optimizer(model)

    def run(group: list, step: int) -> int:
        batches = [collate([data[int(i)] for i in indices]) for indices in group]
        n_tokens = sum(b.n_tgt_tokens for b in batches)
        set_learning_rate(optimizer, learning_rate(step, d_model=config.d_model, warmup_steps=4000))
        for batch in (b.to(device) for b in batches):
            with autocast(device, bf16):
                logits = model(batch.src, batch.tgt_in)
            logits, targets = logits.float().flatten(0, 1), batch.tgt_out.flatten()
            loss = F.cross_entropy(
                logits, targets, label_smoothing=0.1, ignore_index=PAD_ID, reduction="sum"
            )
            (loss / n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return n_tokens

    return run


def measure_updates(
    ctx: Context,
    build: Callable,
    config: Any,
    data: list,
    updates: list,
    precision: str,
    warm: list | None = None,
) -> dict[str, Any]:
    """Warm-up and timed updates of one model at one precision: target tokens/s, peak memory
    (model, Adam and activations), TFLOP/s. `warm`: updates run before those, untimed. Stops
    early to leave time for the later stages."""
    warm = warm or []
    cuda = ctx.device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    seconds, tokens, flops = [], [], []
    with matmul_precision(MATMUL_PRECISION[precision]):
        run = build(config, data, ctx.device, precision == "bf16")
        for step, group in enumerate(warm, start=1):
            run(group, step)
        for step, group in enumerate(updates, start=len(warm) + 1):
            if seconds and ctx.left() < 220:
                break
            took, n = timed(ctx.device, lambda group=group, step=step: run(group, step))
            if step > len(warm) + ctx.sizes.warmup:
                seconds.append(took)
                tokens.append(n)
                flops.append(update_flops(config, data, group))
        busy = device_busy(ctx.device, run, updates, ctx.sizes.profiled if ctx.left() > 230 else 0)
    rates = [n / s for n, s in zip(tokens, seconds, strict=True)]
    return {
        "busy": busy,
        "updates": len(seconds),
        "target_tokens_per_update": round(statistics.mean(tokens)),
        "median_update_s": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "tokens_per_s_range": [min(rates), max(rates)],
        "tflops": sum(flops) / sum(seconds) / 1e12,
        "peak_memory_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else None,
    }


def device_busy(device: torch.device, run: Callable, updates: list, count: int) -> float | None:
    """The fraction of the wall time of `count` more updates (the first of `updates` again)
    in which the GPU runs a kernel: the union of its kernels' intervals (torch.profiler, CUDA
    activity alone) over the updates' wall time, the device synchronised before and after.
    Below 1, the GPU waits for the host to launch work. None on a CPU, or where the profiler
    sees no kernel."""
    if device.type != "cuda" or count < 1:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    groups = [updates[i % len(updates)] for i in range(count)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, _ = timed(device, lambda: [run(g, len(updates) + i) for i, g in enumerate(groups)])
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]  # fmt: skip
    return covered(kernels) / (wall * 1e6) if kernels else None


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `intervals` (start, end): overlapping kernels (on several
    streams) count once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def stage_train(ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
    """`aiayn_update` (as it is, and with fixed shapes into CUDA graphs) and `reference_update`
    at each precision, on the same sentences (the fixed shapes batch them their way)."""
    sizes = ctx.sizes
    config = preset(sizes.preset, src_vocab_size=sizes.vocab)
    data, updates = training_updates(sizes)
    shapes = BatchShapes.for_lengths(max_len(sizes), sizes.max_tokens)
    _, fixed_updates = training_updates(sizes, shapes)
    graphs = functools.partial(aiayn_update, shapes=shapes)
    rows = (
        ("aiayn", aiayn_update, updates, None),
        (GRAPHS_ROW, graphs, fixed_updates, each_shape_twice(data, fixed_updates, shapes)),
        ("nn.Transformer", reference_update, updates, None),
    )
    bf16_rate = report["stages"].get("peak", {}).get("bf16_tflops")
    result: dict[str, Any] = {
        "status": "ok",
        "preset": sizes.preset,
        "vocab": sizes.vocab,
        "max_tokens": sizes.max_tokens,
        "batches_per_update": len(updates[0]),
        "rows": [],
    }
    for precision in sizes.precisions:
        for name, build, batches, warm in rows:
            if name == GRAPHS_ROW and precision != "bf16":
                continue  # its compile time goes to the later stages instead
            row: dict[str, Any] = {"model": name, "precision": precision}
            if ctx.left() < 250:
                row["error"] = "not measured: out of time"
            else:
                try:
                    row |= measure_updates(ctx, build, config, data, batches, precision, warm)
                except torch.cuda.OutOfMemoryError:
                    row["error"] = f"out of memory at --max-tokens {sizes.max_tokens}"
                    result["status"] = "failed"
                except Exception as error:  # the new path's failure keeps the other rows
                    if name != GRAPHS_ROW:
                        raise
                    row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
                    result["status"] = "failed"
                finally:
                    if name == GRAPHS_ROW:
                        torch._dynamo.reset()  # its graphs and their memory go
            if bf16_rate and "tflops" in row:
                row["mfu"] = row["tflops"] / bf16_rate
            result["rows"].append(row)
            done = row.get("error") or f"{row['tokens_per_s']:.0f} target tok/s"
            ctx.say(f"  {name} {precision}: {done}")
    ours = max(
        (r for r in result["rows"] if r["model"] != "nn.Transformer" and "tokens_per_s" in r),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    if ours is not None:
        hours = PAPER_UPDATES * PAPER_TOKENS_PER_UPDATE / ours["tokens_per_s"] / 3600
        result["paper_run"] = {
            "precision": ours["precision"],
            "hours_on_this_gpu": hours,
            "paper_hours_on_8_p100": PAPER_HOURS,
        }
    return result


# --------------------------------------------------------------------------------------------
# Stage 4: torchrun, and the DDP path through NCCL
# --------------------------------------------------------------------------------------------


def ddp_worker(train_args: list[str]) -> int:
    """Under torchrun at one process: `aiayn train` on its DDP path, through NCCL on a GPU
    (gloo on a CPU). aiayn enables DDP only for WORLD_SIZE > 1, so this worker starts the
    process group itself and opens `Distributed.enabled`: the trainer then wraps the model in
    DistributedDataParallel, runs its collectives through the group and destroys it."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    backend, wrapped = dist.get_backend(), []
    distributed.Distributed.enabled = property(lambda self: dist.is_initialized())

    class CountedDDP(setup.DistributedDataParallel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            wrapped.append(backend)

    setup.DistributedDataParallel = CountedDDP  # where set-up wraps the model
    code = aiayn_main(train_args)
    print(f"gpu_check ddp-worker: DistributedDataParallel x{len(wrapped)} over {backend}")
    return code


def stage_torchrun(ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
    """A few updates on a generated copy task under torchrun, then through `ddp_worker`: at one
    process aiayn creates no process group (and one GPU cannot hold two NCCL ranks)."""
    rng = random.Random(0)  # a copy task: lines of 2-8 random words, the target the source
    words = ["".join(rng.choices("abcdefghij", k=rng.randint(1, 4))) for _ in range(60)]
    lines = "".join(" ".join(rng.choices(words, k=rng.randint(2, 8))) + "\n" for _ in range(400))
    (ctx.work / "train.src").write_text(lines, encoding="utf-8")
    (ctx.work / "train.tgt").write_text(lines, encoding="utf-8")
    steps, device = ctx.sizes.torchrun_steps, "cpu" if ctx.smoke else ctx.args.device
    flags = (
        f"--preset tiny --vocab-size 300 --max-len 32 --max-tokens 256 --accumulate 2 "
        f"--max-steps {steps} --warmup-steps 4 --log-every 1 --valid-every 0 "
        f"--save-every {max(1, steps // 2)} --no-progress --seed 1"
    )
    train = ["train", "--src", str(ctx.work / "train.src"), "--tgt", str(ctx.work / "train.tgt"),
             *flags.split()]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                f"--log-dir={ctx.work / 'torchrun'}"]  # fmt: skip
    ddp_device = device if ":" in device or device == "cpu" else f"{device}:0"
    runs = {
        "torchrun": [*torchrun, "-m", "aiayn", *train, "--device", device],
        "torchrun-ddp": [*torchrun, str(Path(__file__).resolve()), "--ddp-worker", *train,
                         "--device", ddp_device],
    }  # fmt: skip
    result: dict[str, Any] = {"status": "ok", "steps": steps}
    losses, outputs = {}, {}
    for name, command in runs.items():
        run_dir = ctx.work / name
        timeout = max(30.0, min(180.0, ctx.left() - 60))
        code, outputs[name] = ctx.run_logged(
            [*command, "--out-dir", str(run_dir)], f"{name}.log", timeout
        )
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        losses[name] = [(r["step"], r["loss"]) for r in records if r["type"] == "train"]
        result[name] = {"exit_code": code, "updates": len(losses[name])}
        if code != 0 or len(losses[name]) != steps:
            error = f"{name}: exit {code}, {len(losses[name])} updates of {steps} (see {name}.log)"
            result |= {"status": "failed", "error": error}
    backend = "gloo" if ctx.smoke else "nccl"
    result["ddp"] = f"DistributedDataParallel x1 over {backend}" in outputs["torchrun-ddp"]
    if result["status"] == "ok" and not result["ddp"]:
        error = f"the DDP run did not wrap the model over {backend}"
        result |= {"status": "failed", "error": error}
    if result["status"] == "ok":
        pairs = zip(losses["torchrun"], losses["torchrun-ddp"], strict=True)
        result["max_loss_difference"] = gap = max(abs(a[1] - b[1]) for a, b in pairs)
        if gap > 1e-3:
            result |= {"status": "failed", "error": f"DDP's losses differ by up to {gap:.2e}"}
    ctx.say(f"  torchrun: {result['status']} {result.get('error', '')}")
    return result


# --------------------------------------------------------------------------------------------
# Stage 5: the user's job, whole commands
# --------------------------------------------------------------------------------------------


def stage_job(ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
    """The user's commands. With CTranslate2, first `--device cuda` (it converts and caches the
    export; it must decode on the GPU or stop with one line naming why), then `--device auto`
    in the rounds (the GPU, or the CPU with a warning where CTranslate2 cannot compute here)."""
    if ctx.smoke:  # an untrained demo model decodes every test number to its length limit
        return {"status": "skipped", "summary": "not run in the CPU smoke (minutes on a CPU)"}
    if importlib.util.find_spec("num2words") is None:
        why = "not run: aiayn demo needs num2words (carry its wheel)"
        return {"status": "skipped", "summary": why}
    demo_dir, sizes = ctx.work / "demo", ctx.sizes
    began = time.perf_counter()
    code, output = ctx.run_logged([*runner.AIAYN, "demo", "-o", str(demo_dir)], "demo.log",
                                  timeout=max(30.0, min(300.0, ctx.left() - 60)))  # fmt: skip
    result: dict[str, Any] = {"status": "ok", "demo_s": time.perf_counter() - began}
    if code != 0:
        return {"status": "failed", "error": f"aiayn demo: exit {code} (see demo.log)"}
    if match := DEMO_EXACT_MATCH.search(output):
        result["demo_exact_match"] = float(match.group(1)) / 100
    ctx.say(f"  aiayn demo: {result['demo_s']:.0f} s, held-out exact match "
            f"{result.get('demo_exact_match', float('nan')):.1%}")  # fmt: skip
    model, source = demo_dir / "run" / "model", demo_dir / "corpus" / "test.en"
    references = (demo_dir / "corpus" / "test.de").read_text(encoding="utf-8").splitlines()
    flags = {p: ["--device", ctx.args.device, *(["--bf16"] if p == "bf16" else [])]
             for p in sizes.job_precisions}  # fmt: skip
    env = {"AIAYN_CT2_CACHE": str(ctx.work / "ct2-cache")}  # not the machine's ~/.cache
    (ctx.args.out / "translate.log").write_text("", encoding="utf-8")  # this run's alone

    def translate(row_flags: list[str], out: Path) -> tuple[int | None, str, float]:
        command = [*runner.AIAYN, "translate", "-m", str(model), "-i",
                   str(source), "-o", str(out), "--no-progress", *row_flags]  # fmt: skip
        began = time.perf_counter()
        code, output = ctx.run_logged(
            command, "translate.log", timeout=max(20.0, min(120.0, ctx.left())),
            append=True, env=env,
        )  # fmt: skip
        return code, output, time.perf_counter() - began

    def exact_match(out: Path) -> float:
        hypotheses = out.read_text(encoding="utf-8").splitlines()
        return sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)

    if importlib.util.find_spec("ctranslate2") is not None and ctx.left() > 60:
        out = ctx.work / "demo-ct2-device.txt"
        device = ctx.args.device
        code, output, seconds = translate(["--backend", "ctranslate2", "--device", device], out)
        probe = _ct2_device_probe(device, code, output, seconds)
        result["ctranslate2_device"] = probe = {"device": device, **probe}
        if probe["status"] == "ok" and code == 0:
            probe["exact_match"] = exact_match(out)
        ctx.say(f"  aiayn translate --backend ctranslate2 --device {device}: {probe['summary']}")
        flags[CT2_ROW] = ["--backend", "ctranslate2", "--device", "auto"]
    rows = [{"precision": name, "seconds": []} for name in flags]
    for round_ in range(sizes.job_rounds):
        if result["status"] == "failed":
            break
        for index, row in enumerate(rows):
            if ctx.left() < 30 and (row["seconds"] or round_ > 0):
                continue  # out of time: a row measured once is kept
            out = ctx.work / f"demo-{round_}-{index}.txt"
            code, output, seconds = translate(flags[row["precision"]], out)
            if code != 0:  # the rows measured so far are kept
                error = f"aiayn translate {' '.join(flags[row['precision']])}: exit {code}"
                result |= {"status": "failed", "error": error + " (translate.log)"}
                break
            row["seconds"].append(seconds)
            row["exact_match"] = exact_match(out)
            if row["precision"] == CT2_ROW:
                if fallback := ct2_fallback().search(output):
                    row["ran_on"] = f"the CPU ({fallback.group(1)})"
                else:  # on a CPU the CLI logs its CPU threads
                    row["ran_on"] = "the CPU" if "CPU thread(s)" in output else "the GPU"
    result["translate"] = rows = [row for row in rows if row["seconds"]]
    for row in rows:
        row["median_s"] = statistics.median(row["seconds"])
        ctx.say(f"  aiayn translate {row['precision']}: {row['median_s']:.1f} s "
                f"({len(references)} sentences), exact match {row['exact_match']:.1%}"
                + (f", on {row['ran_on']}" if "ran_on" in row else ""))  # fmt: skip
    probe = result.get("ctranslate2_device", {})
    if probe.get("status") == "failed" and result["status"] == "ok":
        result |= {"status": "failed", "error": probe["summary"]}
    result["sentences"] = len(references)
    return result


def ct2_fallback() -> re.Pattern:
    """The CLI's warning that `--device auto` decoded on the CPU (`CT2_GPU_FALLBACK`), its
    reason the group."""
    from aiayn.cli.common import CT2_GPU_FALLBACK

    before, after = CT2_GPU_FALLBACK.split("%s")
    return re.compile(re.escape(before) + "(.*)" + re.escape(after))


def _ct2_device_probe(device: str, code: int | None, output: str, seconds: float) -> dict:
    """What `aiayn translate --backend ctranslate2 --device cuda` did: decoded (exit 0), or
    stopped with one line saying why (`cli.common._load_ct2_translator`); a traceback or a
    timeout fails the check."""
    lines = [line for line in output.splitlines() if line.strip()]
    if code == 0:
        summary = f"decoded on {device}, {seconds:.1f} s (converting included)"
        return {"status": "ok", "exit": 0, "seconds": seconds, "summary": summary}
    last = lines[-1] if lines else ""
    one_line = code is not None and "Traceback" not in output and "CTranslate2" in last
    return {
        "status": "ok" if one_line else "failed",
        "exit": code,
        "seconds": seconds,
        "message": last,
        "summary": (f"exit {code}, one line: {last}" if one_line
                    else f"exit {code}: not one line naming why (translate.log)"),
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


TRAIN_COLUMNS = [
    ("model", "model"), ("precision", "precision"), ("tokens_per_update", "target tok/update"),
    ("update_s", "s/update"), ("tokens_per_s", "target tok/s"), ("range", "min–max"),
    ("peak_gib", "peak GiB"), ("tflops", "TFLOP/s"), ("mfu", "MFU"), ("busy", "GPU busy"),
]  # fmt: skip
JOB_COLUMNS = [("decoding", "decoding"), ("wall_s", "wall time, s (rounds)"),
               ("exact_match", "exact match")]  # fmt: skip


def train_rows(train: dict[str, Any]) -> list[dict[str, Any]]:
    """The train stage's rows as its table (and its record) shows them."""
    rows = []
    for r in train.get("rows", []):
        if "error" in r:
            rows.append({"model": r["model"], "precision": r["precision"],
                         "tokens_per_update": r["error"]})  # fmt: skip
            continue
        memory = r["peak_memory_gib"]
        rows.append({
            "model": r["model"],
            "precision": r["precision"],
            "tokens_per_update": r["target_tokens_per_update"],
            "update_s": round(r["median_update_s"], 3),
            "tokens_per_s": round(r["tokens_per_s"]),
            "range": "–".join(f"{x:.0f}" for x in r["tokens_per_s_range"]),
            "peak_gib": None if memory is None else round(memory, 1),
            "tflops": round(r["tflops"], 1),
            "mfu": f"{100 * r['mfu']:.0f}%" if "mfu" in r else None,
            "busy": f"{100 * r['busy']:.0f}%" if r.get("busy") is not None else None,
        })  # fmt: skip
    return rows


def job_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job stage's `aiayn translate` rows as its table (and its record) shows them."""
    return [
        {
            "decoding": r["precision"] + (f", on {r['ran_on']}" if "ran_on" in r else ""),
            "wall_s": runner.figures(r["seconds"], 1),
            "exact_match": f"{100 * r['exact_match']:.1f}%",
        }
        for r in job.get("translate", [])
    ]


def checks(stages: dict[str, Any]) -> list[str]:
    """What the stages without a table found, as notes of the first record."""
    notes = []
    if "bf16_tflops" in (peak := stages.get("peak", {})):
        rates = ", ".join(f"{k.split('_')[0]} {v:.0f}" for k, v in peak.items() if "tflops" in k)
        notes.append(f"Matrix products {peak['n']}³, TFLOP/s: {rates}; MFU against bf16's.")
    if tests := stages.get("tests"):
        notes.append(f"`pytest tests/cuda`: {tests['status']}, "
                     f"{tests.get('summary') or tests.get('error')}.")  # fmt: skip
    if run := stages.get("torchrun"):
        detail = run.get("error") or (
            f"max |Δloss| {run['max_loss_difference']:.1e} between "
            "`torchrun --nproc_per_node=1 -m aiayn train` and the DDP run"
        )
        notes.append(f"torchrun and DDP over NCCL: {run['status']}, {detail}.")
    return notes


def job_notes(job: dict[str, Any]) -> list[str]:
    exact = job.get("demo_exact_match")
    notes = [f"`aiayn demo` {job['demo_s']:.0f} s, held-out exact match "
             f"{'?' if exact is None else f'{100 * exact:.1f}%'}."]  # fmt: skip
    if probe := job.get("ctranslate2_device"):
        command = f"aiayn translate --backend ctranslate2 --device {probe.get('device', 'cuda')}"
        notes.append(f"`{command}`: {probe['status']}, {probe['summary']}.")
    if job.get("status") != "ok":
        notes.append(f"The user's job: {job['status']}, {job.get('error')}.")
    return notes


def records(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The training and job tables as bench/runner.py's records (task "gpu"), the checks in
    the notes of the first."""
    stages, found = report["stages"], []
    say = {"command": "make gpu-check OUT=DIR", "peers": ("ctranslate2",)}
    train = stages.get("train", {})
    measured = [r for r in train.get("rows", []) if "tokens_per_s" in r]
    if measured:
        ours = max(
            (r for r in measured if r["model"] != "nn.Transformer"),
            key=lambda r: r["tokens_per_s"],
            default=measured[0],
        )  # the row of `paper_run`
        hours = train.get("paper_run", {}).get("hours_on_this_gpu", 0)
        summary = (
            f"`{ours['model']}`, {ours['precision']}: {ours['tokens_per_s']:,.0f} target "
            f"tokens/s: the paper's "
            f"100,000-update base run in {hours:.1f} h on this one GPU, against "
            f"{PAPER_HOURS:.0f} h on 8 P100s"
        )
        tokens = ours["target_tokens_per_update"]
        table = f"training `{train['preset']}`, updates of ~{tokens:,} target tokens"
        setup = f"`{train['preset']}`, random data of real lengths"
        batches = (f"Each update {train['batches_per_update']} batches of ≤ "
                   f"{train['max_tokens']:,} tokens, vocabulary {train['vocab']:,}.")  # fmt: skip
        found.append(runner.record("gpu", table=table, setup=setup, columns=TRAIN_COLUMNS,
                                   rows=train_rows(train), summary=summary, notes=[batches],
                                   **say))  # fmt: skip
    job = stages.get("job", {})
    if job.get("translate"):  # measured rows are kept, also when a later run failed
        table = (f"the user's job: `aiayn demo`, then `aiayn translate` of its "
                 f"{job['sentences']} held-out numbers")  # fmt: skip
        summary = f"`aiayn demo` trains and evaluates in {job['demo_s']:.0f} s"
        found.append(runner.record("gpu", table=table, setup="the demo's model",
                                   columns=JOB_COLUMNS, rows=job_rows(job), summary=summary,
                                   notes=job_notes(job), **say))  # fmt: skip
    if found:
        found[0]["notes"][:0] = checks(stages)
    for rec in found:
        rec["versions"]["cuda"] = torch.version.cuda
    return found


def finish(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """A GPU run's records into OUT/records.jsonl (and bench/results/gpu.jsonl with
    --record); printed, a line per stage, then the tables as BENCHMARKS.md shows them."""
    found = records(report)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in found)
    (args.out / "records.jsonl").write_text(lines, encoding="utf-8")
    if args.record:
        with (runner.RESULTS / "gpu.jsonl").open("a", encoding="utf-8") as f:
            f.write(lines)
    print("\n" + "\n".join(stage_lines(report)))
    current = page.current_hashes(found) or {}
    for rec in found:
        print("\n" + "\n".join(page.table_text([rec], current)).rstrip())


def stage_lines(report: dict[str, Any]) -> list[str]:
    """A line per stage: its status, and its error or summary."""
    lines = []
    for name, stage in report["stages"].items():
        detail = stage.get("error") or stage.get("summary")
        lines.append(f"{name}: {stage['status']}" + (f", {detail}" if detail else ""))
    return lines


STAGE_FUNCTIONS = {
    "tests": stage_tests,
    "peak": stage_peak,
    "train": stage_train,
    "torchrun": stage_torchrun,
    "job": stage_job,
}


if __name__ == "__main__":
    sys.exit(main())
