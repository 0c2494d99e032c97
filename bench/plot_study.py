"""Learning curves of `aiayn train` runs that differ in one setting (the small-data study, #30).

Each run NAME is a run directory STUDY_DIR/NAME (its metrics.jsonl, train_config.yaml and,
once `aiayn evaluate --json` has scored its model on the dev set, dev.bleu.json). Draws into
OUT_DIR:

* PREFIX-ppl-updates.png: dev perplexity (log scale) against updates, one colour per run; the
  raw weights solid, their moving average (`ema_decay`) dashed where the run kept one.
* PREFIX-ppl-time.png: the same against the run's wall time. A validation record has no time
  of its own: it takes the `elapsed_s` of the train record at its step (the trainer logs one
  there when `valid_every` is a multiple of `log_every`, and at the last update), else the
  time interpolated between the neighbouring ones; the validation's own time falls into the
  train interval that follows it.
* PREFIX-table.md, also printed: per run the settings of its train_config.yaml that differ from
  the reference run's (the first, or --reference; data files compared by name), updates done,
  wall minutes at the last train record (the final validation and save not included), the last
  dev perplexity of the raw and averaged weights, the weights model/ holds (the run log's
  "model" record), dev BLEU and chrF (– until dev.bleu.json is there) and the median of the
  trainer's target tokens/s per logged interval (the first left out). A run still training
  can be drawn: only complete lines of its log are read.

The figures in docs/figures were made with:

    nice -n 19 .venv/bin/python bench/plot_study.py /work/bench-runs/study \\
        --runs A-base:base ... --out-dir docs/figures --prefix study
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # drawn without pyplot: the Agg canvas, no window
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from aiayn.train.rundir import read_config
from aiayn.train.runlog import read_metrics

# train_config.yaml keys that differ between runs without making them different runs.
NOT_COMPARED = {"out_dir", "progress", "tensorboard", "log_every"}
DATA_KEYS = {"src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv", "tokenizer"}
NONE = "–"


def differences(config: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The settings of `config` that differ from `reference`'s (data files by name; the
    fields of `model` one by one, as `model.dropout`)."""

    def flat(values: dict[str, Any]) -> dict[str, Any]:
        nested = {f"model.{k}": v for k, v in (values.get("model") or {}).items()}
        return {**{k: v for k, v in values.items() if k != "model"}, **nested}

    def comparable(key: str, value: Any) -> Any:
        return Path(value).name if key in DATA_KEYS and value else value

    config, reference = flat(config), flat(reference)
    keys = [*config, *(k for k in reference if k not in config)]
    return {
        key: config.get(key)
        for key in keys
        if key not in NOT_COMPARED
        and comparable(key, config.get(key)) != comparable(key, reference.get(key))
    }


def read_scores(path: Path) -> dict[str, Any]:
    """dev.bleu.json, or {} while it is missing, empty or half written (evaluation running)."""
    try:
        scores = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return scores if isinstance(scores, dict) else {}


def read_run(run_dir: Path) -> dict[str, Any]:
    """What the figures and the table need from one run directory."""
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("type") == "train"]
    valid = [r for r in records if r.get("type") == "valid"]
    model = [r for r in records if r.get("type") == "model"]
    config = read_config(run_dir) or {}
    timed = [r for r in train if r.get("elapsed_s") is not None]  # none in old logs
    steps = [r["step"] for r in valid]
    minutes = None
    if timed and steps:
        seconds = np.interp(steps, [r["step"] for r in timed], [r["elapsed_s"] for r in timed])
        minutes = [float(t) / 60 for t in seconds]
    # No "model" record: without an average model/ holds the raw weights; with one, the run
    # has not ended yet.
    kept = model[-1]["weights"] if model else NONE if config.get("ema_decay") else "raw"
    rates = [r["tokens_per_s"] for r in train]
    return {
        "config": config,
        "steps": steps,
        "minutes": minutes,
        "raw": [r["valid_ppl"] for r in valid],
        "ema": [r.get("valid_ema_ppl") for r in valid],
        "updates": max((r.get("step", 0) for r in records), default=0),
        "wall_minutes": timed[-1]["elapsed_s"] / 60 if timed else None,
        "kept": kept,
        "tokens_per_s": statistics.median(rates[1:] or rates) if rates else None,
        "scores": read_scores(run_dir / "dev.bleu.json"),
    }


def draw(runs: dict[str, dict[str, Any]], x_key: str, xlabel: str, title: str) -> Figure:
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    ax = figure.add_subplot()
    any_ema = False
    for i, (label, run) in enumerate(runs.items()):
        x = run[x_key]
        if x is None or not run["steps"]:
            print(f"{label}: no {xlabel} to draw", file=sys.stderr)
            continue
        ax.plot(x, run["raw"], "-", color=f"C{i}", marker=".", label=label)
        ema = [j for j, ppl in enumerate(run["ema"]) if ppl is not None]
        if ema:
            any_ema = True
            ax.plot([x[j] for j in ema], [run["ema"][j] for j in ema], "--", color=f"C{i}")
    if any_ema:  # say once what the line styles mean
        ax.plot([], [], "-", color="grey", label="raw weights")
        ax.plot([], [], "--", color="grey", label="moving average (EMA)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel=xlabel, ylabel="dev perplexity (log scale)", title=title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return figure


def fmt(value: float | None, spec: str) -> str:
    return NONE if value is None else format(value, spec)


def markdown(runs: dict[str, dict[str, Any]], reference: str) -> str:
    head = (
        "| run | settings that differ from the reference's | updates | wall (min) "
        "| dev ppl raw | dev ppl EMA | model/ holds | dev BLEU | dev chrF | tok/s (median) |"
    )
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    base = runs[reference]["config"]
    for label, run in runs.items():
        changed = differences(run["config"], base)
        settings = ", ".join(f"{k} {v}" for k, v in changed.items()) or "none"
        if label == reference:
            settings = "(reference)"
        last_raw = run["raw"][-1] if run["raw"] else None
        last_ema = run["ema"][-1] if run["ema"] else None
        scores = run["scores"]
        cells = [
            label,
            settings,
            str(run["updates"]),
            fmt(run["wall_minutes"], ".1f"),
            fmt(last_raw, ".2f"),
            fmt(last_ema, ".2f"),
            run["kept"],
            fmt(scores.get("bleu"), ".2f"),
            fmt(scores.get("chrf"), ".2f"),
            fmt(run["tokens_per_s"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("study_dir", type=Path, help="the folder holding one run directory per run")
    p.add_argument("--runs", nargs="+", required=True, metavar="NAME[:LABEL]")
    p.add_argument("--out-dir", type=Path, default=Path("docs/figures"))
    p.add_argument("--prefix", default="study")
    p.add_argument("--reference", metavar="NAME", help="the run settings are compared to")
    args = p.parse_args(argv)

    names = dict(spec.partition(":")[::2] for spec in args.runs)
    labels = {name: label or name for name, label in names.items()}
    reference = args.reference or next(iter(names))
    if reference not in names:
        p.error(f"--reference {reference} is not one of --runs")
    missing = [n for n in names if not (args.study_dir / n / "metrics.jsonl").is_file()]
    if missing:
        p.error(f"no metrics.jsonl in {', '.join(str(args.study_dir / n) for n in missing)}")
    runs = {labels[name]: read_run(args.study_dir / name) for name in names}

    valid_tgt = runs[labels[reference]]["config"].get("valid_tgt") or ""
    where = f"{args.study_dir.name}: {Path(valid_tgt).parent.name}/{Path(valid_tgt).name}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for x_key, xlabel, what, suffix in (
        ("steps", "updates", "updates", "updates"),
        ("minutes", "wall time (min)", "wall time", "time"),
    ):
        figure = draw(runs, x_key, xlabel, f"Dev perplexity against {what} ({where})")
        path = args.out_dir / f"{args.prefix}-ppl-{suffix}.png"
        figure.savefig(path, dpi=110)
        print(f"wrote {path}", file=sys.stderr)
    table = markdown(runs, labels[reference])
    (args.out_dir / f"{args.prefix}-table.md").write_text(table, encoding="utf-8")
    print(table, end="")


if __name__ == "__main__":
    main()
