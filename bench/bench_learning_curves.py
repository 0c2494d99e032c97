"""Dev perplexity per update of whole `aiayn train` runs that differ in one setting, side by side.

Issue #17 asks that CPU bf16 training (`--cpu-bf16`) learn as fp32 does, update for update.
Each variant is a name and the extra `aiayn train` arguments that make it, trained on the same
recipe, data and validation set into `RUNS_DIR/NAME`:

    .venv/bin/python bench/bench_learning_curves.py --src DATA/train.en --tgt DATA/train.es \\
        --valid-src DATA/dev.en --valid-tgt DATA/dev.es --runs-dir runs/curves \\
        --variant fp32= --variant bf16=--cpu-bf16 --variant 'bf16-seed2=--cpu-bf16 --seed 2'

The first variant is the reference. A variant whose directory already holds a finished run
(`model/config.json` and validation records in `metrics.jsonl`) is read, not trained again, and
the table says so; the settings compared are read back from each run's `train_config.yaml`, so
a reused run cannot pass for another. A pair of variants that differ only in the seed measures
run-to-run noise: the difference between precisions means something only where it is larger.

Reported per validation step: each run's dev perplexity and its relative difference to the
reference; per run: steady-state target tokens/s (the trainer's own log), the wall time of the
training loop and the final validation perplexity.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from aiayn.runlog import read_metrics
from bench_train_run import aiayn_command, run_training

# bench/ scripts import each other: running one puts bench/ on sys.path
from benchmarks_md import BENCHMARKS_MD, replace_section

START_MARK = "<!-- bench_learning_curves:start -->"
END_MARK = "<!-- bench_learning_curves:end -->"
HEADING = "## Learning curves: bf16 against fp32, update for update"
# Settings that tell runs apart; shown for each run, read from its train_config.yaml.
COMPARED = ("cpu_bf16", "onednn", "seed", "compile", "max_steps", "max_tokens", "preset")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=ARGS` → (NAME, [ARGS split as a shell would])."""
    name, sep, arguments = text.partition("=")
    if not sep or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=ARGS, got {text!r}")
    return name, shlex.split(arguments)


def finished(run_dir: Path) -> bool:
    """Whether `run_dir` holds a finished run with validation records."""
    if not (run_dir / "model" / "config.json").is_file():
        return False
    return any(r.get("type") == "valid" for r in read_metrics(run_dir))


def train(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> float:
    """Run `aiayn train` into `run_dir`; its wall seconds."""
    command = [*aiayn_command(), "train", "-c", args.config, "--src", args.src, "--tgt", args.tgt]
    command += ["--valid-src", args.valid_src, "--valid-tgt", args.valid_tgt]
    command += ["--out-dir", str(run_dir), "--no-progress", *extra]
    print("running: " + shlex.join(command), flush=True)
    wall, _ = run_training(command)
    return wall


def summarise(run_dir: Path) -> dict[str, Any]:
    """A run's settings, dev perplexity per validation step and speed, from its own files."""
    config = yaml.safe_load((run_dir / "train_config.yaml").read_text(encoding="utf-8"))
    records = read_metrics(run_dir)
    valid = {r["step"]: r["valid_ppl"] for r in records if r.get("type") == "valid"}
    train_records = [r for r in records if r.get("type") == "train"]
    seen, seconds, rates = 0, 0.0, []
    for r in train_records:
        interval = (r["tokens_seen"] - seen) / r["tokens_per_s"]
        seconds, seen = seconds + interval, r["tokens_seen"]
        rates.append(r["tokens_per_s"])
    return {
        "settings": {key: config.get(key) for key in COMPARED},
        "valid_ppl": valid,
        "tokens_per_s_median": statistics.median(rates[1:] or rates) if rates else None,
        "loop_minutes": seconds / 60,
        "steps": train_records[-1]["step"] if train_records else 0,
    }


def markdown(runs: dict[str, dict[str, Any]]) -> str:
    names = list(runs)
    reference = names[0]
    steps = sorted(set.intersection(*(set(r["valid_ppl"]) for r in runs.values())))
    head = ["step", *(f"{n} ppl" for n in names), *(f"{n} vs {reference}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]
    for step in steps:
        ppl = [runs[n]["valid_ppl"][step] for n in names]
        diffs = [f"{p / ppl[0] - 1:+.1%}" for p in ppl[1:]]
        lines.append(f"| {step} | " + " | ".join([*(f"{p:.2f}" for p in ppl), *diffs]) + " |")
    lines += ["", "| run | settings | reused | steps | tok/s (median) | loop (min) |"]
    lines.append("| --- | --- | --- | ---: | ---: | ---: |")
    for name, run in runs.items():
        settings = ", ".join(f"{k} {v}" for k, v in run["settings"].items())
        rate = run["tokens_per_s_median"]
        lines.append(
            f"| {name} | {settings} | {'yes' if run['reused'] else 'no'} | {run['steps']} "
            f"| {rate:.0f} | {run['loop_minutes']:.1f} |"
        )
    return "\n".join(lines)


EXPLANATION = f"""{HEADING}

`bench/bench_learning_curves.py` trains the same recipe with one setting changed and puts the
dev perplexities side by side, validation by validation; two runs that differ only in the seed
give the run-to-run noise the precision difference is measured against.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)
    parser.add_argument("--valid-src", required=True)
    parser.add_argument("--valid-tgt", required=True)
    parser.add_argument("-c", "--config", default="recipes/bible-en-es-cpu.yaml")
    parser.add_argument("--runs-dir", type=Path, required=True, help="one run directory a variant")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        required=True,
        help="NAME=ARGS: a run with these extra `aiayn train` arguments (the first: reference)",
    )
    parser.add_argument(
        "--update-benchmarks",
        action="store_true",
        help=f"rewrite the bench_learning_curves section of {BENCHMARKS_MD.name}",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if len(args.variant) < 2:
        parser.error("give at least two --variant")
    if len({name for name, _ in args.variant}) != len(args.variant):
        parser.error("--variant names must differ")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    for name, extra in args.variant:
        run_dir = args.runs_dir / name
        reused = finished(run_dir)
        if reused:
            print(f"{name}: reading the finished run in {run_dir}", flush=True)
        else:
            train(args, run_dir, extra)
        runs[name] = {**summarise(run_dir), "reused": reused, "args": extra}
    table = markdown(runs)
    print(f"\n{table}\n")
    if args.update_benchmarks:
        command = ".venv/bin/python bench/bench_learning_curves.py " + shlex.join(args.argv)
        variants = "; ".join(
            f"{name} = `{shlex.join(run['args']) or '(the recipe as it is)'}`"
            for name, run in runs.items()
        )
        section = "\n".join(
            [
                table,
                "",
                f"- Recipe `{args.config}`, validation on `{Path(args.valid_src).name}`; "
                f"variants: {variants}.",
                f"- Command: `{command}`",
                f"- Table written on {time.strftime('%Y-%m-%d %H:%M %Z')}.",
            ]
        )
        replace_section(BENCHMARKS_MD, START_MARK, END_MARK, section, EXPLANATION)
        print(f"updated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
