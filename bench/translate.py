"""Translating a file as a user does, against CTranslate2 and Hugging Face: `make bench-translate`.

Each system translates the same file in a process of its own, started fresh for every round,
and is timed from launch to exit (Python start-up, imports, loading, packing, decoding,
writing), in interleaved rounds (bench/runner.py):

- ``aiayn translate -m MODEL -i SRC -o OUT`` as the README shows it, once per variant asked
  (``--variant NAME='--int8'``, ``--variant finished='--stopping finished'``, ...; leading
  VAR=VALUE words set its environment: ``--variant noautoload=TORCH_DEVICE_BACKEND_AUTOLOAD=0``);
- CTranslate2's own Python API on ``aiayn export --to ctranslate2`` (fp32 and int8 exports):
  SentencePiece in, ``translate_batch`` (beam W, batches of 1,024 tokens, the same length limit
  and banned tokens as aiayn), SentencePiece out, what a CTranslate2 user writes; in both
  thread layouts: the threads inside one batch (``intra_threads`` N × ``inter_threads`` 1, its
  default) and one batch per thread (``inter_threads`` N × ``intra_threads`` 1, what aiayn's
  decoding workers do);
- ``aiayn translate --backend ctranslate2`` on the same export, and on the model directory
  (its export converted once, before the rounds, into the cache the command reads);
- Hugging Face ``generate`` on ``aiayn export --to hf`` (``--with-hf``; slow; post-norm models
  only, as MarianMTModel is);

For each: wall time (median and every round), sentences/s, BLEU, chrF (sacreBLEU) and length
against the references' of the first round's output, for aiayn's own search the decoder rows
per sentence (counted in a separate, untimed pass), and how many outputs differ from the first
system's. The run appends one record to bench/results/translate.jsonl (`make benchmarks-page`
shows it).

With ``--one-line``, each round also times each system on the file's first line alone: what a
command costs around its decoding. ``--only`` / ``--skip`` keep or leave out systems by name,
``--alternate`` reverses their order every other round (an A/B of two).

Tools for decoding work, no timing of whole commands: ``--profile`` splits aiayn's search on
one thread into encoder, decoder steps and the search between them, and the operators' shares
(torch.profiler), beside CTranslate2 decoding the same lines on one thread in its own process
(decoding alone, neither start-up counted: where a whole command's gap comes from);
``--step-calls N`` counts the calls into PyTorch per decoding step over the first N sentences
(bench/step_calls.py: exact counts, the same on every machine).

    python bench/translate.py -m MODEL --data DATA --variant int8=--int8 --one-line
    python bench/translate.py -m MODEL --data DATA --step-calls 30
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import runner
from runner import Command

CT2_SCRIPT = r"""
import sys, time
import ctranslate2, sentencepiece as spm
export, src, out, beam, threads, alpha, max_a, max_b, inter = sys.argv[1:10]
warm_up = int(sys.argv[10]) if len(sys.argv) > 10 else 0  # --profile's: lines first, untimed
beam, threads, inter = int(beam), int(threads), int(inter)
alpha, max_a, max_b = float(alpha), float(max_a), float(max_b)
sp = spm.SentencePieceProcessor(model_file=f"{export}/source.spm")
target = spm.SentencePieceProcessor(model_file=f"{export}/target.spm")
lines = open(src, encoding="utf-8").read().split("\n")[:-1]
pieces = [sp.encode(line, out_type=str) for line in lines]
translator = ctranslate2.Translator(
    export, device="cpu", intra_threads=max(1, threads // inter), inter_threads=inter
)
limit = max(int(max_a * (len(p) + 1) + max_b) for p in pieces) if pieces else 1
kwargs = dict(beam_size=beam, length_penalty=alpha, max_batch_size=1024, batch_type="tokens",
              max_decoding_length=limit, suppress_sequences=[["<pad>"], ["<s>"]])
if warm_up:
    translator.translate_batch(pieces[:warm_up], **kwargs)
start = time.perf_counter()
results = translator.translate_batch(pieces, **kwargs)
if warm_up:
    print(time.perf_counter() - start)  # decoding alone
with open(out, "w", encoding="utf-8") as f:
    for r in results:
        f.write(target.decode(r.hypotheses[0]) + "\n")
"""
CT2_ARGUMENTS = ("1.0", "1.0", "50")
"""CT2_SCRIPT's length penalty and max_len a and b: aiayn's defaults."""

HF_SCRIPT = r"""
import sys
import torch
from transformers import MarianMTModel, MarianTokenizer
export, src, out, beam, threads = sys.argv[1:6]
torch.set_num_threads(int(threads))
tokenizer = MarianTokenizer.from_pretrained(export)
model = MarianMTModel.from_pretrained(export).eval()
lines = open(src, encoding="utf-8").read().split("\n")[:-1]
order = sorted(range(len(lines)), key=lambda i: -len(lines[i]))
outputs = [""] * len(lines)
with torch.inference_mode():
    for start in range(0, len(order), 32):
        rows = order[start:start + 32]
        batch = tokenizer([lines[i] for i in rows], return_tensors="pt", padding=True)
        generated = model.generate(**batch, num_beams=int(beam), max_new_tokens=256)
        for i, text in zip(rows, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            outputs[i] = text
open(out, "w", encoding="utf-8").write("".join(o + "\n" for o in outputs))
"""


def count_rows(model: str, src: Path, options: dict) -> float:
    """Decoder rows per sentence of aiayn's search with these options: every row fed to the
    decoder (each live beam of each unfinished sentence, at every step), over the sentences.
    Counted through the Python API, after the timed rounds."""
    from aiayn.decode.translator import Translator
    from step_calls import wrapped_decode_steps

    rows: list[int] = []

    def counting(decode_step: Any) -> Any:
        def counted(self: Any, tokens: Any, cache: Any) -> Any:
            rows.append(tokens.numel())
            return decode_step(self, tokens, cache)

        return counted

    lines = src.read_text(encoding="utf-8").split("\n")[:-1]
    with wrapped_decode_steps(counting):
        Translator(model).translate(lines, **options)
    return sum(rows) / max(1, len(lines))


OPERATOR_GROUPS = {
    "matrix products of the linear layers": ("aten::addmm", "aten::mm",
                                             "mkldnn::_linear_pointwise",
                                             "quantized::linear_dynamic"),
    "attention's batched products (Q Kᵀ, P V)": ("aten::bmm",),
    "log_softmax over the vocabulary": ("aten::_log_softmax",),
}  # fmt: skip
"""The operators `--profile` sums, by what they compute."""


def worker_translator(model: str, warm_up: list[str], beam: int, int8: bool = False) -> Any:
    """aiayn's `Translator` on one thread, as each decoding worker runs it, after translating
    `warm_up` (the first calls' one-time work: oneDNN, MKL)."""
    import torch

    from aiayn.decode.translator import Translator

    torch.set_num_threads(1)
    translator = Translator(model, int8=int8)
    translator.translate(warm_up, beam_size=beam)
    return translator


def ct2_decoding_seconds(args: argparse.Namespace, int8: bool) -> float | None:
    """CTranslate2's decoding alone of `args.src` on one thread, in a process of its own, on
    `aiayn export --to ctranslate2` of the model, after the warm-up aiayn's side has
    (`CT2_SCRIPT`, timed around `translate_batch`); None without ctranslate2."""
    if importlib.util.find_spec("ctranslate2") is None:
        return None
    env = runner.with_src_on_path(os.environ)
    extra = ("--quantization", "int8") if int8 else ()
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as work:
        export = exported(args, Path(work), env, "ctranslate2", *extra)
        script = [str(export), str(args.src), str(Path(work) / "out.txt"), str(args.beam), "1",
                  *CT2_ARGUMENTS, "1", "64"]  # fmt: skip
        done = subprocess.run([sys.executable, "-c", CT2_SCRIPT, *script], env=env,
                              capture_output=True, text=True, check=True,
                              preexec_fn=runner.ends_with_benchmark)  # fmt: skip
    return float(done.stdout.split()[-1])


def profile_translation(args: argparse.Namespace) -> str:
    """Where the time of aiayn's search goes, on one thread as each worker runs it: markdown
    tables from two untimed passes, the second under torch.profiler (which slows it down);
    and CTranslate2's decoding of the same lines on one thread (`ct2_decoding_seconds`)."""
    from torch.profiler import ProfilerActivity, profile

    from aiayn.model import Transformer
    from step_calls import wrapped_decode_steps

    lines = args.src.read_text(encoding="utf-8").split("\n")[:-1]
    translator = worker_translator(args.model, lines[:64], args.beam, args.profile_int8)
    spent = {"encode": 0.0, "decode_step": 0.0}
    calls = dict.fromkeys(spent, 0)

    def timed(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1

        return wrapper

    encode = Transformer.encode
    Transformer.encode = timed("encode", encode)  # type: ignore[method-assign]
    try:
        with wrapped_decode_steps(lambda step: timed("decode_step", step)):
            start = time.perf_counter()
            translator.translate(lines, beam_size=args.beam)  # the wall-clock split: no profiler
            total = time.perf_counter() - start
    finally:
        Transformer.encode = encode  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the operators' shares
        translator.translate(lines, beam_size=args.beam)
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    groups = {g: sum(ops.get(k, 0.0) for k in keys) for g, keys in OPERATOR_GROUPS.items()}
    every = sum(ops.values())
    search = total - spent["encode"] - spent["decode_step"]
    peer = ct2_decoding_seconds(args, args.profile_int8)
    kind = "int8" if args.profile_int8 else "float32"
    beside = (
        ["", f"CTranslate2 {kind} decoding the same lines on one thread: {peer:.3g} s; aiayn's "
         f"search {total:.3g} s, {peer / total:.2f}× CTranslate2's speed."]
        if peer is not None else []
    )  # fmt: skip
    lines = [
        f"Profile: aiayn's search on one thread (as each worker runs it), in one process, "
        f"{calls['decode_step']} decoder steps. Wall clock (no profiler), {total:.1f} s:",
        "",
        "| where | seconds | share |",
        "| --- | ---: | ---: |",
        f"| encoder | {spent['encode']:.2f} | {spent['encode'] / total:.0%} |",
        f"| decoder steps | {spent['decode_step']:.2f} | {spent['decode_step'] / total:.0%} |",
        f"| search between steps (selection, finishing, cache reorder), results | {search:.2f} "
        f"| {search / total:.0%} |",
        "",
        "The operators' own time, under torch.profiler (a second pass), by share of all "
        "operators' time:",
        "",
        "| operators | share |",
        "| --- | ---: |",
        *(f"| {group} | {seconds / every:.0%} |" for group, seconds in groups.items()),
        "| every other operator (element-wise, selections, copies, norms) | "
        f"{(every - sum(groups.values())) / every:.0%} |",
        *beside,
    ]
    return "\n".join(lines)


def scores(hyp: Path, ref: Path) -> tuple[float, float, float]:
    """sacreBLEU's BLEU and chrF of `hyp` against `ref`, and the outputs' length against the
    references' (BLEU's tokens; below 1, the brevity penalty applies)."""
    import sacrebleu

    hyps = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    refs = ref.read_text(encoding="utf-8").split("\n")[:-1]
    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    return bleu.score, sacrebleu.corpus_chrf(hyps, [refs]).score, bleu.sys_len / bleu.ref_len


def as_installed(environ: Mapping[str, str], pycache: Path) -> dict[str, str]:
    """``environ`` for the timed commands as a user's install runs them, with Python's compiled
    modules cached (in ``pycache``) even where ``PYTHONDONTWRITEBYTECODE`` is set, as on the
    machines these tables come from: pip compiles an installed package's modules once, while
    this checkout's src/ would be compiled anew in every process, ~0.14 s of each
    ``aiayn translate`` and none of CTranslate2's (a cProfile of one line). The first command
    that imports a module writes its cache (`warm_up`)."""
    environ = {k: v for k, v in environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**environ, "PYTHONPYCACHEPREFIX": str(pycache)}


def first_line(src: Path, work: Path) -> Path:
    """A file holding the first line of ``src``."""
    first = work / "first-line.txt"
    first.write_text(src.read_text(encoding="utf-8").split("\n")[0] + "\n", encoding="utf-8")
    return first


def warm_up(
    systems: list[Command], src: Path, first: Path, work: Path, env: dict[str, str]
) -> None:
    """Each system once, untimed, on ``first``, the first line of ``src``: Python's module
    caches (`as_installed`) and the page cache then hold what every timed round reads."""
    for system in systems:
        command = system.argv_for(work / "warm-up-out.txt", {str(src): str(first)})
        subprocess.run(command, env={**env, **system.env}, capture_output=True, check=False,
                       preexec_fn=runner.ends_with_benchmark)  # fmt: skip


def search_options(extra: list[str]) -> dict:
    """The DecodingOptions fields a variant's flags set (for the step count)."""
    options: dict = {}
    names = {
        "--stopping": ("stopping", str),
        "--beam-size": ("beam_size", int),
        "--length-penalty": ("length_penalty", float),
        "--length-penalty-kind": ("length_penalty_kind", str),
        "--max-len-a": ("max_len_a", float),
        "--max-len-b": ("max_len_b", float),
    }
    for flag, value in itertools.pairwise(extra):
        if flag in names:
            key, kind = names[flag]
            options[key] = kind(value)
    return options


COLUMNS = [
    ("system", "system"), ("wall_s", "wall time, s (rounds)"), ("sentences_per_s", "sentences/s"),
    ("bleu", "BLEU"), ("chrf", "chrF"), ("length_ratio", "length ÷ references'"),
    ("differ", "outputs ≠ first"),
    ("vs_ct2", "× CTranslate2 fp32"), ("vs_ct2_inter", "× CTranslate2 inter_threads"),
    ("one_line_s", "one line, s"), ("rows_per_sentence", "decoder rows/sentence"),
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="aiayn model directory")
    p.add_argument("--data", type=Path, help="an `aiayn prepare` folder: valid.en, valid.es")
    p.add_argument("--src", type=Path, help="source sentences (default DATA/valid.en)")
    p.add_argument("--ref", type=Path, help="their references (default DATA/valid.es)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    # fmt: off
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another aiayn translate run with these extra flags; leading VAR=VALUE "
                   "words set its environment (repeatable)")
    p.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="time only the systems whose name holds TEXT (repeatable)")
    p.add_argument("--skip", action="append", default=[], metavar="TEXT",
                   help="leave out the systems whose name holds TEXT (repeatable)")
    p.add_argument("--alternate", action="store_true",
                   help="run the systems in reverse order every other round (an A/B of two)")
    p.add_argument("--one-line", action="store_true",
                   help="also time each system on the first line alone, every round")
    p.add_argument("--with-hf", action="store_true", help="also Hugging Face generate (slow)")
    p.add_argument("--profile", action="store_true",
                   help="profile aiayn's search on one thread instead, beside CTranslate2's "
                   "decoding on one thread (untimed, no record)")
    p.add_argument("--profile-int8", action="store_true",
                   help="with --profile: aiayn's --int8 and CTranslate2's int8")
    p.add_argument("--step-calls", type=int, metavar="N",
                   help="count the calls into PyTorch per decoding step over N sentences instead")
    # fmt: on
    runner.add_arguments(p)
    args = p.parse_args(argv)
    args.src = args.src or (args.data / "valid.en" if args.data else None)
    args.ref = args.ref or (args.data / "valid.es" if args.data else None)
    if args.src is None or (args.ref is None and not (args.profile or args.step_calls)):
        p.error("give --data DIR (an `aiayn prepare` folder), or --src and --ref")
    for spec in args.variant:
        try:
            runner.variant_words(spec)
        except ValueError as e:
            p.error(str(e))
    return args


def exported(args: argparse.Namespace, work: Path, env: dict, to: str, *extra: str) -> Path:
    """The model exported by `aiayn export --to TO` into `work`."""
    export = work / f"{to}{'-'.join(('', *extra[1:]))}"
    command = [*runner.AIAYN, "export", args.model, "--to", to, "-o", str(export), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          preexec_fn=runner.ends_with_benchmark)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{shlex.join(command)} failed: {done.stderr.strip()[-2000:]}")
    return export


def systems(args: argparse.Namespace, work: Path, env: dict) -> list[Command]:
    """Every system asked for, as whole commands writing `{out}`."""
    common = ["--beam-size", str(args.beam), "--threads", str(args.threads), "--no-progress"]

    def translate(model: str, *flags: str) -> list[str]:
        return [*runner.AIAYN, "translate", "-m", model, "-i", str(args.src), "-o", "{out}",
                *common, *flags]  # fmt: skip

    found = [Command("aiayn translate", translate(args.model))]
    for spec in args.variant:
        words, variables = runner.variant_words(spec)
        name = runner.shell_line(variables, ["aiayn", "translate", *words])
        found.append(Command(name, translate(args.model, *words), variables))
    # Each system ranks as its users get by default: both by log_prob / |Y|^1.
    for quantization in () if args.no_ct2 else (None, "int8"):
        extra = ("--quantization", quantization) if quantization else ()
        export = str(exported(args, work, env, "ctranslate2", *extra))
        for inter in sorted({1, args.threads}):  # threads in one batch; one batch per thread
            layout = "" if inter == 1 else f", inter_threads {inter}"
            # CT2_SCRIPT's arguments: beam, threads, length penalty, max_len a and b, inter
            script = [export, str(args.src), "{out}", str(args.beam), str(args.threads),
                      *CT2_ARGUMENTS, str(inter)]  # fmt: skip
            name = f"CTranslate2 {quantization or 'fp32'} (Python API{layout})"
            found.append(Command(name, [sys.executable, "-c", CT2_SCRIPT, *script]))
        if not quantization:
            on_export = translate(export)
            found.append(Command("aiayn translate --backend ctranslate2", on_export))
            cached = translate(args.model, "--backend", "ctranslate2")
            warm = [part.replace("{out}", str(work / "warm.txt")) for part in cached]
            subprocess.run(warm, env=env, check=True, capture_output=True,  # converts once
                           preexec_fn=runner.ends_with_benchmark)  # fmt: skip
            found.append(Command("aiayn translate -m MODEL --backend ctranslate2", cached))
    if args.with_hf:
        script = [str(exported(args, work, env, "hf")), str(args.src), "{out}", str(args.beam),
                  str(args.threads)]  # fmt: skip
        hf = [sys.executable, "-c", HF_SCRIPT, *script]
        found.append(Command("HF generate (Python API)", hf))
    if args.only:
        found = [x for x in found if any(text in x.name for text in args.only)]
    if args.skip:
        found = [x for x in found if not any(text in x.name for text in args.skip)]
    if not found:
        sys.exit(f"--only {args.only} / --skip {args.skip}: no system left")
    return found


def model_name(model: str) -> str:
    """A model directory's name, or its run's where it is a run's model/."""
    path = Path(model).resolve()
    return path.parent.name if path.name == "model" else path.name


def step_calls(args: argparse.Namespace) -> str:
    """Calls into PyTorch per decoding step, as one decoding worker makes them."""
    import torch

    from step_calls import count_step_calls, markdown

    lines = args.src.read_text(encoding="utf-8").splitlines()[: args.step_calls]
    translator = worker_translator(args.model, lines, args.beam)
    with torch.inference_mode(), count_step_calls() as counted:
        translator.translate(lines, beam_size=args.beam)
    layers = translator.model.config.n_decoder_layers
    return markdown(counted, layers, f"{len(lines)} sentences, beam {args.beam}, {layers} layers")


def rows_of(args: argparse.Namespace, found: list[Command], one_line: dict) -> list[dict]:
    """The record's rows: times, speed, scores and the ratios against CTranslate2 fp32."""
    n = len(args.src.read_text(encoding="utf-8").split("\n")) - 1
    first = found[0].output.read_text(encoding="utf-8").split("\n")
    ct2 = {
        c.name: statistics.median(c.seconds) for c in found if c.name.startswith("CTranslate2 fp32")
    }
    intra = next((v for k, v in ct2.items() if "inter" not in k), None)
    inter = next((v for k, v in ct2.items() if "inter" in k), None)
    rows = []
    for command in found:
        median = statistics.median(command.seconds)
        bleu, chrf, length = scores(command.output, args.ref)
        lines = command.output.read_text(encoding="utf-8").split("\n")
        row = {
            "system": command.name,
            "wall_s": runner.figures(command.seconds, 1),
            "sentences_per_s": round(n / median, 1),
            "bleu": round(bleu, 2),
            "chrf": round(chrf, 2),
            "length_ratio": round(length, 3),
            "differ": sum(a != b for a, b in zip(lines, first, strict=False)),
            "vs_ct2": intra and f"{intra / median:.2f}×",
            "vs_ct2_inter": inter and f"{inter / median:.2f}×",
        }
        if command.name in one_line:
            row["one_line_s"] = round(statistics.median(one_line[command.name]), 2)
        plain = "aiayn translate" in command.name and "backend" not in command.name
        extra = command.argv[command.argv.index("--no-progress") + 1 :] if plain else []
        if plain and "--int8" not in extra and "--bf16" not in extra:
            options = {"beam_size": args.beam, **search_options(extra)}
            row["rows_per_sentence"] = round(count_rows(args.model, args.src, options), 1)
        rows.append(row)
    return rows


def against_ct2(rows: list[dict[str, Any]], found: list[Command]) -> list[str]:
    """aiayn's default and its --int8 against CTranslate2 fp32 and int8 at the faster of their
    thread layouts (the peer a user who read its docs runs), aiayn's BLEU, and the system that
    scored higher where one did. The ratios divide the unrounded medians of `found`, as the
    rows' ratios do."""
    seconds = {c.name: statistics.median(c.seconds) for c in found}

    def wall(row: dict[str, Any]) -> float:
        return seconds[row["system"]]

    said = []
    for ours, kind in ((rows[0], "fp32"), (next((r for r in rows if r["system"].endswith(
            " --int8")), None), "int8")):  # fmt: skip
        peers = [r for r in rows if r["system"].startswith(f"CTranslate2 {kind} ")]
        if ours and peers:
            best = min(peers, key=wall)
            said.append(f"`{ours['system']}` {wall(ours):.1f} s against CTranslate2 {kind}'s "
                        f"{wall(best):.1f} s at its faster layout "
                        f"({wall(best) / wall(ours):.2f}×)")  # fmt: skip
    said.append(f"BLEU {rows[0]['bleu']}")
    best = max(rows, key=lambda row: row["bleu"])
    if best["bleu"] > rows[0]["bleu"]:
        said.append(f"the highest, {best['bleu']}, `{best['system']}`")
    return said


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.step_calls or args.profile:  # tools for decoding work: no timing, no record
        return print(step_calls(args) if args.step_calls else profile_translation(args))
    runner.stop_children_on_sigterm()
    load = runner.check_idle(args.busy_ok)
    with tempfile.TemporaryDirectory(prefix="bench-translate-") as work:
        measure(args, Path(work), load)


def measure(args: argparse.Namespace, work: Path, load: float | None) -> None:
    """Every system in ``args.rounds`` interleaved rounds, in the folder ``work``; the record
    written."""
    # --backend ctranslate2 on a model directory converts it once, into this cache
    env = {
        **as_installed(runner.with_src_on_path(os.environ), work / "pycache"),
        "AIAYN_CT2_CACHE": str(work / "cache"),
    }
    found = systems(args, work, env)
    first = first_line(args.src, work)
    warm_up(found, args.src, first, work, env)
    one_line: dict[str, list[float]] = {}

    def time_one_line(_: int, command: Command) -> None:
        seconds = runner.timed(command, work / "one-line.out", env, **{str(args.src): str(first)})
        one_line.setdefault(command.name, []).append(seconds)

    after = time_one_line if args.one_line else None
    runner.rounds(found, args.rounds, work, env, alternate=args.alternate, after=after)
    rows = rows_of(args, found, one_line)
    n = len(args.src.read_text(encoding="utf-8").splitlines())
    summary = f"{n} sentences, beam {args.beam}: " + "; ".join(against_ct2(rows, found))
    rec = runner.record(
        "translate",
        table=f"{n} sentences, beam {args.beam}, {args.threads} threads",
        setup=args.setup or model_name(args.model),
        columns=[c for c in COLUMNS if any(c[0] in r for r in rows)],
        rows=rows,
        summary=summary,
        peers=("ctranslate2", "transformers", "sacrebleu"),
        machine_name=args.machine,
        load=load,
    )
    runner.write(rec, args)


if __name__ == "__main__":
    main()
