"""Time one training step of `aiayn.model.Transformer` against a same-shaped `torch.nn.Transformer`.

A step is what the trainer does per batch: forward, label-smoothed cross-entropy (§5.4),
backward, Adam step (§5.3: betas 0.9/0.98, eps 1e-9). The reference wraps `torch.nn.Transformer`
with the same embeddings ×√d_model, sinusoidal positions, embedding dropout and one shared
embedding / pre-softmax matrix (§3.4), and drops what the paper's model does not have (final
encoder/decoder LayerNorms, dropout on attention probabilities and inside the FFN), so both
models have the same parameters and do the same arithmetic. Both get the same batch, the same
dropout, the same thread count.

Steps of the two models are interleaved (AB, BA, AB, ...) so that machine noise and drift hit
both alike. We report target tokens per second at the median step time, its interquartile range
and min–max, and the ratio ours / nn.Transformer: of the median step times, of the best step
times (least disturbed by other processes), and the range of the per-round ratios.

    .venv/bin/python bench/bench_train_step.py                      # base + small on CPU
    .venv/bin/python bench/bench_train_step.py --presets small --steps 5
    .venv/bin/python bench/bench_train_step.py --update-benchmarks  # rewrite BENCHMARKS.md
    .venv/bin/python bench/bench_train_step.py --device cuda        # bf16 autocast
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.acceleration import use_cpu_attention
from aiayn.config import ModelConfig, preset
from aiayn.model import Transformer, sinusoidal_positional_encoding
from benchmarks_md import BENCHMARKS_MD, replace_section

VOCAB_SIZE = 8000  # joint source/target vocabulary, shared embeddings (§3.4)
SEQ_LEN = 32  # tokens per sentence, each side
BATCH_SIZES = {"base": 32, "small": 64, "tiny": 64, "big": 16}  # sentences per batch
LABEL_SMOOTHING = 0.1
PAD_ID = 0
START_MARK = "<!-- bench_train_step:start -->"
END_MARK = "<!-- bench_train_step:end -->"


class ReferenceTransformer(nn.Module):
    """`torch.nn.Transformer` wrapped to do the same work as `aiayn.model.Transformer`.

    Same embedding ×√d_model, sinusoidal positions and embedding dropout; one matrix shared by
    both embeddings and the pre-softmax projection; post-norm layers with the same epsilon; the
    final stack LayerNorms that `nn.Transformer` always adds are removed (post-norm has none),
    and dropout sits where the paper and aiayn put it: on sub-layer outputs and embeddings only.
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.d_model, self.pad_id = c.d_model, c.pad_id
        self.embedding = nn.Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id)
        nn.init.normal_(self.embedding.weight, std=c.d_model**-0.5)
        self.register_buffer(
            "positions", sinusoidal_positional_encoding(c.max_positions, c.d_model), False
        )
        self.embed_dropout = nn.Dropout(c.dropout)
        self.transformer = nn.Transformer(
            d_model=c.d_model,
            nhead=c.n_heads,
            num_encoder_layers=c.n_encoder_layers,
            num_decoder_layers=c.n_decoder_layers,
            dim_feedforward=c.d_ff,
            dropout=c.dropout,
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=c.norm_first,
        )
        if not c.norm_first:
            self.transformer.encoder.norm = None
            self.transformer.decoder.norm = None
        # nn.Transformer also drops out attention probabilities and the FFN's inner activations
        # with the same p; the paper (§5.4) and aiayn's defaults do neither. Left in, they cost
        # the reference 2-3x on CPU (attention dropout forces SDPA's unfused math path).
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout = nn.Identity()  # inside the FFN, between ReLU and linear2
            for module in layer.modules():
                if isinstance(module, nn.MultiheadAttention):
                    module.dropout = c.attention_dropout

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens) * math.sqrt(self.d_model) + self.positions[: tokens.size(1)]
        return self.embed_dropout(x)

    def forward(self, src_tokens: Tensor, tgt_tokens: Tensor) -> Tensor:
        """Source (B, S), shifted target (B, T) → logits (B, T, V)."""
        t = tgt_tokens.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt_tokens.device)
        src_pad = src_tokens == self.pad_id  # nn.Transformer: True = ignore
        src_pad = src_pad if bool(src_pad.any()) else None
        x = self.transformer(
            self.embed(src_tokens),
            self.embed(tgt_tokens),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return F.linear(x, self.embedding.weight)  # (B, T, V)


@dataclass
class Measurement:
    """Step times (seconds) of one model on one preset."""

    name: str
    params: int
    step_s: list[float] = field(default_factory=list)
    first_loss: float = float("nan")


def count_params(model: nn.Module) -> int:
    """Unique parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())


def make_batch(
    batch_size: int, seq_len: int, vocab: int, device: torch.device, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Random full-length sentences (no padding): source, shifted target input, target output."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(1, vocab, (batch_size, seq_len), generator=g)
    tgt = torch.randint(1, vocab, (batch_size, seq_len + 1), generator=g)
    return src.to(device), tgt[:, :-1].to(device), tgt[:, 1:].to(device)


def make_step(
    model: nn.Module, batch: tuple[Tensor, Tensor, Tensor], autocast: Callable[[], object]
) -> Callable[[], float]:
    """One training step on `batch`: forward, label-smoothed loss, backward, Adam. Returns loss."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = batch

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            logits = model(src, tgt_in)
        v = logits.size(-1)
        loss = F.cross_entropy(
            logits.float().view(-1, v),
            tgt_out.reshape(-1),
            label_smoothing=LABEL_SMOOTHING,
            ignore_index=PAD_ID,
        )
        loss.backward()
        optimizer.step()
        return loss.item()  # .item() synchronises the device

    return step


def bench_preset(
    name: str, *, steps: int, warmup: int, device: torch.device, seed: int
) -> dict[str, object]:
    """Build both models for preset `name`, warm them up and time `steps` interleaved steps."""
    config = preset(name, src_vocab_size=VOCAB_SIZE, pad_id=PAD_ID)
    batch_size = BATCH_SIZES.get(name, 32)
    batch = make_batch(batch_size, SEQ_LEN, VOCAB_SIZE, device, seed)
    tokens = int((batch[2] != PAD_ID).sum())
    use_bf16 = device.type == "cuda"

    def autocast() -> AbstractContextManager[object]:
        if use_bf16:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return nullcontext()

    torch.manual_seed(seed)
    ours = Transformer(config).to(device).train()
    if device.type == "cpu":  # as the trainer on a CPU
        use_cpu_attention(ours)
    torch.manual_seed(seed)
    ref = ReferenceTransformer(config).to(device).train()
    runs = [
        (Measurement("aiayn", count_params(ours)), make_step(ours, batch, autocast)),
        (Measurement("nn.Transformer", count_params(ref)), make_step(ref, batch, autocast)),
    ]
    if runs[0][0].params != runs[1][0].params:
        print(f"warning: parameter counts differ: {runs[0][0].params} vs {runs[1][0].params}")
    print(
        f"[{name}] d_model {config.d_model}, d_ff {config.d_ff}, heads {config.n_heads}, "
        f"layers {config.n_encoder_layers}+{config.n_decoder_layers}, batch {batch_size}x"
        f"{SEQ_LEN}, {runs[0][0].params / 1e6:.1f}M params each",
        flush=True,
    )
    for i in range(warmup):
        for m, step in runs:
            loss = step()
            if i == 0:
                m.first_loss = loss
    print(
        f"  warm-up done ({warmup} steps each); first losses: "
        + ", ".join(f"{m.name} {m.first_loss:.3f}" for m, _ in runs),
        flush=True,
    )
    for i in range(steps):
        order = runs if i % 2 == 0 else runs[::-1]  # AB, BA, ...: no model always goes first
        for m, step in order:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            m.step_s.append(time.perf_counter() - start)
        print(
            f"  round {i + 1}/{steps}: "
            + ", ".join(f"{m.name} {m.step_s[-1] * 1e3:.0f} ms" for m, _ in runs),
            flush=True,
        )
    (a, _), (b, _) = runs
    result: dict[str, object] = {
        "preset": name,
        "config": config.to_dict(),
        "batch_size": batch_size,
        "seq_len": SEQ_LEN,
        "target_tokens_per_step": tokens,
        "models": {m.name: summarize(m, tokens) for m in (a, b)},
        # ours / nn.Transformer in tokens/s, i.e. nn.Transformer's step time / ours.
        "ratio_of_medians": statistics.median(b.step_s) / statistics.median(a.step_s),
        "ratio_of_bests": min(b.step_s) / min(a.step_s),
        "round_ratios": [tb / ta for ta, tb in zip(a.step_s, b.step_s, strict=True)],
    }
    return result


def summarize(m: Measurement, tokens: int) -> dict[str, object]:
    """Median, quartiles and extremes of the step time, and the same as target tokens/s.

    Throughputs are `tokens` / a step-time statistic (not statistics of per-step throughputs),
    so the median step time and the median tokens/s always describe the same step.
    """
    q1, median, q3 = _quartiles(m.step_s)
    return {
        **asdict(m),
        "median_step_ms": median * 1e3,
        "iqr_step_ms": (q1 * 1e3, q3 * 1e3),
        "median_tokens_per_s": tokens / median,
        "iqr_tokens_per_s": (tokens / q3, tokens / q1),
        "min_tokens_per_s": tokens / max(m.step_s),
        "max_tokens_per_s": tokens / min(m.step_s),
    }


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def _load_average() -> str:
    """The 1-minute load average: how busy the machine was (other processes add noise)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "n/a"


def machine_info(device: torch.device) -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    info: dict[str, object] = {
        "cpu": cpu,
        "cores": torch.multiprocessing.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["precision"] = "bf16 autocast"
    else:
        info["precision"] = "float32"
    return info


def markdown_table(results: list[dict[str, object]]) -> str:
    rows = [
        "| preset | batch (sentences × tokens) | model | params | median step (ms) "
        "| target tok/s: median | IQR | min–max | ours / nn.Transformer: medians | bests "
        "| per round |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        for name, m in r["models"].items():
            ratios = " | | "
            if name == "aiayn":
                lo, hi = min(r["round_ratios"]), max(r["round_ratios"])
                ratios = (
                    f"**{r['ratio_of_medians']:.2f}** | {r['ratio_of_bests']:.2f} "
                    f"| {lo:.2f}–{hi:.2f}"
                )
            (i_lo, i_hi) = m["iqr_tokens_per_s"]
            rows.append(
                f"| {r['preset']} | {r['batch_size']} × {r['seq_len']} | {name} "
                f"| {m['params'] / 1e6:.1f}M | {m['median_step_ms']:.0f} "
                f"| {m['median_tokens_per_s']:.0f} | {i_lo:.0f}–{i_hi:.0f} "
                f"| {m['min_tokens_per_s']:.0f}–{m['max_tokens_per_s']:.0f} | {ratios} |"
            )
    return "\n".join(rows)


def render_section(
    results: list[dict[str, object]], info: dict[str, object], args: argparse.Namespace
) -> str:
    machine = f"{info['cpu']}, {info['cores']} cores, {info['threads']} torch threads"
    if "gpu" in info:
        machine = f"{info['gpu']} ({machine})"
    command = ".venv/bin/python bench/bench_train_step.py " + shlex.join(args.argv)
    return "\n".join(
        [
            markdown_table(results),
            "",
            f"- Machine: {machine}; torch {info['torch']}, Python {info['python']}, "
            f"{info['precision']}.",
            f"- 1-minute load average {info['load_average']} the run (the machine may be "
            "shared: compare the two models within one run, not across runs).",
            f"- {args.warmup} warm-up and {args.steps} timed steps per model, interleaved; "
            f"vocabulary {VOCAB_SIZE}, dropout and label smoothing 0.1, Adam.",
            f"- Command: `{command.strip()}`",
            f"- Run on {time.strftime('%Y-%m-%d %H:%M %Z')}.",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["base", "small"])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument(
        "--update-benchmarks",
        action="store_true",
        help=f"rewrite the bench_train_step section of {BENCHMARKS_MD.name}",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for the record in BENCHMARKS.md
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but CUDA is not available")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    info = machine_info(device)
    print(
        f"torch {info['torch']} on {info['cpu']} ({info['cores']} cores), "
        f"{info['threads']} threads for both models, device {device}",
        flush=True,
    )
    load_before = _load_average()
    results = [
        bench_preset(name, steps=args.steps, warmup=args.warmup, device=device, seed=args.seed)
        for name in args.presets
    ]
    info["load_average"] = f"{load_before} before, {_load_average()} after"
    print()
    print(markdown_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "results": results}, indent=2))
    if args.update_benchmarks:
        replace_section(BENCHMARKS_MD, START_MARK, END_MARK, render_section(results, info, args))
        print(f"\nupdated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
