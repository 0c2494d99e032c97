"""The CUDA tests: aiayn's GPU path checked against its CPU path, skipped where there is no GPU.

Every test module here is marked `cuda` (`pytest -m cuda` selects them, `-m "not cuda"` leaves
them out) and asks for the `device` fixture, which skips the test, saying why, where
`torch.cuda.is_available()` is false: CI runs on CPUs and stays green. `make gpu-check` runs
them first on a lent GPU (bench/gpu_check.py).

AIAYN_TEST_DEVICE picks the device (default "cuda"; "cuda:1" for another GPU). Set to "cpu", it
runs the tests on the CPU against the CPU: that proves nothing about CUDA, but it checks the
tests' own logic on a machine without a GPU.

This folder has no ``__init__.py`` on purpose: as a package it would be named ``cuda`` and
shadow the ``cuda`` namespace of NVIDIA's Python bindings. Its modules are named
``test_cuda_*.py`` so that they cannot collide with the top-level test modules.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE_VARIABLE = "AIAYN_TEST_DEVICE"


def _device() -> tuple[torch.device | None, str]:
    """The device the tests run on, or None and why they cannot run here."""
    device = torch.device(os.environ.get(DEVICE_VARIABLE, "cuda"))
    if device.type != "cuda":
        return device, ""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return None, f"CUDA is not available (torch {torch.__version__}, {build})"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return None, f"{device} does not exist ({torch.cuda.device_count()} GPU(s) visible)"
    return device, ""


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The GPU under test (AIAYN_TEST_DEVICE, default "cuda"); skips where there is none."""
    found, reason = _device()
    if found is None:
        pytest.skip(reason)
    return found
