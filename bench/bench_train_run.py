"""Tokens/s of a whole `aiayn train` run on real data: start-up, vocabulary, data and saving too.

`bench_train_step.py` times the step alone; this runs the real command in a child process,

    aiayn train -c RECIPE --src SRC --tgt TGT [--valid-src VSRC --valid-tgt VTGT]
        --out-dir OUT --max-steps N --log-every L --no-progress [ARGS after --]

timestamps each of its log lines as it arrives and reads its metrics log (`metrics.jsonl`)
afterwards. Reported:

- the wall time from launch to exit, split at the trainer's log lines into start-up
  (interpreter, imports, the check that the corpus is line-aligned UTF-8), the joint BPE
  vocabulary, the binarised data cache, building the model and optimizer, the training loop
  (up to the last "step N" line) and what follows it (the final validation, if a validation set
  is given, the save, exit); their sum up to the loop is the time before the first step;
- steady-state target tokens/s: the trainer's own figure for each logged interval (`tokens_per_s`
  of the "train" records: the interval's target tokens / its wall time, batching and collation
  included) over all intervals but the first, which holds the first steps' one-time costs;
- loop tokens/s (all steps) and overall tokens/s: every target token trained on / the whole wall
  time, start-up and saving included.

The run directory is a fresh temporary one by default (deleted afterwards), so the vocabulary
and data cache are built from scratch as in a first run; `--out-dir` keeps the run (it must not
hold a run's checkpoints: the trainer refuses). Arguments after `--` go to `aiayn train`.

    .venv/bin/python bench/bench_train_run.py --src DATA/train.en --tgt DATA/train.es
    .venv/bin/python bench/bench_train_run.py --src DATA/train.en --tgt DATA/train.es \\
        --max-steps 100 --update-benchmarks          # a few minutes with the CPU recipe, 2 cores
    .venv/bin/python bench/bench_train_run.py --src ... --tgt ... -- --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from aiayn.train.runlog import read_metrics
from bench_train_step import _load_average, machine_info

# bench/ scripts import each other: running one puts bench/ on sys.path
from benchmarks_md import BENCHMARKS_MD, replace_section

REPO = Path(__file__).resolve().parent.parent
START_MARK = "<!-- bench_train_run:start -->"
END_MARK = "<!-- bench_train_run:end -->"
HEADING = "## Full training run: `aiayn train` on real data"

# Where each phase starts: the first (or last) log line matching the pattern. A phase whose
# line does not appear (no vocabulary is trained when one is given, say) merges into the one
# before.
PHASES = [
    ("start-up: imports, corpus check", None, "first"),
    ("joint BPE vocabulary", re.compile(r"training a joint BPE vocabulary"), "first"),
    ("data cache (binarise)", re.compile(r"(building|reusing) data cache"), "first"),
    ("model, optimizer", re.compile(r"aiayn\.train\.trainer: (train|valid) data: "), "last"),
    ("training loop", re.compile(r"aiayn\.train\.trainer: model: "), "first"),
]
STEP_LINE = re.compile(r"aiayn\.train\.trainer: step (\d+): loss")
MODEL_LINE = re.compile(r"model: ([\d,]+) parameters, (\d+) train pairs.* on (\S+)$")


def aiayn_command() -> list[str]:
    """The `aiayn` console script of this interpreter's environment, else `python -m aiayn`."""
    script = Path(sys.executable).with_name("aiayn")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "aiayn"]


def run_training(command: list[str]) -> tuple[float, list[tuple[float, str]]]:
    """Run `command`, echo its output with timestamps; (wall seconds, [(seconds, line)])."""
    lines: list[tuple[float, str]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            elapsed = time.perf_counter() - started
            lines.append((elapsed, line.rstrip("\n")))
            print(f"  [{elapsed:7.1f} s] {line.rstrip()}", flush=True)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"aiayn train exited with status {child.returncode}")
    return wall, lines


def phases(wall: float, lines: list[tuple[float, str]]) -> list[tuple[str, float]]:
    """(phase, seconds) from launch to exit, split at the trainer's log lines."""
    starts = [(PHASES[0][0], 0.0)]
    for name, pattern, which in PHASES[1:]:
        times = [t for t, line in lines if pattern.search(line)]
        if times:
            starts.append((name, times[0] if which == "first" else times[-1]))
    last_step = [t for t, line in lines if STEP_LINE.search(line)]
    if last_step:
        starts.append(("after the last step: validation, save, exit", last_step[-1]))
    ends = [t for _, t in starts[1:]] + [wall]
    return [(name, end - start) for (name, start), end in zip(starts, ends, strict=True)]


def throughput(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per logged interval: target tokens, seconds, steps; and the steady state (all intervals
    but the first, or the only one)."""
    train = [r for r in records if r.get("type") == "train"]
    if not train:
        raise SystemExit("the run logged no training records: raise --max-steps")
    intervals, seen, step = [], 0, 0
    for r in train:
        tokens = r["tokens_seen"] - seen
        intervals.append(
            {"steps": r["step"] - step, "tokens": tokens, "seconds": tokens / r["tokens_per_s"]}
        )
        seen, step = r["tokens_seen"], r["step"]
    steady = intervals[1:] or intervals
    rates = [i["tokens"] / i["seconds"] for i in steady]
    seconds = sum(i["seconds"] for i in steady)
    return {
        "steps": step,
        "target_tokens": seen,
        "intervals": intervals,
        "steady_intervals": len(steady),
        "steady_tokens_per_s": sum(i["tokens"] for i in steady) / seconds,
        "steady_step_s": seconds / sum(i["steps"] for i in steady),
        "interval_tokens_per_s_median": statistics.median(rates),
        "interval_tokens_per_s_range": (min(rates), max(rates)),
        "first_interval_tokens_per_s": intervals[0]["tokens"] / intervals[0]["seconds"],
    }


def markdown(result: dict[str, Any]) -> str:
    wall, t = result["wall_s"], result["throughput"]
    lines = ["| phase | seconds | share of the run |", "| --- | ---: | ---: |"]
    for name, seconds in result["phases"]:
        if name == "training loop":
            name = f"training loop ({t['steps']} steps)"
        lines.append(f"| {name} | {seconds:.1f} | {seconds / wall:.1%} |")
    lines.append(f"| **total** | **{wall:.1f}** | 100% |")
    loop = dict(result["phases"])["training loop"]
    lo, hi = t["interval_tokens_per_s_range"]
    lines += [
        "",
        "| steps | target tokens | per step | steady-state tok/s | step (s) "
        "| per interval: median | min–max | whole loop tok/s | overall tok/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {t['steps']} | {t['target_tokens']} | {t['target_tokens'] / t['steps']:.0f} "
        f"| **{t['steady_tokens_per_s']:.0f}** | {t['steady_step_s']:.2f} "
        f"| {t['interval_tokens_per_s_median']:.0f} | {lo:.0f}–{hi:.0f} "
        f"| {t['target_tokens'] / loop:.0f} | {t['target_tokens'] / wall:.0f} |",
    ]
    return "\n".join(lines)


def render_section(result: dict[str, Any], info: dict[str, Any], args: argparse.Namespace) -> str:
    t, config = result["throughput"], result["config"]
    threads = config.get("threads") or f"torch default, {info['threads']}"
    command = ".venv/bin/python bench/bench_train_run.py " + shlex.join(args.argv)
    return "\n".join(
        [
            markdown(result),
            "",
            f"- Run: recipe `{args.config}` (preset `{config['preset']}`, batches of ≤ "
            f"{config['max_tokens']} tokens, accumulate {config['accumulate']}), "
            f"{result['train_pairs']} training pairs from `{Path(args.src).name}` → "
            f"`{Path(args.tgt).name}`, validation "
            f"{'on ' + Path(args.valid_src).name if args.valid_src else 'none'}, logged every "
            f"{args.log_every} steps; {result['before_first_step_s']:.0f} s before the first step, "
            f"{t['steady_intervals']} interval(s) in the steady state (the first, "
            f"{t['first_interval_tokens_per_s']:.0f} tok/s, is left out).",
            f"- Machine: {info['cpu']}, {info['cores']} cores, device {result['device']}, "
            f"threads: {threads}; torch {info['torch']}, Python {info['python']}.",
            f"- 1-minute load average {info['load_average']} the run (the machine may be shared).",
            f"- Command: `{command.strip()}`",
            f"- Run on {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        ]
    )


EXPLANATION = f"""{HEADING}

`bench/bench_train_run.py` runs the real `aiayn train` in a child process on real parallel text
and reports where the wall time goes (start-up, vocabulary, data cache, training loop, final
validation and save) and target tokens/s three ways: steady state (the trainer's own per-interval
figure, batching and collation included, first interval left out), over the whole loop, and over
the whole run. It needs the data files on the command line, e.g. the Bible corpus:

```sh
.venv/bin/python bench/bench_train_run.py --src DATA/train.en --tgt DATA/train.es \\
    --max-steps 100 --update-benchmarks
```
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, help="training source text, one line per pair")
    parser.add_argument("--tgt", required=True, help="training target text, line-aligned")
    parser.add_argument("--valid-src", help="validation source (optional)")
    parser.add_argument("--valid-tgt", help="validation target (optional)")
    parser.add_argument(
        "-c", "--config", default="recipes/bible-en-es-cpu.yaml", help="training recipe (YAML)"
    )
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=None, help="default: max-steps / 10")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: a temporary dir")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--update-benchmarks",
        action="store_true",
        help=f"rewrite the bench_train_run section of {BENCHMARKS_MD.name}",
    )
    parser.add_argument("train_args", nargs="*", help="after --: more `aiayn train` arguments")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for the record in BENCHMARKS.md
    if args.max_steps < 2:
        parser.error("--max-steps must be >= 2")
    if (args.valid_src is None) != (args.valid_tgt is None):
        parser.error("--valid-src and --valid-tgt go together")
    args.log_every = args.log_every or max(1, args.max_steps // 10)
    return args


def bench(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    command = [*aiayn_command(), "train", "-c", args.config, "--src", args.src, "--tgt", args.tgt]
    if args.valid_src:
        command += ["--valid-src", args.valid_src, "--valid-tgt", args.valid_tgt]
    command += ["--out-dir", str(out_dir), "--max-steps", str(args.max_steps)]
    command += ["--log-every", str(args.log_every), "--no-progress", *args.train_args]
    print("running: " + shlex.join(command), flush=True)
    wall, lines = run_training(command)
    split = phases(wall, lines)
    names = [name for name, _ in split]
    if "training loop" not in names:
        raise SystemExit("no 'model: ...' line from the trainer: cannot tell where training began")
    model_line = next((m for _, line in lines if (m := MODEL_LINE.search(line))), None)
    config = yaml.safe_load((out_dir / "train_config.yaml").read_text(encoding="utf-8"))
    return {
        "command": command,
        "wall_s": wall,
        "phases": split,
        "before_first_step_s": sum(s for _, s in split[: names.index("training loop")]),
        "throughput": throughput(read_metrics(out_dir)),
        "train_pairs": int(model_line.group(2)) if model_line else "?",
        "device": model_line.group(3) if model_line else config["device"],
        "config": config,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info(torch.device("cpu"))
    load_before = _load_average()
    if args.out_dir is None:
        with tempfile.TemporaryDirectory(prefix="bench_train_run-") as tmp:
            result = bench(args, Path(tmp) / "run")
    else:
        result = bench(args, args.out_dir)
    info["load_average"] = f"{load_before} before, {_load_average()} after"
    print(f"\n{markdown(result)}\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, **result}, indent=2, default=str))
    if args.update_benchmarks:
        replace_section(
            BENCHMARKS_MD, START_MARK, END_MARK, render_section(result, info, args), EXPLANATION
        )
        print(f"updated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
