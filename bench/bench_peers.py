"""aiayn against its peers, side by side in one run: training steps, decoding, and GEMM peak.

Same shapes, same thread count, random weights, medians of repeated runs, with the runs of all
systems interleaved (round r times every system once, in rotating order) so that noise from
other processes hits all of them alike. Each decoding system runs in a process of its own, as
its users run it (`DecodeWorkers` says why).

- **GEMM peak**: float32 `torch.mm` of 2048×2048 by 2048×2048 (MKL), the yardstick for the
  fraction of peak of the training step.
- **Training step** (forward, label-smoothed cross-entropy, backward, Adam) at the `base`
  shape (d_model 512, 6+6 layers, vocabulary 8000 shared, 32 × 32 tokens a side) and the
  `small` one (d_model 256, d_ff 1024, 4 heads, 3+3 layers, 64 × 32): aiayn (its own loss and
  optimizer, as `aiayn train` runs them; and with `--onednn`, its float32 products on
  oneDNN), `torch.nn.Transformer` (bench_train_step's
  reference) and HF `MarianMTModel`, each with `torch.optim.Adam` and `F.cross_entropy`.
  Fraction of peak = the step's matrix-multiply FLOPs (forward ×3) / step time / GEMM peak.
- **Decoding**, base shape, batch 32 × 24 source tokens, every output forced to 24 tokens:
  aiayn fp32 (as `Translator` runs it on a CPU: linear layers on packed weights), fp32
  `--no-onednn` (PyTorch's own `nn.Linear`, MKL) / int8 (dynamic quantization) / bf16 (the
  model in bfloat16), HF `generate`
  (fp32), CTranslate2 fp32 and int8 running *our model's weights* (converted by
  `peers.ct2_convert`; the run checks that CTranslate2's fp32 output equals ours). Beam 4
  (α = 0.6) and greedy.

    .venv/bin/python bench/bench_peers.py                       # everything (~15 min, 2 cores)
    .venv/bin/python bench/bench_peers.py --sections decode --repeats 3
    .venv/bin/python bench/bench_peers.py --update-benchmarks   # rewrite BENCHMARKS.md section
    .venv/bin/python bench/bench_peers.py --profile             # + top operators per step

Peers are optional extras: `pip install '.[bench]'`. One that does not import is reported as
missing in the table, not skipped silently.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import peers
from aiayn import runtime
from aiayn.acceleration import (
    OneDNNLinearProducts,
    maybe_compile,
    native_bf16_cpu,
    onednn_linear_missing,
    quantize_int8,
    use_cpu_attention,
)
from aiayn.config import ModelConfig, preset
from aiayn.decode.packing import pack_for_decoding
from aiayn.decode.search import DecodingOptions, beam_search, greedy_search
from aiayn.model import Transformer
from aiayn.optim import build_optimizer
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.train.update import uses_onednn
from bench_decode import FixedLength
from bench_train_step import (
    ReferenceTransformer,
    _load_average,
    machine_info,
    make_batch,
)
from benchmarks_md import BENCHMARKS_MD, replace_section

VOCAB = 8000
TRAIN_SHAPES = {"base": (32, 32), "small": (64, 32)}  # sentences × tokens per side
MARKERS = "bench_peers"
"""BENCHMARKS.md's table markers: `<!-- bench_peers:start -->` ... `<!-- bench_peers:end -->`."""
# The targets (see BENCHMARKS.md): ratio over the best fp32 peer, per row.
TARGETS = {
    ("train", "base"): 1.15,
    ("train", "small"): 1.25,
    ("decode", "beam4"): 1.2,  # over CTranslate2 fp32
    ("decode", "greedy"): 1.2,  # over HF generate
}


@dataclass
class Runner:
    """One system on one task: `run()` does the work once; `tokens` target tokens per run."""

    name: str
    run: Callable[[], object]
    tokens: int
    peer: bool = True  # a peer (vs aiayn)
    fp32: bool = True
    seconds: list[float] = field(default_factory=list)
    missing: str | None = None
    timed: bool = False  # run() returns its own timing (a worker process timed it)
    goal: bool = True  # held to the target (False: a comparison row)

    def median_tok_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)


def interleave(runners: list[Runner], repeats: int, warmup: int) -> None:
    """Warm every runner up, then time `repeats` rounds; round r starts at runner r mod n."""
    live = [r for r in runners if r.missing is None]
    for r in live:
        for _ in range(warmup):
            r.run()
    for i in range(repeats):
        shift = i % len(live)
        for r in live[shift:] + live[:shift]:
            start = time.perf_counter()
            result = r.run()
            r.seconds.append(result if r.timed else time.perf_counter() - start)
        print(
            f"  round {i + 1}/{repeats}: "
            + ", ".join(f"{r.name} {r.tokens / r.seconds[-1]:.0f}" for r in live)
            + " tok/s",
            flush=True,
        )


# --------------------------------------------------------------------------------------------
# GEMM peak and FLOPs
# --------------------------------------------------------------------------------------------


def gemm_peak(n: int = 2048, repeats: int = 15) -> list[float]:
    """GFLOP/s of float32 n×n by n×n matrix products, one value per repeat."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=out)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        rates.append(2 * n**3 / (time.perf_counter() - start) / 1e9)
    return rates


def forward_flops(c: ModelConfig, batch: int, s: int, t: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of one teacher-forced forward pass: every linear layer
    and the attention products QKᵀ and AV (the causal half counted in full, as computed)."""
    hk, hv, d = c.n_heads * c.d_k, c.n_heads * c.d_v, c.d_model

    def attention(q_len: int, kv_len: int) -> int:
        projections = q_len * d * hk + kv_len * d * (hk + hv) + q_len * hv * d
        return 2 * (projections + q_len * kv_len * (hk + hv))

    ffn = 2 * 2 * d * c.d_ff
    encoder = c.n_encoder_layers * (attention(s, s) + s * ffn)
    decoder = c.n_decoder_layers * (attention(t, t) + attention(t, s) + t * ffn)
    return batch * (encoder + decoder + 2 * t * d * c.tgt_vocab_size)


# --------------------------------------------------------------------------------------------
# Training step
# --------------------------------------------------------------------------------------------


def _peer_step(model: nn.Module, batch) -> Callable[[], float]:
    """The reference step of bench_train_step: F.cross_entropy + default torch.optim.Adam."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = batch

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(src, tgt_in)
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)),
            tgt_out.reshape(-1),
            label_smoothing=0.1,
            ignore_index=PAD_ID,
        )
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _aiayn_step(
    model: Transformer,
    batch,
    bf16: bool = False,
    forward: nn.Module | None = None,
    onednn: bool = False,
) -> Callable[[], float]:
    """aiayn's own step, as the trainer runs it: its loss, its (fused) Adam; with `onednn`, as
    `aiayn train --onednn`, its float32 products on oneDNN (`uses_onednn`); `forward` is the
    model or a compiled wrapper of it."""
    compiled = forward is not None
    use_cpu_attention(model)  # as the trainer on a CPU (a compiled wrapper compiles it lazily)
    forward = model if forward is None else forward
    cpu = torch.device("cpu")
    if uses_onednn(cpu, onednn=onednn, bf16=bf16, compile=compiled):
        products: Callable[[], AbstractContextManager] = OneDNNLinearProducts
    else:
        products = nullcontext
    optimizer = build_optimizer(model)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    src, tgt_in, tgt_out = batch
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with products():
            with autocast:
                sums = forward(src, tgt_in, tgt_out, label_smoothing=0.1)  # the chunked loss
            (sums.loss / sums.n_tokens).backward()
        optimizer.step()
        return sums.loss.item()

    return step


def bench_train(shape: str, repeats: int, warmup: int, compile_model: bool = False) -> dict:
    config = preset(shape, src_vocab_size=VOCAB, pad_id=PAD_ID)
    sentences, length = TRAIN_SHAPES[shape]
    batch = make_batch(sentences, length, VOCAB, torch.device("cpu"), seed=0)
    tokens = sentences * length
    runners = []
    torch.manual_seed(0)
    runners.append(Runner("aiayn", _aiayn_step(Transformer(config).train(), batch), tokens, False))
    if onednn_linear_missing() is None:
        torch.manual_seed(0)
        step = _aiayn_step(Transformer(config).train(), batch, onednn=True)
        runners.append(Runner("aiayn --onednn", step, tokens, False))
    torch.manual_seed(0)
    runners.append(
        Runner("nn.Transformer", _peer_step(ReferenceTransformer(config).train(), batch), tokens)
    )
    missing = peers.available("transformers")
    hf = Runner("HF Marian", lambda: None, tokens, missing=missing)
    if missing is None:
        torch.manual_seed(0)
        hf.run = _peer_step(peers.MarianForTraining(peers.marian(config)).train(), batch)
    runners.append(hf)
    if compile_model:
        torch.manual_seed(0)
        model = Transformer(config).train()
        step = _aiayn_step(model, batch, forward=maybe_compile(model, torch.device("cpu")))
        runners.append(Runner("aiayn torch.compile", step, tokens, False))
    if native_bf16_cpu():
        torch.manual_seed(0)
        step = _aiayn_step(Transformer(config).train(), batch, bf16=True)
        runners.append(Runner("aiayn bf16 autocast", step, tokens, False, fp32=False))
    print(f"[train {shape}] batch {sentences} × {length}", flush=True)
    interleave(runners, repeats, warmup)
    return {
        "task": "train",
        "shape": shape,
        "runners": runners,
        "flops": 3 * forward_flops(config, sentences, length, length),
    }


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSettings:
    """What every decoding worker builds the same way: model, source batch, output length."""

    threads: int
    batch: int
    src_len: int
    out_len: int

    def model_and_source(self) -> tuple[Transformer, torch.Tensor]:
        """The base model (seed 0, random weights) and the source batch, in every process."""
        config = preset("base", src_vocab_size=VOCAB, pad_id=PAD_ID, dropout=0.0)
        torch.manual_seed(0)
        return Transformer(config).eval(), self.source()

    def source(self) -> torch.Tensor:
        """The source batch (B, S), the same in every process."""
        generator = torch.Generator().manual_seed(1)
        return torch.randint(4, VOCAB, (self.batch, self.src_len), generator=generator)


# name → (a peer?, fp32?, held to the target?); "aiayn bf16" runs only with native bf16.
DECODE_SYSTEMS = {
    "aiayn fp32": (False, True, True),
    "aiayn fp32 --no-onednn": (False, True, True),
    "aiayn bf16": (False, False, True),
    "aiayn int8": (False, False, True),
    "aiayn ONNX (onnxruntime) fp32": (False, True, True),
    "aiayn ONNX, PyTorch on every thread": (False, True, False),  # as exports ran before
    "HF generate fp32": (True, True, True),
    "CTranslate2 fp32": (True, True, True),
    "CTranslate2 int8": (True, False, True),
}


class PeerMissing(Exception):
    """A system that cannot run here (its package is not installed, no native bf16)."""


def _onnx_missing() -> str | None:
    """Why an ONNX export cannot be written and run here (`peers.available`), or None."""
    return peers.available("onnxruntime") or peers.available("onnxscript")


def _write_exports(settings: DecodeSettings, directory: Path) -> None:
    """In a process of its own, the model as the runtimes load it from disk: converted to
    CTranslate2 (`directory`/float32, /int8, and the source batch as CTranslate2 tokens in
    /source.json) and exported to ONNX (/onnx), where those are installed. So the CTranslate2
    workers never run PyTorch, and the ONNX worker runs it as `Translator` does (see
    `DecodeWorkers`)."""
    torch.set_num_threads(settings.threads)
    model, src = settings.model_and_source()
    if peers.available("ctranslate2") is None:
        for compute_type, quantization in (("float32", None), ("int8", "int8")):
            peers.ct2_convert(model, directory / compute_type, quantization)
        (directory / "source.json").write_text(json.dumps(peers.ct2_tokens(src, VOCAB)))
    if _onnx_missing() is None:
        from aiayn.interop.onnx import write_onnx_graphs

        write_onnx_graphs(model, directory / "onnx")


def _decode_system(name: str, s: DecodeSettings, exports: Path) -> Callable[[str], list[list[int]]]:
    """Build system `name` in this process; returns run(mode) → output token ids per sentence
    (mode "beam4" or "greedy"). Raises `PeerMissing` with the reason where it cannot run."""
    out_len = s.out_len
    if name.startswith("CTranslate2"):
        if missing := peers.available("ctranslate2"):
            raise PeerMissing(missing)
        compute_type = "int8" if "int8" in name else "float32"
        translator = peers.ct2_translator(exports / compute_type, compute_type, s.threads)
        source_tokens = json.loads((exports / "source.json").read_text())

        def ct2_run(mode: str) -> list[list[int]]:
            out = translator.translate_batch(
                source_tokens,
                beam_size=4 if mode == "beam4" else 1,
                length_penalty=0.6,
                min_decoding_length=out_len,
                max_decoding_length=out_len,
                max_batch_size=s.batch,
            )
            return peers.ct2_ids(out, VOCAB)

        return ct2_run
    if name.startswith("aiayn ONNX"):
        if missing := _onnx_missing():
            raise PeerMissing(missing)
        from aiayn.interop.onnx import OnnxModel

        # `aiayn export --to onnx`'s graphs run by onnxruntime under aiayn's own search, as
        # `Translator(export_dir, threads=N)` runs them: N onnxruntime threads, one PyTorch's
        # (the other row: N for PyTorch too, which its spinning OpenMP threads make slower).
        torch.set_num_threads(1 if name == "aiayn ONNX (onnxruntime) fp32" else s.threads)
        return _aiayn_search(OnnxModel(exports / "onnx", threads=s.threads), s.source(), out_len)
    if name == "aiayn bf16" and not native_bf16_cpu():
        raise PeerMissing("this CPU has no native bf16")
    torch.set_num_threads(s.threads)
    model, src = s.model_and_source()
    if name.startswith("HF"):
        if missing := peers.available("transformers"):
            raise PeerMissing(missing)
        torch.manual_seed(0)
        hf = peers.marian(model.config).eval()

        def hf_run(mode: str) -> list[list[int]]:
            with torch.inference_mode():
                hf.generate(
                    input_ids=src,
                    attention_mask=torch.ones_like(src),
                    num_beams=4 if mode == "beam4" else 1,
                    do_sample=False,
                    min_new_tokens=out_len,
                    max_new_tokens=out_len,
                    early_stopping=False,
                )
            return []  # other weights: nothing to compare

        return hf_run
    if name == "aiayn fp32":
        decoder: nn.Module = pack_for_decoding(model)  # as Translator runs fp32 on a CPU
    elif name == "aiayn fp32 --no-onednn":
        decoder = model  # PyTorch's own nn.Linear (MKL)
    elif name == "aiayn int8":
        decoder = quantize_int8(model)  # as Translator(int8=True)
    elif name == "aiayn bf16":
        decoder = copy.deepcopy(model).to(torch.bfloat16)  # as Translator(bf16=True)
    else:
        raise ValueError(f"unknown decoding system {name!r}")
    return _aiayn_search(decoder, src, out_len)


def _aiayn_search(
    decoder: nn.Module, src: torch.Tensor, out_len: int
) -> Callable[[str], list[list[int]]]:
    """run(mode) of aiayn's own search over `decoder`, every output forced to `out_len`."""
    # out_len - 1 tokens, then EOS (forced): out_len decoding steps, like the peers'.
    fixed = FixedLength(use_cpu_attention(decoder), out_len - 1)  # as Translator on a CPU
    ids = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    options = DecodingOptions(max_len_a=0.0, max_len_b=out_len - 1)  # beam 4, α 0.6

    def aiayn_run(mode: str) -> list[list[int]]:
        with torch.inference_mode():
            if mode == "greedy":
                hyps = greedy_search(fixed, src, **ids, options=options)
            else:
                hyps = [h[0] for h in beam_search(fixed, src, **ids, options=options)]
        return [h.tokens for h in hyps]

    return aiayn_run


def _decode_worker(name: str, settings: DecodeSettings, exports: Path, conn) -> None:
    """A process of its own for one decoding system: builds it, then runs it once per mode
    received until it receives None. Replies ("ready" | "missing" | "error", detail) first,
    then (seconds, outputs) per run, or ("error", detail) where a run fails."""
    try:
        run = _decode_system(name, settings, exports)
    except PeerMissing as missing:
        conn.send(("missing", str(missing)))
        return
    except Exception as error:  # reported in the parent, which stops
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", None))
    while (mode := conn.recv()) is not None:
        start = time.perf_counter()
        try:
            outputs = run(mode)
        except Exception as error:
            conn.send(("error", f"{type(error).__name__}: {error}"))
            return
        conn.send((time.perf_counter() - start, outputs))


class DecodeWorkers:
    """One process per decoding system (multiprocessing, spawned), driven from this one.

    Each system runs alone in its process, as a user runs it. CTranslate2 and PyTorch both
    run OpenMP threads, and in one process (more of them than cores) they slow each other
    down (as in pytorch/pytorch#98836; measured here on 2026-11-24):
    while a CTranslate2 translator existed, PyTorch's small parallel operators ran 2-12x
    slower (an index_select of the decoder cache 1.8 -> 8.3 ms), and CTranslate2 decoded a
    beam-4 batch in 2.26 s in a process where PyTorch had run against 1.96 s in one where it
    had not. So an in-process comparison measures the interference, not the systems. Another
    process converts and exports the model first: the CTranslate2 workers load their models
    and run no PyTorch at all, the ONNX worker runs as `Translator` runs an export.
    Idle workers wait on a pipe (after OpenMP's spin-wait at the end of a run, no CPU).
    """

    def __init__(self, names: list[str], settings: DecodeSettings) -> None:
        context = multiprocessing.get_context("spawn")
        self._exports = tempfile.TemporaryDirectory()
        self.pipes, self.processes, self.missing = {}, {}, {}
        try:
            exports = Path(self._exports.name)
            writer = context.Process(target=_write_exports, args=(settings, exports))
            writer.start()
            writer.join()
            if writer.exitcode != 0:
                raise RuntimeError("exporting the model for CTranslate2/ONNX failed (see above)")
            for name in names:
                parent, child = context.Pipe()
                process = context.Process(
                    target=_decode_worker, args=(name, settings, exports, child), daemon=True
                )
                process.start()
                child.close()  # the worker's end: a worker that dies is then an EOFError here
                self.pipes[name], self.processes[name] = parent, process
            for name in names:
                status, detail = self._receive(name)
                if status == "error":
                    raise RuntimeError(f"{name}: {detail}")
                if status == "missing":
                    self.missing[name] = detail
        except BaseException:
            self.close()
            raise

    def _receive(self, name: str):
        try:
            return self.pipes[name].recv()
        except EOFError:
            raise RuntimeError(f"{name}: the worker process ended unexpectedly") from None

    def run(self, name: str, mode: str) -> tuple[float, list[list[int]]]:
        """Run system `name` once in `mode`: its own timing of the run, and its outputs."""
        self.pipes[name].send(mode)
        reply = self._receive(name)
        if reply[0] == "error":
            raise RuntimeError(f"{name}: {reply[1]}")
        return reply

    def close(self) -> None:
        """Stop every worker (asked first, then terminated), and remove the exports."""
        try:
            for pipe in self.pipes.values():
                with suppress(OSError):  # a worker already gone
                    pipe.send(None)
                pipe.close()
            for process in self.processes.values():
                process.join(timeout=30)
                if process.is_alive():
                    process.terminate()
                    process.join()
        finally:
            self._exports.cleanup()


def bench_decode(repeats: int, warmup: int, settings: DecodeSettings) -> list[dict]:
    names = list(DECODE_SYSTEMS)
    tokens = settings.batch * settings.out_len
    outputs: dict[str, list[list[int]]] = {}
    results = []
    workers = DecodeWorkers(names, settings)
    try:
        for mode in ("beam4", "greedy"):
            runners = []
            for name in names:
                if name == "aiayn bf16" and name in workers.missing:
                    continue  # no native bf16: no row
                peer, fp32, goal = DECODE_SYSTEMS[name]

                def run(name: str = name, mode: str = mode) -> float:
                    seconds, outputs[name] = workers.run(name, mode)
                    return seconds

                missing = workers.missing.get(name)
                runners.append(
                    Runner(name, run, tokens, peer, fp32, missing=missing, timed=True, goal=goal)
                )
            print(
                f"[decode {mode}] batch {settings.batch} × {settings.src_len} → "
                f"{settings.out_len}, each system in a process of its own",
                flush=True,
            )
            interleave(runners, repeats, warmup)
            ours = outputs["aiayn fp32"]
            same = _same(ours, outputs.get("CTranslate2 fp32"), prefix=True)
            same_mkl = _same(ours, outputs.get("aiayn fp32 --no-onednn"))
            same_onnx = _same(ours, outputs.get("aiayn ONNX (onnxruntime) fp32"))
            for label, value in (
                ("CTranslate2 fp32", same), ("--no-onednn", same_mkl), ("ONNX", same_onnx)
            ):  # fmt: skip
                if value is not None:
                    print(f"  {label} output = aiayn's for {100 * value:.0f}% of sentences")
            results.append(
                {
                    "task": "decode",
                    "shape": mode,
                    "runners": runners,
                    "same": same,
                    "same_onnx": same_onnx,
                    "same_mkl": same_mkl,
                }
            )
            outputs.clear()
    finally:
        workers.close()
    return results


def _same(ours: list[list[int]], theirs: list[list[int]] | None, prefix: bool = False):
    """Fraction of sentences whose outputs are equal (`prefix`: ours a prefix of theirs, for
    CTranslate2, whose outputs may run on past our forced EOS); None without outputs."""
    if not theirs:
        return None
    equal = [a == (b[: len(a)] if prefix else b) for a, b in zip(ours, theirs, strict=True)]
    return sum(equal) / len(equal)


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------


def profile_decode(settings: DecodeSettings, rows: int = 12) -> str:
    """torch.profiler table of aiayn's beam-4 decoding: top operators, time per step. In a
    process of its own, like the table's decoding rows (this one has run the training rows)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_profile_decode, (settings, rows))


def _profile_decode(settings: DecodeSettings, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(settings.threads)
    out_len = settings.out_len
    model, src = settings.model_and_source()
    model = FixedLength(use_cpu_attention(pack_for_decoding(model)), out_len - 1)
    ids = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    options = DecodingOptions(max_len_a=0.0, max_len_b=out_len - 1)  # beam 4, α 0.6
    with torch.inference_mode():
        beam_search(model, src, **ids, options=options)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            beam_search(model, src, **ids, options=options)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [
        "| operator | calls per step | self time per step (ms) | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    for e in events[:rows]:
        lines.append(
            f"| `{e.key}` | {e.count / out_len:.0f} | "
            f"{e.self_cpu_time_total / 1e3 / out_len:.2f} "
            f"| {100 * e.self_cpu_time_total / total:.0f}% |"
        )
    lines.append(f"| all operators | | {total / 1e3 / out_len:.2f} | 100% |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _spread(r: Runner) -> str:
    values = sorted(r.tokens / s for s in r.seconds)
    return f"{values[0]:.0f}–{values[-1]:.0f}"


def table(results: list[dict], peak: float) -> str:
    lines = [
        "| task | shape | system | target tok/s (median) | min–max | vs best fp32 peer "
        "| % of GEMM peak | target |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for res in results:
        live = [r for r in res["runners"] if r.missing is None]
        fp32_peers = [r for r in live if r.peer and r.fp32]
        int8_peers = [r for r in live if r.peer and not r.fp32]
        best = max(fp32_peers, key=Runner.median_tok_s, default=None)
        target = TARGETS.get((res["task"], res["shape"]))
        if res["task"] == "decode" and res["shape"] == "beam4":
            best = next((r for r in fp32_peers if r.name.startswith("CTranslate2")), best)
        elif res["task"] == "decode":
            best = next((r for r in fp32_peers if r.name.startswith("HF")), best)
        for r in res["runners"]:
            if r.missing is not None:
                lines.append(
                    f"| {res['task']} | {res['shape']} | {r.name} | not measured: "
                    f"{r.missing} | | | | |"
                )
                continue
            ratio = f"{r.median_tok_s() / best.median_tok_s():.2f}×" if best else ""
            frac = ""
            if res["task"] == "train" and r.fp32:
                flops_per_s = res["flops"] / statistics.median(r.seconds)
                frac = f"{100 * flops_per_s / 1e9 / peak:.0f}%"
            goal = ""
            if not r.peer and r.fp32 and r.goal and target and best:
                met = r.median_tok_s() / best.median_tok_s() >= target
                goal = f"≥ {target}× {best.name}: {'met' if met else 'not met'}"
            if not r.peer and not r.fp32 and "int8" in r.name and int8_peers:
                ct2_int8 = int8_peers[0]
                met = r.median_tok_s() >= ct2_int8.median_tok_s()
                goal = f"≥ {ct2_int8.name}: {'met' if met else 'not met'} " + (
                    f"({r.median_tok_s() / ct2_int8.median_tok_s():.2f}×)"
                )
            name = f"**{r.name}**" if not r.peer else r.name
            lines.append(
                f"| {res['task']} | {res['shape']} | {name} | {r.median_tok_s():.0f} "
                f"| {_spread(r)} | {ratio} | {frac} | {goal} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sections", nargs="+", default=["train", "decode"], choices=["train", "decode"]
    )
    parser.add_argument("--train-shapes", nargs="+", default=["base", "small"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--out-len", type=int, default=24)
    parser.add_argument("--profile", action="store_true", help="add a profile of aiayn beam 4")
    parser.add_argument(
        "--compile", action="store_true", help="add aiayn under torch.compile (training)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--update-benchmarks", action="store_true")
    parser.add_argument(
        "--markers",
        default=MARKERS,
        help="which BENCHMARKS.md table --update-benchmarks replaces: the one between "
        "<!-- MARKERS:start --> and <!-- MARKERS:end --> (default %(default)s; another CPU's "
        "table has markers of its own)",
    )
    args = parser.parse_args(argv)
    # As `aiayn train --compile` runs: a compilation that fails at the first step runs eagerly.
    runtime.configure(threads=args.threads, compile_errors_fall_back=args.compile or None)
    info = machine_info(torch.device("cpu"))
    load_before = _load_average()
    versions = {"torch": torch.__version__}
    for module in ("transformers", "ctranslate2", "onnxruntime"):
        versions[module] = peers.installed_version(module)  # not imported here (see DecodeWorkers)
    print(
        f"{info['cpu']}, {args.threads} threads; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    peak_rates = gemm_peak()
    peak = statistics.median(peak_rates)
    print(
        f"fp32 GEMM peak: {peak:.0f} GFLOP/s (median; {min(peak_rates):.0f}–{max(peak_rates):.0f})"
    )
    results = []
    if "train" in args.sections:
        for shape in args.train_shapes:
            results.append(bench_train(shape, args.repeats, args.warmup, args.compile))
    settings = DecodeSettings(args.threads, args.batch, args.src_len, args.out_len)
    if "decode" in args.sections:
        results += bench_decode(args.repeats, args.warmup, settings)
    peak_after = statistics.median(gemm_peak())
    text = table(results, peak)
    print()
    print(text)
    profile = profile_decode(settings) if args.profile else ""
    if profile:
        print()
        print(profile)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        **r,
                        "runners": [
                            {
                                "name": x.name,
                                "seconds": x.seconds,
                                "tokens": x.tokens,
                                "missing": x.missing,
                            }
                            for x in r["runners"]
                        ],
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    if args.update_benchmarks:
        argv_text = shlex.join(sys.argv[1:] if argv is None else argv)
        same = [r["same"] for r in results if r.get("same") is not None]
        same_onnx = [r["same_onnx"] for r in results if r.get("same_onnx") is not None]
        same_mkl = [r["same_mkl"] for r in results if r.get("same_mkl") is not None]
        notes = [
            f"- Machine: {info['cpu']}, {info['cores']} cores, {args.threads} threads for every "
            f"system; "
            + ", ".join(f"{k} {v}" for k, v in versions.items())
            + f", Python {info['python']}.",
            f"- fp32 GEMM peak (2048³ `torch.mm`): {peak:.0f} GFLOP/s before the run, "
            f"{peak_after:.0f} after; 1-minute load average {load_before} before, "
            f"{_load_average()} after.",
            f"- {args.repeats} timed rounds after {args.warmup} warm-up, systems interleaved; "
            "decoding: each system in a process of its own (`DecodeWorkers`), batch "
            f"{args.batch} × {args.src_len} source tokens, every output forced to "
            f"{args.out_len} tokens.",
        ]
        if same:
            notes.append(
                "- CTranslate2 runs aiayn's own weights: its fp32 output equals aiayn's for "
                + " / ".join(f"{100 * s:.0f}%" for s in same)
                + " of the sentences (beam 4 / greedy). It is converted by the converter of "
                "`aiayn export --to ctranslate2` and run as `--backend ctranslate2` runs it."
            )
        if same_onnx:
            notes.append(
                "- aiayn ONNX: the graphs of `aiayn export --to onnx` run by onnxruntime under "
                "aiayn's search, as `Translator(export, threads=N)` runs an ONNX export: N "
                'threads for onnxruntime, one for PyTorch ("PyTorch on every thread": N for '
                "both, as it ran before); output equal to aiayn fp32's for "
                + " / ".join(f"{100 * s:.0f}%" for s in same_onnx)
                + " of the sentences (beam 4 / greedy)."
            )
        if same_mkl:
            notes.append(
                "- aiayn fp32 runs its linear layers on packed weights as `Translator` does on "
                "this CPU (`decode.packing.pack_for_decoding`); `--no-onednn` runs PyTorch's "
                "own `nn.Linear` (MKL); their outputs are equal for "
                + " / ".join(f"{100 * s:.0f}%" for s in same_mkl)
                + " of the sentences (beam 4 / greedy)."
            )
        notes.append(
            f"- Command: `.venv/bin/python bench/bench_peers.py {argv_text}`; run on "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}."
        )
        section = text + "\n\n" + "\n".join(notes)
        if profile:
            section += "\n\nTop operators of aiayn's beam-4 decoding (base, fp32), per step:\n\n"
            section += profile
        start, end = f"<!-- {args.markers}:start -->", f"<!-- {args.markers}:end -->"
        replace_section(BENCHMARKS_MD, start, end, section, "## Speed: aiayn and its peers")
        print(f"\nupdated {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
