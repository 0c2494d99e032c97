"""Model directories for the interop tests (tests/interop, and the CLI tests of exports): the
settings of `model_dirs.tiny_model_dir` these tests were tuned on (`INTEROP_MODEL`), a model
trained on `PAIRS`, and a split tokenizer's files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from aiayn.model_dir import save_model_dir
from aiayn.text.tokenizer import EOS_ID
from model_dirs import CORPUS, tiny_model, train_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SENTENCES = [
    "the cat sat",
    "",
    "a dog barked at the moon all night and the cat sat on the mat",
    "hello",
    "wir übersetzen kurze sätze",
    "the mat",
    "ein hund",
]


INTEROP_MODEL: dict[str, Any] = {"seed": 1234, "eos_scale": 4.0, "max_positions": 64}
"""`model_dirs.tiny_model_dir`'s settings for the interop tests, whose tolerances were tuned on
the model they give: its ``</s>`` row scaled up 4x ends most beam search outputs and a few
greedy ones with EOS, as a trained model does, instead of running all of them into the length
limit; a positional table of 64 rows keeps the exports small."""


PAIRS = [(CORPUS[i], CORPUS[i + 3]) for i in range(3)] + [(CORPUS[6], CORPUS[7])]
"""The English–German pairs of `CORPUS`."""


def trained_model_dir(directory: Path, *, steps: int = 150) -> Path:
    """A tiny model that has learned `PAIRS` both ways, saved as `directory`/model (~5 s).

    Random weights leave the next token's distribution flat, so any rounding (int8 weights, an
    instruction set's kernels) flips some greedy choices; a trained model's are decided by wide
    margins, as a real model's mostly are.
    """
    from aiayn.text.tokenizer import BOS_ID, PAD_ID

    tokenizer = train_tokenizer(directory, CORPUS)
    pairs = PAIRS + [(tgt, src) for src, tgt in PAIRS]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(map(len, rows))
        return torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows])

    src = padded([[*tokenizer.encode(s), EOS_ID] for s, _ in pairs])
    tgt = padded([[BOS_ID, *tokenizer.encode(t), EOS_ID] for _, t in pairs])
    model = tiny_model(
        tokenizer.vocab_size, preset="tiny", seed=0, max_positions=64, dropout=0.0
    ).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        sums = model(src, tgt[:, :-1], tgt[:, 1:])
        (sums.loss / sums.n_tokens).backward()
        optimizer.step()
    return save_model_dir(directory / "model", model.eval(), tokenizer_file=tokenizer.model_file)


def split_spm_files(directory: Path) -> tuple[Path, Path]:
    """Raw SentencePiece models as Marian ships them: `directory`/source.spm learned on the
    English lines of `CORPUS`, target.spm on the German ones (so the two cut German text
    differently)."""
    import sentencepiece as spm

    models = []
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
        models.append((directory / f"{name}.model").rename(directory / f"{name}.spm"))
    return models[0], models[1]


def spm_pieces(model_file: Path) -> list[str]:
    """The pieces of a raw SentencePiece model, control pieces left out."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i)]


def split_tokenizer_files(directory: Path) -> Path:
    """A `SplitTokenizer`'s files in `directory`, as `aiayn import` writes them: the two models
    of `split_spm_files` and a vocab.json of both models' pieces. Returns the vocab.json."""
    import json

    pieces = ["<pad>", "<unk>", "<s>", "</s>"]
    for model in split_spm_files(directory):
        pieces += spm_pieces(model)
    vocab_file = directory / "vocab.json"
    vocab_file.write_text(json.dumps({"pieces": list(dict.fromkeys(pieces))}), encoding="utf-8")
    return vocab_file
