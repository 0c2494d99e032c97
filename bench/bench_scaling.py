"""Throughput and peak memory as sequences get longer and batches bigger: training and decoding.

For one preset (default `small`; `--presets small base` adds `base`) this measures

- the training step the trainer takes (`Transformer.forward` with the target: the projection
  and `loss.projected_label_smoothed_loss` with ε_ls = 0.1 in chunks, never the whole (B·T, V)
  logits; backward, the fused Adam of `optim.build_optimizer`; dropout 0.1) on random full-length
  sentences (no padding, vocabulary 8000):
  - length sweep: 32, 64, ..., 1024 tokens per side at a constant 4096 target tokens per batch
    (batch = 4096 // length), so a change in tokens/s is the cost of longer sequences and not of
    smaller batches: per token, the linear layers and the softmax cost the same at every length,
    while self-attention's scores and weighted sums grow with T (O(T²·d) per sentence, §4);
  - batch sweep: 8, 32, 128, 512 sentences of 32 tokens;
- decoding with the KV cache, greedy and beam 4 (α = 0.6), every output forced to exactly its
  length with `bench_decode.FixedLength`, sources as long as the outputs:
  - length sweep: 32, 128, 512 output tokens at batch 8;
  - batch sweep: 1, 8, 32, 128 sentences of 32 tokens.

Every point runs in a fresh child process (`--_one`), so its peak memory is its own: the peak
RSS of the child (`getrusage` ru_maxrss: interpreter, torch, weights and all the point
allocated) and its increase over the RSS right after the model was built (gradients, Adam's
state, activations, the KV cache, allocator caches), plus `torch.cuda.max_memory_allocated`
with `--device cuda` (training then runs in bf16 autocast, as the trainer does; decoding in
float32). A point in both sweeps (128 × 32 for training, 8 × 32 for decoding) is measured once.

Timing: a training point takes one warm-up step on an eighth of its batch (allocates Adam's state
and pays first-call costs), then `--steps` timed steps; a decoding point one warm-up search of 8
tokens, then `--repeats` timed searches. We report target tokens/s (for beam search: tokens of
the returned translations, not of all hypotheses) at the median time, and the min–max. With the
defaults (3 and 3) the `small` run should take about 13 minutes on a 2-core CPU (estimated from
timing single points: a 4096-token step ~8 s, a 512-token step ~24 s, searches of 8 × 512
tokens ~27 s greedy and ~75 s beam 4, ~3 s to start each child); `base` takes several times as
long. `--quick` is a smoke run on smaller grids with one timed step (under a minute with
`--presets tiny`).

    .venv/bin/python bench/bench_scaling.py                        # small, ~13 min on 2 cores
    .venv/bin/python bench/bench_scaling.py --quick --presets tiny # smoke run
    .venv/bin/python bench/bench_scaling.py --update-benchmarks    # rewrite BENCHMARKS.md section
    .venv/bin/python bench/bench_scaling.py --device cuda          # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from aiayn.acceleration import use_cpu_attention
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.optim import build_optimizer, set_learning_rate
from aiayn.text.tokenizer import PAD_ID
from bench_decode import FixedLength, time_search
from bench_train_step import _load_average, machine_info, make_batch

# bench/ scripts import each other: running one puts bench/ on sys.path
from benchmarks_md import BENCHMARKS_MD, replace_section

VOCAB_SIZE = 8000  # joint vocabulary, shared embeddings (§3.4)
DROPOUT = 0.1  # training points; decoding runs in eval mode
LABEL_SMOOTHING = 0.1
DECODE_WARMUP_LEN = 8  # output tokens of the warm-up search
MIB = 2**20
START_MARK = "<!-- bench_scaling:start -->"
END_MARK = "<!-- bench_scaling:end -->"
HEADING = "## Scaling: throughput and peak memory vs sequence length and batch size"
PARTS = {"train": "train step", "greedy": "greedy", "beam4": "beam 4"}


@dataclass(frozen=True)
class Grid:
    """The points to measure. Batch sweeps run at the shortest length of their part."""

    tokens_per_batch: int  # training length sweep: batch = tokens_per_batch // length
    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    decode_batch: int  # decoding length sweep
    decode_lengths: tuple[int, ...]
    decode_batches: tuple[int, ...]


FULL = Grid(
    tokens_per_batch=4096,
    lengths=(32, 64, 128, 256, 512, 1024),
    batches=(8, 32, 128, 512),
    decode_batch=8,
    decode_lengths=(32, 128, 512),
    decode_batches=(1, 8, 32, 128),
)
QUICK = Grid(512, lengths=(32, 64), batches=(8, 16), decode_batch=2, decode_lengths=(8, 16),
             decode_batches=(1, 2))  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One measurement: `kind` "train", "greedy" or "beam4"; `length` tokens per sentence (for
    decoding, source and output length)."""

    kind: str
    batch: int
    length: int


def plan(grid: Grid) -> list[tuple[str, Point]]:
    """(sweep, point) rows in the order of the table."""
    rows = [("length", Point("train", grid.tokens_per_batch // n, n)) for n in grid.lengths]
    rows += [("batch", Point("train", b, grid.lengths[0])) for b in grid.batches]
    for mode in ("greedy", "beam4"):
        rows += [("length", Point(mode, grid.decode_batch, n)) for n in grid.decode_lengths]
        rows += [("batch", Point(mode, b, grid.decode_lengths[0])) for b in grid.decode_batches]
    return rows


# -- one point, in the child process --------------------------------------------------------


def rss_mib() -> float:
    """Resident memory now (Linux /proc), else the peak so far."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, else KiB


def time_training(
    model: Transformer, point: Point, *, steps: int, device: torch.device, seed: int
) -> list[float]:
    """Seconds per training step: one warm-up step on an eighth of the batch, then `steps`."""
    model.train()
    optimizer = build_optimizer(model)
    set_learning_rate(optimizer, 1e-4)  # the rate does not change the work of a step

    def autocast() -> AbstractContextManager[object]:
        if device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return nullcontext()

    def step(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
        src, tgt_in, tgt_out = batch
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            sums = model(src, tgt_in, tgt_out, label_smoothing=LABEL_SMOOTHING)
        (sums.loss / sums.n_tokens).backward()
        optimizer.step()
        return sums.loss.item()  # .item() synchronises the device

    step(make_batch(max(1, point.batch // 8), point.length, VOCAB_SIZE, device, seed))
    batch = make_batch(point.batch, point.length, VOCAB_SIZE, device, seed)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    return times


def time_decoding(
    model: Transformer, point: Point, *, repeats: int, device: torch.device, seed: int
) -> list[float]:
    """Seconds per search of `point.batch` sources of `point.length` tokens, each output forced
    to `point.length` tokens; one short warm-up search first."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB_SIZE, (point.batch, point.length), generator=g).to(device)
    warm = min(point.length, DECODE_WARMUP_LEN)
    time_search(FixedLength(model, warm), src[:, :warm], point.kind, warm)
    fixed = FixedLength(model, point.length)
    return [time_search(fixed, src, point.kind, point.length) for _ in range(repeats)]


def measure(point: Point, preset_name: str, args: argparse.Namespace) -> dict[str, object]:
    """Build the model, time `point` and read this process's peak memory."""
    device = torch.device(args.device)
    dropout = DROPOUT if point.kind == "train" else 0.0
    config = preset(preset_name, src_vocab_size=VOCAB_SIZE, pad_id=PAD_ID, dropout=dropout)
    torch.manual_seed(args.seed)
    model = Transformer(config).to(device)
    if device.type == "cpu":  # as the trainer and Translator on a CPU
        use_cpu_attention(model)
    result: dict[str, object] = {"rss_model_mib": rss_mib()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if point.kind == "train":
        times = time_training(model, point, steps=args.steps, device=device, seed=args.seed)
    else:
        times = time_decoding(model, point, repeats=args.repeats, device=device, seed=args.seed)
    result.update(times_s=times, peak_rss_mib=peak_rss_mib())
    if device.type == "cuda":
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    return result


# -- the sweep, in the parent process -------------------------------------------------------


def run_point(point: Point, preset_name: str, args: argparse.Namespace) -> dict[str, object]:
    """`measure` in a fresh child process, so that its peak memory is the point's alone."""
    spec = json.dumps({"preset": preset_name, **asdict(point)})
    command = [sys.executable, str(Path(__file__).resolve()), "--_one", spec]
    command += ["--device", args.device, "--threads", str(args.threads), "--seed", str(args.seed)]
    command += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
    started = time.perf_counter()
    child = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - started
    if child.returncode != 0:  # e.g. killed for memory: report it and go on
        return {"error": f"child exited with status {child.returncode}", "wall_s": wall}
    result = json.loads(child.stdout.strip().splitlines()[-1])
    tokens = point.batch * point.length
    times = result["times_s"]
    return {
        **result,
        "wall_s": wall,
        "target_tokens": tokens,
        "median_s": statistics.median(times),
        "median_tokens_per_s": tokens / statistics.median(times),
        "min_tokens_per_s": tokens / max(times),
        "max_tokens_per_s": tokens / min(times),
        "increase_mib": result["peak_rss_mib"] - result["rss_model_mib"],
    }


def run_preset(preset_name: str, grid: Grid, args: argparse.Namespace) -> list[dict[str, object]]:
    """Every row of the plan; a point in both sweeps is measured once."""
    measured: dict[Point, dict[str, object]] = {}
    rows = []
    for sweep, point in plan(grid):
        if point not in measured:
            measured[point] = run_point(point, preset_name, args)
            m = measured[point]
            label = f"[{preset_name}] {PARTS[point.kind]} {point.batch} × {point.length}"
            if "error" in m:
                print(f"{label}: {m['error']}", flush=True)
            else:
                print(
                    f"{label}: {m['median_tokens_per_s']:.0f} tok/s "
                    f"({m['min_tokens_per_s']:.0f}–{m['max_tokens_per_s']:.0f}), "
                    f"peak RSS {m['peak_rss_mib']:.0f} MiB (+{m['increase_mib']:.0f}) "
                    f"[{m['wall_s']:.0f} s]",
                    flush=True,
                )
        rows.append({"preset": preset_name, "sweep": sweep, **asdict(point), **measured[point]})
    return rows


def markdown_table(rows: list[dict[str, object]], cuda: bool) -> str:
    header = (
        "| preset | part | sweep | batch × tokens | target tokens | median tok/s | min–max "
        "| median time (s) | peak RSS (MiB) | + over model (MiB) |"
    )
    rule = "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if cuda:
        header, rule = header + " CUDA peak (MiB) |", rule + " ---: |"
    lines = [header, rule]
    for r in rows:
        first = (
            f"| {r['preset']} | {PARTS[r['kind']]} | {r['sweep']} | {r['batch']} × {r['length']} "
            f"| {r['batch'] * r['length']} "
        )
        if "error" in r:
            lines.append(first + f"| {r['error']} |" + " |" * (5 + cuda))
            continue
        line = (
            first + f"| {r['median_tokens_per_s']:.0f} "
            f"| {r['min_tokens_per_s']:.0f}–{r['max_tokens_per_s']:.0f} | {r['median_s']:.3g} "
            f"| {r['peak_rss_mib']:.0f} | {r['increase_mib']:.0f} |"
        )
        if cuda:
            line += f" {r.get('cuda_peak_mib', float('nan')):.0f} |"
        lines.append(line)
    return "\n".join(lines)


def _sweep(rows: list[dict[str, object]], kind: str, sweep: str) -> list[dict[str, object]]:
    return [r for r in rows if r["kind"] == kind and r["sweep"] == sweep and "error" not in r]


def _ratio(x: float) -> str:
    return f"×{x:.2f}" if x < 10 else f"×{x:.0f}"


def _span(rows: list[dict[str, object]], key: str) -> str:
    """'x → y tok/s (×r) from <key> a to b' over the first and last rows of a sweep."""
    a, b = rows[0]["median_tokens_per_s"], rows[-1]["median_tokens_per_s"]
    return f"{a:.0f} → {b:.0f} tok/s ({_ratio(b / a)}) from {key} {rows[0][key]} to {rows[-1][key]}"


def reading(rows: list[dict[str, object]]) -> str:
    """A paragraph that reads the table of one preset: every number in it comes from `rows`."""
    sentences = []
    lengths = _sweep(rows, "train", "length")
    if len(lengths) >= 2:
        first, last = lengths[0], lengths[-1]
        rates = ", ".join(f"{r['length']}: {r['median_tokens_per_s']:.0f}" for r in lengths)
        ratio = last["median_tokens_per_s"] / first["median_tokens_per_s"]
        why = (
            "per token the linear layers and the softmax cost the same at every length, so what "
            "grows is self-attention, where each of T queries scores and sums T keys (T² per "
            "sentence)"
            if ratio < 0.85
            else f"at these lengths the linear layers and the {VOCAB_SIZE}-way softmax "
            "dominate, and attention's T² term barely shows"
        )
        sentences.append(
            f"Training at a constant {first['target_tokens']} target tokens per batch, tok/s by "
            f"sentence length: {rates} ({_ratio(ratio)} from {first['length']} to "
            f"{last['length']} tokens): {why}. The memory a step adds over the model goes from "
            f"{first['increase_mib']:.0f} to {last['increase_mib']:.0f} MiB."
        )
    batches = _sweep(rows, "train", "batch")
    if len(batches) >= 2:
        a, b = batches[0], batches[-1]
        per_k = (b["increase_mib"] - a["increase_mib"]) / (
            (b["target_tokens"] - a["target_tokens"]) / 1000
        )
        sentences.append(
            f"At {a['length']} tokens per sentence, training goes {_span(batches, 'batch')} "
            f"sentences, and the memory over the model from {a['increase_mib']:.0f} to "
            f"{b['increase_mib']:.0f} MiB, about {per_k:.0f} MiB per 1000 target tokens."
        )
    for kind in ("greedy", "beam4"):
        by_length, by_batch = _sweep(rows, kind, "length"), _sweep(rows, kind, "batch")
        parts = []
        if len(by_length) >= 2:
            batch = by_length[0]["batch"]
            parts.append(f"{_span(by_length, 'length')} output tokens at batch {batch}")
        if len(by_batch) >= 2:
            parts.append(f"{_span(by_batch, 'batch')} sentences at {by_batch[0]['length']} tokens")
        if parts:
            peak = max(by_length + by_batch, key=lambda r: r["increase_mib"])
            sentences.append(
                f"{PARTS[kind].capitalize()} decoding goes {'; '.join(parts)}; it needs at most "
                f"{peak['increase_mib']:.0f} MiB over the model ({peak['batch']} × "
                f"{peak['length']})."
            )
    return " ".join(sentences)


def render_section(
    rows: list[dict[str, object]], info: dict[str, object], args: argparse.Namespace
) -> str:
    machine = f"{info['cpu']}, {info['cores']} cores, {args.threads} torch threads"
    if "gpu" in info:
        machine = f"{info['gpu']} ({machine}); training in bf16 autocast, decoding in float32"
    command = ".venv/bin/python bench/bench_scaling.py " + shlex.join(args.argv)
    presets = dict.fromkeys(r["preset"] for r in rows)
    readings = [reading([r for r in rows if r["preset"] == p]) for p in presets]
    return "\n".join(
        [
            markdown_table(rows, cuda="gpu" in info),
            "",
            *(f"**{p}.** {text}\n" for p, text in zip(presets, readings, strict=True) if text),
            f"- Machine: {machine}; torch {info['torch']}, Python {info['python']}.",
            f"- 1-minute load average {info['load_average']} the run (the machine may be "
            "shared: compare rows of one run, not across runs).",
            f"- Training: 1 warm-up step on ⅛ of the batch, then {args.steps} timed; decoding: "
            f"1 warm-up search of {DECODE_WARMUP_LEN} tokens, then {args.repeats} timed. Every "
            "point in its own process; peak RSS is that process's maximum, '+ over model' its "
            "increase over the RSS right after the model was built.",
            f"- Command: `{command.strip()}` (took {info['minutes']:.1f} min).",
            f"- Run on {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        ]
    )


EXPLANATION = f"""{HEADING}

`bench/bench_scaling.py` measures how throughput (target tokens/s) and peak memory change with
sequence length and batch size, for the training step (forward, label-smoothed loss, backward,
fused Adam; dropout 0.1) and for decoding with the KV cache (greedy and beam 4, every output
forced to its length as in `bench_decode.py`), on random weights and random full-length
sentences from a vocabulary of 8000. The training length sweep keeps the number of target tokens
per batch constant, so what changes is only the length. Every point runs in its own process, so
its peak RSS is its own. The default run (`small`) takes about a quarter of an hour on the
2-core CPU (the time of each run is recorded below):

```sh
.venv/bin/python bench/bench_scaling.py --update-benchmarks
```
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small"])
    parser.add_argument("--quick", action="store_true", help="smoke run: small grids, 1 step")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps (3)")
    parser.add_argument("--repeats", type=int, default=None, help="timed searches (3)")
    parser.add_argument("--tokens", type=int, default=None, help="target tokens per batch (4096)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--update-benchmarks",
        action="store_true",
        help=f"rewrite the bench_scaling section of {BENCHMARKS_MD.name}",
    )
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)  # child: one point
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for the record in BENCHMARKS.md
    grid = QUICK if args.quick else FULL
    args.steps = args.steps or (1 if args.quick else 3)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.tokens is not None:
        grid = replace(grid, tokens_per_batch=args.tokens)
    args.grid = grid
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if grid.tokens_per_batch < max(grid.lengths):
        parser.error(f"--tokens ({grid.tokens_per_batch}) must be >= {max(grid.lengths)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args._one is not None:
        spec = json.loads(args._one)
        preset_name = spec.pop("preset")
        print(json.dumps(measure(Point(**spec), preset_name, args)))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but CUDA is not available")
    info = machine_info(device)
    print(
        f"torch {info['torch']} on {info['cpu']} ({info['cores']} cores), {args.threads} "
        f"threads per point, device {device}; one child process per point",
        flush=True,
    )
    load_before, started = _load_average(), time.perf_counter()
    rows = [row for name in args.presets for row in run_preset(name, args.grid, args)]
    info["load_average"] = f"{load_before} before, {_load_average()} after"
    info["minutes"] = (time.perf_counter() - started) / 60
    print(f"\n{markdown_table(rows, cuda=device.type == 'cuda')}\n")
    for name in args.presets:
        print(f"{name}: {reading([r for r in rows if r['preset'] == name])}")
    print(f"\ntook {info['minutes']:.1f} minutes")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    if args.update_benchmarks:
        replace_section(
            BENCHMARKS_MD, START_MARK, END_MARK, render_section(rows, info, args), EXPLANATION
        )
        print(f"updated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
