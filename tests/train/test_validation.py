"""Tests for aiayn.train.validation: validation loss (the chunked loss path equals the plain
one)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from aiayn.loss import label_smoothed_loss
from aiayn.text.batching import collate
from aiayn.text.corpus import load_or_build
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.train.validation import validation_loss
from model_dirs import tiny_model

LETTERS = "abcdefgh"


class _LetterEncoder:
    """One id per letter (a stand-in tokenizer for building a data cache)."""

    vocab_size = 4 + len(LETTERS)
    sha256 = "letters"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[4 + LETTERS.index(c) for c in text.split()] for text in texts]

    encode_target_batch = encode_batch


@torch.no_grad()
def test_validation_loss_reports_per_token_means_in_eval_mode(tmp_path) -> None:
    """Per-token means of the plain path (logits, then `label_smoothed_loss`) over the whole
    set in one batch, from batches of at most 64 tokens scored in chunks, without dropout."""
    rng = random.Random(0)
    lines = [" ".join(rng.choices(LETTERS, k=rng.randint(3, 6))) for _ in range(48)]
    src, tgt = tmp_path / "valid.src", tmp_path / "valid.tgt"
    for path in (src, tgt):
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    dataset, _ = load_or_build(src, tgt, None, _LetterEncoder(), tmp_path / "data", max_len=16)
    model = tiny_model(_LetterEncoder.vocab_size, preset="tiny", d_model=16, d_ff=32)  # dropout 0.1
    model.train()
    metrics = validation_loss(
        model, dataset, max_tokens=64, device=torch.device("cpu"), label_smoothing=0.1
    )
    assert metrics is not None
    assert not model.training  # no dropout: the numbers below are reproducible
    everything = collate([dataset[i] for i in range(len(dataset))], bos_id=BOS_ID, eos_id=EOS_ID)
    sums = label_smoothed_loss(
        model(everything.src, everything.tgt_in), everything.tgt_out, epsilon=0.1, pad_id=PAD_ID
    )
    assert metrics["valid_tokens"] == everything.n_tgt_tokens == sums.n_tokens
    assert metrics["valid_loss"] == pytest.approx(sums.loss.item() / sums.n_tokens, rel=1e-6)
    assert metrics["valid_nll"] == pytest.approx(sums.nll.item() / sums.n_tokens, rel=1e-6)
    assert metrics["valid_ppl"] == pytest.approx(math.exp(metrics["valid_nll"]))
