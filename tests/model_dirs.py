"""Tiny model directories for tests: one factory for every test module that needs a model
directory, a tokenizer or a tiny random model (tests/decode, tests/serve, tests/cli, tests/interop,
tests/integration, ...).

A SentencePiece tokenizer is learned on a few lines (written three times over, so that their
pieces are frequent enough), and `preset("tiny")` over its vocabulary gets random weights drawn
from a fixed seed: the translations are garbage, but deterministic. `eos_scale` scales up the row
of ``</s>`` in the (tied) embedding, so that the random model ends some outputs with EOS (most
beam search outputs, a few greedy ones), as a trained model does, instead of running all of them
into the length limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.model_dir import save_model_dir
from aiayn.text.tokenizer import EOS_ID, Tokenizer

CORPUS = [
    "the cat sat on the mat",
    "a dog barked at the moon all night",
    "hello world, this is a small test",
    "die katze sass auf der matte",
    "ein hund bellte die ganze nacht den mond an",
    "hallo welt, das ist ein kleiner test",
    "we translate short sentences quickly",
    "wir übersetzen kurze sätze schnell",
]
"""English and German lines, pairs three apart (and the last two)."""
EN_DE = {"src_lang": "en", "tgt_lang": "de"}
"""The metadata of a model directory that translates English to German."""


def train_tokenizer(
    directory: Path, lines: Sequence[str] = CORPUS, *, vocab_size: int = 300
) -> Tokenizer:
    """A tokenizer learned on `lines`, written as `directory`/tokenizer.model."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(list(lines) * 3) + "\n", encoding="utf-8")
    return Tokenizer.train([corpus], directory / "tokenizer.model", vocab_size=vocab_size)


def tiny_model(
    tokenizer: Tokenizer, *, seed: int = 0, eos_scale: float = 1.0, **overrides: Any
) -> Transformer:
    """`preset("tiny", **overrides)` over `tokenizer`'s vocabulary, weights drawn from `seed`, in
    eval mode."""
    torch.manual_seed(seed)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, **overrides)
    model = Transformer(config).eval()
    if eos_scale != 1.0:
        with torch.no_grad():
            model.tgt_embed.embedding.weight[EOS_ID] *= eos_scale
    return model


def tiny_model_dir(
    directory: Path,
    lines: Sequence[str] = CORPUS,
    *,
    vocab_size: int = 300,
    seed: int = 0,
    eos_scale: float = 1.0,
    metadata: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """A tokenizer learned on `lines` (in `directory`) and a `tiny_model`, saved as
    `directory`/model with `metadata`; returns that model directory."""
    tokenizer = train_tokenizer(directory, lines, vocab_size=vocab_size)
    model = tiny_model(tokenizer, seed=seed, eos_scale=eos_scale, **overrides)
    return save_model_dir(
        directory / "model", model, tokenizer_file=tokenizer.model_file, metadata=metadata
    )
