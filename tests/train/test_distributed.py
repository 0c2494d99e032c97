"""`init_distributed`: the device each process trains on (§5.2 trained on 8 GPUs; aiayn on one or
more, `docs/gpu.md`). Runs on any machine: a machine with two GPUs is pretended, and the device
is checked as torch checks the one `train` makes CUDA's current device (the check that failed
on the first GPU `aiayn train` met: a device without an index)."""

from __future__ import annotations

import pytest
import torch
from torch.cuda._utils import _get_device_index

from aiayn.errors import UserValueError
from aiayn.train.distributed import init_distributed


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with two GPUs, outside torchrun."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def gpu_index(device: torch.device) -> int:
    """The GPU `device` selects, checked as `torch.cuda.device` and `set_device` check it."""
    return _get_device_index(device)


def test_a_single_process_on_cuda_trains_on_gpu_0() -> None:
    context, device = init_distributed("cuda")
    assert device == torch.device("cuda:0")
    assert gpu_index(device) == 0
    assert not context.enabled


def test_auto_on_a_gpu_machine_trains_on_gpu_0() -> None:
    _, device = init_distributed("auto")
    assert device == torch.device("cuda:0")
    assert gpu_index(device) == 0


def test_torchrun_with_one_process_trains_on_its_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    _, device = init_distributed("cuda")
    assert device == torch.device("cuda:0")
    assert gpu_index(device) == 0


def test_an_explicit_gpu_is_kept() -> None:
    _, device = init_distributed("cuda:1")
    assert device == torch.device("cuda:1")
    assert gpu_index(device) == 1


def test_the_cpu_selects_no_gpu() -> None:
    _, device = init_distributed("cpu")
    assert device == torch.device("cpu")


def test_torchrun_with_one_gpu_for_every_process_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two processes on cuda:1 would both take GPU 1, and NCCL stops at the first collective
    ("Duplicate GPU detected"): refused in one line before any process group starts."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserValueError, match="--device cuda:1: under torchrun each process"):
        init_distributed("cuda:1")


def test_more_processes_than_gpus_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UserValueError, match=r"torchrun process 2 \(LOCAL_RANK\) has no GPU"):
        init_distributed("cuda")
