"""Dev perplexity per update of whole `aiayn train` runs that differ in one setting, side by side.

Issue #17 asks that CPU bf16 training (`--precision bf16`) learn as fp32 does, update for update.
Each variant is a name and the extra `aiayn train` arguments that make it, trained on the same
recipe, data and validation set into `RUNS_DIR/NAME`:

    .venv/bin/python bench/bench_learning_curves.py --src DATA/train.en --tgt DATA/train.es \\
        --valid-src DATA/dev.en --valid-tgt DATA/dev.es --runs-dir runs/curves \\
        --variant fp32= --variant bf16="--precision bf16" \\
        --variant "bf16-seed2=--precision bf16 --seed 2"

Every run trains for the same number of updates with no time budget, whatever the recipe says
(`--time-budget none --max-steps N --schedule S`, given before the variant's own arguments,
which may override them): under a budget (the Bible recipe's 30 minutes) a run's length and its
decaying schedule would follow its own pace, and two variants would no longer get the same
learning rate at the same update. The defaults, 1200 updates of Eq. 3 (`--max-steps 1200
--schedule inverse_sqrt`), are the length and schedule of the recipe the earlier tables were
made with; the other settings (model, batch size, `lr_scale`) are the recipe's as it is now.

The first variant is the reference. A variant whose directory already holds a finished run
(a model and a validation at its last update) is read, not trained again, and the table says
so; a run stopped before its end is continued (`--resume`). A run directory trained for another
length or schedule, or with a time budget, is refused (unless the variant's arguments set
these themselves). The script records each variant's arguments in its run directory
(`variant.json`) and refuses a reused run trained with other ones; for a run trained without
the script (no `variant.json`) the table shows, as for every run, the settings of its
`train_config.yaml` that differ from the reference's (data files compared by name), so a reused
run cannot pass for another. A pair of variants that differ only in the seed measures
run-to-run noise: a difference between precisions means something only where it is larger.

Reported per validation step: each run's dev perplexity (– where a run has no validation at
that step) and its relative difference to the reference; per run: the settings that differ
from the reference's, the median of the trainer's own target tokens/s per logged interval (the
first left out), the training time summed from those intervals (periodic validations and saves
fall inside the intervals that follow them, so they are counted; the final validation is not)
and the last validation's step and perplexity.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from aiayn.optim import SCHEDULES
from aiayn.train.rundir import read_config
from aiayn.train.runlog import read_metrics
from bench_train_run import aiayn_command, run_training
from bench_train_step import _load_average, machine_info

# bench/ scripts import each other: running one puts bench/ on sys.path
from benchmarks_md import BENCHMARKS_MD, replace_section

START_MARK = "<!-- bench_learning_curves:start -->"
END_MARK = "<!-- bench_learning_curves:end -->"
HEADING = "## Learning curves: bf16 against fp32, update for update"
VARIANT_FILE = "variant.json"
# train_config.yaml keys that differ between runs without making them different runs.
NOT_COMPARED = {"out_dir", "progress", "tensorboard"}
DATA_KEYS = {"src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv", "tokenizer"}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=ARGS` → (NAME, [ARGS split as a shell would])."""
    name, sep, arguments = text.partition("=")
    if not sep or not name or "/" in name or name in (".", ".."):
        raise argparse.ArgumentTypeError(f"--variant wants NAME=ARGS, got {text!r}")
    return name, shlex.split(arguments)


def finished(run_dir: Path) -> bool:
    """Whether `run_dir` holds a finished run: a model, and a validation at its last update."""
    config = read_config(run_dir)
    if config is None or not (run_dir / "model" / "config.json").is_file():
        return False
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    last = config.get("max_steps")
    return any(r.get("type") == "valid" and r["step"] == last for r in read_metrics(run_dir))


def check_variant(run_dir: Path, extra: list[str]) -> None:
    """Refuse a run directory the script trained with other arguments."""
    recorded = run_dir / VARIANT_FILE
    if recorded.is_file():
        earlier = json.loads(recorded.read_text(encoding="utf-8"))["args"]
        if earlier != extra:
            raise SystemExit(
                f"{run_dir} was trained with {shlex.join(earlier)!r}, not {shlex.join(extra)!r}: "
                "choose another --runs-dir or variant name"
            )


def _sets(extra: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def check_length(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> None:
    """Refuse a run directory trained for another length or schedule, or with a time budget,
    than the script gives (where the variant's own arguments do not set these)."""
    config = read_config(run_dir)
    if config is None:
        return
    wanted = {"max_steps": args.max_steps, "schedule": args.schedule, "time_budget": None}
    for key, value in wanted.items():
        if not _sets(extra, "--" + key.replace("_", "-")) and config.get(key) != value:
            raise SystemExit(
                f"{run_dir} was trained with {key} {config.get(key)!r}, not {value!r}: choose "
                "another --runs-dir, or the --max-steps and --schedule that made it"
            )


def train(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> None:
    """Run `aiayn train` into `run_dir`, continuing a run stopped before its end."""
    command = [*aiayn_command(), "train", "-c", args.config, "--src", args.src, "--tgt", args.tgt]
    command += ["--valid-src", args.valid_src, "--valid-tgt", args.valid_tgt]
    command += ["--time-budget", "none", "--max-steps", str(args.max_steps)]
    command += ["--schedule", args.schedule, "--out-dir", str(run_dir), "--no-progress", *extra]
    if (run_dir / "checkpoints").is_dir():
        command.append("--resume")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / VARIANT_FILE).write_text(json.dumps({"args": extra}) + "\n", encoding="utf-8")
    print("running: " + shlex.join(command), flush=True)
    run_training(command)


def differences(config: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The settings of `config` that differ from `reference`'s (data files by name)."""

    def comparable(key: str, value: Any) -> Any:
        return Path(value).name if key in DATA_KEYS and value else value

    return {
        key: value
        for key, value in config.items()
        if key not in NOT_COMPARED and comparable(key, value) != comparable(key, reference.get(key))
    }


def summarise(run_dir: Path) -> dict[str, Any]:
    """A run's settings, dev perplexity per validation step and speed, from its own files."""
    records = read_metrics(run_dir)
    valid = {r["step"]: r["valid_ppl"] for r in records if r.get("type") == "valid"}
    train_records = [r for r in records if r.get("type") == "train"]
    if not train_records or not valid:
        raise SystemExit(f"{run_dir}: no training or validation records in its metrics.jsonl")
    seen, seconds, rates = 0, 0.0, []
    for r in train_records:
        interval = (r["tokens_seen"] - seen) / r["tokens_per_s"]
        seconds, seen = seconds + interval, r["tokens_seen"]
        rates.append(r["tokens_per_s"])
    return {
        "config": read_config(run_dir),
        "valid_ppl": valid,
        "tokens_per_s_median": statistics.median(rates[1:] or rates),
        "loop_minutes": seconds / 60,
        "steps": train_records[-1]["step"],
    }


def markdown(runs: dict[str, dict[str, Any]]) -> str:
    names = list(runs)
    reference = names[0]
    steps = sorted(set.union(*(set(r["valid_ppl"]) for r in runs.values())))
    head = ["step", *(f"{n} ppl" for n in names), *(f"{n} vs {reference}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]
    for step in steps:
        ppl = [runs[n]["valid_ppl"].get(step) for n in names]
        cells = ["–" if p is None else f"{p:.2f}" for p in ppl]
        diffs = ["–" if p is None or ppl[0] is None else f"{p / ppl[0] - 1:+.1%}" for p in ppl[1:]]
        lines.append(f"| {step} | " + " | ".join([*cells, *diffs]) + " |")
    lines += [
        "",
        "| run | settings that differ from the reference's | reused | steps | tok/s (median) "
        "| training (min) | last validation: ppl (step) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    base = runs[reference]["config"]
    for name, run in runs.items():
        changed = differences(run["config"], base)
        settings = ", ".join(f"{k} {v}" for k, v in changed.items()) or "—"
        last = max(run["valid_ppl"])
        lines.append(
            f"| {name} | {settings} | {'yes' if run['reused'] else 'no'} | {run['steps']} "
            f"| {run['tokens_per_s_median']:.0f} | {run['loop_minutes']:.1f} "
            f"| {run['valid_ppl'][last]:.2f} ({last}) |"
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
    parser.add_argument(
        "--max-steps",
        type=int,
        default=1200,
        help="updates of every run, with no time budget (default %(default)s)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="inverse_sqrt",
        help="learning-rate schedule of every run (default %(default)s: Eq. 3)",
    )
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
    if len({tuple(extra) for _, extra in args.variant}) != len(args.variant):
        parser.error("two --variant with the same arguments would be the same run")
    if args.max_steps < 1:
        parser.error("--max-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info(torch.device("cpu"))
    load_before = _load_average()
    runs: dict[str, dict[str, Any]] = {}
    for name, extra in args.variant:
        run_dir = args.runs_dir / name
        check_variant(run_dir, extra)
        check_length(args, run_dir, extra)
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
                f"- Recipe `{args.config}`, {args.max_steps} updates of the `{args.schedule}` "
                "schedule and no time budget for every run, validation on "
                f"`{Path(args.valid_src).name}`; variants: {variants}.",
                f"- Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, "
                f"Python {info['python']}; 1-minute load average {load_before} before the "
                f"script, {_load_average()} after (reused runs were trained earlier: their "
                "speed is from their own logs).",
                f"- Command: `{command}`",
                f"- Table written on {time.strftime('%Y-%m-%d %H:%M %Z')}.",
            ]
        )
        replace_section(BENCHMARKS_MD, START_MARK, END_MARK, section, EXPLANATION)
        print(f"updated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
