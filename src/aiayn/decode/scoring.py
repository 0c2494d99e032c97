"""Score given translations: the model's log-probability of each target given its source.

fairseq calls it ``--score-reference``: no search, one teacher-forced pass per batch, reading
off log p(y_t | y_<t, x) for every reference token. Uses: filtering a parallel corpus (drop
pairs the model finds implausible), checking a system's outputs, comparing models on the same
translations.

What is scored. A pair is batched as training batches it (``aiayn.text.batching.collate``): the
source's pieces + EOS, the decoder fed BOS + the target's pieces, the labels the target's pieces
+ EOS. ``log_prob`` sums the labels' log-probabilities, EOS included, exactly as
``Hypothesis.log_prob`` of a search that output this target, and ``n_tokens`` counts them
(pieces + 1). Sentences are stripped first; a source longer than the model accepts is cut to
``max_positions − 1`` pieces as ``Translator.translate`` cuts it (with a warning). A target is
never cut (its score would be meaningless): with learned positions, a target longer than
``max_positions − 1`` pieces is an error naming its line.

An ensemble (several models) scores each token with the mean of the models' probabilities, as
ensemble decoding does (:mod:`aiayn.decode.ensemble`).

Shapes: B pairs in a batch, N models, S source length, T target length + 1, V vocabulary.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aiayn.decode.costs import padded_batches
from aiayn.decode.sources import SourceLimits
from aiayn.errors import UserValueError
from aiayn.model import Transformer
from aiayn.text.batching import collate
from aiayn.text.tokenizer import PAD_ID, Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["PairScore", "score_pairs"]


@dataclass(frozen=True)
class PairScore:
    """How probable the model finds one target given its source.

    Attributes:
        log_prob: Sum of the log-probabilities of the target's pieces and of the final EOS.
        n_tokens: Number of those tokens: target pieces + 1.
        truncated: The source was longer than the model accepts and was cut.
    """

    log_prob: float
    n_tokens: int
    truncated: bool = False

    @property
    def perplexity(self) -> float:
        """exp(−log_prob / n_tokens): the per-token perplexity of this target (inf past a
        float's range)."""
        return _exp(-self.log_prob / self.n_tokens)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class _Pair:
    index: int  # position in the chunk
    src: list[int]  # source ids (no EOS)
    tgt: list[int]  # target ids (no BOS, no EOS)
    truncated: bool


def score_pairs(
    models: Transformer | Sequence[Transformer],
    tokenizer: Tokenizer,
    pairs: Iterable[tuple[str, str]],
    *,
    max_tokens: int = 4096,
    chunk_size: int = 4096,
    progress: Callable[[int], None] | None = None,
) -> Iterator[PairScore]:
    """Scores (source, target) pairs, teacher-forced; yields one :class:`PairScore` per pair,
    in input order.

    Reads ``chunk_size`` pairs at a time (so a large corpus streams), sorts them by length and
    cuts batches of at most ``max_tokens`` padded tokens (the longer side of each pair:
    `aiayn.decode.costs.padded_batches`).

    Args:
        models: One model, or the models of an ensemble (sharing ``tokenizer``).
        tokenizer: The models' tokenizer.
        pairs: Plain-text (source, target) pairs.
        max_tokens: Batch budget in padded tokens; a pair alone over it gets its own batch.
        chunk_size: Pairs read and sorted at a time.
        progress: Called with the number of pairs just scored, after each batch.

    Raises:
        ValueError: A target is longer than a model with learned positions accepts (its
            1-based number in ``pairs`` is named).
    """
    models = [models] if isinstance(models, Transformer) else list(models)
    if not models:
        raise ValueError("no model to score with")
    limits = SourceLimits.of(m.config for m in models)
    max_src, max_tgt = limits.max_source_tokens, limits.max_output_tokens
    stream = iter(pairs)
    number = 1
    while chunk := list(itertools.islice(stream, chunk_size)):
        prepared = _prepare(chunk, tokenizer, max_src, max_tgt, number)
        scores: list[PairScore | None] = [None] * len(prepared)
        for batch in padded_batches(prepared, _width, max_tokens):
            log_probs = _score_batch(models, batch)
            for pair, log_prob in zip(batch, log_probs, strict=True):
                scores[pair.index] = PairScore(log_prob, len(pair.tgt) + 1, pair.truncated)
            if progress is not None:
                progress(len(batch))
        yield from scores  # type: ignore[misc]
        number += len(chunk)


def _prepare(
    chunk: list[tuple[str, str]],
    tokenizer: Tokenizer,
    max_src: int,
    max_tgt: int | None,
    first_number: int,
) -> list[_Pair]:
    sources = tokenizer.encode_batch([src.strip() for src, _ in chunk])
    targets = tokenizer.encode_target_batch([tgt.strip() for _, tgt in chunk])
    prepared = []
    for i, (src, tgt) in enumerate(zip(sources, targets, strict=True)):
        number = first_number + i
        if max_tgt is not None and len(tgt) > max_tgt:
            raise UserValueError(
                f"target {number} has {len(tgt)} tokens, more than the model accepts "
                f"(max_positions - 1 = {max_tgt}); it cannot be scored"
            )
        truncated = len(src) > max_src
        if truncated:
            logger.warning(
                "source %d has %d tokens, more than the model accepts (max_positions - 1 = "
                "%d); scoring with only its first %d tokens",
                number,
                len(src),
                max_src,
                max_src,
            )
            src = src[:max_src]
        prepared.append(_Pair(i, list(src), list(tgt), truncated))
    return prepared


def _width(pair: _Pair) -> int:
    return max(len(pair.src), len(pair.tgt)) + 1  # + EOS, or + BOS


@torch.inference_mode()
def _score_batch(models: list[Transformer], batch: list[_Pair]) -> list[float]:
    """Summed log-probability of each pair's labels (target + EOS), (B,) as floats."""
    device = next(models[0].parameters()).device
    padded = collate([(p.src, p.tgt) for p in batch]).to(device)
    labels = padded.tgt_out  # (B, T)
    per_model = []
    for model in models:
        was_training = model.training
        model.eval()
        try:
            logits = model(padded.src, padded.tgt_in)  # (B, T, V)
        finally:
            model.train(was_training)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        per_model.append(log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1))  # (B, T)
    token_log_probs = torch.stack(per_model)  # (N, B, T)
    if len(models) > 1:  # the log of the mean of the models' probabilities
        token_log_probs = token_log_probs.logsumexp(dim=0, keepdim=True) - math.log(len(models))
    token_log_probs = token_log_probs[0].masked_fill(labels.eq(PAD_ID), 0.0)
    return token_log_probs.double().sum(dim=1).tolist()
