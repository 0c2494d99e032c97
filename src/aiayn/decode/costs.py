"""What decoding costs: the padded batch of a token budget, and the price of a request.

The unit of a decoding batch budget (``Translator(max_tokens=...)``) is padded source tokens ×
decoder rows per sentence (``DecodingOptions.rows_per_sentence``: the beam size, or the
samples): a batch of n sentences whose longest source has S ids (EOS included) costs n × S ×
rows. Scoring counts padded tokens of the longer side of each pair the same way.
`padded_batches` is the one cut by that unit, for translating and for scoring.

`DecodingCosts` prices sentences before they are decoded, under the rules of
`aiayn.decode.sources` (blank sentences cost nothing, long ones count as truncated, the output
limit as the search applies it): per sentence S × rows, the unit of ``max_tokens``, or with an
output-length limit S × T × rows, a bound on the work of its search whatever the model
prefers, the unit of the server's budgets (`aiayn.serve`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TypeVar

from aiayn.decode.options import DecodingOptions
from aiayn.decode.sources import SourceLimits, prepare_sources
from aiayn.text.tokenizer import SplitTokenizer, Tokenizer

__all__ = ["DecodingCosts", "padded_batches"]

T = TypeVar("T")


def padded_batches(
    items: Sequence[T],
    width: Callable[[T], int],
    max_tokens: int,
    *,
    key: Callable[[T], Hashable] | None = None,
) -> Iterator[list[T]]:
    """``items`` longest first (by ``width``, stably), cut before a batch's padded size, its
    items × the first's (the widest's) width, would pass ``max_tokens``, or where ``key``
    changes from the batch's first item; an item alone over the budget gets a batch of its
    own."""
    batch: list[T] = []
    for item in sorted(items, key=lambda item: -width(item)):
        if batch:
            over = (len(batch) + 1) * width(batch[0]) > max_tokens
            if over or (key is not None and key(item) != key(batch[0])):
                yield batch
                batch = []
        batch.append(item)
    if batch:
        yield batch


class DecodingCosts:
    """What sentences will cost a translator to decode, computed without decoding them."""

    def __init__(self, tokenizer: Tokenizer | SplitTokenizer, limits: SourceLimits) -> None:
        """
        Args:
            tokenizer: The translator's (``Translator.tokenizer``).
            limits: What its model accepts (``Translator.source_limits``).
        """
        self.tokenizer = tokenizer
        self.limits = limits

    def search_bounds(
        self,
        sentences: Sequence[str],
        *,
        max_len_a: float = DecodingOptions.max_len_a,
        max_len_b: float = DecodingOptions.max_len_b,
    ) -> list[tuple[int, int]]:
        """(S, T) per sentence, as the search will see it: source tokens after truncation and
        the most output tokens, both with EOS; (0, 0) for a blank sentence.

        T is ``int(a * S + b)`` (at least 0) plus EOS, the rule of the search
        (:func:`aiayn.decode.options.max_output_length`), under the cap of learned positions.
        S × T bounds a sentence's attention map, and S × T × rows the work of its search.
        """
        bounds = [(0, 0)] * len(sentences)
        sources = prepare_sources(
            self.tokenizer, self.limits, sentences, max_len_a, max_len_b, warn=False
        )
        for source in sources:
            bounds[source.index] = (len(source.ids), source.max_output_positions)
        return bounds

    def costs(
        self,
        sentences: Sequence[str],
        rows_per_sentence: int,
        *,
        max_len_a: float | None = None,
        max_len_b: float | None = None,
    ) -> list[int]:
        """Each sentence's cost: source tokens the model will see (after truncation, EOS
        included) × ``rows_per_sentence``, the unit of ``max_tokens``. With ``max_len_a`` or
        ``max_len_b``, also × the most output tokens (EOS included) the search may run: the
        server's unit."""
        a = DecodingOptions.max_len_a if max_len_a is None else max_len_a
        b = DecodingOptions.max_len_b if max_len_b is None else max_len_b
        bounds = self.search_bounds(sentences, max_len_a=a, max_len_b=b)
        if max_len_a is None and max_len_b is None:
            return [rows_per_sentence * s for s, _ in bounds]
        return [rows_per_sentence * s * t for s, t in bounds]

    def cost(
        self,
        sentences: Sequence[str],
        rows_per_sentence: int,
        *,
        max_len_a: float | None = None,
        max_len_b: float | None = None,
    ) -> int:
        """The sum of :meth:`costs`: what a batch of these sentences costs."""
        return sum(
            self.costs(sentences, rows_per_sentence, max_len_a=max_len_a, max_len_b=max_len_b)
        )
