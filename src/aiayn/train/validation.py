"""Validation during training: the label-smoothed loss, NLL and perplexity of the validation
set (§5.4, §6.2 report perplexity on newstest2013), and its BLEU with the paper's beam search.

Both run the model in eval mode (no dropout) and ask `should_stop()` between batches, so that a
stop request (SIGTERM from a scheduler) never waits for a whole dev set: they then return None.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.loss import perplexity
from aiayn.text.batching import collate, make_batches
from aiayn.text.corpus import ParallelDataset, read_parallel, read_tsv
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from aiayn.train.update import autocast


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    dataset: ParallelDataset,
    *,
    max_tokens: int,
    device: torch.device,
    label_smoothing: float,
    bf16: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, float] | None:
    """Loss, NLL per token and perplexity on a validation set (eval mode, no dropout).

    Returns None, abandoning the pass, as soon as `should_stop()` says so between batches: a
    real dev set takes longer than a scheduler waits between SIGTERM and SIGKILL.
    """
    model.eval()
    batches = make_batches(
        dataset.src_lengths,
        dataset.tgt_lengths,
        max_tokens=max_tokens,
        seed=0,
        epoch=0,
        shuffle=False,
    )
    loss = nll = 0.0
    tokens = 0
    for indices in batches:
        if should_stop():
            return None
        batch = collate(
            [dataset[int(i)] for i in indices], pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID
        ).to(device)
        with autocast(device, bf16):
            sums = model(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=label_smoothing)
        loss += float(sums.loss)
        nll += float(sums.nll)
        tokens += sums.n_tokens
    return {
        "valid_loss": loss / tokens,
        "valid_nll": nll / tokens,
        "valid_ppl": perplexity(nll, tokens),
        "valid_tokens": tokens,
    }


def validation_bleu(
    model: nn.Module,
    tokenizer: Tokenizer,
    *,
    valid_tsv: str | None,
    valid_src: str | None,
    valid_tgt: str | None,
    max_tokens: int,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any] | None:
    """sacreBLEU of the validation set (`valid_tsv`, or `valid_src` and `valid_tgt`) decoded
    with the paper's beam search (§6.1), or None when `should_stop()` said stop; see
    `aiayn.decode.evaluation.bleu_of_pairs`."""
    from aiayn.decode import evaluation
    from aiayn.decode.translator import Translator

    if valid_tsv:
        pairs = list(read_tsv(Path(valid_tsv)))
    else:
        assert valid_src is not None and valid_tgt is not None
        pairs = list(read_parallel(Path(valid_src), Path(valid_tgt)))
    translator = Translator.from_model(model, tokenizer, max_tokens=max_tokens)
    return evaluation.bleu_of_pairs(translator, pairs, should_stop=should_stop)


def validation_metrics(
    model: nn.Module,
    tokenizer: Tokenizer,
    dataset: ParallelDataset,
    *,
    bleu_files: tuple[str | None, str | None, str | None] | None,
    max_tokens: int,
    device: torch.device,
    label_smoothing: float,
    bf16: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any] | None:
    """`validation_loss` on `dataset`, then, given `bleu_files` (valid_tsv, valid_src,
    valid_tgt), `validation_bleu`; None if `should_stop()` cut either short."""
    valid = validation_loss(
        model,
        dataset,
        max_tokens=max_tokens,
        device=device,
        label_smoothing=label_smoothing,
        bf16=bf16,
        should_stop=should_stop,
    )
    if valid is None or bleu_files is None:
        return valid
    tsv, src, tgt = bleu_files
    bleu = validation_bleu(
        model,
        tokenizer,
        valid_tsv=tsv,
        valid_src=src,
        valid_tgt=tgt,
        max_tokens=max_tokens,
        should_stop=should_stop,
    )
    return None if bleu is None else {**valid, **bleu}
