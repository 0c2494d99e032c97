"""Shared fixtures: a fixed seed for every test, the process's settings kept from leaking between
tests, and a tokenizer file to save with a tiny model (`model_dirs.tiny_model` makes those)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo

from aiayn.runtime import ONEDNN_CACHE_VARIABLES


def pytest_configure(config: pytest.Config) -> None:
    # Test models are tiny: one intra-op thread is fastest for them, and it keeps a loaded
    # 2-core CI machine from oversubscribing (OpenMP spin-waits made the suite ~4x slower).
    torch.set_num_threads(1)
    # A test run started in the background by a non-interactive shell (`bash .ci/run &`)
    # inherits SIGINT ignored, and so would every command the tests start: Python then raises
    # no KeyboardInterrupt, and the tests of Ctrl-C would see none. Ctrl-C as at a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _process_settings() -> Iterator[None]:
    """What `aiayn.runtime.configure` sets, given back after each test: the library sets none of
    it, but the commands that tests run in-process (``main(["translate", "--threads", ...])``,
    ``main(["train", ...])``) set it as the programs they are, and so do some tests."""
    threads = torch.get_num_threads()
    environ = {name: os.environ.get(name) for name in ONEDNN_CACHE_VARIABLES}
    suppress_errors = torch._dynamo.config.suppress_errors
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for name, value in environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch._dynamo.config.suppress_errors = suppress_errors


@pytest.fixture(scope="session", autouse=True)
def _no_user_ct2_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Never the user's ~/.cache for the CTranslate2 exports of ``--backend ctranslate2``, not
    even in module- or session-scoped fixtures."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AIAYN_CT2_CACHE", str(tmp_path_factory.mktemp("ct2-cache-session")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _ct2_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own empty cache of CTranslate2 exports."""
    monkeypatch.setenv("AIAYN_CT2_CACHE", str(tmp_path_factory.mktemp("ct2-cache")))


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    """A tokenizer file for a model directory that no test decodes with: saving copies it as
    opaque bytes, so no real SentencePiece model is needed."""
    path = tmp_path / "spm.model"
    path.write_bytes(b"not a real sentencepiece model")
    return path
