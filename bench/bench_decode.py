"""Decoding speed: beam-4 and greedy search with the KV cache, on random weights.

Every sentence is forced to produce exactly `--out-len` tokens (EOS is masked until the maximum
length, where search forces it), so all runs do the same work whatever the random weights
prefer. The model runs as `Translator` runs it in float32 on a CPU, its linear layers on
oneDNN-packed weights (`--no-onednn`: PyTorch's own `nn.Linear`). Reports the median and
min–max over `--repeats` runs of target tokens/s and sentences/s.

    .venv/bin/python bench/bench_decode.py                      # base and small, batch 32
    .venv/bin/python bench/bench_decode.py --update-benchmarks  # rewrite BENCHMARKS.md section
    .venv/bin/python bench/bench_decode.py --varied 40 --presets tiny small base --threads 1

`--varied N` instead compares the model with and without oneDNN-packed linear layers on N
batches of 1–32 sentences of 3–20 tokens (beam 4, 16 output tokens each), interleaved round by
round: the row counts a server meets, which the fixed shape above does not.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from aiayn.acceleration import pack_linear_layers
from aiayn.cache import DecoderCache
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.search import DecodingOptions, beam_search, greedy_search
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID
from bench_train_step import machine_info
from benchmarks_md import BENCHMARKS_MD, replace_section

START, END = "<!-- bench_decode:start -->", "<!-- bench_decode:end -->"


class FixedLength(torch.nn.Module):
    """The model with EOS masked out before `out_len` tokens, so every hypothesis has exactly
    `out_len` tokens (search then forces EOS)."""

    def __init__(self, model: Transformer, out_len: int) -> None:
        super().__init__()
        self.model, self.out_len = model, out_len

    def encode(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.encode(src_tokens)

    def init_cache(self, memory, src_key_mask, max_len: int) -> DecoderCache:
        return self.model.init_cache(memory, src_key_mask, max_len)

    def decode_step(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        log_probs = self.model.decode_step(tokens, cache)
        if cache.length <= self.out_len:  # this step predicts output token cache.length - 1
            log_probs[:, EOS_ID] = float("-inf")
        return log_probs


def time_search(model: FixedLength, src: torch.Tensor, mode: str, out_len: int) -> float:
    ids = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    options = DecodingOptions(max_len_a=0.0, max_len_b=out_len)  # the paper's beam 4, α 0.6
    start = time.perf_counter()
    with torch.inference_mode():
        if mode == "greedy":
            greedy_search(model, src, **ids, options=options)
        else:
            beam_search(model, src, **ids, options=options)
    return time.perf_counter() - start


def run(
    presets: list[str], batch: int, src_len: int, out_len: int, repeats: int, onednn: bool = True
) -> list[dict]:
    rows = []
    for name in presets:
        torch.manual_seed(0)
        transformer = Transformer(preset(name, src_vocab_size=8000, dropout=0.0)).eval()
        if onednn:  # as Translator runs float32 on a CPU
            transformer = pack_linear_layers(transformer)
        model = FixedLength(transformer, out_len)
        src = torch.randint(4, 8000, (batch, src_len))
        for mode in ("greedy", "beam4"):
            time_search(model, src, mode, out_len)  # warm-up
            times = [time_search(model, src, mode, out_len) for _ in range(repeats)]
            tok_s = [batch * out_len / t for t in times]
            rows.append(
                dict(
                    preset=name,
                    mode=mode,
                    batch=batch,
                    src_len=src_len,
                    out_len=out_len,
                    median_s=statistics.median(times),
                    tok_s=statistics.median(tok_s),
                    tok_s_min=min(tok_s),
                    tok_s_max=max(tok_s),
                    sent_s=batch / statistics.median(times),
                )
            )
            print(
                f"{name:6s} {mode:6s} {rows[-1]['tok_s']:8.0f} tok/s "
                f"({rows[-1]['tok_s_min']:.0f}–{rows[-1]['tok_s_max']:.0f}), "
                f"{rows[-1]['sent_s']:.1f} sentences/s",
                flush=True,
            )
    return rows


def compare_onednn(
    presets: list[str], n_batches: int, repeats: int, min_features: int | None = None
) -> None:
    """Seconds to beam-search `n_batches` varied batches, plain vs packed, interleaved."""
    rng = random.Random(0)
    shapes = [(rng.randint(1, 32), rng.randint(3, 20)) for _ in range(n_batches)]
    for name in presets:
        torch.manual_seed(0)
        plain = Transformer(preset(name, src_vocab_size=8000, dropout=0.0)).eval()
        packed = pack_linear_layers(plain, min_features)
        models = {"nn.Linear": FixedLength(plain, 16), "oneDNN packed": FixedLength(packed, 16)}
        batches = [torch.randint(4, 8000, shape) for shape in shapes]
        seconds: dict[str, list[float]] = {k: [] for k in models}
        for r in range(repeats + 1):  # the first round warms up
            for k in list(models)[r % 2 :] + list(models)[: r % 2]:
                took = sum(time_search(models[k], b, "beam4", 16) for b in batches)
                if r:
                    seconds[k].append(took)
        med = {k: statistics.median(v) for k, v in seconds.items()}
        same = "" if packed is not plain else " (too small: nothing packed)"
        print(
            f"{name:6s} {n_batches} varied batches, beam 4: nn.Linear {med['nn.Linear']:.2f} s, "
            f"oneDNN packed {med['oneDNN packed']:.2f} s: "
            f"{med['nn.Linear'] / med['oneDNN packed']:.2f}x{same}",
            flush=True,
        )


def machine() -> str:
    info = machine_info(torch.device("cpu"))
    return f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}"


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "| preset | search | batch × source tokens → output tokens | median target tok/s "
        "| min–max | sentences/s |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['mode']} | {r['batch']} × {r['src_len']} → {r['out_len']} "
            f"| {r['tok_s']:.0f} | {r['tok_s_min']:.0f}–{r['tok_s_max']:.0f} "
            f"| {r['sent_s']:.1f} |"
        )
    lines += ["", f"Machine: {machine()}. Command: `{command}`."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["base", "small"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--out-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--no-onednn", dest="onednn", action="store_false", help="PyTorch's own nn.Linear"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--varied", type=int, default=0, help="compare on N varied batches")
    parser.add_argument(
        "--pack-min-features",
        type=int,
        help="with --varied: pack layers this wide and wider (default: as Translator does)",
    )
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--update-benchmarks", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.varied:
        compare_onednn(args.presets, args.varied, args.repeats, args.pack_min_features)
        return
    rows = run(args.presets, args.batch, args.src_len, args.out_len, args.repeats, args.onednn)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.update_benchmarks:
        command = (
            "python bench/bench_decode.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}"
                for k, v in (
                    ("batch", args.batch),
                    ("src_len", args.src_len),
                    ("out_len", args.out_len),
                    ("repeats", args.repeats),
                )
            )
            + ("" if args.onednn else " --no-onednn")
        )
        replace_section(
            BENCHMARKS_MD,
            START,
            END,
            markdown(rows, command),
            "## Decoding: beam 4 and greedy with the KV cache",
        )


if __name__ == "__main__":
    main()
