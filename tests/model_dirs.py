"""Tiny models and model directories for tests: the one factory of a tiny random Transformer
(`tiny_model`) and the one of a model directory (`tiny_model_dir`, built on it), with the
tokenizer the directories hold (`train_tokenizer`).

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

from aiayn.config import PRESETS, ModelConfig
from aiayn.model import Transformer
from aiayn.model_dir import save_model_dir
from aiayn.text.tokenizer import EOS_ID, Tokenizer

TINY_VOCAB = 23
"""`tiny_model`'s vocabulary size (source and target) unless given."""
TINY: dict[str, Any] = dict(
    d_model=32,
    d_ff=64,
    n_heads=4,
    n_encoder_layers=2,
    n_decoder_layers=2,
    dropout=0.1,
    attention_dropout=0.1,
    max_positions=64,
)
"""`tiny_model`'s sizes unless it starts from a preset: 2+2 layers of width 32, fast on any CPU;
dropout and attention dropout non-zero, so that tests also show eval mode turns them off."""

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
    vocab_size: int = TINY_VOCAB,
    *,
    preset: str | None = None,
    seed: int | None = None,
    eos_scale: float = 1.0,
    **overrides: Any,
) -> Transformer:
    """A tiny Transformer in eval mode: `TINY`, or the named preset, with `overrides`.

    Args:
        vocab_size: Source and target vocabulary size (``tgt_vocab_size`` in `overrides` sets
            the target's apart).
        preset: An `aiayn.config.PRESETS` name to start from instead of `TINY`: the model
            directories' models are ``preset("tiny")``, the tests that translate with them were
            tuned on it.
        seed: Draws the weights from this seed; None draws them from the global generator as
            the test left it (the autouse fixture seeds it with 0 before each test).
        eos_scale: Scales the target embedding's ``</s>`` row (also the pre-softmax one when
            tied), so that the random model ends outputs with EOS as a trained model does.
        **overrides: Any other `ModelConfig` field.
    """
    sizes = dict(PRESETS[preset]) if preset is not None else dict(TINY)
    values = {"src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, **sizes, **overrides}
    if seed is not None:
        torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_dict(values)).eval()
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
    """A tokenizer learned on `lines` (in `directory`) and a ``tiny_model(preset="tiny")`` over
    its vocabulary, weights drawn from `seed`, saved as `directory`/model with `metadata`;
    returns that model directory."""
    tokenizer = train_tokenizer(directory, lines, vocab_size=vocab_size)
    model = tiny_model(
        tokenizer.vocab_size, preset="tiny", seed=seed, eos_scale=eos_scale, **overrides
    )
    return save_model_dir(
        directory / "model", model, tokenizer_file=tokenizer.model_file, metadata=metadata
    )
