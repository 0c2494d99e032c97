"""fp32 vs int8 (dynamic quantization of the linear layers) on a real test set: BLEU, chrF,
exact match and decoding time, side by side in one run.

    .venv/bin/python bench/bench_int8.py -m demo_run/run/model \\
        --src demo_run/corpus/test.en --ref demo_run/corpus/test.de
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from aiayn.evaluation import score
from aiayn.translator import Translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model-dir", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--beam-size", type=int, default=4)
    args = parser.parse_args()
    sources = Path(args.src).read_text(encoding="utf-8").splitlines()
    references = Path(args.ref).read_text(encoding="utf-8").splitlines()
    print("| weights | BLEU | chrF | exact match | decoding time (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for int8 in (False, True):
        translator = Translator(args.model_dir, int8=int8)
        start = time.perf_counter()
        results = translator.translate(sources, beam_size=args.beam_size)
        seconds = time.perf_counter() - start
        hypotheses = [r.text for r in results]
        scores = score(hypotheses, [references])
        exact = sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)
        print(
            f"| {'int8' if int8 else 'fp32'} | {scores.bleu:.2f} | {scores.chrf:.2f} "
            f"| {100 * exact:.1f}% | {seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
