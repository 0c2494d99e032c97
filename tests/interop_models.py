"""Tiny model directories for the interop tests (tests/test_interop_*.py).

Random weights, with one twist: the row of ``</s>`` in the (tied) embedding is scaled up, so
that the random model ends some outputs with EOS (most beam search outputs, a few greedy
ones), as a trained model does, instead of running all of them into the length limit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.model_dir import save_model_dir
from aiayn.text.tokenizer import EOS_ID, Tokenizer

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
    return save_model_dir(directory / "model", model, tokenizer_file=tokenizer.model_file)


PAIRS = [(CORPUS[i], CORPUS[i + 3]) for i in range(3)] + [(CORPUS[6], CORPUS[7])]
"""The English–German pairs of `CORPUS`."""


def trained_model_dir(directory: Path, *, steps: int = 150) -> Path:
    """A tiny model that has learned `PAIRS` both ways, saved as `directory`/model (~5 s).

    Random weights leave the next token's distribution flat, so any rounding (int8 weights, an
    instruction set's kernels) flips some greedy choices; a trained model's are decided by wide
    margins, as a real model's mostly are.
    """
    from aiayn.text.tokenizer import BOS_ID, PAD_ID

    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3) + "\n", encoding="utf-8")
    tokenizer = Tokenizer.train([corpus], directory / "tokenizer.model", vocab_size=300)
    pairs = PAIRS + [(tgt, src) for src, tgt in PAIRS]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(map(len, rows))
        return torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows])

    src = padded([[*tokenizer.encode(s), EOS_ID] for s, _ in pairs])
    tgt = padded([[BOS_ID, *tokenizer.encode(t), EOS_ID] for _, t in pairs])
    torch.manual_seed(0)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, max_positions=64, dropout=0.0)
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        sums = model(src, tgt[:, :-1], tgt[:, 1:])
        (sums.loss / sums.n_tokens).backward()
        optimizer.step()
    return save_model_dir(directory / "model", model.eval(), tokenizer_file=tokenizer.model_file)


def split_tokenizer_files(directory: Path) -> Path:
    """A `SplitTokenizer`'s files in `directory`, as `aiayn import` writes them: a source model
    learned on the English lines of `CORPUS`, a target model on the German ones (so the two cut
    German text differently), and a vocab.json of both models' pieces. Returns the vocab.json."""
    import json

    import sentencepiece as spm

    pieces = ["<pad>", "<unk>", "<s>", "</s>"]
    for name, lines in (("source", CORPUS[:3] + CORPUS[6:7]), ("target", CORPUS[3:6] + CORPUS[7:])):
        text = directory / f"{name}.txt"
        text.write_text("\n".join(lines * 3) + "\n", encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(text),
            model_prefix=str(directory / name),
            vocab_size=60,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        model = (directory / f"{name}.model").rename(directory / f"{name}.spm")
        sp = spm.SentencePieceProcessor(model_file=str(model))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i)]
    vocab_file = directory / "vocab.json"
    vocab_file.write_text(json.dumps({"pieces": list(dict.fromkeys(pieces))}), encoding="utf-8")
    return vocab_file
