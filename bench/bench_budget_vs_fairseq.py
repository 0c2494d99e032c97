"""`fairseq-train` for aiayn's time budget: its dev curve and BLEU beside aiayn's own run (#30).

Issue #30 asks for "fairseq-train's curve for the same budget": on the Bible EN→ES corpus, in the
wall time `recipes/bible-en-es-cpu.yaml` gives `aiayn train` (30 minutes on a 2-core CPU), what
dev perplexity curve and dev BLEU does `fairseq-train` (0.12.2) reach with the same model and
training settings? aiayn's side is not run here: it is read from a finished run of the recipe
(`--aiayn-run`). fairseq's is run here, once, as a fairseq user of the recipe would run it, and
its checkpoint_last.pt decoded with `fairseq-generate`.

The same on both sides:

- **Data and vocabulary**, made by `bench_train_vs_fairseq.prepare`: the joint SentencePiece BPE
  vocabulary trained as `aiayn train` trains it (the recipe's `vocab_size` and `seed`; compared
  byte for byte with the aiayn run's tokenizer.model, and the result printed), the pairs that
  survive the recipe's length filter, given to fairseq as piece strings with aiayn's pieces as
  its dictionary (the token counts checked against aiayn's cache), and the dev set, encoded whole,
  as fairseq's valid split (its target tokens, EOS included, compared with the count of aiayn's
  validation records).
- **Model**: the recipe's `ModelConfig` as fairseq `transformer` flags (`fairseq_model_flags`).
- **Training**: ≤ `max_tokens` tokens a side per batch (`--required-batch-size-multiple 1`),
  `accumulate` as `--update-freq`, label smoothing, Adam β and ε, no weight decay, no clipping,
  dropout, seed, on the CPU with the same threads (2); fairseq keeps its default of one
  data-loader worker. Validation on the dev set every `valid_every` updates and at the last
  update, in eval mode; a checkpoint at each validation (`save_every` = `valid_every` in the
  recipe): `--validate-interval-updates` and `--save-interval-updates`, with `--validate-interval`
  and `--save-interval` (epochs) set beyond the run, so that the end of an epoch adds neither a
  validation nor a save (aiayn does neither there); `--no-epoch-checkpoints
  --keep-interval-updates 1` keep one checkpoint besides checkpoint_last.pt and checkpoint_best.pt.
- **Dev perplexity**: exp of the mean per-token NLL, without smoothing, over the dev set's target
  tokens with EOS (aiayn: `valid_ppl` of `aiayn.train.validation.validation_loss`). fairseq
  logs in base 2 (`label_smoothed_cross_entropy.reduce_metrics`, 0.12.2): `valid_loss` is the
  *smoothed* loss, `valid_nll_loss` the unsmoothed NLL / ntokens / ln 2 (rounded to 3 decimals)
  and `valid_ppl` = 2 ** (the unrounded mean `nll_loss`), rounded to 2 decimals: the same
  quantity, not the perplexity of the smoothed loss. The curve takes 2 ** `valid_nll_loss`
  (rounding: ± 0.04 %) and the JSON keeps `valid_ppl` beside it.
- **Wall time on the curve**: seconds since the trainer's process was launched at which the
  validation began (aiayn: `elapsed_s` of the train record at that update, as
  `plot_study.read_run` places it; fairseq: the arrival of its 'begin validation' line, each
  line timestamped here as it arrives).
- **Scoring**: sacreBLEU BLEU (13a) and chrF2 of the detokenized dev output against the dev
  references, through `aiayn.decode.evaluation.score`, as `aiayn evaluate` scores.

What differs, and why:

- **The schedule.** Under a time budget aiayn warms up, then decays the rate linearly to 0 at the
  update its measured pace says the budget ends (docs/training.md). fairseq has no schedule that
  knows a wall-clock budget (`polynomial_decay` needs `--total-num-update` in advance, which a
  user would have to guess from a trial run): what a fairseq user of this recipe runs is Eq. 3,
  `--lr-scheduler inverse_sqrt` with the recipe's warm-up and peak rate (`peak_lr`: lr_scale ·
  d_model^-0.5 · warmup^-0.5; `--warmup-init-lr 0`, so fairseq's first update runs at lr 0),
  stopped by `--stop-time-hours`.
- **The stop.** aiayn's budget counts from its process start and holds the whole run (the final
  validation and save included). fairseq's `--stop-time-hours` compares
  `Trainer.cumulative_training_time()`, the wall time since its `Trainer` was built (after
  imports, the model and the valid split, before the train split; validations and saves
  included), with the budget after each update: the update that crosses it is the last, then it
  validates and writes its checkpoints. Its process so runs past the budget by its start-up and
  final validation and save; the table gives each process's whole wall time (fairseq's measured
  here from launch to exit; aiayn's from `/usr/bin/time -v` in `--aiayn-train-log`, if given).
- **Decoding.** `fairseq-generate`, run through `--generate-script` (fairseq_generate_nobt.py:
  fairseq 0.12.2's BetterTransformer encoder path fails on torch 2.13; and
  `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`, as loading its checkpoints needs on torch >= 2.6), on
  checkpoint_last.pt: beam 4 and an output limit of source length + 50 as aiayn's defaults, but
  fairseq's length penalty (`--lenpen 1.0`, its default: score / length^1; aiayn ranks with the
  GNMT penalty, α 0.6), its stopping rule (a sentence ends when 4 hypotheses have finished) and
  its length limit taken from the longest source of each batch (of ≤ `max_tokens` source tokens).
  fairseq prints pieces (no `--remove-bpe`); they are put back in input order (the id of each
  H- line) and turned into text by aiayn's tokenizer, as `aiayn evaluate` does (SentencePiece
  decode: `--remove-bpe sentencepiece` would leave byte-fallback pieces as `<0xNN>` text).
- fairseq's LayerNorm ε is 1e-5 (aiayn's 1e-6).

    .venv/bin/python bench/bench_budget_vs_fairseq.py -c recipes/bible-en-es-cpu.yaml \\
        --src DATA/train.en --tgt DATA/train.es --valid-src DATA/dev.en --valid-tgt DATA/dev.es \\
        --work-dir runs/fairseq-budget --fairseq-venv /tmp/peers/fairseq \\
        --generate-script PATH/fairseq_generate_nobt.py --aiayn-run runs/bible-en-es-cpu \\
        --markdown out.md --json out.json --figure out.png        # ~35 min, on an idle machine

`--skip-train` reads a finished fairseq run back from the work directory and decodes it again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure  # drawn without pyplot: the Agg canvas, no window
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from aiayn.config import TrainConfig, load_yaml_config, parse_duration
from aiayn.decode.evaluation import score
from aiayn.decode.options import DecodingOptions
from aiayn.text.lines import read_lines
from aiayn.text.tokenizer import UNK_ID
from aiayn.train.runlog import read_metrics

# bench/ scripts import each other: running one puts bench/ on sys.path
from bench_train_step import machine_info
from bench_train_vs_fairseq import (
    FAIRSEQ_INNER,
    FAIRSEQ_UNK,
    Prepared,
    child_env,
    fairseq_missing,
    fairseq_model_flags,
    fairseq_training_flags,
    fairseq_versions,
    peak_lr,
    prepare,
    train_config,
)
from plot_study import read_run

NEVER = 10**6  # an epoch interval beyond any run: no validation or save at epoch ends
OVERRUN_S = 900  # a fairseq-train still running this long after the budget is stopped
TIMED = re.compile(r"^\[\s*([\d.]+)\] (.*)$")  # a log line as written here: [seconds] line
FAIRSEQ_VALID = re.compile(r"\| valid \| (\{.*\})\s*$")
VALID_BEGINS = re.compile(r'begin validation on "valid" subset')
FAIRSEQ_STOP = re.compile(r"Stopping training due to (.*)$")
FAIRSEQ_DONE = re.compile(r"done training in ([\d.]+) seconds")
TIME_V_WALL = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)")
ECHOED = re.compile(r"\| valid \||Stopping training|done training|Error|Traceback")


# --------------------------------------------------------------------------------------------
# fairseq-train for the budget
# --------------------------------------------------------------------------------------------


def train_command(
    args: argparse.Namespace, c: TrainConfig, prepared: Prepared, run_dir: Path
) -> list[str]:
    """fairseq-train with `run_fairseq`'s model and optimisation flags, Eq. 3, stopped by the
    budget, validating and saving every `valid_every` updates."""
    m = c.model_config(prepared.tokenizer.vocab_size)
    command = [str(args.fairseq_venv / "bin" / "fairseq-train"), str(prepared.fairseq_data)]
    command += ["--task", "translation", "--source-lang", c.src_lang, "--target-lang", c.tgt_lang]
    command += fairseq_model_flags(m)
    command += fairseq_training_flags(c, m)
    command += ["--max-update", str(c.max_steps), "--max-epoch", str(c.max_epochs)]
    command += ["--stop-time-hours", repr(args.budget_s / 3600), "--seed", str(c.seed)]
    command += ["--cpu", "--num-workers", "1"]
    command += ["--validate-interval-updates", str(c.valid_every)]
    command += ["--validate-interval", str(NEVER), "--save-interval", str(NEVER)]
    command += ["--save-interval-updates", str(c.valid_every), "--keep-interval-updates", "1"]
    command += ["--no-epoch-checkpoints", "--save-dir", str(run_dir / "checkpoints")]
    return [*command, "--log-format", "json", "--log-interval", str(args.log_interval)]


def run_logged(command: list[str], env: dict[str, str], log: Path, limit_s: float) -> dict:
    """Run `command` to its end, each output line written to `log` (flushed) with the seconds
    since launch at which it arrived; validations echoed. Stopped (SIGTERM to its process group)
    if it runs past `limit_s`."""
    started = time.perf_counter()
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        encoding="utf-8", errors="replace",
        start_new_session=True,  # its own process group: the stop reaches the data loader
    )  # fmt: skip
    overran = threading.Event()

    def stop() -> None:
        overran.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)

    timer = threading.Timer(limit_s, stop)
    timer.start()
    assert child.stdout is not None
    with open(log, "w", encoding="utf-8") as out:
        for line in child.stdout:
            stamped = f"[{time.perf_counter() - started:8.2f}] {line}"
            out.write(stamped)
            out.flush()
            if ECHOED.search(line):
                print("  " + stamped, end="", flush=True)
    child.wait()
    timer.cancel()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "returncode": child.returncode, "overran": overran.is_set()}


def read_fairseq_log(log: Path) -> dict[str, Any]:
    """The validations (update, minutes since launch at which each began, dev perplexity),
    the tokens/s of each logged interval, and the stop, from a log written by `run_logged`."""
    curve, rates, began, stop, done = [], [], None, None, None
    for raw in log.read_text(encoding="utf-8").splitlines():
        if (timed := TIMED.match(raw)) is None:
            continue
        t, line = float(timed.group(1)), timed.group(2)
        if VALID_BEGINS.search(line):
            began = t
        elif found := FAIRSEQ_VALID.search(line):
            record = json.loads(found.group(1))
            nll_bits = float(record["valid_nll_loss"])
            curve.append({
                "update": int(float(record["valid_num_updates"])),
                "minutes": (t if began is None else began) / 60,
                "ended_s": t,
                "valid_nll_loss_bits": nll_bits,
                "ppl": 2**nll_bits,
                "valid_ppl_logged": float(record["valid_ppl"]),
            })  # fmt: skip
            began = None
        elif found := FAIRSEQ_INNER.search(line):
            rates.append(float(json.loads(found.group(1))["wps"]))
        elif found := FAIRSEQ_STOP.search(line):
            stop = {"at_s": t, "why": found.group(1)}
        elif found := FAIRSEQ_DONE.search(line):
            done = float(found.group(1))
    return {
        "curve": curve,
        "updates": curve[-1]["update"] if curve else None,
        "tokens_per_s": statistics.median(rates[1:] or rates) if rates else None,  # first out
        "stop": stop,
        "done_training_s": done,
    }


# --------------------------------------------------------------------------------------------
# fairseq-generate on the dev set, scored as aiayn evaluate scores
# --------------------------------------------------------------------------------------------


def generate(
    args: argparse.Namespace, c: TrainConfig, prepared: Prepared, checkpoint: Path, work: Path
) -> dict[str, Any]:
    """Decode fairseq's valid split (the dev set) with `checkpoint`; BLEU and chrF of the
    output, SentencePiece-decoded in input order, against `--valid-tgt`."""
    options = DecodingOptions()  # aiayn's defaults: beam 4, source length + 50
    command = [str(args.fairseq_venv / "bin" / "python"), str(args.generate_script)]
    command += [str(prepared.fairseq_data), "--path", str(checkpoint), "--task", "translation"]
    command += ["--source-lang", c.src_lang, "--target-lang", c.tgt_lang, "--gen-subset", "valid"]
    command += ["--beam", str(options.beam_size), "--nbest", "1", "--lenpen", "1.0"]
    command += ["--max-len-a", f"{options.max_len_a:g}", "--max-len-b", f"{options.max_len_b:g}"]
    command += ["--max-tokens", str(c.max_tokens), "--cpu"]
    env = {**child_env(args.threads), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    env["PYTHONIOENCODING"] = "utf-8"  # pieces are not ASCII
    print("running: " + shlex.join(command), flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", env=env)
    wall = time.perf_counter() - started
    (work / "generate.out").write_text(done.stdout, encoding="utf-8")
    (work / "generate.log").write_text(done.stderr, encoding="utf-8")
    if done.returncode != 0:
        raise SystemExit(
            f"fairseq-generate failed ({work / 'generate.log'}):\n{done.stderr[-3000:]}"
        )
    hypotheses: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("H-"):  # H-<id> \t score \t pieces, ids out of order
            ident, _score, *text = line.split("\t")
            hypotheses[int(ident[2:])] = text[0].split() if text else []
    references = [line.strip() for line in read_lines(args.valid_tgt)]
    if sorted(hypotheses) != list(range(len(references))):
        raise SystemExit(
            f"fairseq-generate gave {len(hypotheses)} hypotheses for {len(references)} dev "
            f"sentences ({work / 'generate.out'})"
        )
    tokenizer = prepared.tokenizer
    ids = {piece: i for i, piece in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    unknown = sum(p not in ids for pieces in hypotheses.values() for p in pieces)
    texts = [
        tokenizer.decode([ids.get(p, UNK_ID) for p in hypotheses[i]])
        for i in range(len(references))
    ]
    (work / "dev.fairseq.hyp").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    scores = score(texts, [references], names=["fairseq-generate", str(args.valid_tgt)])
    print(f"  {scores}", flush=True)
    return {
        "command": command,
        "wall_s": wall,
        "pieces_not_in_vocabulary": unknown,
        "hypotheses_file": str(work / "dev.fairseq.hyp"),
        **scores.to_dict(),
    }


# --------------------------------------------------------------------------------------------
# aiayn's run, and the checks that both sides saw the same data
# --------------------------------------------------------------------------------------------


def process_wall_s(log: Path | None) -> float | None:
    """The wall time `/usr/bin/time -v` reported in `log` (h:mm:ss or m:ss), if any."""
    if log is None:
        return None
    found = TIME_V_WALL.search(log.read_text(encoding="utf-8", errors="replace"))
    if found is None:
        return None
    seconds = 0.0
    for part in found.group(1).split(":"):
        seconds = 60 * seconds + float(part)
    return seconds


def same_data_checks(args: argparse.Namespace, c: TrainConfig, prepared: Prepared) -> list[str]:
    """The vocabulary against the aiayn run's, and the dev set's target tokens against those
    aiayn's validation counted."""
    checks = []
    theirs = args.aiayn_run / "tokenizer.model"
    if theirs.is_file():
        same = theirs.read_bytes() == prepared.tokenizer.model_file.read_bytes()
        checks.append(
            f"the vocabulary is {'byte for byte' if same else 'NOT'} the aiayn run's "
            f"tokenizer.model"
        )
    log = (prepared.fairseq_data.parent / "fairseq-preprocess.log").read_text(encoding="utf-8")
    fairseq_tokens = [
        int(tokens)
        for lang, name, _, tokens, _ in FAIRSEQ_UNK.findall(log)
        if lang == c.tgt_lang and Path(name).name.startswith("valid.")
    ]
    valid = [r for r in read_metrics(args.aiayn_run) if r.get("type") == "valid"]
    aiayn_tokens = valid[-1].get("valid_tokens") if valid else None
    checks.append(
        f"dev target tokens (EOS included): fairseq-preprocess {fairseq_tokens or '?'}, "
        f"aiayn's validation {aiayn_tokens or '?'}"
    )
    return checks


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else format(value, spec) + unit


def tables(aiayn: dict[str, Any], fairseq: dict[str, Any]) -> str:
    rows = [
        "| system | updates in the budget | process wall time | final dev perplexity "
        "| dev BLEU | dev chrF | target tok/s (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in (("aiayn train", aiayn), ("fairseq-train", fairseq)):
        wall = fmt(s["wall_s"] and s["wall_s"] / 60, ".1f", " min")
        if s["wall_s"] is None and s.get("last_record_s"):  # aiayn without its console log
            wall = f"≥ {s['last_record_s'] / 60:.1f} min (its last train record)"
        cells = [name, str(s["updates"]), wall]
        cells += [fmt(s["curve"][-1]["ppl"] if s["curve"] else None, ".2f")]
        cells += [fmt(s["scores"].get("bleu"), ".2f"), fmt(s["scores"].get("chrf"), ".2f")]
        rows.append("| " + " | ".join([*cells, fmt(s["tokens_per_s"], ".0f")]) + " |")
    rows += [
        "",
        "| update | aiayn: min | aiayn: dev ppl | fairseq: min | fairseq: dev ppl |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    points = {name: {p["update"]: p for p in s["curve"]} for name, s in
              (("aiayn", aiayn), ("fairseq", fairseq))}  # fmt: skip
    for update in sorted(set(points["aiayn"]) | set(points["fairseq"])):
        cells = [str(update)]
        for name in ("aiayn", "fairseq"):
            p = points[name].get(update)
            cells += [fmt(p and p["minutes"], ".1f"), fmt(p and p["ppl"], ".2f")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def draw(aiayn: dict[str, Any], fairseq: dict[str, Any], budget_min: float, where: str) -> Figure:
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    for ax, x_key, xlabel in zip(
        figure.subplots(1, 2), ("minutes", "update"), ("wall time since launch (min)", "updates"),
        strict=True,
    ):  # fmt: skip
        for i, (label, s) in enumerate((("aiayn train", aiayn), ("fairseq-train", fairseq))):
            x = [p[x_key] for p in s["curve"]]
            ax.plot(x, [p["ppl"] for p in s["curve"]], "-", marker=".", color=f"C{i}", label=label)
        if x_key == "minutes":
            ax.axvline(budget_min, color="grey", linestyle=":", label="budget")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel=xlabel, ylabel="dev perplexity (log scale)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    figure.suptitle(f"Dev perplexity in a {budget_min:g}-minute budget ({where})")
    return figure


def notes(args: argparse.Namespace, c: TrainConfig, results: dict[str, Any]) -> list[str]:
    fairseq, aiayn, info = results["fairseq"], results["aiayn"], results["machine"]
    stop = fairseq["stop"]
    stopped = (
        f"fairseq logged 'Stopping training due to {stop['why']}' {stop['at_s'] / 60:.1f} min "
        f"after launch" if stop else "fairseq logged no stop line"
    )  # fmt: skip
    aiayn_config = aiayn["config"]
    return [
        f"- Budget {args.budget}; aiayn: `aiayn train -c {args.config}` (time_budget "
        f"{aiayn_config.get('time_budget')}, schedule {aiayn_config.get('schedule')}), read "
        f"from `{args.aiayn_run}`; fairseq: Eq. 3 (inverse_sqrt, warm-up {c.warmup_steps}, peak "
        f"{results['peak_lr']:.6g}), `--stop-time-hours {args.budget_s / 3600:g}`; {stopped}.",
        f"- Same data: {'; '.join(results['checks'])}.",
        "- Dev BLEU: aiayn `aiayn evaluate` (beam 4, GNMT length penalty α 0.6); fairseq "
        "`fairseq-generate` on checkpoint_last.pt (beam 4, `--lenpen 1.0`, `--max-len-a 1 "
        "--max-len-b 50`); both sacreBLEU "
        f"`{fairseq['scores'].get('bleu_signature', '?')}` on SentencePiece-decoded output.",
        "- Wall time on the curve: when each validation began, since the trainer's launch; "
        "tok/s: target tokens per second of each logged interval, the first left out.",
        f"- Machine: {info['cpu']}, {info['cores']} cores, {args.threads} threads; torch "
        f"{torch.__version__}; fairseq {results['fairseq_version']}.",
        f"- Command: `.venv/bin/python bench/bench_budget_vs_fairseq.py {shlex.join(args.argv)}`",
        f"- fairseq-train: `{shlex.join(fairseq['command'])}`",
        f"- Run on {results['date']}.",
    ]


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default="recipes/bible-en-es-cpu.yaml", help="the recipe")
    p.add_argument("--src", required=True, help="training source text, one line per pair")
    p.add_argument("--tgt", required=True, help="training target text, line-aligned")
    p.add_argument("--valid-src", required=True, help="dev source: fairseq's valid split")
    p.add_argument("--valid-tgt", required=True, help="dev target: its references")
    p.add_argument("--work-dir", type=Path, required=True, help="data, fairseq's run, outputs")
    p.add_argument("--budget", help="wall time for fairseq-train (default: the recipe's)")
    p.add_argument("--fairseq-venv", type=Path, default=Path("/tmp/peers/fairseq"))
    p.add_argument(
        "--generate-script", type=Path, required=True,
        help="fairseq_generate_nobt.py: fairseq-generate without the BetterTransformer path",
    )  # fmt: skip
    p.add_argument("--aiayn-run", type=Path, required=True, help="aiayn's run directory")
    p.add_argument(
        "--aiayn-train-log", type=Path,
        help="its console log, if it ran under /usr/bin/time -v: the process's wall time",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=25, help="fairseq --log-interval")
    p.add_argument("--skip-train", action="store_true", help="reuse the work dir's fairseq run")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--figure", type=Path)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    budget = args.budget or load_yaml_config(args.config).get("time_budget")
    if not budget:
        p.error(f"{args.config} has no time_budget: give --budget")
    args.budget, args.budget_s = budget, parse_duration(budget, name="--budget")
    if not (args.aiayn_run / "metrics.jsonl").is_file():
        p.error(f"no metrics.jsonl in {args.aiayn_run}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fairseq_bin = args.fairseq_venv / "bin"
    missing = fairseq_missing(fairseq_bin)
    if missing:
        raise SystemExit(f"fairseq not found ({missing}): see --fairseq-venv")
    c = train_config(args)
    info = machine_info(torch.device("cpu"))
    version = fairseq_versions(fairseq_bin)
    print(f"{info['cpu']}, {info['cores']} cores, {args.threads} threads; fairseq {version}")
    work = args.work_dir.resolve()
    run_dir = work / "fairseq-train"
    checkpoint = run_dir / "checkpoints" / "checkpoint_last.pt"
    if args.skip_train and not (run_dir / "run.json").is_file():
        raise SystemExit(f"--skip-train: no finished fairseq run in {run_dir}")
    if not args.skip_train and checkpoint.exists():  # fairseq-train would resume from it
        raise SystemExit(f"{run_dir} holds a fairseq run: give --skip-train, or another work dir")
    work.mkdir(parents=True, exist_ok=True)
    prepared = prepare(args, c, work, fairseq_bin, reuse_fairseq_data=args.skip_train)
    checks = same_data_checks(args, c, prepared)
    print("  " + "; ".join(checks), flush=True)

    if not args.skip_train:
        run_dir.mkdir(parents=True, exist_ok=True)
        command = train_command(args, c, prepared, run_dir)
        print(f"running ({args.budget}, log in {run_dir / 'train.log'}): {shlex.join(command)}")
        limit = args.budget_s + OVERRUN_S
        env = {**child_env(args.threads), "PYTHONIOENCODING": "utf-8"}
        run = run_logged(command, env, run_dir / "train.log", limit)
        run["command"] = command
        (run_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
        if run["returncode"] != 0 and not run["overran"]:
            tail = (run_dir / "train.log").read_text(encoding="utf-8").splitlines()[-30:]
            raise SystemExit("fairseq-train failed:\n" + "\n".join(tail))
    run = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    if run["overran"]:
        print(f"  fairseq-train was stopped {OVERRUN_S} s after the budget", flush=True)
    fairseq = {**read_fairseq_log(run_dir / "train.log"), "command": run["command"]}
    fairseq["wall_s"] = run["wall_s"]
    fairseq["generate"] = generate(args, c, prepared, checkpoint, work)
    fairseq["scores"] = {k: fairseq["generate"][k] for k in ("bleu", "chrf", "bleu_signature")}

    read = read_run(args.aiayn_run)
    aiayn = {
        "run_dir": str(args.aiayn_run),
        "config": read["config"],
        "curve": [
            {"update": s, "minutes": m, "ppl": ppl}
            for s, m, ppl in zip(read["steps"], read["minutes"] or [], read["raw"], strict=False)
        ],
        "updates": read["updates"],
        "wall_s": process_wall_s(args.aiayn_train_log),
        "last_record_s": read["wall_minutes"] and read["wall_minutes"] * 60,
        "tokens_per_s": read["tokens_per_s"],
        "scores": read["scores"],
    }
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": info,
        "fairseq_version": version,
        "budget": args.budget,
        "peak_lr": peak_lr(c, c.model_config(prepared.tokenizer.vocab_size).d_model),
        "checks": checks,
        "aiayn": aiayn,
        "fairseq": fairseq,
    }
    text = tables(aiayn, fairseq) + "\n\n" + "\n".join(notes(args, c, results)) + "\n"
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    if args.figure:
        where = f"{Path(args.valid_tgt).parent.name}/{Path(args.valid_tgt).name}, {info['cpu']}"
        draw(aiayn, fairseq, args.budget_s / 60, where).savefig(args.figure, dpi=110)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
