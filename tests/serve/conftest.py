"""Fixtures of the server tests: one tiny model with random weights (its translations are
garbage, but deterministic), its translator, and a test client of the app serving it; built once
for all of tests/serve/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from aiayn.config import preset
from aiayn.decode.translator import Translator
from aiayn.model import Transformer
from aiayn.model_dir import save_model_dir
from aiayn.serve import create_app
from aiayn.text.tokenizer import Tokenizer

from .helpers import CORPUS, MAX_POSITIONS, SETTINGS


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("server")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.train([corpus], directory / "tokenizer.model", vocab_size=300)
    torch.manual_seed(0)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, max_positions=MAX_POSITIONS)
    return save_model_dir(
        directory / "model",
        Transformer(config),
        tokenizer_file=tokenizer.model_file,
        metadata={"src_lang": "en", "tgt_lang": "de"},
    )


@pytest.fixture(scope="package")
def translator(model_dir: Path) -> Translator:
    return Translator(model_dir)


@pytest.fixture(scope="package")
def client(translator: Translator) -> Iterator[TestClient]:
    with TestClient(create_app(translator, SETTINGS)) as test_client:
        yield test_client
