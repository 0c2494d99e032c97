"""The small-data study of docs/small-data.md, and the recipe's own run: `make bench-study`.

`run` trains `aiayn train -c recipes/bible-en-es-cpu.yaml` once per run, each changing one
setting of a common base (`RUNS`), then scores its model with `aiayn evaluate` on the
validation set (beam 4): whole commands, each in a process of its own, one after another (they
share the CPU otherwise: run nothing beside them). Each run appends one record to
bench/results/study.jsonl, and the run `recipe` (the recipe exactly as a user runs it, its
30-minute budget included) and `recipe-2x` (the same with `--time-budget 60m`) to
bench/results/recipe.jsonl; a run whose STUDY_DIR/NAME/
valid.bleu.json exists is skipped. Every study run has a step count and a linear decay to 0 at
its last update, so what it learns does not depend on how busy the machine is; its wall time
does.

    python bench/study.py run DATA runs/study                      # every run of RUNS
    python bench/study.py run DATA runs/study I0-xavier I1-fairseq
    python bench/study.py run DATA runs/recipe recipe              # the recipe's own run
    python bench/study.py run DATA runs/recipe recipe-2x           # ... at twice its budget
    python bench/study.py run DATA runs/recipe fairseq --fairseq-bin FAIRSEQ_BIN

The run `fairseq` is the recipe's peer: `fairseq-train` given the recipe's settings for the
same budget (`--budget`), its updates foreseen by a pilot run (`--pilot`), scored as
`aiayn evaluate` scores; its record goes into recipe.jsonl (bench/fairseq_peer.py says how).

DATA is a folder made by `aiayn prepare bible-en-es` (train.*, valid.*); where it has test.* too
(`--test-books`), each run is scored on that split as well, its BLEU recorded as `test_bleu`.

`average` scores the last checkpoints of runs averaged (`aiayn average -n N`, N of `--last`)
beside the model each run kept, on the validation set; one record in recipe.jsonl:

    python bench/study.py average DATA runs/recipe recipe recipe-s2 --last 2 3 5

`plot` draws the learning curves of runs that differ in one setting. Each run NAME is a run
directory STUDY_DIR/NAME (its metrics.jsonl, train_config.yaml and, once evaluated,
valid.bleu.json); a run still training can be drawn. Into OUT_DIR:

* PREFIX-ppl-updates.png: dev perplexity (log scale) against updates, one colour per run; the
  raw weights solid, their moving average (`ema_decay`) dashed where the run kept one.
* PREFIX-ppl-time.png: the same against the run's wall time (`read_run` says how).
* PREFIX-table.md, also printed: per run the settings of its train_config.yaml that differ from
  the reference run's (the first, or --reference; data files compared by name), then its
  updates, wall minutes, last validation perplexities, the weights model/ holds, BLEU, chrF
  (– until valid.bleu.json is there) and tokens/s (`PLOT_COLUMNS`).

    python bench/study.py plot runs/study --runs S1-base:base S2-tok2048 ... \\
        --out-dir docs/figures --prefix study
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # drawn without pyplot: the Agg canvas, no window
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

import runner
from aiayn.train.rundir import read_config
from aiayn.train.runlog import read_metrics

# train_config.yaml keys that differ between runs without making them different runs.
NOT_COMPARED = {"out_dir", "progress", "tensorboard", "log_every"}
DATA_KEYS = {"src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv", "tokenizer"}
NONE = "–"

# Every study run gives each setting that differs from the recipe as it is now: the recipe took
# S5's settings, then fairseq's initialisation (the S runs drew tensor2tensor's: init=xavier),
# then S12's 2+2 layers (the S runs have the `small` preset's 3+3 unless they say otherwise).
# bf16 (a CPU with AMX or AVX512-BF16) learns the same per update as float32.
COMMON = ["--precision", "bf16", "--ema-decay", "0.999", "--schedule", "linear",
          "--time-budget", "none", "--valid-every", "100", "--save-every", "0"]  # fmt: skip
LAYERS3 = "--model n_encoder_layers=3 --model n_decoder_layers=3"
BASE = f"--max-tokens 4096 --lr-scale 0.5 --model norm_first=false --model init=xavier {LAYERS3}"
S5 = (
    "--max-steps 1200 --warmup-steps 400 --max-tokens 2048 --lr-scale 1.0 "
    f"--model norm_first=true --model init=xavier {LAYERS3}"
)
S8 = f"{S5} --model init=fairseq"  # the base of S9-S13, each changing one of its settings
# The initialisation runs: S5's model and batches, 500 updates of Eq. 3 in float32 without an
# average, as fairseq-train ran beside the recipe.
INIT = f"{S5} --max-steps 500 --schedule inverse_sqrt --precision fp32 --ema-decay 0"
# A greedy search: the first runs change one setting of the base (BASE: the recipe before the
# study), the later ones one setting of the best run so far (S2, then S5, then S8).
RUNS = {name: flags.split() for name, flags in {
    "S1-base": f"--max-steps 600 --warmup-steps 200 {BASE}",
    "S2-tok2048": f"--max-steps 1200 --warmup-steps 400 {BASE} --max-tokens 2048",
    "S3-lr1": f"--max-steps 600 --warmup-steps 200 {BASE} --lr-scale 1.0",
    "S5-tok2048-prenorm-lr1": S5,
    "S4-bpe4k": f"{S5} --vocab-size 4000",
    "S6-lr2": f"{S5} --lr-scale 2.0",
    "S7-dropout03": f"{S5} --model dropout=0.3",
    "I0-xavier": INIT,
    "I1-fairseq": f"{INIT} --model init=fairseq",
    "S8-fairseq-init": S8,
    "S9-warmup200": f"{S8} --warmup-steps 200",
    "S10-ls02": f"{S8} --label-smoothing 0.2",
    "S11-bpe2k": f"{S8} --vocab-size 2000",
    "S12-layers2": f"{S8} --model n_encoder_layers=2 --model n_decoder_layers=2",
    "S13-width384": f"{S8} --model d_model=384 --model d_ff=1536",
}.items()}  # fmt: skip
# The full budget, counted in updates: each run makes the updates that the recipe's 30 minutes
# buy on a 2-core AMD EPYC with AVX512-BF16 with its settings (their speed measured there, idle),
# on the same linear schedule, so what it learns does not depend on how busy the machine is.
# The recipe in float32 made 3,493 and 3,753 updates in its 30 minutes; in short runs on that
# CPU bf16 trained 1.43x its target tokens per second (the harness's training table: 1.37x),
# without dropout 1.07x more, with batches of 1,024 tokens 0.88x as many (twice the updates, its
# warm-up as many tokens), with 3 encoder layers and 1 decoder layer 1.12x more, at d_model 192
# (d_ff 768) 1.33x more (two interleaved runs of 150 updates each against the recipe's); dropout
# 0.2 and the peak's size cost what the recipe's do. B8 keeps the recipe's peak (Eq. 3 would
# raise it by sqrt(256/192) = 1.15 at d_model 192: `--lr-scale 0.866`). BPE-dropout 0.1 (the
# paper's value, Provilkov et al., 2020) trains as many tokens per second and spends ~8 s
# segmenting the corpus before the first update: 25 updates fewer. A joint 16k BPE vocabulary
# (not 8k) makes 0.76x the updates: 0.53 s an update against 0.40 (two interleaved runs of 160
# updates each; 1,784 target tokens an update against 1,826).
FULL = "--schedule linear --time-budget none --save-every 0"
WIDTH192 = "--model d_model=192 --model d_ff=768 --lr-scale 0.866"  # B8's, at the recipe's peak
BF16 = f"{FULL} --precision bf16"
FULL_RUNS = {name: flags.split() for name, flags in {
    "B0-recipe": f"{FULL} --precision fp32 --max-steps 3600",
    "B1-bf16": f"{BF16} --max-steps 5100",
    "B2-bf16-dropout0": f"{BF16} --max-steps 5450 --model dropout=0.0",
    "B3-bf16-tok1024": f"{BF16} --max-steps 9000 --max-tokens 1024 --warmup-steps 800",
    "B4-bf16-dropout02": f"{BF16} --max-steps 5100 --model dropout=0.2",
    "B5-bf16-lr15": f"{BF16} --max-steps 5100 --lr-scale 1.5",
    "B6-bf16-lr075": f"{BF16} --max-steps 5100 --lr-scale 0.75",
    "B7-bf16-enc3-dec1": f"{BF16} --max-steps 5700 --model n_encoder_layers=3 "
    "--model n_decoder_layers=1",
    "B8-bf16-width192": f"{BF16} --max-steps 6800 {WIDTH192}",
    "B9-bf16-bpe-dropout01": f"{BF16} --max-steps 5075 --bpe-dropout 0.1",
    "B10-bf16-bpe16k": f"{BF16} --max-steps 3900 --vocab-size 16000",
    # The schedule's shape at the same peak: a warm-up of 200 updates, not 400, with the rate
    # scaled by 1/sqrt(2) (Eq. 3 peaks at d_model^-0.5 * warmup^-0.5: the same 3.1e-3, twice as
    # soon); and Eq. 3's own decay after the peak, cooled down linearly to 0 over the last 20% of
    # the updates (a warmup-stable-decay shape), not the linear decay from the peak.
    "B11-bf16-warmup200": f"{BF16} --max-steps 5100 --warmup-steps 200 --lr-scale 0.7071",
    "B12-bf16-cooldown": f"{BF16} --max-steps 5100 --schedule inverse_sqrt_cooldown",
    # The same runs from a second seed (initialisation, dropout, batch order).
    "B0-recipe-s2": f"{FULL} --precision fp32 --max-steps 3600 --seed 2",
    "B1-bf16-s2": f"{BF16} --max-steps 5100 --seed 2",
    "B8-bf16-width192-s2": f"{BF16} --max-steps 6800 {WIDTH192} --seed 2",
}.items()}  # fmt: skip
# Fixed batch shapes (`--static-shapes`, a GPU's CUDA graphs; with `--compile`, the loss over
# the whole logits in the compiled graph) against the recipe's own batches from two seeds: 600
# updates each in float32, each run's schedule decaying to 0 at its last, so that learning per
# update is compared, not speed (padding makes a CPU slower).
SHAPES = f"{FULL} --precision fp32 --max-steps 600 --valid-every 100"
FULL_RUNS |= {name: flags.split() for name, flags in {
    "G0-recipe-600": SHAPES,
    "G0-recipe-600-s2": f"{SHAPES} --seed 2",
    "G1-static-shapes-compile": f"{SHAPES} --static-shapes --compile",
    "G1-static-shapes-compile-s2": f"{SHAPES} --static-shapes --compile --seed 2",
}.items()}  # fmt: skip
STUDY_COLUMNS = [("run", "run"), ("flags", "settings on top of the recipe"), ("updates", "updates"),
                 ("minutes", "minutes"), ("valid_ppl", "validation perplexity"),
                 ("bleu", "BLEU"), ("chrf", "chrF")]  # fmt: skip
RECIPE_COLUMNS = [("run", "run"), ("flags", "settings on top of the recipe"),
                  ("budget", "time budget"),
                  ("updates", "updates"), ("valid_ppl", "validation perplexity"),
                  ("bleu", "BLEU"), ("chrf", "chrF"), ("peak_rss", "peak RSS")]  # fmt: skip
TEST_COLUMN = ("test_bleu", "test BLEU")  # where DATA has a test split
PEER = "fairseq"  # the recipe's run by fairseq-train (bench/fairseq_peer.py)
# The recipe exactly as a user runs it, at twice its 30-minute budget (its schedule stretches
# to the budget: the same command with `--time-budget 60m`), and in its own budget with a lever
# of the study for a CPU where it runs in float32 and makes fewer passes over the corpus:
# d_model 192 (d_ff 768) at the recipe's peak (B8 of FULL_RUNS: more updates), no dropout (B2:
# learns faster per update until it overfits); each also from a second seed. And the `small`
# preset's own depth, 3+3 layers, in the recipe's budget: the depth the recipe gave up, and the
# second model of `bench/translate.py`'s tables.
DROPOUT0 = "--model dropout=0.0"
LAYERS3 = "--model n_encoder_layers=3 --model n_decoder_layers=3"
RECIPE_RUNS = {"recipe": [], "recipe-2x": ["--time-budget", "60m"],
               "recipe-width192": WIDTH192.split(), "recipe-s2": ["--seed", "2"],
               "recipe-width192-s2": [*WIDTH192.split(), "--seed", "2"],
               "recipe-dropout0": DROPOUT0.split(),
               "recipe-dropout0-s2": [*DROPOUT0.split(), "--seed", "2"],
               "recipe-layers3": LAYERS3.split()}  # fmt: skip


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
    """valid.bleu.json, or {} while it is missing, empty or half written (evaluation running)."""
    try:
        scores = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return scores if isinstance(scores, dict) else {}


def read_run(run_dir: Path) -> dict[str, Any]:
    """What the figures and the table need from one run directory. A validation has no time of
    its own: it takes the `elapsed_s` of the train record at its step (logged there when
    `valid_every` is a multiple of `log_every`, and at the last update), else the time
    interpolated between its neighbours. Wall minutes: at the last train record (the final
    validation and save left out); tokens/s: the median of the logged intervals but the first."""
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
        "scores": read_scores(run_dir / "valid.bleu.json"),
    }


def dev_set(config: dict[str, Any]) -> str:
    """What a run validated on, for a figure's title: the split of its `aiayn prepare` manifest
    that holds the file ("dev: books Ruth, Jonah, Mark"), else the file's name."""
    path = Path(config.get("valid_tgt") or config.get("valid_tsv") or "")
    if not path.name:
        return "dev"
    try:
        manifest = json.loads((path.parent / "manifest.json").read_text(encoding="utf-8"))
        for split in manifest["splits"].values():
            if path.name in split["files"].values():
                return f"dev: {split['origin']}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return f"dev: {path.name}"


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


PLOT_COLUMNS = [("run", "run"), ("settings", "settings that differ from the reference's"),
                ("updates", "updates"), ("minutes", "wall (min)"), ("raw", "dev ppl raw"),
                ("ema", "dev ppl EMA"), ("kept", "model/ holds"), ("bleu", "dev BLEU"),
                ("chrf", "dev chrF"), ("tokens_per_s", "tok/s (median)")]  # fmt: skip


def markdown(runs: dict[str, dict[str, Any]], reference: str) -> str:
    rows, base = [], runs[reference]["config"]
    for label, run in runs.items():
        changed = differences(run["config"], base)
        settings = ", ".join(f"{k} {v}" for k, v in changed.items()) or "none"
        rows.append({
            "run": label,
            "settings": "(reference)" if label == reference else settings,
            "updates": run["updates"],
            "minutes": fmt(run["wall_minutes"], ".1f"),
            "raw": fmt(run["raw"][-1] if run["raw"] else None, ".2f"),
            "ema": fmt(run["ema"][-1] if run["ema"] else None, ".2f"),
            "kept": run["kept"],
            "bleu": fmt(run["scores"].get("bleu"), ".2f"),
            "chrf": fmt(run["scores"].get("chrf"), ".2f"),
            "tokens_per_s": fmt(run["tokens_per_s"], ".0f"),
        })  # fmt: skip
    return runner.markdown_table(PLOT_COLUMNS, rows) + "\n"


def run_one(args: argparse.Namespace, name: str, load: float | None) -> None:
    """Train and evaluate run `name` in processes of their own; append its record."""
    out = args.study_dir / name
    if (out / "valid.bleu.json").is_file():
        print(f"{name}: done, skipped")
        return
    data = args.data
    if name in RECIPE_RUNS:
        flags = RECIPE_RUNS[name]
    else:
        flags = FULL_RUNS.get(name) or [*COMMON, *RUNS[name]]
    given = FULL_RUNS.get(name) or RUNS.get(name, [])  # what the record says differs
    train = [*runner.AIAYN, "train", "-c", runner.RECIPE, "--src", str(data / "train.en"),
             "--tgt", str(data / "train.es"), "--valid-src", str(data / "valid.en"),
             "--valid-tgt", str(data / "valid.es"), "--out-dir", str(out), "--no-progress",
             "--threads", str(args.threads), *flags]  # fmt: skip
    evaluate = [*runner.AIAYN, "evaluate", "-m", str(out / "model"), "--json", "--no-progress",
                "--threads", str(args.threads)]  # fmt: skip
    on = {split: ["--src", str(data / f"{split}.en"), "--ref", str(data / f"{split}.es"),
                  "-o", str(out / f"{split}.hyp")] for split in ("valid", "test")}  # fmt: skip
    has_test = (data / "test.en").is_file()
    env = runner.with_src_on_path(os.environ)
    print(f"{time.strftime('%H:%M')} {name}: {' '.join(flags)}", flush=True)
    args.study_dir.mkdir(parents=True, exist_ok=True)
    with open(args.study_dir / f"{name}.train.log", "w", encoding="utf-8") as log:
        code, _, peak_kib = runner.run_to(train, log, env=env)
    if code != 0:
        raise subprocess.CalledProcessError(code, train)
    peak = peak_kib / 2**20  # GiB
    for split in ("test", "valid") if has_test else ("valid",):  # valid.bleu.json: run done
        done = subprocess.run([*evaluate, *on[split]], capture_output=True, text=True, env=env,
                              check=True, preexec_fn=runner.ends_with_benchmark)  # fmt: skip
        (out / f"{split}.bleu.json").write_text(done.stdout, encoding="utf-8")
    got = read_run(out)
    ppl = round(got["raw"][-1], 2) if got["raw"] else None
    bleu, chrf = got["scores"].get("bleu"), got["scores"].get("chrf")
    row = {"updates": got["updates"], "valid_ppl": ppl, "minutes": fmt(got["wall_minutes"], ".1f"),
           "bleu": bleu and round(bleu, 2), "chrf": chrf and round(chrf, 2)}  # fmt: skip
    if name in RECIPE_RUNS:
        budget = got["config"].get("time_budget")
        row |= {"run": name, "flags": " ".join(flags),
                "budget": f"{budget}, ended at {row.pop('minutes')} min",
                "peak_rss": f"{peak:.1f} GiB"}  # fmt: skip
        task, columns, table = "recipe", RECIPE_COLUMNS, "the recipe, 2 threads"
        pairs = len((data / "valid.en").read_text(encoding="utf-8").splitlines())
        if name == "recipe-2x":
            how = f" at twice the recipe's budget (`{' '.join(flags)}`; "
        else:
            how = f" with `{' '.join(flags)}` (" if flags else " ("
        setup = f"`aiayn prepare bible-en-es`'s corpus{how}validation set: {pairs} pairs)"
        summary = (f"BLEU {row['bleu']}, chrF {row['chrf']} after a {budget} budget "
                   f"({row['updates']:,} updates)")  # fmt: skip
    else:
        row |= {"run": name, "flags": " ".join(given)}
        task, columns, table, setup = "study", STUDY_COLUMNS, "the small-data study", name
        summary = ""
    if has_test:
        test_bleu = read_scores(out / "test.bleu.json").get("bleu")
        row["test_bleu"], columns = test_bleu and round(test_bleu, 2), [*columns, TEST_COLUMN]
    rec = runner.record(task, table=table, setup=setup, columns=columns, rows=[row],
                        summary=summary, machine_name=args.machine, load=load,
                        command=f"python bench/study.py run DATA RUNS {name}")  # fmt: skip
    runner.write(rec, args)


AVERAGE_COLUMNS = [("run", "run"), ("last", "checkpoints averaged"), ("steps", "their steps"),
                   ("bleu", "BLEU"), ("chrf", "chrF")]  # fmt: skip


def average(args: argparse.Namespace) -> None:
    """Score the runs' last checkpoints averaged (`aiayn average`), beside the model each run
    kept; one record of every run and count."""
    from aiayn.train.checkpoint import list_checkpoints  # what `aiayn average` averages

    env = runner.with_src_on_path(os.environ)
    valid = ["--src", str(args.data / "valid.en"), "--ref", str(args.data / "valid.es")]
    rows = []
    for name in args.names:
        run = args.study_dir / name
        steps = [int(p.name.removeprefix("step_")) for p in list_checkpoints(run)]
        for last in [1, *sorted(set(args.last) - {1})]:
            model = run / "model"
            if last > 1:
                if last > len(steps):
                    raise SystemExit(f"{run}: {len(steps)} checkpoints, fewer than {last}")
                model = run / f"averaged-{last}"
                subprocess.run([*runner.AIAYN, "average", "-n", str(last), "-o", str(model),
                                str(run)], check=True, stdout=subprocess.DEVNULL, env=env,
                               preexec_fn=runner.ends_with_benchmark)  # fmt: skip
            done = subprocess.run([*runner.AIAYN, "evaluate", "-m", str(model), *valid, "--json",
                                   "--no-progress", "--threads", str(args.threads),
                                   "-o", str(run / f"valid.averaged-{last}.hyp")],
                                  capture_output=True, text=True, env=env, check=True,
                                  preexec_fn=runner.ends_with_benchmark)  # fmt: skip
            scores = json.loads(done.stdout)
            kept = ", ".join(f"{s:,}" for s in steps[-last:]) if last > 1 else "model/"
            bleu, chrf = round(scores["bleu"], 2), round(scores["chrf"], 2)
            rows.append({"run": name, "last": last, "steps": kept, "bleu": bleu, "chrf": chrf})
            print(rows[-1], flush=True)
    pairs = len((args.data / "valid.en").read_text(encoding="utf-8").splitlines())
    runs = f"run {args.names[0]}" if len(args.names) == 1 else f"runs {', '.join(args.names)}"
    setup = (
        args.setup
        or f"`aiayn prepare bible-en-es`'s corpus, the {runs} (validation set: {pairs} pairs)"
    )
    command = f"python bench/study.py average DATA RUNS {' '.join(args.names)} --last "
    rec = runner.record(
        "recipe",
        table="the recipe's last checkpoints averaged",
        setup=setup,
        columns=AVERAGE_COLUMNS,
        rows=rows,
        summary="",
        machine_name=args.machine,
        command=command + " ".join(map(str, args.last)),
    )
    runner.write(rec, args)


def plot(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    names = dict(spec.partition(":")[::2] for spec in args.runs)
    labels = {name: label or name for name, label in names.items()}
    reference = args.reference or next(iter(names))
    if reference not in names:
        p.error(f"--reference {reference} is not one of --runs")
    missing = [n for n in names if not (args.study_dir / n / "metrics.jsonl").is_file()]
    if missing:
        p.error(f"no metrics.jsonl in {', '.join(str(args.study_dir / n) for n in missing)}")
    runs = {labels[name]: read_run(args.study_dir / name) for name in names}

    where = dev_set(runs[labels[reference]]["config"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for x_key, xlabel, what, suffix in (
        ("steps", "updates", "updates", "updates"),
        ("minutes", "wall time (min)", "wall time", "time"),
    ):
        figure = draw(runs, x_key, xlabel, f"Perplexity against {what} ({where})")
        path = args.out_dir / f"{args.prefix}-ppl-{suffix}.png"
        figure.savefig(path, dpi=110)
        print(f"wrote {path}", file=sys.stderr)
    table = markdown(runs, labels[reference])
    (args.out_dir / f"{args.prefix}-table.md").write_text(table, encoding="utf-8")
    print(table, end="")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train and evaluate runs, one record each")
    run.add_argument("data", type=Path, help="an `aiayn prepare` folder: train.*, valid.*")
    run.add_argument("study_dir", type=Path, help="the folder for one run directory per run")
    runs, own = " ".join(RUNS | FULL_RUNS), [*RECIPE_RUNS, PEER]
    run.add_argument("names", nargs="*", metavar="RUN", help=f"of: {' '.join(own)} {runs}")
    run.add_argument("--threads", type=int, default=2)
    peer = run.add_argument_group("the run fairseq (bench/fairseq_peer.py)")
    peer.add_argument("--fairseq-bin", type=Path, help="folder of fairseq-train and its tools")
    peer.add_argument("--budget", help="its time budget, e.g. 60s (default: the recipe's)")
    peer.add_argument(
        "--pilot", default="120s", help="the pilot that foresees its updates (%(default)s)"
    )
    runner.add_arguments(run)
    mean = commands.add_parser("average", help="score runs' last checkpoints averaged")
    mean.add_argument("data", type=Path, help="an `aiayn prepare` folder: valid.*")
    mean.add_argument("study_dir", type=Path, help="the folder holding one directory per run")
    mean.add_argument("names", nargs="+", metavar="RUN")
    mean.add_argument("--last", type=int, nargs="+", default=[2, 3, 5], metavar="N")
    mean.add_argument("--threads", type=int, default=2)
    runner.add_arguments(mean)
    draw_ = commands.add_parser("plot", help="draw the runs' learning curves and a table")
    draw_.add_argument("study_dir", type=Path, help="the folder holding one directory per run")
    draw_.add_argument("--runs", nargs="+", required=True, metavar="NAME[:LABEL]")
    draw_.add_argument("--out-dir", type=Path, default=Path("docs/figures"))
    draw_.add_argument("--prefix", default="study")
    draw_.add_argument("--reference", metavar="NAME", help="the run settings are compared to")
    args = p.parse_args(argv)
    if args.command == "plot":
        return plot(args, p)
    if args.command == "average":
        return average(args)
    unknown = [n for n in args.names if n not in own and n not in RUNS | FULL_RUNS]
    if unknown:
        p.error(f"unknown run(s) {unknown}: the runs are {', '.join([*own, *RUNS, *FULL_RUNS])}")
    if PEER in args.names:
        import fairseq_peer  # bench/train.py's fairseq set-up, only for this run

        if why := fairseq_peer.missing(args.fairseq_bin) or fairseq_peer.check_budgets(args):
            p.error(f"the run {PEER}: {why}")
    runner.stop_children_on_sigterm()
    load = runner.check_idle(args.busy_ok)
    for name in args.names or RUNS:
        if name == PEER:
            fairseq_peer.run(args, args.study_dir / PEER, load)
        else:
            run_one(args, name, load)


if __name__ == "__main__":
    main()
