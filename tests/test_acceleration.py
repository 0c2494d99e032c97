"""torch.compile with an eager fallback (the compiled model computes the same function); how
many threads decoding picks."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from aiayn import acceleration
from aiayn.acceleration import (
    MAX_DECODING_THREADS,
    compiler_missing,
    decoding_threads,
    maybe_compile,
)
from aiayn.config import preset
from aiayn.model import Transformer

CPU = torch.device("cpu")


def test_without_a_cxx_compiler_the_model_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(acceleration.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler" in (compiler_missing(CPU) or "")
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="aiayn.acceleration"):
        assert maybe_compile(model, CPU) is model
    assert "running eagerly" in caplog.text


def test_without_triton_cuda_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceleration.importlib.util, "find_spec", lambda name: None)
    assert compiler_missing(torch.device("cuda")) == "Triton is not installed"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++")
def test_compiled_training_step_equals_eager() -> None:
    """Forward (with padding) and gradients of the compiled model = the eager model's."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, dropout=0.0))
    src = torch.randint(4, 300, (3, 9))
    src[1, 6:] = model.config.pad_id
    tgt = torch.randint(4, 300, (3, 7))
    compiled = maybe_compile(model, CPU)
    assert compiled is not model
    eager_out = model(src, tgt)
    eager_out.square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(src, tgt)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


def test_decoding_threads_leave_busy_cores_alone_and_stay_between_1_and_4() -> None:
    assert decoding_threads(cores=2, load=2.9) == 1  # a training run on a 2-core machine
    assert decoding_threads(cores=2, load=0.1) == 2
    assert decoding_threads(cores=8, load=5.2) == 3
    assert decoding_threads(cores=64, load=0.0) == MAX_DECODING_THREADS
    assert decoding_threads(cores=4, load=40.0) == 1
    assert 1 <= decoding_threads() <= MAX_DECODING_THREADS
