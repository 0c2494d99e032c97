"""Decoding speed: beam-4 and greedy search with the KV cache, on random weights.

Every sentence is forced to produce exactly `--out-len` tokens (EOS is masked until the maximum
length, where search forces it), so all runs do the same work whatever the random weights
prefer. The model runs as `Translator` runs it in float32 on a CPU, its linear layers on packed
weights (`decode.packing.pack_for_decoding`; `--no-onednn`: PyTorch's own `nn.Linear`). Reports
the median and min–max over `--repeats` runs of target tokens/s and sentences/s.

    .venv/bin/python bench/bench_decode.py                      # base and small, batch 32
    .venv/bin/python bench/bench_decode.py --update-benchmarks  # rewrite BENCHMARKS.md section
    .venv/bin/python bench/bench_decode.py --varied 40 --presets tiny small base --threads 1

`--varied N` instead compares the model with and without oneDNN-packed linear layers on N
batches of 1–32 sentences of 3–20 tokens (beam 4, 16 output tokens each), interleaved round by
round: the row counts a server meets, which the fixed shape above does not.

`--compile` times the decoding step under `torch.compile(dynamic=True)` (TorchInductor; with
`--freeze`, in its frozen-weights mode) against the eager model, plain and packed,
interleaved, with the time the first search took (compilation) and whether the outputs match:

    .venv/bin/python bench/bench_decode.py --compile --presets base --repeats 5

`--fusions` compares the packed model as `Translator` runs it with the same model without its
two fusions (self-attention's Q/K/V in one product, the feed-forward ReLU applied by the first
product), interleaved round by round:

    .venv/bin/python bench/bench_decode.py --fusions --presets base --repeats 11 --threads 2

`--reorder` compares the decoder cache as `Translator` runs it (a reorder copies only the rows
that change, in place, with search keeping each beam's best child in its parent's row) with
the same model whose cache gathers every row into its second buffer at every step, as it did
before, interleaved round by round:

    .venv/bin/python bench/bench_decode.py --reorder --presets base --repeats 11 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

import torch

from aiayn.acceleration import use_cpu_attention
from aiayn.cache import DecoderCache
from aiayn.config import preset
from aiayn.decode.packing import PackedSelfAttention, pack_for_decoding, pack_linear_layers
from aiayn.decode.search import DecodingOptions, beam_search, greedy_search
from aiayn.model import Transformer
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
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


def search(model: FixedLength, src: torch.Tensor, mode: str, out_len: int) -> list[list[int]]:
    """The best output's tokens of every sentence: greedy or beam 4 ("beam4")."""
    ids = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    options = DecodingOptions(max_len_a=0.0, max_len_b=out_len)  # the paper's beam 4, α 0.6
    with torch.inference_mode():
        if mode == "greedy":
            return [h.tokens for h in greedy_search(model, src, **ids, options=options)]
        return [h[0].tokens for h in beam_search(model, src, **ids, options=options)]


def time_search(model: FixedLength, src: torch.Tensor, mode: str, out_len: int) -> float:
    start = time.perf_counter()
    search(model, src, mode, out_len)
    return time.perf_counter() - start


def decoded(model: torch.nn.Module, src: torch.Tensor, mode: str, out_len: int) -> list:
    """`search` of `model` with every output forced to `out_len` tokens."""
    return search(FixedLength(model, out_len), src, mode, out_len)


def interleaved_seconds(
    systems: dict[str, torch.nn.Module], src: torch.Tensor, mode: str, out_len: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per search of each system, `repeats` rounds, the order rotating each round."""
    names = list(systems)
    seconds: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            seconds[k].append(time_search(FixedLength(systems[k], out_len), src, mode, out_len))
    return seconds


def run(
    presets: list[str], batch: int, src_len: int, out_len: int, repeats: int, onednn: bool = True
) -> list[dict]:
    rows = []
    for name in presets:
        torch.manual_seed(0)
        transformer = Transformer(preset(name, src_vocab_size=8000, dropout=0.0)).eval()
        use_cpu_attention(transformer)  # as Translator on a CPU
        if onednn:  # as Translator runs float32 on a CPU
            transformer = pack_for_decoding(transformer)
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
        packed = pack_linear_layers(use_cpu_attention(plain), min_features)
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


def compare_compiled(
    presets: list[str], batch: int, src_len: int, out_len: int, repeats: int, freeze: bool
) -> None:
    """Eager (as `Translator` runs float32, and with `nn.Linear`) against the decoding step
    compiled by TorchInductor with dynamic shapes (the rows and the cache length change from
    step to step; with `freeze`, in its frozen-weights mode); beam 4 and greedy, interleaved.
    One compiled model per process: a second model would reuse the first one's graph."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = freeze
    label = "compiled, frozen" if freeze else "compiled"
    for name in presets:
        torch.manual_seed(0)
        plain = use_cpu_attention(Transformer(preset(name, src_vocab_size=8000, dropout=0.0)))
        plain.eval()
        src = torch.randint(4, 8000, (batch, src_len))
        compiled = copy.deepcopy(plain)
        compiled.decode_step = torch.compile(compiled.decode_step, dynamic=True)
        start = time.perf_counter()
        outputs = {m: decoded(compiled, src, m, out_len) for m in ("beam4", "greedy")}
        compiling = time.perf_counter() - start
        systems = {"eager, packed": pack_for_decoding(plain), "eager, nn.Linear": plain}
        systems[label] = compiled
        for mode in ("beam4", "greedy"):
            reference = decoded(plain, src, mode, out_len)
            agree = sum(a == b for a, b in zip(outputs[mode], reference, strict=True))
            seconds = interleaved_seconds(systems, src, mode, out_len, repeats)
            for k, v in seconds.items():
                print(
                    f"{name:6s} {mode:6s} {k:18s} {batch * out_len / statistics.median(v):6.0f} "
                    "tok/s"
                    + (
                        f", same output as eager for {agree}/{batch} sentences; the first beam "
                        f"4 and greedy searches took {compiling:.0f} s (compiling)"
                        if k == label
                        else ""
                    ),
                    flush=True,
                )


def compare_fusions(
    presets: list[str], batch: int, src_len: int, out_len: int, repeats: int
) -> None:
    """The packed model against a copy without `pack_linear_layers`' two fusions."""
    import torch.nn.functional as F

    from aiayn.decode.packing import PackedLinear
    from aiayn.model import PositionwiseFeedForward

    for name in presets:
        torch.manual_seed(0)
        plain = use_cpu_attention(Transformer(preset(name, src_vocab_size=8000, dropout=0.0)))
        plain.eval()
        fused, unfused = pack_linear_layers(plain), pack_linear_layers(plain)
        originals = dict(plain.named_modules())
        for path, m in unfused.named_modules():
            if isinstance(m, PackedSelfAttention):
                m.__class__ = ThreeProducts
            if isinstance(m, PositionwiseFeedForward) and isinstance(m.linear1, PackedLinear):
                m.linear1, m.activation = PackedLinear(originals[path].linear1), F.relu
        systems = {"with fusions": fused, "without": unfused}
        src = torch.randint(4, 8000, (batch, src_len))
        for mode in ("beam4", "greedy"):
            agree = sum(
                a == b
                for a, b in zip(
                    decoded(fused, src, mode, out_len),
                    decoded(unfused, src, mode, out_len),
                    strict=True,
                )
            )
            seconds = interleaved_seconds(systems, src, mode, out_len, repeats)
            ratios = sorted(
                a / b for a, b in zip(seconds["without"], seconds["with fusions"], strict=True)
            )
            tok_s = {k: batch * out_len / statistics.median(v) for k, v in seconds.items()}
            print(
                f"{name:6s} {mode:6s} with fusions {tok_s['with fusions']:.0f} tok/s, without "
                f"{tok_s['without']:.0f}: {tok_s['with fusions'] / tok_s['without']:.3f}x "
                f"(round by round {ratios[0]:.3f}-{ratios[-1]:.3f}x), same output for "
                f"{agree}/{batch} sentences",
                flush=True,
            )


class ThreeProducts(PackedSelfAttention):
    """A packed copy's self-attention without its stacked product: Q, K and V in three
    packed products, as before `pack_linear_layers` stacked them."""

    def project_qkv(
        self, x: torch.Tensor, stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.project_query(x), *self.project_key_value(x)


class GatheringCache(DecoderCache):
    """The decoder cache as it was before it moved rows in place: every reorder gathers every
    row into its second buffer."""

    def _rows_to_move_in_place(self, index: torch.Tensor) -> None:
        return None


class Gathering(torch.nn.Module):
    """A model whose decoder cache gathers every row at every reorder (`GatheringCache`)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def encode(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.encode(src_tokens)

    def init_cache(self, memory, src_key_mask, max_len: int) -> DecoderCache:
        cache = self.model.init_cache(memory, src_key_mask, max_len)
        cache.__class__ = GatheringCache
        return cache

    def decode_step(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        return self.model.decode_step(tokens, cache)


def compare_reorder(
    presets: list[str], batch: int, src_len: int, out_len: int, repeats: int
) -> None:
    """The packed model as `Translator` runs it (its cache moves only the rows that change, in
    place) against the same model whose cache gathers every row at every step, interleaved."""
    for name in presets:
        torch.manual_seed(0)
        packed = pack_for_decoding(
            use_cpu_attention(Transformer(preset(name, src_vocab_size=8000, dropout=0.0))).eval()
        )
        systems = {"moving changed rows": packed, "gathering every row": Gathering(packed)}
        src = torch.randint(4, 8000, (batch, src_len))
        for mode in ("beam4", "greedy"):
            outputs = [decoded(m, src, mode, out_len) for m in systems.values()]
            agree = sum(a == b for a, b in zip(*outputs, strict=True))
            seconds = interleaved_seconds(systems, src, mode, out_len, repeats)
            moving, gathering = seconds["moving changed rows"], seconds["gathering every row"]
            ratios = sorted(g / m for g, m in zip(gathering, moving, strict=True))
            print(
                f"{name:6s} {mode:6s} moving changed rows "
                f"{batch * out_len / statistics.median(moving):.0f} tok/s, gathering every row "
                f"{batch * out_len / statistics.median(gathering):.0f}: "
                f"{statistics.median(gathering) / statistics.median(moving):.3f}x "
                f"(round by round {ratios[0]:.3f}-{ratios[-1]:.3f}x), same output for "
                f"{agree}/{batch} sentences",
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
    parser.add_argument(
        "--compile", action="store_true", help="eager against the step under torch.compile"
    )
    parser.add_argument("--freeze", action="store_true", help="with --compile: frozen weights")
    parser.add_argument(
        "--fusions", action="store_true", help="the packed model with and without its fusions"
    )
    parser.add_argument(
        "--reorder",
        action="store_true",
        help="the cache moving only changed rows against gathering every row",
    )
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--update-benchmarks", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        compare_compiled(
            args.presets, args.batch, args.src_len, args.out_len, args.repeats, args.freeze
        )
        return
    if args.fusions:
        compare_fusions(args.presets, args.batch, args.src_len, args.out_len, args.repeats)
        return
    if args.reorder:
        compare_reorder(args.presets, args.batch, args.src_len, args.out_len, args.repeats)
        return
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
