"""Sentences as a model decodes them: ids + EOS, cut to what the model accepts, each with its
output-length limit.

The one home of these rules, so that what the translator decodes (`Translator.translate`) and
what it is said to cost beforehand (`aiayn.decode.costs`) cannot drift apart:

- Each sentence is stripped and encoded with the tokenizer and followed by EOS, exactly as
  training presents sources (``aiayn.text.batching.collate``); a blank one is no source.
- A source longer than the model can take, ``max_positions − 1`` subword tokens (plus EOS),
  keeps only its first ``max_positions − 1`` tokens (a logged warning names it).
- The output may run to ``int(a * S + b)`` tokens before EOS (`max_output_length`); with
  learned positional embeddings, which cannot extend past ``max_positions``, at most
  ``max_positions − 1`` (the decoder then sees BOS + max_positions − 1 tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aiayn.config import ModelConfig
from aiayn.decode.options import max_output_length
from aiayn.text.tokenizer import EOS_ID, SplitTokenizer, Tokenizer, stripped

logger = logging.getLogger(__name__)

__all__ = ["Source", "SourceLimits", "prepare_sources"]


@dataclass(frozen=True)
class Source:
    """One non-blank input sentence, ready for the model.

    Attributes:
        index: Its position in the input.
        ids: Source ids + EOS (S of them).
        max_len_a, max_len_b: Its output-length limit (`SourceLimits.length_limit`).
        truncated: The sentence was cut to what the model accepts.
    """

    index: int
    ids: list[int]
    max_len_a: float
    max_len_b: float
    truncated: bool

    @property
    def max_output_positions(self) -> int:
        """T: the most output tokens the search may run to, EOS included."""
        return max_output_length(len(self.ids), self.max_len_a, self.max_len_b) + 1


@dataclass(frozen=True)
class SourceLimits:
    """What a model (or every model of an ensemble) accepts.

    Attributes:
        max_source_tokens: Longest source in subword tokens before EOS: max_positions − 1
            (the smallest of an ensemble's).
        max_output_tokens: With learned positions, the most output tokens before EOS
            (max_positions − 1, the smallest of those models'); None where the sinusoids
            extend as far as needed.
    """

    max_source_tokens: int
    max_output_tokens: int | None

    @classmethod
    def of(cls, configs: Iterable[ModelConfig]) -> SourceLimits:
        configs = list(configs)
        learned = [c.max_positions for c in configs if c.positional_encoding == "learned"]
        return cls(min(c.max_positions for c in configs) - 1, min(learned) - 1 if learned else None)

    def length_limit(self, src_len: int, a: float, b: float) -> tuple[float, float]:
        """(max_len_a, max_len_b) for a source of ``src_len`` ids (EOS included): the caller's,
        or a hard cap of `max_output_tokens` where they would go further."""
        cap = self.max_output_tokens
        if cap is None or max_output_length(src_len, a, b) <= cap:
            return a, b
        return 0.0, float(cap)


def prepare_sources(
    tokenizer: Tokenizer | SplitTokenizer,
    limits: SourceLimits,
    sentences: Sequence[str],
    max_len_a: float,
    max_len_b: float,
    *,
    first_number: int = 1,
    warn: bool = True,
) -> list[Source]:
    """The non-blank sentences as sources, in input order: encoded, + EOS, cut to
    ``limits.max_source_tokens`` (with a warning naming each cut one, counted from
    ``first_number``, unless not ``warn``), each with its output-length limit."""
    texts = [stripped(s) for s in sentences]
    indices = [i for i, text in enumerate(texts) if text]
    encoded = tokenizer.encode_batch([texts[i] for i in indices])
    limit = limits.max_source_tokens
    sources = []
    for i, ids in zip(indices, encoded, strict=True):
        truncated = len(ids) > limit
        if truncated:
            if warn:
                logger.warning(
                    "sentence %d has %d tokens, more than the model accepts "
                    "(max_positions - 1 = %d); translating only its first %d tokens",
                    first_number + i,
                    len(ids),
                    limit,
                    limit,
                )
            ids = ids[:limit]
        src_ids = [*ids, EOS_ID]
        a, b = limits.length_limit(len(src_ids), max_len_a, max_len_b)
        sources.append(Source(i, src_ids, a, b, truncated))
    return sources
