"""Tests for aiayn.runtime: what belongs to the process is set by the entry points, through
`runtime.configure`, and by no library object: a notebook that builds a `Translator`, trains, or
serves an app in the background finds its threads, environment, TorchInductor settings, logging,
limits, random number generators, PyTorch's kernel switches (cuDNN, TF32, attention backends) and
current GPU as they were."""

from __future__ import annotations

import logging
import os
import random
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo

from aiayn import runtime
from aiayn.decode.translator import Translator
from aiayn.errors import UserValueError
from aiayn.runtime import (
    MAX_DECODING_THREADS,
    ONEDNN_CACHE_VARIABLES,
    busy_cores,
    decoding_threads,
    threads_beyond_free_cores,
)
from aiayn.train import trainer
from model_dirs import tiny_model_dir
from train.test_trainer import make_config, write_copy_corpus

LOGGERS = ("", "aiayn", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def process_state() -> dict[str, Any]:
    """What `runtime.configure` and a server's entry point may change, as it is now, and what
    belongs to the program that calls the library: its random streams, PyTorch's kernel
    switches and its current GPU."""
    loggers = {name: logging.getLogger(name) for name in LOGGERS}
    numpy_rng = np.random.get_state()
    cuda = torch.cuda.is_available()
    return {
        "threads": torch.get_num_threads(),
        "interop threads": torch.get_num_interop_threads(),
        "torch rng": torch.get_rng_state().tolist(),
        "cuda rng": [state.tolist() for state in torch.cuda.get_rng_state_all()] if cuda else None,
        "python rng": random.getstate(),
        "numpy rng": (numpy_rng[0], numpy_rng[1].tolist(), *numpy_rng[2:]),
        "cuda device": torch.cuda.current_device() if cuda else None,
        "kernel switches": kernel_switches(),
        "environ": dict(os.environ),
        "suppress_errors": torch._dynamo.config.suppress_errors,
        "open files": resource.getrlimit(resource.RLIMIT_NOFILE),
        "logging": {
            name or "root": (
                log.level,
                list(log.handlers),
                list(log.filters),
                log.propagate,
                log.disabled,
            )
            for name, log in loggers.items()
        },
    }


def kernel_switches() -> dict[str, Any]:
    """PyTorch's process-wide choices of kernels and numerics."""
    backends = torch.backends
    return {
        "cudnn": (
            backends.cudnn.enabled,
            backends.cudnn.benchmark,
            backends.cudnn.deterministic,
            backends.cudnn.allow_tf32,
        ),
        "matmul tf32": backends.cuda.matmul.allow_tf32,
        "matmul precision": torch.get_float32_matmul_precision(),
        "attention backends": (
            backends.cuda.cudnn_sdp_enabled(),
            backends.cuda.flash_sdp_enabled(),
            backends.cuda.mem_efficient_sdp_enabled(),
            backends.cuda.math_sdp_enabled(),
        ),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "default dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def unsettled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose settings differ from what the library is asked for: 2 threads (the
    translator and the trainer get 1), no oneDNN cache size (bf16 training limits it)."""
    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)  # tests/conftest.py gives the suite's back afterwards


@pytest.mark.usefixtures("unsettled")
def test_a_translator_leaves_the_process_as_it_was(model_dir: Path) -> None:
    before = process_state()
    with pytest.warns(UserWarning, match=r"runtime\.configure\(threads=1\)"):
        translator = Translator(model_dir, threads=1)  # asked for, and not taken
    results = translator.translate(["the cat sat", "hello"], beam_size=2)
    assert len(results) == 2
    assert process_state() == before


@pytest.mark.usefixtures("unsettled")
def test_training_leaves_the_process_as_it_was(tmp_path: Path) -> None:
    """`train` with `threads` and bf16 on the CPU: `aiayn train` sets both for its process
    (tests/train/test_trainer.py), `train` itself neither; the run seeds PyTorch's generator
    from `seed`, and the caller's stream is its own again afterwards."""
    corpus = write_copy_corpus(tmp_path / "corpus", 24)
    config = make_config(corpus, tmp_path / "run", max_steps=3, threads=1, cpu_bf16=True)
    before = process_state()
    result = trainer.train(config)
    assert result.model_dir.is_dir()
    assert process_state() == before


def test_serving_in_background_leaves_the_process_as_it_was(model_dir: Path) -> None:
    """The app, and uvicorn running it in a thread, add no filter or handler to a logger, set
    no level and raise no limit (`aiayn serve`'s entry point, `serve.app.serve`, does)."""
    pytest.importorskip("fastapi", reason="optional: pip install -e '.[serve]'")
    import httpx

    from aiayn.serve import ServerSettings, create_app, serve_in_background

    translator = Translator(model_dir)
    settings = ServerSettings(max_connections=100_000)  # more than the limit on open files
    before = process_state()
    with serve_in_background(create_app(translator, settings)) as url:
        answer = httpx.post(f"{url}/translate?q=secret", timeout=60)
        assert answer.status_code == 200, answer.text
    assert process_state() == before


def test_configure_sets_threads_and_zero_keeps_the_default() -> None:
    torch.set_num_threads(3)  # tests/conftest.py gives the suite's back afterwards
    runtime.configure(threads=2)
    assert torch.get_num_threads() == 2
    runtime.configure(threads=0)
    assert torch.get_num_threads() == 2
    runtime.configure()  # None: nothing
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match=r"threads \(-1\) must be >= 0"):
        runtime.configure(threads=-1)


def test_configure_limits_onednn_kernels_only_where_the_user_did_not_choose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    runtime.configure(onednn_kernels=16)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    runtime.configure(onednn_kernels=16)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "64")  # oneDNN's older name
    runtime.configure(onednn_kernels=16)
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ


def test_configure_sets_the_compile_fallback() -> None:
    runtime.configure(compile_errors_fall_back=True)  # conftest.py restores it afterwards
    assert torch._dynamo.config.suppress_errors is True
    runtime.configure(compile_errors_fall_back=False)
    assert torch._dynamo.config.suppress_errors is False


def test_configure_raises_the_open_files_limit_and_never_lowers_it() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft < 64:
        pytest.skip(f"a soft limit on open files of {soft}")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
        runtime.configure(open_files=soft)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
        runtime.configure(open_files=10)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


GLIBC = (getattr(os, "confstr", lambda name: None)("CS_GNU_LIBC_VERSION") or "").startswith("glibc")

# The allocator's account (glibc's mallinfo2) of a 20 MB tensor, and of ten more freed: where the
# first came from (bytes in blocks mapped from the system for themselves) and what the process
# keeps of the 200 MB freed (free bytes in its heap).
MEMORY = r"""
import ctypes, sys
import torch
from aiayn import runtime

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
print(runtime.keep_freed_memory() if sys.argv[1] == "keep" else None)
one = torch.ones(5 * 2**20)
mapped = libc.mallinfo2().hblkhd
del one
tensors = [torch.ones(5 * 2**20) for _ in range(10)]
del tensors
print(mapped >> 20, libc.mallinfo2().fordblks >> 20)
"""


def allocator_account(how: str, **environ: str) -> tuple[str, int, int]:
    """In a process of its own (the allocator is the process's): whether `keep_freed_memory`
    set anything, the MB mapped for blocks of their own while a 20 MB tensor lived, and the
    MB free in the heap after ten more were freed."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | environ
    done = subprocess.run(
        [sys.executable, "-c", MEMORY, how], env=env, capture_output=True, text=True, check=True
    )
    kept, mapped, free = done.stdout.split()
    return kept, int(mapped), int(free)


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_keep_freed_memory_serves_tensors_from_the_heap_and_keeps_them_there() -> None:
    """By default a 20 MB block is mapped from the system for itself, and freed blocks go back
    to it (a later tensor faults its pages in again, 4 KB at a time); kept, the block comes
    from the heap and 200 MB freed stay there for the next tensors."""
    kept, mapped, free = allocator_account("keep")
    _, default_mapped, _ = allocator_account("default")
    assert kept == "True"
    assert mapped < 20 <= default_mapped
    assert free >= 160  # glibc's defaults keep 40–200 MB of it, as their heuristics fall


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    ],
)
def test_keep_freed_memory_leaves_the_users_own_thresholds(environ: dict[str, str]) -> None:
    kept, mapped, _ = allocator_account("keep", **environ)
    assert kept == "False"
    assert mapped >= 20  # the user's setting: blocks from 128 KB on mapped for themselves


def test_aiayn_demo_keeps_freed_memory_as_aiayn_train_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import signal

    from aiayn import demo
    from aiayn.cli import main

    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1) or True)

    def stopped(*args: object, **kwargs: object) -> None:
        assert calls == [1]  # set before the demo starts
        raise demo.DemoStopped(0, signal.SIGINT, tmp_path)

    monkeypatch.setattr(demo, "run_demo", stopped)
    assert main(["demo", "-o", str(tmp_path)]) == 128 + signal.SIGINT


def test_configure_keeps_freed_memory_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: calls.append(1) or True)
    runtime.configure(threads=None)
    runtime.configure(reuse_freed_memory=False)
    assert calls == []
    runtime.configure(reuse_freed_memory=True)
    assert calls == [1]


def test_decoding_threads_leave_busy_cores_alone_and_stay_between_1_and_4() -> None:
    assert decoding_threads(cores=2, load=2.9) == 1  # a training run on a 2-core machine
    assert decoding_threads(cores=2, load=0.1) == 2
    assert decoding_threads(cores=8, load=5.2) == 3
    assert decoding_threads(cores=64, load=0.0) == MAX_DECODING_THREADS
    assert decoding_threads(cores=4, load=40.0) == 1
    assert 1 <= decoding_threads() <= MAX_DECODING_THREADS


def test_threads_asked_for_beyond_the_free_cores_say_so_and_others_do_not() -> None:
    message = threads_beyond_free_cores(2, cores=2, load=1.9)  # a training run on 2 cores
    assert message is not None
    assert message.startswith("--threads 2: other processes keep 1.9 of the 2 cores busy")
    assert "1 would fit" in message
    assert threads_beyond_free_cores(2, cores=2, load=0.2) is None  # idle
    assert threads_beyond_free_cores(3, cores=8, load=5.2) is None  # 3 free
    assert threads_beyond_free_cores(4, cores=8, load=5.2) is not None
    assert threads_beyond_free_cores(1, cores=1, load=7.0) is None  # one thread cannot wait
    assert threads_beyond_free_cores(0, cores=2, load=2.0) is None  # PyTorch's default


def test_busy_cores_forget_a_run_that_has_just_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    # Just after a training run on 2 cores: the average still counts it, nothing else runs.
    assert busy_cores(average=1.8, runnable=1) == 0.0
    assert decoding_threads(cores=2, load=busy_cores(average=1.8, runnable=1)) == 2
    # While it runs: its two threads and this process are runnable.
    assert busy_cores(average=2.4, runnable=3) == 2.0
    assert decoding_threads(cores=2, load=busy_cores(average=2.4, runnable=3)) == 1
    # A moment's burst of tasks on an idle machine does not count beyond the average.
    assert busy_cores(average=0.1, runnable=9) == 0.1
    assert busy_cores() >= 0.0
    # No /proc/loadavg (macOS): the average alone.
    monkeypatch.setattr(runtime, "_runnable_tasks", lambda: None)
    assert busy_cores(average=1.5) == 1.5


def test_checked_device_resolves_auto_and_keeps_the_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert runtime.checked_device("auto").type == expected
    assert runtime.checked_device("cpu") == torch.device("cpu")
    assert runtime.checked_device(torch.device("cpu")) == torch.device("cpu")


def test_auto_is_one_rule_for_every_device_question(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" is the GPU where the runtime that computes has one (PyTorch unless another is
    asked), else the CPU, the CPU whatever there is for what runs there alone (int8 decoding);
    the type of a named device needs no GPU to exist."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.checked_device("auto") == torch.device("cuda")
    assert runtime.device_type("auto") == "cuda"
    assert runtime.checked_device("auto", cpu_only=True) == torch.device("cpu")
    assert runtime.device_type("auto", cpu_only=True) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.device_type("auto") == "cpu"
    # Another runtime's answer where it computes (CTranslate2 has CUDA where PyTorch may not).
    assert runtime.auto_device(lambda: True) == "cuda"
    assert runtime.auto_device(lambda: True, cpu_only=True) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.auto_device(lambda: False) == "cpu"
    assert runtime.device_type("cuda:3") == "cuda" and runtime.device_type("cpu") == "cpu"
    assert runtime.device_type(torch.device("cuda", 1)) == "cuda"


def test_checked_device_refuses_a_gpu_index_past_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a 1-GPU machine: cuda and cuda:0 exist, cuda:1 does not (torch would say
    "invalid device ordinal" deep inside the first CUDA call)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runtime.checked_device("cuda") == torch.device("cuda")
    assert runtime.checked_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(UserValueError, match=r"--device cuda:1: this machine shows 1 CUDA GPU"):
        runtime.checked_device("cuda:1")
