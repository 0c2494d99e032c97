"""Decoding as a user runs it: a trained model, a real test set, the whole command timed.

Each system translates the same file in a process of its own, started fresh for every round,
and is timed from launch to exit (Python start-up, imports, loading, packing, decoding,
writing), interleaved round by round so that a slow minute of the machine hurts every system
alike:

- ``aiayn translate -m MODEL -i SRC -o OUT`` as the README shows it, once per variant asked
  (``--variant NAME='--int8'``, ``--variant finished='--stopping finished'``, ...);
- CTranslate2's own Python API on ``aiayn export --to ctranslate2`` (fp32 and int8 exports):
  SentencePiece in, ``translate_batch`` (beam W, batches of 1,024 tokens, the same length limit
  and banned tokens as aiayn), SentencePiece out — what a CTranslate2 user writes; once with
  the threads inside one batch (``intra_threads``, its default way), once with as many batches
  side by side, one thread each (``inter_threads``: what aiayn's decoding workers do);
- ``aiayn translate --backend ctranslate2`` on the same export, and on the model directory
  (its export converted once, before the rounds, into the cache the command reads);
- Hugging Face ``generate`` on ``aiayn export --to hf`` (``--with-hf``; slow; post-norm models
  only, as MarianMTModel is);
- ``fairseq-interactive`` (``--fairseq-checkpoint``, with fairseq in a venv of its own:
  ``../shared/tools/install-fairseq.sh``) on a fairseq model of the same shape trained on the
  same data and vocabulary, e.g. by ``bench/bench_budget_vs_fairseq.py``: fairseq cannot load
  aiayn's weights, so its BLEU is its own model's; raw text in (its SentencePiece), beam W,
  its defaults otherwise (length penalty 1, batches of up to 1,024 tokens).

For each: wall time (median and every round), sentences/s, BLEU and chrF
(sacreBLEU) of the first round's output, and for aiayn's own search the decoding steps per
sentence (the rows fed to the decoder, every live beam at every step: counted in a separate,
untimed pass through the Python API), so that a faster search that scores worse, or a stopping
rule that saves steps, shows. Outputs that differ from the first system's are counted.

With ``--one-line``, each round also times each system on the file's first line alone: what a
command costs around its decoding (start-up, imports, loading; exit), so that the table also
compares the systems on the decoding of the file, the whole time less that one line's.
``--only`` keeps some of the systems, ``--skip`` leaves some out, and ``--alternate`` reverses
their order every other round: an A/B of two, each going first as often as the other.

    python bench/bench_translate.py -m runs/bible/model --src test.en --ref test.es \\
        --variant int8=--int8 --variant finished='--stopping finished' --markdown out.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIAYN = [sys.executable, "-m", "aiayn"]

CT2_SCRIPT = r"""
import sys, json
import ctranslate2, sentencepiece as spm
export, src, out, beam, threads, alpha, max_a, max_b, inter = sys.argv[1:10]
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
results = translator.translate_batch(
    pieces, beam_size=beam, length_penalty=alpha, max_batch_size=1024, batch_type="tokens",
    max_decoding_length=limit, suppress_sequences=[["<pad>"], ["<s>"]],
)
with open(out, "w", encoding="utf-8") as f:
    for r in results:
        f.write(target.decode(r.hypotheses[0]) + "\n")
"""

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

# fairseq-interactive with fairseq 0.12.2's inference-only encoder fast path off: with torch 2.13
# it fails on post-norm layers ("Mask Type should be defined"); decoding then runs the layer code
# training ran. Its "D-i" lines (detokenised hypotheses) are written in input order.
FAIRSEQ_SCRIPT = r"""
import contextlib, io, sys
from fairseq.modules import transformer_layer as tl
from fairseq_cli.interactive import cli_main
load = tl.TransformerEncoderLayerBase._load_from_state_dict
def load_without_fast_path(self, *args, **kwargs):
    load(self, *args, **kwargs)
    self.load_to_BT = False
tl.TransformerEncoderLayerBase._load_from_state_dict = load_without_fast_path
out = sys.argv.pop(1)
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    cli_main()
hypotheses = {}
for line in printed.getvalue().splitlines():
    if line.startswith("D-"):
        index, _, text = line[2:].split("\t", 2)
        hypotheses[int(index)] = text
with open(out, "w", encoding="utf-8") as f:
    f.write("".join(hypotheses[i] + "\n" for i in range(len(hypotheses))))
"""


@dataclass
class System:
    name: str
    command: list[str]  # {out} is replaced by the output file of the round
    seconds: list[float] = field(default_factory=list)
    one_line_seconds: list[float] = field(default_factory=list)  # with --one-line
    output: Path | None = None
    rows_per_sentence: float | None = None
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)  # on top of the benchmark's


def command_of(
    system: System, out: Path, src: Path | None = None, instead: Path | None = None
) -> list[str]:
    """``system``'s command writing ``out`` (and reading ``instead`` of ``src`` when both are
    given)."""
    swap = {"{out}": str(out)}
    if src is not None and instead is not None:
        swap[str(src)] = str(instead)
    return [swap.get(part, part) for part in system.command]


def run_timed(
    system: System,
    out: Path,
    env: dict[str, str],
    src: Path | None = None,
    instead: Path | None = None,
) -> float:
    """Seconds from launch to exit of ``system`` writing ``out`` (reading ``instead`` of ``src``
    when both are given)."""
    command = command_of(system, out, src, instead)
    start = time.perf_counter()
    done = subprocess.run(command, env={**env, **system.env}, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{system.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def count_rows(model: str, src: Path, options: dict) -> float:
    """Decoder rows per sentence of aiayn's search with these options: every row fed to the
    decoder (each live beam of each unfinished sentence, at every step), over the sentences.
    Counted in a separate process through the Python API, untimed."""
    code = f"""
import json
from aiayn.decode.translator import Translator
from aiayn.model import Transformer
rows = []
real = Transformer.decode_step
def counted(self, tokens, cache):
    rows.append(tokens.numel())
    return real(self, tokens, cache)
Transformer.decode_step = counted
lines = open({str(src)!r}, encoding="utf-8").read().split("\\n")[:-1]
Translator({model!r}).translate(lines, **json.loads({json.dumps(json.dumps(options))}))
print(sum(rows) / max(1, len(lines)))
"""
    env = with_src_on_path(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return float(done.stdout.strip().splitlines()[-1])


PROFILE_SCRIPT = r"""
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from aiayn.decode.translator import Translator
from aiayn.model import Transformer
model, src, beam = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)  # as each decoding worker runs
translator = Translator(model)
lines = open(src, encoding="utf-8").read().split("\n")[:-1]
translator.translate(lines[:64], beam_size=beam)  # warm-up: oneDNN / MKL first calls
spent = {"encode": 0.0, "decoder step": 0.0}  # from here on
steps = [0]
def timed(name, real):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            steps[0] += name == "decoder step"
    return wrapper
Transformer.encode = timed("encode", Transformer.encode)
Transformer.decode_step = timed("decoder step", Transformer.decode_step)
start = time.perf_counter()
translator.translate(lines, beam_size=beam)  # the wall-clock split: no profiler
total = time.perf_counter() - start
wall = dict(spent, steps=steps[0])
with profile(activities=[ProfilerActivity.CPU]) as prof:  # the operators' shares
    translator.translate(lines, beam_size=beam)
ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
groups = {
    "matrix products of the linear layers": (
        "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"
    ),
    "attention's batched products (Q Kᵀ, P V)": ("aten::bmm",),
    "log_softmax over the vocabulary": ("aten::_log_softmax",),
}
out = {"total_s": total, "steps": wall["steps"], "encode_s": wall["encode"],
       "decoder_step_s": wall["decoder step"], "ops_s": sum(ops.values()),
       "groups": {g: sum(ops.get(k, 0.0) for k in keys) for g, keys in groups.items()}}
print(json.dumps(out))
"""


def profile_translation(model: str, src: Path, beam: int) -> str:
    """Where the time of aiayn's search goes, on one thread as each worker runs it: a markdown
    table from one untimed in-process pass under torch.profiler (which slows it down)."""
    env = with_src_on_path(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", PROFILE_SCRIPT, model, str(src), str(beam)],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    p = json.loads(done.stdout.strip().splitlines()[-1])
    total, ops = p["total_s"], p["ops_s"]
    search = total - p["encode_s"] - p["decoder_step_s"]
    lines = [
        f"Profile: aiayn's search on one thread (as each worker runs it), in one process, "
        f"{p['steps']} decoder steps. Wall clock (no profiler), {total:.1f} s:",
        "",
        "| where | seconds | share |",
        "| --- | ---: | ---: |",
        f"| encoder | {p['encode_s']:.2f} | {p['encode_s'] / total:.0%} |",
        f"| decoder steps | {p['decoder_step_s']:.2f} | {p['decoder_step_s'] / total:.0%} |",
        f"| search between steps (selection, finishing, cache reorder), results | {search:.2f} "
        f"| {search / total:.0%} |",
        "",
        "The operators' own time, under torch.profiler (a second pass), by share of all "
        "operators' time:",
        "",
        "| operators | share |",
        "| --- | ---: |",
    ]
    for group, seconds in p["groups"].items():
        lines.append(f"| {group} | {seconds / ops:.0%} |")
    rest = ops - sum(p["groups"].values())
    lines.append(
        f"| every other operator (element-wise, selections, copies, norms) | {rest / ops:.0%} |"
    )
    return "\n".join(lines)


def scores(hyp: Path, ref: Path) -> tuple[float, float]:
    import sacrebleu

    hyps = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    refs = ref.read_text(encoding="utf-8").split("\n")[:-1]
    return (
        sacrebleu.corpus_bleu(hyps, [refs]).score,
        sacrebleu.corpus_chrf(hyps, [refs]).score,
    )


def with_src_on_path(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with this checkout's src/ first on PYTHONPATH (what was there stays after
    it: packages installed with ``pip --target``, say)."""
    paths = [str(ROOT / "src"), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


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


def warm_up(systems: list[System], src: Path, first: Path, work: Path, env: dict[str, str]) -> None:
    """Each system once, untimed, on ``first``, the first line of ``src``: Python's module
    caches (`as_installed`) and the page cache then hold what every timed round reads."""
    for system in systems:
        command = command_of(system, work / "warm-up-out.txt", src, first)
        subprocess.run(command, env={**env, **system.env}, capture_output=True, check=False)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    """The cores this process may run on (``taskset`` limits them), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def isa() -> str:
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return "?"
    if "amx_tile" in flags:
        return "AVX-512 + AMX"
    return "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")


def gpu_names() -> str:
    """The machine's NVIDIA GPUs by nvidia-smi, or "" (aiayn translate's --device auto takes
    the first one where PyTorch has CUDA, so the rows of such a machine are GPU rows unless a
    variant says cpu). "" too where CUDA_VISIBLE_DEVICES hides every GPU from the systems."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return ""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if done.returncode != 0:  # no driver: nvidia-smi says so on stdout
        return ""
    return ", ".join(line.strip() for line in done.stdout.splitlines() if line.strip())


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


def one_line_cells(row: dict, ct2_rest: float | None) -> str:
    """The --one-line columns of ``row``: its median on the first line alone, and CTranslate2
    fp32's time for the file less its one line, over this system's."""
    one = row["one_line_median_s"]
    rest = row["median_s"] - one
    ratio = "" if ct2_rest is None or rest <= 0 else f"{ct2_rest / rest:.2f}×"
    return f" {one:.2f} s | {ratio} |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="aiayn model directory")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--ref", type=Path, required=True)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another aiayn translate run with these extra flags (repeatable)",
    )
    p.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="time only the systems whose name holds TEXT (repeatable), e.g. two of them A/B",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="TEXT",
        help="leave out the systems whose name holds TEXT (repeatable), e.g. '--backend'",
    )
    p.add_argument(
        "--alternate",
        action="store_true",
        help="run the systems in reverse order in every other round (for an A/B of two)",
    )
    p.add_argument(
        "--one-line",
        action="store_true",
        help="also time each system on the first line alone, every round: its start-up (and "
        "one sentence), and the ratio of what is left, the decoding of the file",
    )
    p.add_argument("--with-hf", action="store_true", help="also Hugging Face generate (slow)")
    p.add_argument(
        "--fairseq-checkpoint", type=Path, help="also fairseq-interactive on this checkpoint"
    )
    p.add_argument("--fairseq-venv", type=Path, help="fairseq's venv (install-fairseq.sh)")
    p.add_argument("--fairseq-data", type=Path, help="the checkpoint's dict.{src,tgt}.txt dir")
    p.add_argument("--fairseq-spm", type=Path, help="the checkpoint's SentencePiece model")
    p.add_argument("--langs", default="en-es", help="source-target, for fairseq (en-es)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile aiayn's search on one thread (a separate, untimed pass)",
    )
    p.add_argument("--markdown", type=Path, help="write the table here too")
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args(argv)
    fairseq = (args.fairseq_venv, args.fairseq_data, args.fairseq_spm)
    if args.fairseq_checkpoint and not all(fairseq):
        p.error("--fairseq-checkpoint needs --fairseq-venv, --fairseq-data and --fairseq-spm")

    work = Path(tempfile.mkdtemp(prefix="bench_translate-"))
    # --backend ctranslate2 on a model directory converts it once, into this cache
    env = {
        **as_installed(with_src_on_path(os.environ), work / "pycache"),
        "AIAYN_CT2_CACHE": str(work / "cache"),
    }
    common = ["--beam-size", str(args.beam), "--threads", str(args.threads), "--no-progress"]
    translate = [*AIAYN, "translate", "-m", args.model, "-i", str(args.src), "-o", "{out}"]
    systems = [System("aiayn translate", [*translate, *common])]
    for spec in args.variant:
        name, _, flags = spec.partition("=")
        systems.append(
            System(
                f"aiayn translate {flags}", [*translate, *common, *shlex.split(flags)], note=name
            )
        )
    if not args.no_ct2:
        for quantization in (None, "int8"):
            export = work / f"ct2-{quantization or 'fp32'}"
            command = [*AIAYN, "export", args.model, "--to", "ctranslate2", "-o", str(export)]
            if quantization:
                command += ["--quantization", quantization]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{shlex.join(command)} failed: {done.stderr.strip()[-2000:]}")
            label = "int8" if quantization else "fp32"
            # Each system ranks as its users get by default: CTranslate2 by log_prob / |Y|^1
            # (its length_penalty 1), aiayn by the paper's GNMT penalty, α = 0.6.
            systems.append(
                System(
                    f"CTranslate2 {label} (Python API)",
                    [sys.executable, "-c", CT2_SCRIPT, str(export), str(args.src), "{out}",
                     str(args.beam), str(args.threads), "1.0", "1.0", "50", "1"],
                )
            )  # fmt: skip
            if args.threads > 1:  # its batches side by side, one thread each (as aiayn's workers)
                systems.append(
                    System(
                        f"CTranslate2 {label} (Python API, inter_threads {args.threads})",
                        [sys.executable, "-c", CT2_SCRIPT, str(export), str(args.src), "{out}",
                         str(args.beam), str(args.threads), "1.0", "1.0", "50",
                         str(args.threads)],
                    )
                )  # fmt: skip
            if not quantization:
                systems.append(
                    System(
                        "aiayn translate --backend ctranslate2",
                        [*AIAYN, "translate", "-m", str(export), "-i", str(args.src), "-o",
                         "{out}", *common, "--length-penalty-kind", "power",
                         "--length-penalty", "1.0"],
                    )
                )  # fmt: skip
                cached = [*AIAYN, "translate", "-m", args.model, "--backend", "ctranslate2",
                          "-i", str(args.src), "-o", "{out}", *common,
                          "--length-penalty-kind", "power", "--length-penalty", "1.0"]  # fmt: skip
                warm = [part.replace("{out}", str(work / "warm.txt")) for part in cached]
                subprocess.run(warm, env=env, check=True, capture_output=True)  # converts once
                systems.append(System("aiayn translate -m MODEL --backend ctranslate2", cached))
    if args.with_hf:
        export = work / "hf"
        subprocess.run(
            [*AIAYN, "export", args.model, "--to", "hf", "-o", str(export)],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        systems.append(
            System(
                "HF generate (Python API)",
                [sys.executable, "-c", HF_SCRIPT, str(export), str(args.src), "{out}",
                 str(args.beam), str(args.threads)],
            )
        )  # fmt: skip
    if args.fairseq_checkpoint:
        source, target = args.langs.split("-")
        systems.append(
            System(
                "fairseq-interactive (its own model)",
                [str(args.fairseq_venv / "bin" / "python"), "-c", FAIRSEQ_SCRIPT, "{out}",
                 str(args.fairseq_data), "--path", str(args.fairseq_checkpoint),
                 "--source-lang", source, "--target-lang", target, "--task", "translation",
                 "--bpe", "sentencepiece", "--sentencepiece-model", str(args.fairseq_spm),
                 "--beam", str(args.beam), "--max-tokens", "1024", "--buffer-size", "100000",
                 "--input", str(args.src), "--cpu"],
                # loading a fairseq 0.12 checkpoint needs this on torch >= 2.6
                env={"OMP_NUM_THREADS": str(args.threads), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
            )
        )  # fmt: skip

    if args.only:
        systems = [x for x in systems if any(text in x.name for text in args.only)]
        if not systems:
            p.error(f"--only {args.only}: no system's name holds it")
    if args.skip:
        systems = [x for x in systems if not any(text in x.name for text in args.skip)]
        if not systems:
            p.error(f"--skip {args.skip}: every system's name holds one of these")
    one_line_src = first_line(args.src, work)
    warm_up(systems, args.src, one_line_src, work, env)
    for round_ in range(args.rounds):
        for system in systems[::-1] if args.alternate and round_ % 2 else systems:
            out = work / f"{len(system.seconds)}-{abs(hash(system.name))}.txt"
            system.seconds.append(run_timed(system, out, env))
            if system.output is None:
                system.output = out
            print(f"round {round_ + 1}: {system.name}: {system.seconds[-1]:.1f} s", flush=True)
            if args.one_line:
                one = run_timed(system, work / "one-line-out.txt", env, args.src, one_line_src)
                system.one_line_seconds.append(one)
                print(f"round {round_ + 1}: {system.name}, one line: {one:.2f} s", flush=True)

    n = len(args.src.read_text(encoding="utf-8").split("\n")) - 1
    first = systems[0].output.read_text(encoding="utf-8").split("\n")
    rows = []
    for system in systems:
        if system.name.startswith("aiayn translate") and "backend" not in system.name:
            extra = system.command[len(translate) + len(common) :]
            if "--int8" not in extra and "--bf16" not in extra:
                options = {"beam_size": args.beam, **search_options(extra)}
                system.rows_per_sentence = count_rows(args.model, args.src, options)
        bleu, chrf = scores(system.output, args.ref)
        lines = system.output.read_text(encoding="utf-8").split("\n")
        differ = sum(a != b for a, b in zip(lines, first, strict=False))
        median = statistics.median(system.seconds)
        one_line = statistics.median(system.one_line_seconds) if system.one_line_seconds else None
        rows.append(
            {
                "system": system.name,
                "seconds": system.seconds,
                "median_s": median,
                "one_line_seconds": system.one_line_seconds,
                "one_line_median_s": one_line,
                "sentences_per_s": n / median,
                "bleu": bleu,
                "chrf": chrf,
                "decoder_rows_per_sentence": system.rows_per_sentence,
                "outputs_differing_from_first": differ,
            }
        )
    ct2 = next((r["median_s"] for r in rows if r["system"].startswith("CTranslate2 fp32")), None)
    ct2_inter = next(
        (r["median_s"] for r in rows if r["system"].startswith("CTranslate2 fp32 (Python API, i")),
        None,
    )
    ct2_rest = next(
        (
            r["median_s"] - r["one_line_median_s"]
            for r in rows
            if r["system"].startswith("CTranslate2 fp32") and r["one_line_median_s"] is not None
        ),
        None,
    )
    gpu = gpu_names()
    lines = [
        f"{n} sentences of `{args.src.name}`, model `{args.model}`, beam {args.beam}, "
        f"{args.threads} threads, {args.rounds} interleaved rounds, each system a process of "
        f"its own timed from launch to exit; {cpu_name()} ({isa()}), {cores()} cores, "
        + (
            f"GPU: {gpu} (aiayn's `--device auto` picks it where PyTorch has CUDA, and for "
            "`--backend ctranslate2` where CTranslate2 can compute on it; CTranslate2's own "
            "API rows run on the CPU), "
            if gpu
            else ""
        )
        + f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| system | wall time (median) | rounds | sentences/s | decoder rows/sentence | BLEU "
        "| chrF "
        "| outputs ≠ first | × CTranslate2 fp32 |"
        + (" × CTranslate2 fp32 inter_threads |" if ct2_inter else "")
        + (" one line | × CTranslate2 fp32, less one line |" if args.one_line else ""),
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: |" if ct2_inter else "")
        + (" ---: | ---: |" if args.one_line else ""),
    ]
    for r in rows:
        rows_ = r["decoder_rows_per_sentence"]
        steps = "" if rows_ is None else f"{rows_:.1f}"
        speed = "" if ct2 is None else f"{ct2 / r['median_s']:.2f}×"
        lines.append(
            f"| {r['system']} | {r['median_s']:.1f} s | "
            + ", ".join(f"{s:.1f}" for s in r["seconds"])
            + f" | {r['sentences_per_s']:.1f} | {steps} | {r['bleu']:.2f} | {r['chrf']:.2f} | "
            f"{r['outputs_differing_from_first']} | {speed} |"
            + (f" {ct2_inter / r['median_s']:.2f}× |" if ct2_inter else "")
            + (one_line_cells(r, ct2_rest) if args.one_line else "")
        )
    table = "\n".join(lines)
    if args.profile:
        table += "\n\n" + profile_translation(args.model, args.src, args.beam)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n", encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
