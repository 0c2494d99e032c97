"""Training on CUDA: a stopped and resumed run equals an uninterrupted one, and what is trained
on a GPU loads, translates and resumes in a process that has none (and the reverse).

The runs are tests/train/test_trainer.py's: a 1+1-layer, d_model=16 model on copy pairs, here with
the
trainer's CUDA defaults (bf16 autocast, fused Adam on the GPU, dropout from the CUDA generator).
A process without a GPU is a subprocess with ``CUDA_VISIBLE_DEVICES=""``, which hides every
GPU from CUDA: what a CPU-only machine sees.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn import Translator
from aiayn.acceleration import compiler_missing
from aiayn.optim import build_optimizer
from aiayn.text.corpus import ParallelDataset
from aiayn.train import checkpoint as ckpt
from aiayn.train import trainer, update
from aiayn.train.distributed import Distributed
from aiayn.train.runlog import read_metrics
from aiayn.train.update import cuda_computes_bf16, optimizer_update
from train.test_trainer import (
    TINY_MODEL,
    checkpoint_steps,
    cli_args,
    make_config,
    stop_at,
    train_losses,
    weights,
    write_copy_corpus,
)
from train.test_update import WARMUP, letter_dataset, letter_model

pytestmark = pytest.mark.cuda

GREEDY_AND_BEAM = ({"beam_size": 1, "max_len_b": 8}, {"beam_size": 4, "max_len_b": 8})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_copy_corpus(tmp_path_factory.mktemp("cuda-corpus"), 48)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> ParallelDataset:
    return letter_dataset(tmp_path_factory.mktemp("cuda-letters"))


def largest_difference(a: Path, b: Path) -> float:
    """The largest element-wise difference between two model directories' weights."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[name].double() - wb[name].double()).abs().max()) for name in wa)


def test_sigterm_and_resume_on_cuda_equal_an_uninterrupted_run(
    device: torch.device,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped after update 5 of 10 and resumed on the GPU: the weights, losses and token
    counts of the uninterrupted run (the CUDA generator's state, which draws the dropout
    masks, travels in the checkpoint).

    Bitwise, if two uninterrupted runs are bitwise equal, as expected at these sizes. Some
    CUDA kernels may accumulate with atomics in an order that changes from run to run (flash
    and memory-efficient attention's backward over several key blocks); where two
    uninterrupted runs differ, bitwise equality cannot be asked of the resumed one, and its
    losses must equal the uninterrupted run's to 1e-3 at every update instead: a resume that
    lost the RNG state (other dropout masks) or the data position (other batches) moves them
    by far more.
    """
    config = make_config(
        corpus, tmp_path / "whole", device=str(device), max_steps=10, log_every=4, save_every=4
    )
    trainer.train(config)
    trainer.train(dataclasses.replace(config, out_dir=str(tmp_path / "again")))

    stopped_config = dataclasses.replace(config, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 5)
        stopped = trainer.train(stopped_config)
    assert (stopped.interrupted, stopped.step) == (True, 5)
    assert checkpoint_steps(tmp_path / "stopped") == [4, 5]
    resumed = trainer.train(stopped_config, resume=True)
    assert (resumed.interrupted, resumed.step) == (False, 10)

    whole, again, resumed_dir = (tmp_path / run / "model" for run in ("whole", "again", "stopped"))
    noise = largest_difference(whole, again)
    gap = largest_difference(whole, resumed_dir)
    if noise == 0:
        assert gap == 0, f"resumed run differs by {gap:.2e}; two uninterrupted runs by 0"
        assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "stopped")
    else:  # nondeterministic kernels: see the docstring
        whole_losses, resumed_losses = (
            train_losses(tmp_path / run) for run in ("whole", "stopped")
        )
        assert [s for s, _, _ in resumed_losses] == [s for s, _, _ in whole_losses]
        for (step, loss, nll), (_, resumed_loss, resumed_nll) in zip(
            whole_losses, resumed_losses, strict=True
        ):
            assert resumed_loss == pytest.approx(loss, rel=1e-3), (step, gap, noise)
            assert resumed_nll == pytest.approx(nll, rel=1e-3), (step, gap, noise)
    tokens_seen = [r["tokens_seen"] for r in read_metrics(tmp_path / "whole")]
    assert tokens_seen == [r["tokens_seen"] for r in read_metrics(tmp_path / "stopped")]


def test_the_training_log_shows_the_gpus_peak_memory(
    device: torch.device,
    corpus: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every train record on a GPU holds the memory its tensors peaked at (CUDA's allocator
    count, read at the record), and the log line says it; a CPU run has none."""
    config = make_config(corpus, tmp_path / "run", device=str(device), max_steps=4, log_every=2)
    with caplog.at_level(logging.INFO, logger="aiayn.train.trainer"):
        trainer.train(config)
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    lines = [m for m in caplog.messages if m.startswith("step ") and "tok/s" in m]
    assert [r["step"] for r in records] == [2, 4] and len(lines) == 2
    if device.type != "cuda":
        assert all("peak_memory_gib" not in r for r in records)
        assert not any("GiB" in line for line in lines)
        return
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    peaks = [r["peak_memory_gib"] for r in records]
    assert all(0 < peak <= total for peak in peaks) and peaks == sorted(peaks)
    for line, peak in zip(lines, peaks, strict=True):
        assert line.endswith(f", peak {peak:.1f} GiB"), line


def test_updates_on_a_gpu_make_no_host_sync(device: torch.device, dataset: ParallelDataset) -> None:
    """`torch.cuda.set_sync_debug_mode("error")` over three updates, float32 and (where the
    GPU computes it) bf16, with clipping: no copy to the host, no wait on the stream (the
    batches' copies to the GPU are non-blocking; the loss sums stay on the GPU until a record
    reads them; whether a batch's sources are padded is its token count, `Batch.src_padded`)."""
    if device.type != "cuda":
        pytest.skip("a CUDA check (on a CPU: tests/train/test_update.py counts host reads)")
    precisions = [False, True] if cuda_computes_bf16(device) else [False]
    for bf16 in precisions:
        torch.manual_seed(0)
        model = letter_model().to(device)
        optimizer, interval = build_optimizer(model), {"loss": 0.0, "nll": 0.0}
        sums = update.IntervalLossSums()
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step, start in enumerate((0, 16, 32), start=1):
                stats = optimizer_update(
                    model, optimizer, dataset, [np.arange(start, start + 16)], step=step,
                    d_model=16, warmup_steps=WARMUP, lr_scale=1.0, label_smoothing=0.1,
                    clip_norm=1.0, bf16=bf16, device=device, distributed=Distributed(),
                )  # fmt: skip
                sums.add(stats.sums, interval)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sums.settle(interval)
        assert interval["loss"] > interval["nll"] > 0, bf16


def test_fixed_shapes_compiled_into_cuda_graphs_learn_what_the_eager_path_learns(
    device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`static_shapes` with `compile` (on a GPU, CUDA graphs: torch.compile's reduce-overhead
    mode; on a CPU an ordinary compile), float32 without dropout, 6 updates: the losses of the
    eager run at every update, to 1e-3; no graph skipped; stopped after update 3 and resumed,
    the same losses again."""
    if compiler_missing(device):
        pytest.skip(f"torch.compile cannot run here: {compiler_missing(device)}")
    from torch._dynamo.utils import counters

    # Batches of two widths, 8 and 17 (tests/train/test_trainer.py checks which): two graphs.
    corpus = write_copy_corpus(tmp_path / "corpus", 48, longest=12)
    settings = dict(
        device=str(device), precision="fp32", static_shapes=True, max_steps=6, save_every=3,
        max_tokens=40, model=dict(TINY_MODEL, dropout=0.0),
    )  # fmt: skip
    trainer.train(make_config(corpus, tmp_path / "eager", **settings))
    torch._dynamo.reset()
    counters.clear()
    graphs = make_config(corpus, tmp_path / "graphs", compile=True, **settings)
    trainer.train(graphs)
    assert counters["stats"]["unique_graphs"] >= 1
    assert counters["inductor"]["cudagraph_skips"] == 0, "a graph ran without CUDA graphs"

    stopped = dataclasses.replace(graphs, out_dir=str(tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        stop_at(patch, 3)
        assert trainer.train(stopped).step == 3
    assert trainer.train(stopped, resume=True).step == 6
    eager = train_losses(tmp_path / "eager")
    for run in ("graphs", "stopped"):
        losses = train_losses(tmp_path / run)
        assert [s for s, _, _ in losses] == [s for s, _, _ in eager] == list(range(1, 7))
        for (_, loss, nll), (step, want_loss, want_nll) in zip(losses, eager, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-3), (run, step)
            assert nll == pytest.approx(want_nll, rel=1e-3), (run, step)


# -- moving between a GPU and a CPU-only process ----------------------------------------------

CPU_ONLY = """
import json, sys
import torch

assert not torch.cuda.is_available(), "CUDA_VISIBLE_DEVICES='' left a GPU visible"
task, *args = sys.argv[1:]
if task == "translate":
    from aiayn import Translator

    model_dir, lines, options = args[0], json.loads(args[1]), json.loads(args[2])
    translator = Translator(model_dir)
    assert str(translator.device) == "cpu"
    outputs = [[r.token_ids for r in translator.translate(lines, **o)] for o in options]
    scores = [s.log_prob for s in translator.score(lines, lines)]
    print(json.dumps({"outputs": outputs, "scores": scores}))
else:  # "aiayn": a command line, e.g. train ...
    from aiayn.cli import main

    sys.exit(main(args))
"""


def cpu_only(*args: str) -> str:
    """Run `CPU_ONLY` with `args` in a process that sees no GPU; its stdout."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-c", CPU_ONLY, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def lines(corpus: tuple[Path, Path]) -> list[str]:
    """Sentences of the copy task the models learn (their own translations)."""
    return corpus[0].read_text(encoding="utf-8").splitlines()[:8]


def decode_cpu_only(model_dir: Path, sentences: list[str]) -> dict:
    """Greedy and beam-4 outputs (token ids per sentence) of `model_dir` on a CPU, and the
    log-probability it gives each sentence as its own translation."""
    args = (json.dumps(sentences), json.dumps(GREEDY_AND_BEAM))
    return json.loads(cpu_only("translate", str(model_dir), *args).strip().splitlines()[-1])


def decode_here(model_dir: Path, sentences: list[str], device: torch.device) -> dict:
    translator = Translator(model_dir, device=device)
    outputs = [[r.token_ids for r in translator.translate(sentences, **o)] for o in GREEDY_AND_BEAM]
    scores = [s.log_prob for s in translator.score(sentences, sentences)]
    return {"outputs": outputs, "scores": scores}


def assert_same_model(a: dict, b: dict) -> None:
    """The same log-probabilities (float32 on two devices: to 1e-4), and the same outputs
    but for at most one sentence per search: rounding may decide a near tie apart
    (tests/cuda/test_cuda_decoding.py checks such ties closely)."""
    assert b["scores"] == pytest.approx(a["scores"], abs=1e-4)
    for outputs_a, outputs_b in zip(a["outputs"], b["outputs"], strict=True):
        differing = sum(x != y for x, y in zip(outputs_a, outputs_b, strict=True))
        assert differing <= 1, (outputs_a, outputs_b)


def test_a_model_trained_on_cuda_translates_and_resumes_in_a_cpu_only_process(
    device: torch.device, corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    config = make_config(corpus, tmp_path / "run", device=str(device), max_steps=4, save_every=2)
    result = trainer.train(config)

    sentences = lines(corpus)
    on_gpu = decode_here(result.model_dir, sentences, device)
    assert_same_model(on_gpu, decode_cpu_only(result.model_dir, sentences))

    # The GPU run's checkpoint (CUDA RNG states, Adam's state saved from the GPU) resumes on
    # the CPU: two more updates.
    resume = ["train", "--out-dir", str(tmp_path / "run"), "--resume", "--max-steps", "6"]
    cpu_only("aiayn", *resume, "--device", "cpu")
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["type"] == "train"][-1] == 6


def test_a_model_trained_in_a_cpu_only_process_translates_and_resumes_on_cuda(
    device: torch.device, corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """`device: auto` picks the CPU where no GPU is visible; the model then moves to CUDA."""
    config = make_config(corpus, tmp_path / "run", device="auto", max_steps=4, save_every=2)
    cpu_only("aiayn", *cli_args(config))
    model_dir = tmp_path / "run" / "model"
    sentences = lines(corpus)
    assert_same_model(
        decode_here(model_dir, sentences, device), decode_cpu_only(model_dir, sentences)
    )

    resumed = trainer.train(
        dataclasses.replace(config, device=str(device), max_steps=6), resume=True
    )
    assert (resumed.interrupted, resumed.step) == (False, 6)
    assert [s for s, _, _ in train_losses(tmp_path / "run")][-1] == 6


def test_a_checkpoint_saved_where_more_gpus_were_visible_resumes(device: torch.device) -> None:
    """Under torchrun on an 8-GPU machine every process sees the 8 GPUs, and its checkpoint
    holds the RNG states of all of them (`checkpoint.capture_rng`). Resumed where fewer GPUs are
    visible (one GPU, or CUDA_VISIBLE_DEVICES), the states of GPUs that are not there must be
    left aside: restoring them raises IndexError in `torch.cuda.set_rng_state_all`."""
    if device.type != "cuda":
        pytest.skip("CUDA generator states exist on CUDA only")
    saved = ckpt.capture_rng()
    here = torch.cuda.device_count()
    saved["cuda"] = [*saved["cuda"], *saved["cuda"][:1]]  # one GPU more than this process sees
    assert len(saved["cuda"]) == here + 1
    ckpt.restore_rng(saved)
    index = device.index if device.index is not None else torch.cuda.current_device()
    assert torch.equal(torch.cuda.get_rng_state(index), saved["cuda"][index])
