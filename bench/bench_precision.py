"""fp32 vs int8 (dynamic quantization of the linear layers) vs bf16 on a real test set: BLEU,
chrF, exact match and decoding time, side by side in one run.

fp32 is `Translator`'s default (linear layers on packed weights where they are large enough,
`decode.packing.pack_for_decoding`); `fp32-no-onednn` is fp32 with MKL's products for every
layer (`--no-onednn`).

    .venv/bin/python bench/bench_precision.py -m demo_run/run/model \\
        --src demo_run/corpus/test.en --ref demo_run/corpus/test.de
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from aiayn import runtime
from aiayn.acceleration import native_bf16_cpu
from aiayn.decode.evaluation import score
from aiayn.decode.translator import Translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model-dir", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "fp32-no-onednn", "int8", "bf16"],
        choices=["fp32", "fp32-no-onednn", "int8", "bf16"],
    )
    args = parser.parse_args()
    runtime.configure(threads=args.threads)
    sources = Path(args.src).read_text(encoding="utf-8").splitlines()
    references = Path(args.ref).read_text(encoding="utf-8").splitlines()
    print(f"native bf16 on this CPU: {native_bf16_cpu()}")
    print("| weights | BLEU | chrF | exact match | same output as fp32 | decoding time (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    fp32_outputs: list[str] | None = None
    for precision in args.precisions:
        translator = Translator(
            args.model_dir,
            int8=precision == "int8",
            bf16=precision == "bf16",
            onednn=precision != "fp32-no-onednn",
        )
        start = time.perf_counter()
        results = translator.translate(sources, beam_size=args.beam_size)
        seconds = time.perf_counter() - start
        hypotheses = [r.text for r in results]
        if precision == "fp32":
            fp32_outputs = hypotheses
        same = "—"
        if fp32_outputs is not None:
            agree = sum(a == b for a, b in zip(hypotheses, fp32_outputs, strict=True))
            same = f"{100 * agree / len(hypotheses):.1f}%"
        scores = score(hypotheses, [references])
        exact = sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)
        print(
            f"| {precision} | {scores.bleu:.2f} | {scores.chrf:.2f} | {100 * exact:.1f}% "
            f"| {same} | {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
