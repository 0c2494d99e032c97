"""The recipe's peer: `fairseq-train` given the recipe's settings for the recipe's time budget,
its model scored as `aiayn evaluate` scores aiayn's. bench/study.py's run `fairseq`:

    python bench/study.py run DATA runs/recipe fairseq --fairseq-bin FAIRSEQ_BIN
    python bench/study.py run DATA runs/smoke fairseq --fairseq-bin FAIRSEQ_BIN \\
        --budget 90s --pilot 40s --no-record                        # a smoke run

It appends one record to bench/results/recipe.jsonl, in the recipe's table beside the row of
`aiayn train -c recipes/bible-en-es-cpu.yaml` (the run `recipe`). The same work as that run:

- **Data.** bench/train.py's `prepare`: aiayn's joint BPE vocabulary (the recipe's size and
  seed), aiayn's cached training pairs (the recipe's length filter) as piece strings and aiayn's
  pieces as fairseq's dictionary, checked token for token; the dev set (fairseq's valid split)
  and, where DATA has one, the test set encoded whole with the same vocabulary.
- **Model.** `fairseq_model_flags`: the recipe's width, depth, pre-norm, all embeddings shared
  and dropout; fairseq's own initialisation, which the recipe's `init: fairseq` copies.
- **Training.** `fairseq_training_flags` (label smoothing, Adam's β and ε, the batch, Eq. 3's
  peak learning rate) with the recipe's schedule (`linear_decay`): a linear warm-up from 0 over
  `warmup_steps`, then a straight line to 0 at update N, where the run stops. The recipe's seed
  and threads; the dev set validated every `valid_every` updates (perplexity only, as the
  recipe's); the last checkpoint saved once, at the end.
- **Budget.** The recipe's run ends by itself inside its budget, start-up, validations and the
  final save included, its schedule foreseeing the last update from the speed it measures as
  it goes. fairseq has no such schedule: N comes from a pilot (`pilot_command`), the same
  fairseq-train run on Eq. 3 for `--pilot` seconds, stopped by its `--stop-time-hours`, then
  validated and saved as the real run's end is. From its timestamped log (`read_pilot`): the
  updates per second from its first logged interval to its last update, the start-up (the
  time of its first logged interval less that interval's updates at that rate), one
  validation, and the final save and exit. N is the most updates that fit (`updates_in_budget`):

      start-up + N / rate + validation × ceil(N / valid_every) + save and exit ≤ budget

  (a validation every `valid_every` updates and one at the end). `--stop-time-hours` set to
  what is left for training (its clock starts when its trainer is made, near the end of the
  start-up) ends the run inside the budget should the machine be slower than the pilot saw.
- **Scores.** `fairseq-generate` on the last checkpoint: beam 4, `--lenpen 1` (its default:
  scores divided by length, as aiayn's default search ranks), `--max-len-a 1 --max-len-b 50`
  (aiayn's output limit, fairseq's counted from the longest source of a batch); its
  hypotheses in the order of the sentences, their pieces turned back into text by aiayn's
  SentencePiece model (`Tokenizer.decode`, as aiayn's translator does), a blank source given a
  blank hypothesis (as aiayn's), then `aiayn.decode.evaluation.score` against the references
  read as `aiayn evaluate` reads them: the same sacreBLEU signatures. SPLIT.hyp and
  SPLIT.bleu.json (as `aiayn evaluate --json` prints it) go into the run directory
  STUDY_DIR/fairseq, with the pilot's and the run's logs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import runner
from aiayn.config import ConfigError, TrainConfig, load_yaml_config, parse_duration
from aiayn.decode.evaluation import score
from aiayn.text.corpus import read_parallel
from aiayn.text.lines import one_line, read_lines
from aiayn.text.tokenizer import UNK_ID, Tokenizer, stripped

# bench/train.py by its path: under pytest the name `train` is the tests' package.
_spec = importlib.util.spec_from_file_location("bench_train", Path(__file__).with_name("train.py"))
bench_train = sys.modules.get("bench_train") or importlib.util.module_from_spec(_spec)
if "bench_train" not in sys.modules:
    sys.modules["bench_train"] = bench_train
    _spec.loader.exec_module(bench_train)

PILOT_LOG_EVERY = 5  # updates per logged interval in the pilot
NEVER = str(10**6)  # an epoch interval never reached: no validation or save at epoch ends
BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B = 4, 1.0, 1.0, 50

FAIRSEQ_VALID = re.compile(r"\| valid \| (\{.*\})\s*$")
FAIRSEQ_STOP = re.compile(r"Stopping training due to")
HYPOTHESIS = re.compile(r"^H-(\d+)\t[^\t]*\t(.*)$")

COLUMNS = [("system", "system"), ("budget", "time budget"), ("updates", "updates"),
           ("valid_ppl", "validation perplexity"), ("bleu", "BLEU"), ("chrf", "chrF"),
           ("peak_rss", "peak RSS")]  # fmt: skip
TEST_COLUMN = ("test_bleu", "test BLEU")


@dataclass(frozen=True)
class Pilot:
    """What a pilot run measured: updates per second, and the seconds around the updates."""

    rate: float  # updates per second, from the first logged interval to the last update
    startup_s: float  # from launch to the first update
    valid_s: float  # one validation of the dev set
    end_s: float  # the final save and the exit
    updates: int


def read_pilot(lines: Sequence[tuple[float, str]], wall_s: float) -> Pilot:
    """The pilot's figures from its log lines, each with its seconds since launch
    (`bench_train.run_window`), and its wall time from launch to exit.

    The updates are counted at each logged interval's line and at the "Stopping training"
    line, written just after the last update (the number of updates its validation reports);
    the rate runs from the first of these points to the last, the first interval's one-time
    costs counted in the start-up. The validation is timed from the stop line to the valid
    line.
    """
    points = [(t, int(float(json.loads(m.group(1))["num_updates"]))) for t, line in lines
              if (m := bench_train.FAIRSEQ_INNER.search(line))]  # fmt: skip
    valid = [(t, json.loads(m.group(1))) for t, line in lines
             if (m := FAIRSEQ_VALID.search(line))]  # fmt: skip
    stops = [t for t, line in lines if FAIRSEQ_STOP.search(line)]
    if not valid or not stops:
        raise SystemExit("the pilot logged no stop or no validation: see its train.log")
    t_valid, record = valid[-1]
    updates = int(float(record["valid_num_updates"]))
    if not points or updates > points[-1][1]:
        points.append((stops[-1], updates))
    if len(points) < 2:
        raise SystemExit(f"the pilot made {updates} update(s), too few to time: raise --pilot")
    (t0, u0), (t1, u1) = points[0], points[-1]
    rate = (u1 - u0) / (t1 - t0)
    return Pilot(
        rate=rate,
        startup_s=max(0.0, t0 - u0 / rate),
        valid_s=max(0.0, t_valid - stops[-1]),
        end_s=max(0.0, wall_s - t_valid),
        updates=updates,
    )


def run_seconds(updates: int, pilot: Pilot, valid_every: int) -> float:
    """A run's wall time at the pilot's pace: start-up, the updates, a validation every
    `valid_every` updates and one at the end (ceil(updates / valid_every) in all; only the
    final one when `valid_every` is 0), the final save and exit."""
    validations = math.ceil(updates / valid_every) if valid_every > 0 else 1
    return pilot.startup_s + updates / pilot.rate + pilot.valid_s * validations + pilot.end_s


def updates_in_budget(budget_s: float, pilot: Pilot, valid_every: int) -> int:
    """N: the most updates whose run fits `budget_s` at the pilot's pace (`run_seconds`); 0
    where not even the start-up and the final validation and save fit."""
    n = max(0, math.floor((budget_s - pilot.startup_s - pilot.end_s) * pilot.rate))
    while n > 0 and run_seconds(n, pilot, valid_every) > budget_s:
        n -= 1
    return n


def linear_decay(flags: Sequence[str], updates: int) -> list[str]:
    """`fairseq_training_flags` (Eq. 3: `inverse_sqrt` warming up from `--warmup-init-lr 0`)
    with the recipe's schedule instead: `polynomial_decay` at power 1, which warms up linearly
    from 0 over the same `--warmup-updates` to the same peak `--lr`, then falls in a straight
    line to 0 at update `updates`."""
    flags, kept = list(flags), []
    if "--lr-scheduler" not in flags:
        raise ValueError("the training flags name no --lr-scheduler to replace")
    pairs = iter(flags)
    for flag in pairs:
        if flag in ("--lr-scheduler", "--warmup-init-lr"):
            next(pairs)  # and its value
        else:
            kept.append(flag)
    return [*kept, "--lr-scheduler", "polynomial_decay", "--power", "1",
            "--end-learning-rate", "0", "--total-num-update", str(updates)]  # fmt: skip


def hypotheses(output: str, n: int) -> list[str | None]:
    """The piece strings of fairseq-generate's best hypothesis of sentence 0..n-1, from its
    `H-ID<tab>SCORE<tab>PIECES` lines (in the order it finished them); None where it gave
    none."""
    found: list[str | None] = [None] * n
    for line in output.splitlines():
        if (m := HYPOTHESIS.match(line)) and int(m.group(1)) < n:
            found[int(m.group(1))] = m.group(2)
    return found


def detokenized(pieces: str, tokenizer: Tokenizer, ids: dict[str, int]) -> str:
    """fairseq's piece string as text, decoded as aiayn decodes ids; a piece fairseq has and
    aiayn has not (its dictionary's `madeupword` padding) counts as <unk>."""
    return one_line(tokenizer.decode([ids.get(p, UNK_ID) for p in pieces.split()]))


# --------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------


def base_command(fairseq_bin: Path, data: Path, c: TrainConfig, vocab_size: int) -> list[str]:
    """fairseq-train on `data` with the recipe's model and what both runs share: no validation
    or checkpoint at an epoch's end, one save at the run's (checkpoint_last.pt, and
    checkpoint_best.pt, a copy fairseq 0.12 cannot be told to leave out)."""
    m = c.model_config(vocab_size)
    command = [str(fairseq_bin / "fairseq-train"), str(data), "--task", "translation"]
    command += ["--source-lang", c.src_lang, "--target-lang", c.tgt_lang]
    command += bench_train.fairseq_model_flags(m)
    command += ["--seed", str(c.seed), "--max-epoch", str(c.max_epochs), "--cpu"]
    command += ["--num-workers", "1", "--log-format", "json"]
    command += ["--validate-interval", NEVER, "--save-interval", NEVER, "--save-interval-updates"]
    return [*command, "0", "--no-epoch-checkpoints"]


def pilot_command(base: list[str], c: TrainConfig, vocab_size: int, seconds: float, out: Path):
    """The pilot: Eq. 3 (its pace is the schedule's), stopped by fairseq's clock after
    `seconds`, then validated and saved."""
    m = c.model_config(vocab_size)
    command = [*base, *bench_train.fairseq_training_flags(c, m), "--max-update", str(c.max_steps)]
    command += ["--stop-time-hours", repr(seconds / 3600), "--save-dir", str(out / "checkpoints")]
    return [*command, "--log-interval", str(PILOT_LOG_EVERY)]


def run_command(
    base: list[str], c: TrainConfig, vocab_size: int, updates: int, guard_s: float, out: Path
) -> list[str]:
    """The run: the recipe's schedule to 0 at `updates`, where it stops; fairseq's clock stops
    it after `guard_s` of training should the machine be slower than the pilot saw."""
    m = c.model_config(vocab_size)
    command = [*base, *linear_decay(bench_train.fairseq_training_flags(c, m), updates)]
    command += ["--max-update", str(updates), "--stop-time-hours", repr(guard_s / 3600)]
    command += ["--validate-interval-updates", str(c.valid_every)]
    return [*command, "--save-dir", str(out / "checkpoints"), "--log-interval", str(c.log_every)]


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def recipe_budget() -> str:
    return load_yaml_config(runner.ROOT / runner.RECIPE)["time_budget"]


def budgets(args: argparse.Namespace) -> tuple[float, float]:
    """(budget, pilot) in seconds: --budget (default the recipe's time_budget), --pilot."""
    budget = parse_duration(args.budget or recipe_budget(), name="--budget")
    return budget, parse_duration(args.pilot, name="--pilot")


def check_budgets(args: argparse.Namespace) -> str | None:
    """Why --budget and --pilot cannot be run (or recorded); None if they can."""
    try:
        budget_s, pilot_s = budgets(args)
    except ConfigError as error:
        return str(error)
    if pilot_s >= budget_s:
        return f"--pilot ({args.pilot}) must be shorter than the budget ({budget_s:g} s)"
    if budget_s != parse_duration(recipe_budget()) and not args.no_record:
        return f"a budget other than the recipe's ({recipe_budget()}) is not recorded: --no-record"
    return None


def missing(fairseq_bin: Path | None) -> str | None:
    """What of fairseq this run needs is missing from `fairseq_bin`; None if nothing."""
    if why := bench_train.fairseq_missing(fairseq_bin):
        return why
    if not os.access(fairseq_bin / "fairseq-generate", os.X_OK):
        return f"no fairseq-generate in {fairseq_bin}"
    return None


def add_test_split(
    args: argparse.Namespace, c: TrainConfig, prepared: bench_train.Prepared, work: Path
) -> None:
    """DATA/test.* as fairseq's test split, binarised with the same dictionary."""
    tokenizer, text = prepared.tokenizer, work / "fairseq-text"
    names = tokenizer.pieces(range(tokenizer.vocab_size))
    pairs = read_parallel(args.data / "test.en", args.data / "test.es")
    with (
        open(text / f"test.{c.src_lang}", "w", encoding="utf-8") as src_out,
        open(text / f"test.{c.tgt_lang}", "w", encoding="utf-8") as tgt_out,
    ):
        for src, tgt in pairs:
            src_out.write(" ".join(names[t] for t in tokenizer.encode(src)) + "\n")
            tgt_out.write(" ".join(names[t] for t in tokenizer.encode(tgt)) + "\n")
    # A folder of its own: fairseq-preprocess refuses a destination that holds a dictionary.
    destination = work / "fairseq-test-data"
    shutil.rmtree(destination, ignore_errors=True)
    command = [str(args.fairseq_bin / "fairseq-preprocess"), "--source-lang", c.src_lang]
    command += ["--target-lang", c.tgt_lang, "--testpref", str(text / "test"), "--destdir"]
    command += [str(destination), "--joined-dictionary", "--srcdict", str(text / "dict.txt")]
    command += ["--workers", "1"]
    log = work / "fairseq-preprocess-test.log"
    code, output = runner.run_logged(command, log, env=bench_train.child_env(args.threads))
    if code != 0:
        raise SystemExit(f"fairseq-preprocess (test split) failed:\n{output[-3000:]}")
    for binarised in destination.glob("test.*"):
        shutil.copy(binarised, prepared.fairseq_data / binarised.name)


def generate(
    args: argparse.Namespace, c: TrainConfig, prepared: bench_train.Prepared, out: Path, split: str
) -> dict[str, Any]:
    """Decode DATA/SPLIT.en with the last checkpoint, score it as `aiayn evaluate` does; write
    SPLIT.hyp and SPLIT.bleu.json; the scores."""
    src, ref = args.data / f"{split}.{c.src_lang}", args.data / f"{split}.{c.tgt_lang}"
    command = [str(args.fairseq_bin / "fairseq-generate"), str(prepared.fairseq_data)]
    command += ["--path", str(out / "checkpoints" / "checkpoint_last.pt"), "--task"]
    command += ["translation", "--source-lang", c.src_lang, "--target-lang", c.tgt_lang]
    command += ["--gen-subset", split, "--beam", str(BEAM), "--lenpen", str(LENPEN)]
    command += ["--max-len-a", str(MAX_LEN_A), "--max-len-b", str(MAX_LEN_B), "--nbest", "1"]
    command += ["--max-tokens", "4096", "--cpu", "--num-workers", "1"]
    print(f"  {split}: " + shlex.join(command), flush=True)
    # fairseq 0.12's checkpoints hold an argparse.Namespace, which torch ≥ 2.6 loads only
    # without weights_only: this run's own checkpoint, written a moment ago.
    env = {**bench_train.child_env(args.threads), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    code, output = runner.run_logged(command, out / f"{split}.generate.log", env=env)
    if code != 0:
        raise SystemExit(f"fairseq-generate failed on {split}:\n{output[-3000:]}")
    sources = list(read_lines(src))
    tokenizer = prepared.tokenizer
    ids = {p: i for i, p in enumerate(tokenizer.pieces(range(tokenizer.vocab_size)))}
    found = hypotheses(output, len(sources))
    missing = [i for i, (s, h) in enumerate(zip(sources, found, strict=True))
               if h is None and stripped(s)]  # fmt: skip
    if missing:
        raise SystemExit(f"fairseq-generate gave no hypothesis for {split} lines {missing[:5]}")
    texts = [detokenized(h, tokenizer, ids) if stripped(s) and h is not None else ""
             for s, h in zip(sources, found, strict=True)]  # fmt: skip
    hyp = out / f"{split}.hyp"
    hyp.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    references = [[line.strip() for line in read_lines(ref)]]
    scores = score(texts, references, names=[str(hyp), str(ref)]).to_dict()
    scores |= {"hypotheses_file": str(hyp), "checkpoint": command[command.index("--path") + 1]}
    (out / f"{split}.bleu.json").write_text(json.dumps(scores, indent=2) + "\n", encoding="utf-8")
    return scores


def last_valid(lines: Sequence[tuple[float, str]]) -> dict[str, Any]:
    """The last valid record of a fairseq-train json log; {} without one."""
    found = [m.group(1) for _, line in lines if (m := FAIRSEQ_VALID.search(line))]
    return json.loads(found[-1]) if found else {}


@contextlib.contextmanager
def temporary_directory_of_its_own() -> Iterator[None]:
    """Within the block, the commands started get a temporary directory (TMPDIR) of their own,
    removed after: fairseq's data-loading workers, stopped at the end of each pass, leave
    multiprocessing's pymp-* folders behind in it."""
    with (
        tempfile.TemporaryDirectory(prefix="fairseq-peer-") as own,
        mock.patch.dict(os.environ, TMPDIR=own),  # what bench/train.py's child_env hands on
    ):
        yield


def run(args: argparse.Namespace, out: Path, load: float | None) -> None:
    """Prepare, pilot, train, decode and score in the run directory `out`; append the record
    (bench/study.py's run `fairseq`)."""
    if (out / "valid.bleu.json").is_file():
        print(f"{out.name}: done, skipped")
        return
    with temporary_directory_of_its_own():
        _run(args, out, load)


def _run(args: argparse.Namespace, out: Path, load: float | None) -> None:
    budget_s, pilot_s = budgets(args)
    data, work = args.data, out / "work"
    ns = argparse.Namespace(  # what bench/train.py's set-up reads of its arguments
        config=str(runner.ROOT / runner.RECIPE), threads=args.threads,
        src=str(data / "train.en"), tgt=str(data / "train.es"),
        valid_src=str(data / "valid.en"), valid_tgt=str(data / "valid.es"),
    )  # fmt: skip
    c = bench_train.train_config(ns)  # the recipe, its data; its own budget set aside
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "fairseq-data", ignore_errors=True)  # made afresh (the vocabulary kept)
    prepared = bench_train.prepare(ns, c, work, args.fairseq_bin)
    splits = ["test", "valid"] if (data / "test.en").is_file() else ["valid"]
    if "test" in splits:
        add_test_split(args, c, prepared, work)
    vocab, env = prepared.tokenizer.vocab_size, bench_train.child_env(args.threads)
    base = base_command(args.fairseq_bin, prepared.fairseq_data, c, vocab)

    pilot_dir = out / "pilot"
    shutil.rmtree(pilot_dir, ignore_errors=True)
    pilot_dir.mkdir(parents=True)
    command = pilot_command(base, c, vocab, pilot_s, pilot_dir)
    print(f"pilot, {pilot_s:.0f} s: " + shlex.join(command), flush=True)
    window = bench_train.run_window(command, env, pilot_s + 600, pilot_dir / "train.log")
    pilot = read_pilot(window.lines, window.wall_s)
    shutil.rmtree(pilot_dir / "checkpoints", ignore_errors=True)
    updates = updates_in_budget(budget_s, pilot, c.valid_every)
    if updates < 1:
        raise SystemExit(f"no update fits a {budget_s:.0f} s budget at the pilot's pace {pilot}")
    guard_s = budget_s - pilot.startup_s - pilot.valid_s - pilot.end_s
    plan = {"budget_s": budget_s, "pilot_s": pilot_s, "pilot": asdict(pilot), "updates": updates}
    print(f"  plan: {plan}", flush=True)

    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    command = run_command(base, c, vocab, updates, guard_s, out)
    (out / "plan.json").write_text(json.dumps({**plan, "command": command}, indent=2) + "\n")
    print(f"{out.name}, {budget_s:.0f} s, {updates} updates: " + shlex.join(command), flush=True)
    window = bench_train.run_window(command, env, 2 * budget_s + 600, out / "train.log")
    if window.stopped:
        raise SystemExit(f"fairseq-train ran past twice its budget: see {out / 'train.log'}")
    valid = last_valid(window.lines)
    if not valid:
        raise SystemExit(f"fairseq-train logged no validation: see {out / 'train.log'}")
    stops = [t for t, line in window.lines if FAIRSEQ_STOP.search(line)]
    scores = {split: generate(args, c, prepared, out, split) for split in splits}
    record(args, c, prepared, pilot, updates, window, valid, stops, scores, budget_s, load)


def record(
    args: argparse.Namespace,
    c: TrainConfig,
    prepared: bench_train.Prepared,
    pilot: Pilot,
    planned: int,
    window: bench_train.Window,
    valid: dict[str, Any],
    stops: list[float],
    scores: dict[str, dict[str, Any]],
    budget_s: float,
    load: float | None,
) -> None:
    m = c.model_config(prepared.tokenizer.vocab_size)
    version = bench_train.fairseq_version(args.fairseq_bin)
    updates = int(float(valid["valid_num_updates"]))
    last_update_s = stops[-1] if stops else window.wall_s
    bleu, chrf = round(scores["valid"]["bleu"], 2), round(scores["valid"]["chrf"], 2)
    rss = f"{(window.peak_rss_kib or 0) / 2**20:.1f} GiB"
    if window.worker_rss_kib:
        rss += f" (+ worker {window.worker_rss_kib / 2**20:.1f} GiB)"
    row = {
        "system": f"fairseq-train {version}",
        "budget": f"ended at {last_update_s / 60:.1f} min",  # its last update, as aiayn's row
        "updates": updates,
        "valid_ppl": round(float(valid["valid_ppl"]), 2),
        "bleu": bleu,
        "chrf": chrf,
        "peak_rss": rss,
    }
    columns = list(COLUMNS)
    if "test" in scores:
        row["test_bleu"], columns = round(scores["test"]["bleu"], 2), [*columns, TEST_COLUMN]
    pairs = len((args.data / "valid.en").read_text(encoding="utf-8").splitlines())
    minutes = f"{budget_s / 60:g}-minute"
    notes = [
        f"fairseq-train on the recipe's settings: {m.n_encoder_layers}+{m.n_decoder_layers} "
        f"layers, d_model {m.d_model}, d_ff {m.d_ff}, {m.n_heads} heads, "
        f"{'pre' if m.norm_first else 'post'}-norm, `--share-all-embeddings`, dropout "
        f"{m.dropout}, fairseq's initialisation (the recipe's `init: {m.init}`), label smoothing "
        f"{c.label_smoothing}, Adam β ({c.adam_beta1}, {c.adam_beta2}) ε {c.adam_eps}, ≤ "
        f"{c.max_tokens} tokens, peak lr {bench_train.peak_lr(c, m.d_model):.6g} after a linear "
        f"warm-up of {c.warmup_steps} updates from 0, then linear to 0 at update {planned}; "
        f"seed {c.seed}, {args.threads} threads, validation every {c.valid_every} updates, "
        f"the last checkpoint saved at the end; the process exited at "
        f"{window.wall_s / 60:.1f} min.",
        f"Updates: the most that fit the {minutes} budget at a pilot's pace (bench/"
        f"fairseq_peer.py): {pilot.rate:.3f} updates/s, start-up {pilot.startup_s:.0f} s, a "
        f"validation {pilot.valid_s:.0f} s, the final save and exit {pilot.end_s:.0f} s.",
        f"Data: {prepared.pairs} training pairs; {prepared.fairseq_check}.",
        "Precision: float32; fairseq 0.12's `--bf16` implies `--tpu` and stops on a CPU (no "
        "XLA device). The recipe's row computes in bf16 where the CPU does natively "
        "(AVX512-BF16 or AMX), its default `precision: auto`.",
        f"Scores: `fairseq-generate` on the last checkpoint, beam {BEAM}, `--lenpen {LENPEN:g}`, "
        f"`--max-len-a {MAX_LEN_A:g} --max-len-b {MAX_LEN_B}`; pieces decoded by aiayn's "
        f"SentencePiece model; sacreBLEU {scores['valid']['bleu_signature']}, chrF "
        f"{scores['valid']['chrf_signature']}, as `aiayn evaluate`.",
    ]
    rec = runner.record(
        "recipe", table="the recipe, 2 threads",
        setup=f"`fairseq-train` with the recipe's settings on `aiayn prepare bible-en-es`'s "
        f"corpus (validation set: {pairs} pairs)",
        columns=columns, rows=[row], machine_name=args.machine, load=load, notes=notes,
        summary=f"BLEU {bleu}, chrF {chrf} in the same {minutes} budget ({updates:,} updates)",
        command="python bench/study.py run DATA RUNS fairseq --fairseq-bin FAIRSEQ_BIN "
        f"--pilot {args.pilot}" + (f" --budget {args.budget}" if args.budget else ""),
    )  # fmt: skip
    rec["versions"]["fairseq"] = version
    runner.write(rec, args)
