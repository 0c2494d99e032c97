"""The demo model, trained once per test session and shared: by test_demo.py, which checks what
it learned, and by test_readme.py, which runs the README's commands against it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from aiayn.demo import DemoResult, run_demo


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoResult]:
    """`aiayn demo` as `make demo` runs it (a few minutes on 2 CPU cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs with 1 thread; the demo is sized for 2 cores
    try:
        result = run_demo(tmp_path_factory.mktemp("demo"), progress=False)
    finally:
        torch.set_num_threads(threads)
    yield result
