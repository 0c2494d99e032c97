"""Where the CPU time of decoding goes: aiayn's search and CTranslate2's, side by side.

A profile, for finding causes (``bench_translate.py`` times the commands users run). Each
system translates the same sentences on one thread (what each of aiayn's decoding workers
runs), in a process of its own under Linux ``perf record``, which samples 999 times a second
and only while the sentences are translated: the process turns sampling on after loading and
a warm-up pass over the first 64 lines, and off when done (perf's control FIFO). Every sample
is put in a group by the library and function it fell in (`GROUPS`), so that the matrix
products, which both systems run near the core's peak, stand apart from what lies between
them: Python, PyTorch's dispatch, the softmax, copies.

- aiayn: ``Translator(MODEL).translate(lines, beam_size=W)``, its defaults otherwise;
- CTranslate2: ``translate_batch`` on ``aiayn export --to ctranslate2`` as bench_translate.py
  runs it (as its users get it by default: batches of 1,024 tokens, its length penalty,
  log_prob / |Y|; aiayn's length limit and banned tokens), ``intra_threads=1``, with the
  SentencePiece encoding and decoding that aiayn's pass also does.

The largest symbols of the groups that collect what no other matched are printed to stderr,
to check the grouping.

Needs Linux ``perf`` (Debian: ``apt install linux-perf``) with permission to sample its own
processes (``kernel.perf_event_paranoid`` ≤ 2), and ``pip install ctranslate2``.

    python bench/bench_cpu_time.py -m MODEL --src DATA/dev.en --beam 4 --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench_translate import AIAYN, cpu_name, with_src_on_path

FREQUENCY = 999
"""Samples per second of CPU time."""

CONTROL = r"""
def perf(command):
    with open(CTL, "w") as f:
        f.write(command + "\n")
    with open(ACK) as f:
        f.readline()
"""

AIAYN_CHILD = (
    r"""
import json, sys, time
import torch
from aiayn.decode.translator import Translator
model, src, beam, CTL, ACK = sys.argv[1:6]
"""
    + CONTROL
    + r"""
torch.set_num_threads(1)
translator = Translator(model)
lines = open(src, encoding="utf-8").read().split("\n")[:-1]
translator.translate(lines[:64], beam_size=int(beam))
perf("enable")
start = time.perf_counter()
translator.translate(lines, beam_size=int(beam))
wall = time.perf_counter() - start
perf("disable")
print(json.dumps({"wall": wall}))
"""
)

CT2_CHILD = (
    r"""
import json, sys, time
import ctranslate2, sentencepiece as spm
export, src, beam, CTL, ACK = sys.argv[1:6]
"""
    + CONTROL
    + r"""
source = spm.SentencePieceProcessor(model_file=f"{export}/source.spm")
target = spm.SentencePieceProcessor(model_file=f"{export}/target.spm")
lines = open(src, encoding="utf-8").read().split("\n")[:-1]
translator = ctranslate2.Translator(export, device="cpu", intra_threads=1, inter_threads=1)
def translate(lines):  # text in, text out, as aiayn's Translator
    pieces = [source.encode(line, out_type=str) for line in lines]
    limit = max(int(1.0 * (len(p) + 1) + 50) for p in pieces)  # aiayn's default limit
    results = translator.translate_batch(
        pieces, beam_size=int(beam), length_penalty=1.0, max_batch_size=1024,
        batch_type="tokens", max_decoding_length=limit, suppress_sequences=[["<pad>"], ["<s>"]],
    )
    return [target.decode(r.hypotheses[0]) for r in results]
translate(lines[:64])
perf("enable")
start = time.perf_counter()
translate(lines)
wall = time.perf_counter() - start
perf("disable")
print(json.dumps({"wall": wall}))
"""
)

GROUPS: list[tuple[str, re.Pattern[str]]] = [
    # (group, a pattern over "library symbol"), the first that matches wins.
    (
        "matrix products (MKL, oneDNN)",
        re.compile(r"^\[JIT\]|gemm|gemv|bmm|mkl_blas|dnnl|ideep", re.IGNORECASE),
    ),
    ("softmax, log-softmax, exp", re.compile(r"softmax|Sleef|\bexpf?\b", re.IGNORECASE)),
    (
        "other compute kernels (element-wise, reductions, top-k, norms, concatenation)",
        re.compile(
            r"libtorch_cpu\S* .*(AVX|DEFAULT|Vectoriz|_kernel|KernelImpl|topk|introselect|"
            r"Moments|reduce|index_select|gather|layer_norm)|libctranslate2\S* .*cpu::|TopK"
        ),
    ),
    ("memory copies (libc's memcpy, memmove, memset)", re.compile(r"^libc\S* .*mem(move|cpy|set)")),
    (
        "memory allocation",
        re.compile(r"malloc|calloc|realloc|memalign|(\b|_|c)free\b|unlink_chunk"),
    ),
    ("Python interpreter", re.compile(r"^(libpython|python3)")),
    ("PyTorch's Python bindings", re.compile(r"^libtorch_python")),
    ("PyTorch's dispatch and tensor bookkeeping", re.compile(r"^(libtorch_cpu|libc10)")),
    ("CTranslate2's own code (other)", re.compile(r"^libctranslate2")),
    ("operating system (page faults, scheduling)", re.compile(r"^\[kernel")),
]
OTHER = "everything else"


def group_of(library: str, symbol: str) -> str:
    """The `GROUPS` entry a sample in `symbol` of `library` belongs to."""
    key = f"{library} {symbol}"
    return next((name for name, pattern in GROUPS if pattern.search(key)), OTHER)


def perf_report(data: Path) -> str:
    """``perf report``'s table of a ``perf record`` file: samples per library and symbol."""
    return subprocess.run(
        ["perf", "report", "-i", str(data), "-n", "--no-children", "--sort", "dso,sym",
         "-g", "none", "--percent-limit", "0", "--stdio"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


REPORT_LINE = re.compile(r"\s+[\d.]+%\s+(\d+)\s+(.+?)\s+\[[.k]\]\s+(.*)")
"""A line of `perf_report`: "  18.37%   1720  libtorch_cpu.so  [.] mkl_blas_def_sgemm..."."""


def seconds_by_symbol(report: str) -> Counter[tuple[str, str]]:
    """CPU seconds per (library, symbol) in a `perf_report`."""
    seconds: Counter[tuple[str, str]] = Counter()
    for line in report.splitlines():
        if m := REPORT_LINE.match(line):
            seconds[m[2], m[3]] += int(m[1]) / FREQUENCY
    return seconds


def seconds_by_group(by_symbol: Counter[tuple[str, str]]) -> Counter[str]:
    """`seconds_by_symbol`'s seconds added up by `GROUPS`."""
    seconds: Counter[str] = Counter()
    for (library, symbol), spent in by_symbol.items():
        seconds[group_of(library, symbol)] += spent
    return seconds


def largest(by_symbol: Counter[tuple[str, str]], group: str, n: int = 6) -> str:
    """The `n` symbols that took most of `group`'s time, one a line (to check the grouping)."""
    mine = [(s, lib, sym) for (lib, sym), s in by_symbol.items() if group_of(lib, sym) == group]
    return "\n".join(f"  {s:6.2f} s  {lib}  {sym[:100]}" for s, lib, sym in sorted(mine)[-n:][::-1])


def profiled(
    name: str, child: str, argv: list[str], work: Path, env: dict[str, str]
) -> tuple[float, Path]:
    """Run a child script under ``perf record``, sampling while it says; (its wall, data)."""
    ctl, ack, data = work / "ctl", work / "ack", work / f"{name}.data"
    for fifo in (ctl, ack):
        if fifo.exists():
            fifo.unlink()
        os.mkfifo(fifo)
    command = [
        "perf", "record", "-F", str(FREQUENCY), "-D", "-1", "--control",
        f"fifo:{ctl},{ack}", "-o", str(data), "--",
        sys.executable, "-c", child, *argv, str(ctl), str(ack),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{name} under perf record failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["wall"], data


def table(results: dict[str, tuple[float, Counter[str]]]) -> str:
    names = list(results)
    groups = [name for name, _ in GROUPS] + [OTHER]
    lines = [
        "| where the CPU time went | " + " | ".join(f"{n} (s)" for n in names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for group in groups:
        if any(results[n][1][group] >= 0.005 for n in names):
            cells = " | ".join(f"{results[n][1][group]:.2f}" for n in names)
            lines.append(f"| {group} | {cells} |")
    totals = " | ".join(f"**{sum(results[n][1].values()):.2f}**" for n in names)
    lines.append(f"| all samples | {totals} |")
    walls = " | ".join(f"{results[n][0]:.2f}" for n in names)
    lines.append(f"| wall clock of the pass (s) | {walls} |")
    return "\n".join(lines)


CHECKED = ("PyTorch's dispatch and tensor bookkeeping", OTHER)
"""The groups whose largest symbols are printed (to stderr), to check what they hold."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="an aiayn model directory")
    p.add_argument("--src", type=Path, required=True, help="source sentences, one a line")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--markdown", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        sys.exit("needs Linux perf (Debian: apt install linux-perf)")
    lines = len(args.src.read_text(encoding="utf-8").split("\n")[:-1])
    if lines == 0:
        sys.exit(f"{args.src}: no sentences")
    env = with_src_on_path(os.environ)
    results: dict[str, tuple[float, Counter[str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        export = work / "ct2"
        command = [*AIAYN, "export", args.model, "--to", "ctranslate2", "-o", str(export)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"aiayn export failed: {done.stderr.strip()[-2000:]}")
        runs = {
            "aiayn": (AIAYN_CHILD, [args.model]),
            "CTranslate2": (CT2_CHILD, [str(export)]),
        }
        for name, (child, first) in runs.items():
            argv_ = [*first, str(args.src), str(args.beam)]
            wall, data = profiled(name, child, argv_, work, env)
            by_symbol = seconds_by_symbol(perf_report(data))
            results[name] = (wall, seconds_by_group(by_symbol))
            print(f"{name}: {wall:.2f} s", file=sys.stderr)
            for group in CHECKED:
                print(f" {group}:\n{largest(by_symbol, group)}", file=sys.stderr, flush=True)
    header = (
        f"{lines} sentences of {args.src.name}, beam {args.beam}, one thread, {cpu_name()}; "
        f"perf samples at {FREQUENCY} Hz while translating (after a warm-up):"
    )
    out = header + "\n\n" + table(results)
    print(out)
    if args.markdown:
        args.markdown.write_text(out + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
