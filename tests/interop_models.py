"""Tiny model directories for the interop tests (tests/test_interop_*.py).

Random weights, with one twist: the row of ``</s>`` in the (tied) embedding is scaled up, so
that the random model ends some outputs with EOS (most beam search outputs, a few greedy
ones), as a trained model does, instead of running all of them into the length limit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from aiayn import checkpoint
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.tokenizer import EOS_ID, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
SENTENCES = [
    "the cat sat",
    "",
    "a dog barked at the moon all night and the cat sat on the mat",
    "hello",
    "wir übersetzen kurze sätze",
    "the mat",
    "ein hund",
]


def tiny_model_dir(directory: Path, *, eos_scale: float = 4.0, **overrides: object) -> Path:
    """A tokenizer trained on `CORPUS` and a random tiny model, saved as `directory`/model."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.train([corpus], directory / "tokenizer.model", vocab_size=300)
    torch.manual_seed(1234)
    values = {"max_positions": 64, **overrides}
    model = Transformer(preset("tiny", src_vocab_size=tokenizer.vocab_size, **values)).eval()
    with torch.no_grad():
        model.tgt_embed.embedding.weight[EOS_ID] *= eos_scale
    return checkpoint.save_model_dir(
        directory / "model", model, tokenizer_file=tokenizer.model_file
    )
