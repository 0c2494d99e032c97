"""Does CPU bf16 training lose its speed to changing batch shapes? Updates on real batches.

Issue #17: `--precision bf16` is 1.5–1.7× fp32 per step at a fixed shape (the peers table) but only
~1.2× in a real run, where token-bucketed batches change shape nearly every update. If oneDNN
preparing kernels per new shape were the cost, padding batches up to a few widths (and row
counts) would buy the speed back. This runs the trainer's own `optimizer_update` (the `small`
model, Adam, label smoothing, autocast as `aiayn train --precision bf16` uses it) on the batches of
one epoch of a real corpus, in these variants, one after the other on the same batches:

- `fp32`, `bf16`: the batches as `aiayn train` collates them;
- `bf16, widths ×W`: every batch's source and target width padded up to a multiple of W;
- `bf16, widths ×W, rows ×R`: also its rows, with all-padding rows, up to a multiple of R;
- `fp32 fixed`, `bf16 fixed`: one batch of the epoch, the same shape every update.

Padding adds no target tokens (the loss skips it), so tok/s counts the same tokens in every
variant. Median target tokens/s over the updates, the first `--skip` left out:

    .venv/bin/python bench/bench_bf16_shapes.py --src DATA/train.en --tgt DATA/train.es \\
        --tokenizer runs/bible-en-es-cpu/tokenizer.model
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import aiayn.train.update as update
from aiayn.acceleration import use_cpu_attention
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.optim import build_optimizer
from aiayn.text.batching import Batch, collate, epoch_updates
from aiayn.text.corpus import load_or_build
from aiayn.text.tokenizer import PAD_ID, Tokenizer
from aiayn.train.distributed import Distributed


def padded(widths: int, rows: int) -> Callable[..., Batch]:
    """`collate`, then widths up to a multiple of `widths` and rows up to one of `rows`."""

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra_cols = -x.shape[1] % widths
        extra_rows = -x.shape[0] % rows
        return F.pad(x, (0, extra_cols, 0, extra_rows), value=PAD_ID)

    def collate_padded(examples, **kwargs) -> Batch:
        b = collate(examples, **kwargs)
        return Batch(pad(b.src), pad(b.tgt_in), pad(b.tgt_out), b.n_src_tokens, b.n_tgt_tokens)

    return collate_padded


def measure(dataset, groups, *, vocab: int, bf16: bool, collate_fn, skip: int) -> float:
    update.collate = collate_fn  # what optimizer_update collates its batches with
    torch.manual_seed(0)
    config = preset("small", src_vocab_size=vocab)
    model = use_cpu_attention(Transformer(config))  # as the trainer on a CPU
    optimizer = build_optimizer(model, betas=(0.9, 0.98), eps=1e-9)
    rates = []
    for step, group in enumerate(groups, 1):
        start = time.perf_counter()
        stats = update.optimizer_update(
            model, optimizer, dataset, group, step=step, d_model=config.d_model,
            warmup_steps=400, lr_scale=0.5, label_smoothing=0.1, clip_norm=0.0, bf16=bf16,
            device=torch.device("cpu"), distributed=Distributed(),
        )  # fmt: skip
        if step > skip:
            rates.append(stats.tokens / (time.perf_counter() - start))
    update.collate = collate
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--tgt", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first updates left out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = Tokenizer.load(args.tokenizer)
    with tempfile.TemporaryDirectory() as cache:
        dataset, _ = load_or_build(
            args.src, args.tgt, None, tokenizer, Path(cache), max_len=args.max_len
        )
        groups = epoch_updates(
            dataset.src_lengths, dataset.tgt_lengths, max_tokens=args.max_tokens, seed=1,
            epoch=1, accumulate=1, rank=0, world_size=1,
        )[: args.updates + args.skip]  # fmt: skip
        fixed = [groups[len(groups) // 2]] * len(groups)
        variants = [("fp32", False, groups, collate), ("bf16", True, groups, collate)]
        for w in args.widths:
            variants.append((f"bf16, widths ×{w}", True, groups, padded(w, 1)))
        w = args.widths[-1]
        variants.append(
            (f"bf16, widths ×{w}, rows ×{args.rows}", True, groups, padded(w, args.rows))
        )
        variants += [("fp32 fixed", False, fixed, collate), ("bf16 fixed", True, fixed, collate)]
        results = {}
        for name, bf16, batches, collate_fn in variants:
            results[name] = measure(
                dataset, batches, vocab=tokenizer.vocab_size, bf16=bf16,
                collate_fn=collate_fn, skip=args.skip,
            )  # fmt: skip
            print(f"{name}: {results[name]:.0f} tok/s", flush=True)

    print("\n| batches | target tok/s (median) | vs fp32 as collated |")
    print("| --- | ---: | ---: |")
    for name, rate in results.items():
        print(f"| {name} | {rate:.0f} | {rate / results['fp32']:.2f}× |")
    print(
        f"\n{args.updates} updates of ≤ {args.max_tokens} tokens ({args.skip} more left out), "
        f"`small` model, {args.threads} threads, torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
