"""What a translation returns: :class:`TranslationResult` per input sentence, its n-best
:class:`TranslationHypothesis` list and, on request, its :class:`SentenceAttention` maps; and
the :class:`Hypothesis` (token ids) that a search returns before they are made into text.

Plain frozen dataclasses, shared by every backend of :class:`aiayn.decode.translator.Translator`
(PyTorch, an ensemble, ONNX Runtime, CTranslate2: :mod:`aiayn.decode.backends`) and read by the
CLI, the server's response schemas, the attention pictures and the alignments. No torch is
imported here: the CTranslate2 backend decodes without it.

Shapes: S source length (EOS included), T output length (EOS included), L layers, H heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiayn.text.tokenizer import EOS_ID

if TYPE_CHECKING:
    from torch import Tensor

    from aiayn.model import AttentionMaps
    from aiayn.text.tokenizer import SplitTokenizer, Tokenizer

__all__ = [
    "Hypothesis",
    "SentenceAttention",
    "TranslationHypothesis",
    "TranslationResult",
    "empty_result",
    "translation_result",
]


@dataclass(frozen=True)
class Hypothesis:
    """One finished output sequence, as a search (`aiayn.decode.search`) or a backend
    (`aiayn.decode.backends`) returns it, before detokenizing.

    Attributes:
        tokens: Generated token ids, without BOS and EOS.
        score: The ranking score, ``log_prob / length_penalty(len(tokens) + 1)``. Greedy search
            and sampling apply no penalty, so there it equals ``log_prob``.
        log_prob: Sum of the model's log-probabilities of the tokens and of the final EOS.
    """

    tokens: list[int]
    score: float
    log_prob: float


@dataclass(frozen=True)
class SentenceAttention:
    """The attention maps of one sentence, without padding, for pictures and alignments; a
    kind not asked for (``Transformer.forward_with_attention``'s ``kinds``) is None.

    Computed by one teacher-forced ``Transformer.forward_with_attention`` pass over the source
    and ``[BOS] + output``; because decoder self-attention is causal (§3.2.3), these are the
    probabilities incremental decoding used for the best hypothesis.

    Attributes:
        encoder: (L, H, S, S) encoder self-attention.
        decoder: (L, H, T, T) masked decoder self-attention; row t is the input position whose
            next token is output token t (row 0 is BOS).
        cross: (L, H, T, S) encoder-decoder attention.
    """

    encoder: Tensor | None
    decoder: Tensor | None
    cross: Tensor | None


@dataclass(frozen=True)
class TranslationHypothesis:
    """One entry of the n-best list.

    Attributes:
        text: Detokenized output.
        tokens: Output subword pieces, without EOS.
        token_ids: Output ids, without BOS and EOS.
        score: Ranking score: ``log_prob`` divided by the length penalty (beam search), or
            ``log_prob`` itself (greedy search and sampling).
        log_prob: Model log-probability of the tokens and the final EOS.
    """

    text: str
    tokens: list[str]
    token_ids: list[int]
    score: float
    log_prob: float


@dataclass(frozen=True)
class TranslationResult:
    """The translation of one input sentence; ``text``, ``score``, ... are the best hypothesis'.

    Attributes:
        text: Detokenized best output ("" for a blank input).
        tokens: Its subword pieces, without EOS.
        token_ids: Its ids, without BOS and EOS.
        score: Its ranking score (see :class:`TranslationHypothesis`); 0 for a blank input.
        log_prob: Its log-probability; 0 for a blank input.
        hypotheses: The n-best list, best first; ``hypotheses[0]`` is the best. A blank input
            has a single empty hypothesis.
        src_tokens: Source pieces fed to the model, ``</s>`` included (after truncation).
        tgt_tokens: Output pieces, ``</s>`` included: the labels of ``attention``'s rows.
        attention: (T, S) encoder-decoder attention of the last decoder layer averaged over
            heads, for the best hypothesis; only with ``return_attention=True``.
        attention_maps: Every layer's and head's maps; only with ``return_attention=True``.
        truncated: The source was longer than the model accepts and was cut.
    """

    text: str
    tokens: list[str]
    token_ids: list[int]
    score: float
    log_prob: float
    hypotheses: list[TranslationHypothesis]
    src_tokens: list[str] = field(default_factory=list)
    tgt_tokens: list[str] = field(default_factory=list)
    attention: Tensor | None = None
    attention_maps: SentenceAttention | None = None
    truncated: bool = False


def empty_result() -> TranslationResult:
    """The result of a blank input: an empty text and one empty hypothesis."""
    empty = TranslationHypothesis(text="", tokens=[], token_ids=[], score=0.0, log_prob=0.0)
    return TranslationResult(
        text="", tokens=[], token_ids=[], score=0.0, log_prob=0.0, hypotheses=[empty]
    )


def translation_result(
    tokenizer: Tokenizer | SplitTokenizer,
    source_ids: Sequence[int],
    hyps: Sequence[Hypothesis],
    maps: SentenceAttention | None = None,
    *,
    truncated: bool = False,
) -> TranslationResult:
    """The result of one sentence: its n-best `hyps` (best first) decoded to text and pieces;
    `source_ids` are the ids the model read (EOS included)."""
    candidates = [
        TranslationHypothesis(
            text=tokenizer.decode(h.tokens),
            tokens=tokenizer.pieces(h.tokens),
            token_ids=list(h.tokens),
            score=h.score,
            log_prob=h.log_prob,
        )
        for h in hyps
    ]
    best = candidates[0]
    return TranslationResult(
        text=best.text,
        tokens=best.tokens,
        token_ids=best.token_ids,
        score=best.score,
        log_prob=best.log_prob,
        hypotheses=candidates,
        src_tokens=tokenizer.pieces(source_ids),
        tgt_tokens=tokenizer.pieces([*best.token_ids, EOS_ID]),
        attention=None if maps is None or maps.cross is None else maps.cross[-1].mean(dim=0),
        attention_maps=maps,
        truncated=truncated,
    )


def cut_attention(
    maps: AttentionMaps, source_lengths: Sequence[int], output_lengths: Sequence[int]
) -> list[SentenceAttention]:
    """Each sentence's maps out of a batch's (L, B, H, ·, ·) ones, padding cut away; lengths
    as the model read them (sources with EOS, outputs with the leading BOS). A kind the batch
    has no maps of is None in every sentence."""
    encoder, decoder, cross = (
        None if m is None else m.float().cpu() for m in (maps.encoder, maps.decoder, maps.cross)
    )
    return [
        SentenceAttention(
            encoder=None if encoder is None else encoder[:, row, :, :s, :s],  # (L, H, S, S)
            decoder=None if decoder is None else decoder[:, row, :, :t, :t],  # (L, H, T, T)
            cross=None if cross is None else cross[:, row, :, :t, :s],  # (L, H, T, S)
        )
        for row, (s, t) in enumerate(zip(source_lengths, output_lengths, strict=True))
    ]
