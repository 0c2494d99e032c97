"""`init_distributed`: the device each process trains on (§5.2 trained on 8 GPUs; aiayn on one or
more, `docs/gpu.md`). Runs on any machine: CUDA's device selection is replaced by torch's own
argument check, the one that failed on the first GPU `aiayn train` met."""

from __future__ import annotations

import pytest
import torch
from torch.cuda._utils import _get_device_index

from aiayn.errors import UserValueError
from aiayn.train.distributed import init_distributed


@pytest.fixture
def selected(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The GPU index each torch.cuda.set_device call selected, checked as torch checks it, on
    a machine with two GPUs."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(_get_device_index(d)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_a_single_process_on_cuda_trains_on_gpu_0(selected: list[int]) -> None:
    context, device = init_distributed("cuda")
    assert device == torch.device("cuda:0")
    assert selected == [0]
    assert not context.enabled


def test_auto_on_a_gpu_machine_trains_on_gpu_0(selected: list[int]) -> None:
    _, device = init_distributed("auto")
    assert device == torch.device("cuda:0")
    assert selected == [0]


def test_torchrun_with_one_process_trains_on_its_local_gpu(
    selected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    _, device = init_distributed("cuda")
    assert device == torch.device("cuda:0")
    assert selected == [0]


def test_an_explicit_gpu_is_kept(selected: list[int]) -> None:
    _, device = init_distributed("cuda:1")
    assert device == torch.device("cuda:1")
    assert selected == [1]


def test_the_cpu_selects_no_gpu(selected: list[int]) -> None:
    _, device = init_distributed("cpu")
    assert device == torch.device("cpu")
    assert selected == []


def test_torchrun_with_one_gpu_for_every_process_is_refused(
    selected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes on cuda:1 would both take GPU 1, and NCCL stops at the first collective
    ("Duplicate GPU detected"): refused in one line before any process group starts."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserValueError, match="--device cuda:1: under torchrun each process"):
        init_distributed("cuda:1")
    assert selected == []


def test_more_processes_than_gpus_is_refused_in_one_line(
    selected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UserValueError, match=r"torchrun process 2 \(LOCAL_RANK\) has no GPU"):
        init_distributed("cuda")
    assert selected == []
