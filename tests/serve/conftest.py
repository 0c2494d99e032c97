"""Fixtures of the server tests: one tiny model with random weights (its translations are
garbage, but deterministic), its translator, and a test client of the app serving it; built once
for all of tests/serve/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from aiayn.decode.translator import Translator
from aiayn.serve import create_app
from model_dirs import EN_DE, tiny_model_dir

from .helpers import CORPUS, MAX_POSITIONS, SETTINGS


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("server")
    return tiny_model_dir(directory, CORPUS, max_positions=MAX_POSITIONS, metadata=EN_DE)


@pytest.fixture(scope="package")
def translator(model_dir: Path) -> Translator:
    return Translator(model_dir)


@pytest.fixture(scope="package")
def client(translator: Translator) -> Iterator[TestClient]:
    with TestClient(create_app(translator, SETTINGS)) as test_client:
        yield test_client
