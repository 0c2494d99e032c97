"""`aiayn demo`: the whole job — corpus, vocabulary, training, evaluation, translation — offline.

The built-in task translates numbers written as English words into German words, generated
with `num2words`: "four thousand, three hundred and twenty-one" → "viertausenddreihundert-
einundzwanzig". It needs what real translation needs: reordering ("twenty-one" →
"einundzwanzig", units before tens), dropping words ("and", commas), and subwords (German
writes the whole number as one word, which the BPE vocabulary must split). Held-out numbers
are never seen in training, so exact match on them measures generalisation, not memory.

The numbers people type first, 0–100, are 1 in 100 of 0–9999: trained on once each, the model
got only 4 of 0–19 right ("five" → "fünftausend"). They are therefore never held out and are
written `SMALL_WEIGHT` times into the training file; the vocabulary is still learned from each
number once. The demo reports their accuracy separately, as accuracy on numbers it trained on,
not as generalisation.

The vocabulary has no byte pieces and no piece longer than `DEMO_MAX_PIECE_LENGTH`. With
SentencePiece's defaults (256 byte pieces, pieces up to 16 characters) only 144 of the 400
pieces were real ones: "null" was spelled letter by letter and came out as "n" (100/101 of
0–100 at best; weighting "zero" ×16–×40 made it "nulllll…" or broke other numbers). Without
byte pieces alone, "null" became one piece, but so did "viertausenddrei" and "undzwanzig",
which no longer line up with the English words. With both changes "null" is one piece and
"viertausenddreihunderteinundzwanzig" is vier|tausend|drei|hundert|einund|zwanzig.
Measured on 2 CPU cores: ×8 over 1200 updates gives 101/101 of 0–100 and 100% held-out exact
match with seeds 1, 2 and 3, in about 3.5 minutes; 600 updates were not
enough for seed 2 (96/101), nor 900 (100/101).
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from num2words import num2words

if TYPE_CHECKING:
    from aiayn.config import TrainConfig
    from aiayn.decode.translator import Translator

logger = logging.getLogger(__name__)

SMALL = range(101)
"""Numbers always in training, never held out: the first ones people type."""
SMALL_WEIGHT = 8
"""Times each number of `SMALL` is written into the training file."""
SMALL_EXAMPLES = (5, 12, 42)
"""Shown at the end: numbers of `SMALL`, so in training."""
EXAMPLES = (342, 1909, 4321, 7777)
"""Shown at the end: held-out numbers, never in training."""
DEMO_MAX_PIECE_LENGTH = 9
"""The longest vocabulary piece: "▁thousand" whole, German compounds cut into word-sized
pieces ("vier|tausend|drei|hundert|einund|zwanzig") that line up with the English words."""


@dataclass(frozen=True)
class DemoSplits:
    """Which numbers go where; each number once (`write_demo_corpus` weights `SMALL`)."""

    train: list[int]
    valid: list[int]
    test: list[int]


def split_numbers(limit: int, *, n_valid: int, n_test: int, seed: int) -> DemoSplits:
    """Numbers 0 .. limit-1, shuffled from `seed` and split. `SMALL` is all in training;
    `EXAMPLES` are all in the test set, so that the held-out translations shown at the end are
    of unseen numbers."""
    numbers = list(range(limit))
    random.Random(seed).shuffle(numbers)
    small = [n for n in SMALL if n < limit]
    held_out = [n for n in EXAMPLES if n < limit]
    rest = [n for n in numbers if n not in held_out and n not in SMALL]
    test = held_out + rest[: n_test - len(held_out)]
    valid = rest[n_test - len(held_out) : n_test - len(held_out) + n_valid]
    train = small + rest[n_test - len(held_out) + n_valid :]
    return DemoSplits(train=train, valid=valid, test=test)


def training_weight(n: int, *, small_weight: int) -> int:
    """Times `n` is written into the training file."""
    return small_weight if n in SMALL else 1


def write_demo_corpus(
    directory: Path,
    splits: DemoSplits,
    *,
    small_weight: int = SMALL_WEIGHT,
) -> dict[str, tuple[Path, Path]]:
    """Write `{train,valid,test,vocab}.{en,de}`; returns name → (English file, German file).

    The training file holds each number `training_weight` times; `vocab` holds the training
    numbers once each, for the vocabulary. Not `aiayn.text.prepare.write_corpus`: the numbers are
    generated clean, one per line, so there is nothing to clean, drop or record in a manifest.
    """
    directory.mkdir(parents=True, exist_ok=True)
    train = [n for n in splits.train for _ in range(training_weight(n, small_weight=small_weight))]
    files = {}
    named = [("train", train), ("valid", splits.valid), ("test", splits.test)]
    for name, numbers in [*named, ("vocab", splits.train)]:
        en, de = directory / f"{name}.en", directory / f"{name}.de"
        en.write_text("".join(num2words(n, lang="en") + "\n" for n in numbers), encoding="utf-8")
        de.write_text("".join(num2words(n, lang="de") + "\n" for n in numbers), encoding="utf-8")
        files[name] = (en, de)
    return files


class DemoStopped(Exception):
    """Training stopped on a signal (and saved): the demo stops too instead of evaluating a
    half-trained model while the user or a scheduler waits for it to end."""

    def __init__(self, step: int, signum: int | None, out_dir: Path) -> None:
        super().__init__(
            f"interrupted at step {step}; run the same command again to continue ({out_dir})"
        )
        self.signum = signum


@dataclass(frozen=True)
class DemoExample:
    source: str
    hypothesis: str
    reference: str
    held_out: bool  # False: a number of `SMALL`, seen in training


@dataclass
class DemoResult:
    """What the demo measured.

    Attributes:
        exact_match: Fraction of the held-out test numbers translated exactly.
        small_wrong: The numbers of `SMALL` translated wrongly, as (source, hypothesis).
        small_total: How many numbers of `SMALL` were translated.
        small_weight: Times each of them was in the training file.
    """

    model_dir: Path
    exact_match: float
    chrf: float
    chrf_signature: str
    small_wrong: list[tuple[str, str]]
    small_total: int
    small_weight: int
    minutes: float
    examples: list[DemoExample]


def run_demo(
    out_dir: str | Path = "demo_run",
    *,
    limit: int = 10_000,
    max_steps: int = 1200,
    seed: int = 1,
    small_weight: int = SMALL_WEIGHT,
    progress: bool = True,
    device: str = "auto",
    **overrides: Any,
) -> DemoResult:
    """Build the corpus, train a small Transformer on it, evaluate on held-out numbers and on
    0–100.

    Args:
        out_dir: Where the corpus, run directory and hypotheses go.
        limit: Numbers 0 .. limit-1 make the corpus.
        max_steps: Optimizer updates.
        seed: Seeds the split, the model and the batch order.
        small_weight: Times each number of `SMALL` is in the training file.
        progress: Show the training progress bar.
        device: Where it trains and translates: "auto" (a CUDA GPU where there is one, else
            the CPU), "cpu", "cuda" or "cuda:N"; a device this machine lacks is refused
            before anything is written.
        **overrides: Other `TrainConfig` fields (e.g. a smaller model for tests).
    """
    from aiayn.decode.evaluation import score
    from aiayn.decode.translator import Translator
    from aiayn.runtime import checked_device
    from aiayn.train.checkpoint import list_checkpoints
    from aiayn.train.trainer import train

    start = time.monotonic()
    device = str(checked_device(device))  # "auto" made one; a missing GPU refused up front
    out_dir = Path(out_dir)
    splits = split_numbers(limit, n_valid=200, n_test=500, seed=seed)
    files = write_demo_corpus(out_dir / "corpus", splits, small_weight=small_weight)
    small = [n for n in SMALL if n < limit]
    logger.info(
        "corpus: %d train numbers (%d–%d ×%d: %d pairs) / %d valid / %d test in %s",
        len(splits.train),
        small[0],
        small[-1],
        small_weight,
        sum(training_weight(n, small_weight=small_weight) for n in splits.train),
        len(splits.valid),
        len(splits.test),
        out_dir / "corpus",
    )
    config = demo_train_config(
        out_dir, files, max_steps=max_steps, seed=seed, progress=progress, device=device,
        **overrides,
    )  # fmt: skip
    # Continue an interrupted demo exactly when the trainer would find a checkpoint to resume.
    result = train(config, resume=bool(list_checkpoints(out_dir / "run")))
    if result.interrupted:
        raise DemoStopped(result.step, result.stop_signal, out_dir)
    translator = Translator(result.model_dir, device=device)
    held_out = _translate_pairs(translator, *files["test"])
    (out_dir / "test.hyp.de").write_text(
        "".join(example.hypothesis + "\n" for example in held_out), encoding="utf-8"
    )
    hypotheses = [example.hypothesis for example in held_out]
    references = [example.reference for example in held_out]
    exact = sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)
    scores = score(hypotheses, [references])
    seen = _translate_numbers(translator, small)
    shown = [seen[n] for n in SMALL_EXAMPLES if n < limit]
    shown += held_out[: len([n for n in EXAMPLES if n < limit])]  # EXAMPLES open the test set
    return DemoResult(
        model_dir=result.model_dir,
        exact_match=exact,
        chrf=scores.chrf,
        chrf_signature=scores.chrf_signature,
        small_wrong=[(e.source, e.hypothesis) for e in seen if e.hypothesis != e.reference],
        small_total=len(small),
        small_weight=small_weight,
        minutes=(time.monotonic() - start) / 60,
        examples=shown,
    )


def demo_train_config(
    out_dir: Path,
    files: dict[str, tuple[Path, Path]],
    *,
    max_steps: int,
    seed: int,
    progress: bool,
    **overrides: Any,
) -> TrainConfig:
    """The demo's training settings, and its vocabulary (unless `overrides` name a tokenizer)."""
    from aiayn.config import TrainConfig
    from aiayn.text.tokenizer import Tokenizer

    settings: dict[str, Any] = dict(
        out_dir=str(out_dir / "run"),
        src=str(files["train"][0]),
        tgt=str(files["train"][1]),
        valid_src=str(files["valid"][0]),
        valid_tgt=str(files["valid"][1]),
        src_lang="en",
        tgt_lang="de",
        vocab_size=400,
        preset="demo",
        max_len=64,
        max_tokens=1600,
        max_steps=max_steps,
        warmup_steps=200,
        # Eq. 3 at half scale and β2 = 0.998: at the paper's full rate a model this small
        # (d_model 128) diverges on this task within a few hundred updates.
        lr_scale=0.5,
        adam_beta2=0.998,
        seed=seed,
        log_every=50,
        valid_every=300,
        save_every=300,
        keep_last=2,
        progress=progress,
    )
    settings.update(overrides)
    if "tokenizer" not in overrides:
        # Learned from each training number once: repeating 0–100 weights them in the loss and
        # should not also reshape the BPE merges (it made "undzwanzig" one piece, so "zwanzig"
        # was no longer a piece to align with "twenty").
        tokenizer = out_dir / "corpus" / "tokenizer.model"
        vocab_files = list(files["vocab"])
        Tokenizer.train(
            vocab_files,
            tokenizer,
            vocab_size=settings["vocab_size"],
            byte_fallback=False,
            max_piece_length=DEMO_MAX_PIECE_LENGTH,
            seed=seed,
        )
        settings["tokenizer"] = str(tokenizer)
    return TrainConfig(**settings)


def _translate_pairs(translator: Translator, english: Path, german: Path) -> list[DemoExample]:
    """The test set translated with the paper's beam search: held-out numbers."""
    sources = english.read_text(encoding="utf-8").splitlines()
    references = german.read_text(encoding="utf-8").splitlines()
    hypotheses = [r.text for r in translator.translate(sources)]
    return [
        DemoExample(s, h, r, held_out=True)
        for s, h, r in zip(sources, hypotheses, references, strict=True)
    ]


def _translate_numbers(translator: Translator, numbers: list[int]) -> list[DemoExample]:
    """`numbers` (all in training) translated; the result's index is the number's."""
    sources = [num2words(n, lang="en") for n in numbers]
    hypotheses = [r.text for r in translator.translate(sources)]
    return [
        DemoExample(s, h, num2words(n, lang="de"), held_out=False)
        for n, s, h in zip(numbers, sources, hypotheses, strict=True)
    ]


def command_as_run() -> str:
    """How to call `aiayn` again as this process was called: `aiayn` where the shell finds this
    one by that name, else the path it was run by (`.venv/bin/aiayn`, which `make demo` runs
    without an activated environment), else `PYTHON -m aiayn`."""
    script = sys.argv[0] if sys.argv else ""
    if Path(script).name != "aiayn":
        return f"{shlex.quote(sys.executable)} -m aiayn"
    found = shutil.which("aiayn")
    if found and os.path.realpath(found) == os.path.realpath(script):
        return "aiayn"
    return shlex.quote(script)


def format_report(result: DemoResult, command: str | None = None) -> str:
    """The demo's closing report; its last line is a command to try, run as `command` (default:
    :func:`command_as_run`)."""
    command = command_as_run() if command is None else command
    right = result.small_total - len(result.small_wrong)
    lines = [
        "",
        f"Held-out numbers (never seen in training): exact match {100 * result.exact_match:.1f}%",
        f"chrF {result.chrf:.1f}  ({result.chrf_signature})",
        "(BLEU says nothing here: a German number is one word, so it has no word 4-grams.)",
        f"Numbers 0–{result.small_total - 1} (in training, weighted ×{result.small_weight}): "
        f"{right}/{result.small_total} right",
    ]
    lines += [f"  wrong: {source} → {hypothesis}" for source, hypothesis in result.small_wrong]
    lines.append("")
    for example in result.examples:
        mark = "✓" if example.hypothesis == example.reference else "✗"
        seen = "held out" if example.held_out else "in training"
        lines.append(f"  {example.source}  ({seen})\n    → {example.hypothesis}  {mark}")
    lines += [
        "",
        f"Finished in {result.minutes:.1f} minutes. Model directory: {result.model_dir}",
        f"Try: {command} translate -m {shlex.quote(str(result.model_dir))} "
        "<<< 'two thousand and twenty-six'",
    ]
    return "\n".join(lines)
