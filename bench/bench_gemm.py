"""The matrix products of a decoding step: PyTorch's `nn.Linear` (MKL) vs oneDNN on packed weights.

Times the linear layers one decoder step of the `base` model runs (6 layers of self-attention
W^Q, W^K, W^V, W^O, encoder-decoder W^Q, W^O and the two feed-forward layers, then the
pre-softmax projection to 8,000 tokens) at the row counts decoding and training meet: 32 (a
greedy step over 32 sentences), 128 (a beam-4 step), 768 (the encoder over 32 × 24 tokens) and
4,096 (a training batch). Three ways, interleaved round by round, medians:

- `nn.Linear`: PyTorch's float32 linear layer (`addmm`, MKL's sgemm in the CPU wheels);
- oneDNN packed: `decode.packing.PackedLinear`, what `Translator` runs on an x86-64 CPU;
- oneDNN as stored: the same oneDNN call on the weight as stored (packed on every call).

Also checks that the results agree up to float32 rounding. `--new-shapes` instead measures
what a row count oneDNN has not seen before costs (it builds a kernel for each new shape):
one call at each of 400 new row counts, then at the same ones again.

    .venv/bin/python bench/bench_gemm.py
    .venv/bin/python bench/bench_gemm.py --update-benchmarks
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from aiayn.acceleration import onednn_linear_missing
from aiayn.decode.packing import PackedLinear
from benchmarks_md import BENCHMARKS_MD, replace_section

START, END = "<!-- bench_gemm:start -->", "<!-- bench_gemm:end -->"
HEADING = "## Matrix products: MKL vs oneDNN on packed weights"
D_MODEL, D_FF, VOCAB, LAYERS = 512, 2048, 8000, 6
STEP_LAYERS = [(D_MODEL, D_MODEL)] * 6 + [(D_MODEL, D_FF), (D_FF, D_MODEL)]  # one decoder layer


def layers() -> list[nn.Linear]:
    torch.manual_seed(0)
    shapes = STEP_LAYERS * LAYERS + [(D_MODEL, VOCAB)]
    return [nn.Linear(i, o, bias=o != VOCAB).eval() for i, o in shapes]


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def new_shapes(threads: int) -> None:
    """Microseconds per call of a oneDNN product on a packed weight at 400 row counts it has
    not seen, then at the same ones again (no rounding of row counts: the raw operator)."""
    torch.set_num_threads(threads)
    for d_in, d_out in ((64, 256), (D_MODEL, D_FF)):
        packed = PackedLinear(nn.Linear(d_in, d_out)).packed_weight
        inputs = [torch.randn(m, d_in) for m in range(1, 401)]
        for when in ("first time", "again"):
            start = time.perf_counter()
            with torch.inference_mode():
                for x in inputs:
                    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            took = (time.perf_counter() - start) / len(inputs) * 1e6
            print(f"{d_in}->{d_out}, 1-400 rows, {when}: {took:.0f} us per call", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 768, 4096])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--update-benchmarks", action="store_true")
    parser.add_argument("--new-shapes", action="store_true", help="cost of new row counts")
    args = parser.parse_args()
    missing = onednn_linear_missing()
    if missing:
        raise SystemExit(f"no oneDNN packing here: {missing}")
    if args.new_shapes:
        new_shapes(args.threads)
        return
    torch.set_num_threads(args.threads)
    linears = layers()
    packed = [PackedLinear(m) for m in linears]

    def onednn_as_stored(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, m.weight, m.bias, "none", [], "")

    lines = [
        "| rows | `nn.Linear` (MKL), ms | oneDNN packed, ms | oneDNN as stored, ms "
        "| `nn.Linear` / packed | largest difference |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in (D_MODEL, D_FF)}
            ways = {
                "mkl": lambda x=inputs: [m(x[m.in_features]) for m in linears],
                "packed": lambda x=inputs: [p(x[p.in_features]) for p in packed],
                "stored": lambda x=inputs: [onednn_as_stored(m, x[m.in_features]) for m in linears],
            }
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            for fn in ways.values():
                fn()  # warm-up
            for r in range(args.repeats):
                names = list(ways)[r % 3 :] + list(ways)[: r % 3]  # rotate the order
                for name in names:
                    seconds[name].append(_once(ways[name]))
            ms = {name: 1e3 * statistics.median(s) for name, s in seconds.items()}
            diff = max(
                float((a - b).abs().max() / b.abs().max())
                for a, b in zip(ways["packed"](), ways["mkl"](), strict=True)
            )
            lines.append(
                f"| {rows} | {ms['mkl']:.1f} | {ms['packed']:.1f} | {ms['stored']:.1f} "
                f"| {ms['mkl'] / ms['packed']:.2f}× | {diff:.0e} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print()
    print(text)
    if args.update_benchmarks:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
        except (OSError, StopIteration):
            pass
        notes = (
            f"Machine: {cpu}, {args.threads} threads, torch {torch.__version__}. Milliseconds "
            f"for the {len(linears)} linear layers of one `base` decoder step (with the "
            f"pre-softmax projection to {VOCAB} tokens) at each row count, medians of "
            f"{args.repeats} interleaved rounds; largest difference = the largest |packed − "
            "`nn.Linear`| over the largest |`nn.Linear`| output. Command: "
            f"`python bench/bench_gemm.py --repeats {args.repeats}`; run on "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}."
        )
        replace_section(BENCHMARKS_MD, START, END, text + "\n\n" + notes, HEADING)
        print(f"updated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
