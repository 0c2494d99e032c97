"""Which products float32 CPU decoding should run on: an A/B of `Translator`s in one process.

A microbenchmark for causes (the user's job is `bench/bench_translate.py`): one thread, as each
decoding worker runs; the test set cut into chunks that go to the translators in turn, the
order reversed every other chunk, so that a machine's slow minutes fall on all of them alike.
The translators differ only in `--onednn` / `--no-onednn`:

- ``default``: what `aiayn translate` runs here (`decode.packing.decoding_kernels`: on x86-64
  CPUs other than Intel's, oneDNN for the pre-softmax projection and MKL for the rest);
- ``onednn``: oneDNN's packed products for every layer (`--onednn`);
- ``mkl``: MKL's products on weights stored transposed for every layer (`--no-onednn`).

Prints each one's total seconds, its ratio to the first, and how many outputs differ from the
first's (float32 rounding may change a few).

    python bench/bench_kernels_ab.py -m MODEL --src DATA/dev.en
    python bench/bench_kernels_ab.py -m MODEL --src DATA/dev.en --lines 96 --chunk 16 \\
        --max-len-b 10 --systems default,onednn   # a random-weight `base`: short outputs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from aiayn.decode.packing import decoding_kernels  # noqa: E402
from aiayn.decode.translator import Translator  # noqa: E402

ONEDNN = {"default": None, "onednn": True, "mkl": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="aiayn model directory")
    p.add_argument("--src", type=Path, required=True, help="one sentence per line")
    p.add_argument(
        "--systems", default="default,onednn,mkl", help="comma-separated, of " + ", ".join(ONEDNN)
    )
    p.add_argument("--lines", type=int, default=0, help="the first N lines only (0: all)")
    p.add_argument("--chunk", type=int, default=64, help="sentences a translator takes in turn")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-len-b", type=float, default=50.0, help="as aiayn translate's")
    args = p.parse_args()
    names = args.systems.split(",")
    unknown = [n for n in names if n not in ONEDNN]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(ONEDNN)}")

    torch.set_num_threads(1)
    lines = args.src.read_text(encoding="utf-8").splitlines()
    lines = lines[: args.lines] if args.lines else lines
    chunks = [lines[i : i + args.chunk] for i in range(0, len(lines), args.chunk)]
    search = dict(beam_size=args.beam, max_len_b=args.max_len_b)
    translators = {n: Translator(args.model, onednn=ONEDNN[n]) for n in names}
    for t in translators.values():
        t.translate(chunks[0][:8], **search)  # the kernels' first calls
    seconds = dict.fromkeys(names, 0.0)
    outputs: dict[str, list[str]] = {n: [] for n in names}
    for i, chunk in enumerate(chunks):
        for n in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            results = translators[n].translate(chunk, **search)
            seconds[n] += time.perf_counter() - start
            outputs[n] += [r.text for r in results]
    first = names[0]
    kernels = decoding_kernels()
    print(f"{len(lines)} sentences of {args.src.name}, beam {args.beam}, one thread; "
          f"default kernels here (layers, pre-softmax projection): {kernels}")  # fmt: skip
    for n in names:
        differ = sum(a != b for a, b in zip(outputs[first], outputs[n], strict=True))
        print(f"{n}: {seconds[n]:.2f} s ({seconds[n] / seconds[first]:.3f}x {first}), "
              f"outputs != {first}'s: {differ}")  # fmt: skip


if __name__ == "__main__":
    main()
