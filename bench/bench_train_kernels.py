"""The three CPU training speed-ups, each against what it replaced, alone and in a whole step.

Part 1, the kernels alone, at the batch shape of the Bible recipe as of commit 0529388 (`small`:
d_model 256, d_ff 1024, 4 heads; ≤ 4096 tokens a side, about 3,400 target tokens a batch; the
recipe's limit is 2048 since), medians of interleaved repeats:

- the linear layers' products: PyTorch's float32 `F.linear` and its backward (MKL's sgemm in
  the CPU wheels) against `acceleration.OneDNNLinearProducts` (oneDNN for y = x Wᵀ and
  dL/dx, `torch.mm` for dL/dW): forward + backward of the layers of one step;
- dropout: `F.dropout` against `model.Dropout` (keep-mask drawn as U[0, 1) ≥ p), forward +
  backward of a (3,400 × 256) activation;
- attention under bf16 autocast: the fused kernel in bf16 against `attention`'s float32 one
  (what `--precision bf16` training runs), forward + backward.

Part 2, whole training steps of the `small` model (forward, chunked label-smoothed loss,
backward, Adam) on batches of varied shape (≈ 4,000 tokens a side, 12–80 tokens long: a new
shape nearly every step, as in a real run), the new and the old way interleaved step by step on
the same batches: float32 with and without the oneDNN products and the new dropout, and bf16
autocast with and without float32 attention and the new dropout. Reported per target token.

    .venv/bin/python bench/bench_train_kernels.py
    .venv/bin/python bench/bench_train_kernels.py --update-benchmarks
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from aiayn.acceleration import OneDNNLinearProducts, cpu_attention, onednn_linear_missing
from aiayn.attention import MultiHeadAttention
from aiayn.config import preset
from aiayn.model import Dropout, Transformer
from benchmarks_md import BENCHMARKS_MD, replace_section

START, END = "<!-- bench_train_kernels:start -->", "<!-- bench_train_kernels:end -->"
HEADING = "## CPU training: oneDNN products, dropout, bf16 attention"
D, FF, V, HEADS, ROWS = 256, 1024, 8000, 4, 3400
# One `small` step's linear layers: 3 encoder layers (fused QKV, W^O, FFN), 3 decoder layers
# (fused QKV, W^O, cross W^Q, cross K/V, W^O, FFN).
STEP_LAYERS = [(D, 3 * D), (D, D), (D, FF), (FF, D)] * 3 + [
    (D, 3 * D), (D, D), (D, D), (D, 2 * D), (D, D), (D, FF), (FF, D)
] * 3  # fmt: skip


def median_ms(ways: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Milliseconds per call of each way: one warm-up each, then rounds in rotating order."""
    for fn in ways.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            ways[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(s) for name, s in seconds.items()}


def kernels(repeats: int) -> list[str]:
    torch.manual_seed(0)
    weights = [(torch.randn(o, i) * 0.05).requires_grad_() for i, o in STEP_LAYERS]
    inputs = [torch.randn(ROWS, i, requires_grad=True) for i, _ in STEP_LAYERS]

    def linears(products: contextlib.AbstractContextManager) -> None:
        with products:
            for x, w in zip(inputs, weights, strict=True):
                F.linear(x, w).sum().backward()

    x = torch.randn(ROWS, D, requires_grad=True)
    dropout = Dropout(0.1).train()
    b, t = 110, 31
    qkv = [torch.randn(b, HEADS, t, D // HEADS, dtype=torch.bfloat16) for _ in range(3)]
    qkv = [q.requires_grad_() for q in qkv]

    def attention(in_fp32: bool) -> None:
        kernel = cpu_attention if in_fp32 else F.scaled_dot_product_attention
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = kernel(*qkv, is_causal=True)
        out.float().sum().backward()

    rows = [
        ("linear layers of one step, fwd + bwd", f"{len(STEP_LAYERS)} layers × {ROWS} rows",
         "`F.linear` (MKL)", "oneDNN products",
         {"old": lambda: linears(contextlib.nullcontext()),
          "new": lambda: linears(OneDNNLinearProducts())}),
        ("dropout p = 0.1, fwd + bwd", f"{ROWS} × {D} float32", "`F.dropout`", "`model.Dropout`",
         {"old": lambda: F.dropout(x, 0.1, True).sum().backward(),
          "new": lambda: dropout(x).sum().backward()}),
        ("attention under bf16 autocast, fwd + bwd", f"{b} × {HEADS} heads × {t} × {t}, causal",
         "fused kernel in bf16", "in float32",
         {"old": lambda: attention(False), "new": lambda: attention(True)}),
    ]  # fmt: skip
    lines = [
        "| kernel | shape | before | ms | now | ms | speed-up |",
        "| --- | --- | --- | ---: | --- | ---: | ---: |",
    ]
    for what, shape, old, new, ways in rows:
        ms = median_ms(ways, repeats)
        lines.append(
            f"| {what} | {shape} | {old} | {ms['old']:.1f} | {new} | {ms['new']:.1f} "
            f"| {ms['old'] / ms['new']:.2f}× |"
        )
        print(lines[-1], flush=True)
    return lines


def steps(n_steps: int) -> list[str]:
    """Whole steps, old and new way alternating on the same batches; µs per target token."""
    torch.manual_seed(0)
    model = Transformer(preset("small", src_vocab_size=V, dropout=0.1)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    new_dropout = Dropout.forward
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]

    def step(batch: tuple[torch.Tensor, ...], bf16: bool, new: bool) -> float:
        Dropout.forward = new_dropout if new else torch.nn.Dropout.forward
        for m in attentions:  # the trainer's on a CPU, or PyTorch's fused kernel
            m.kernel = cpu_attention if new else F.scaled_dot_product_attention
        products = OneDNNLinearProducts() if new and not bf16 else contextlib.nullcontext()
        bf16_autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        start = time.perf_counter()
        with products:
            with bf16_autocast:
                sums = model(*batch, label_smoothing=0.1)
            (sums.loss / sums.n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / batch[2].numel()

    rng = random.Random(0)
    lines = [
        "| precision | before: µs per target token | now | speed-up | steps each |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    try:
        for bf16 in (False, True):
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(n_steps + 2):
                t = rng.randint(12, 80)
                b, s = 4000 // t, max(5, t + rng.randint(-4, 4))
                batch = (torch.randint(4, V, (b, s)), torch.randint(4, V, (b, t)))
                batch = (*batch, torch.randint(4, V, (b, t)))
                for new in (True, False) if i % 2 else (False, True):
                    took = step(batch, bf16, new)
                    if i >= 2:  # the first two rounds warm up
                        times[new].append(took)
            old, new = (1e6 * statistics.median(times[k]) for k in (False, True))
            what = "bf16 autocast (`--precision bf16`)" if bf16 else "float32"
            lines.append(f"| {what} | {old:.0f} | {new:.0f} | {old / new:.2f}× | {n_steps} |")
            print(lines[-1], flush=True)
    finally:
        Dropout.forward = new_dropout
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="rounds per kernel")
    parser.add_argument("--steps", type=int, default=16, help="training steps per way")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--update-benchmarks", action="store_true")
    args = parser.parse_args()
    missing = onednn_linear_missing()
    if missing:
        raise SystemExit(f"no oneDNN products here: {missing}")
    torch.set_num_threads(args.threads)
    kernel_lines = kernels(args.repeats)
    step_lines = steps(args.steps)
    text = "\n".join(kernel_lines) + "\n\n" + "\n".join(step_lines)
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
            f"Machine: {cpu}, {args.threads} threads, torch {torch.__version__}. Kernels: "
            f"milliseconds, medians of {args.repeats} interleaved rounds. Steps: the `small` "
            "model (7.6M parameters, 8,000-token vocabulary), batches of ≈ 4,000 tokens a side "
            "and 12–80 tokens long, each batch once each way, in alternating order; medians of "
            "µs per target token (forward, chunked loss, backward, Adam). Command: "
            f"`python bench/bench_train_kernels.py --repeats {args.repeats} --steps "
            f"{args.steps}`; run on {time.strftime('%Y-%m-%d %H:%M %Z')}."
        )
        replace_section(BENCHMARKS_MD, START, END, text + "\n\n" + notes, HEADING)
        print(f"updated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
