"""Hard word alignments from encoder-decoder attention, in the Pharaoh ``i-j`` format.

The Transformer was not trained to align, but its encoder-decoder attention (§3.2.3) often
puts most weight on the source piece being translated, especially in the last layer. Taking,
for each output token, the source position with the highest attention (averaged over the heads
of one layer) gives the hard alignment that fast_align and Moses write as ``srcpos-tgtpos``
pairs, 0-based, separated by spaces::

    [result] = translator.translate(["the cat sat"], return_attention=True)
    pairs = hard_alignment(result)        # [(0, 0), (1, 1), (2, 2)]
    format_alignment(pairs)               # "0-0 1-1 2-2"

Conventions:

* Positions are subword positions: ``result.src_tokens`` and ``result.tgt_tokens`` index them.
* The EOS of the source and of the output are excluded: the output's EOS gets no pair, and
  no output token is aligned to the source's EOS (the argmax runs over the real pieces only).
  So there is one pair per output token (``len(result.tokens)``), in target order.
* Row t of the encoder-decoder attention is the one computed while predicting output token t
  (its query is the decoder input at t: BOS, then the previous tokens), as fairseq's
  ``--print-alignment`` uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiayn.errors import UserValueError

if TYPE_CHECKING:  # torch too: `aiayn translate` formats its lines here without it
    from torch import Tensor

    from aiayn.decode.results import SentenceAttention, TranslationResult

__all__ = [
    "alignment_matrix",
    "attention_maps",
    "check_index",
    "format_alignment",
    "format_translation",
    "hard_alignment",
]


def check_index(index: int, count: int, name: str, of: str) -> int:
    """``index`` (negative counts from the end, as in Python) as 0..count-1.

    Raises:
        ValueError: Out of range, naming the valid choices: "layer 5 is out of range: the
            model has 2 decoder layers (valid: 0, 1, or -2, -1)".
    """
    if isinstance(index, bool) or not isinstance(index, int) or not -count <= index < count:
        valid = ", ".join(str(i) for i in range(count))
        negative = ", ".join(str(i) for i in range(-count, 0))
        raise UserValueError(
            f"{name} {index!r} is out of range: the model has {count} {of} "
            f"(valid: {valid}, or {negative})"
        )
    return index % count


def attention_maps(result: TranslationResult) -> SentenceAttention:
    """``result.attention_maps``, or a ValueError saying why there are none."""
    if result.attention_maps is None:
        if not result.src_tokens:
            raise UserValueError("the input is blank: there is no attention to show")
        raise ValueError("the result has no attention maps: translate with return_attention=True")
    return result.attention_maps


def alignment_matrix(result: TranslationResult, layer: int = -1, head: int | None = None) -> Tensor:
    """Encoder-decoder attention of one decoder layer, (T, S): averaged over heads, or one
    ``head``. Rows are ``result.tgt_tokens`` (EOS included), columns ``result.src_tokens``.

    Raises:
        ValueError: No attention maps (a blank input, or translated without
            ``return_attention=True``), or ``layer`` or ``head`` out of range (the message
            lists the valid ones).
    """
    cross = attention_maps(result).cross  # (L, H, T, S)
    layer = check_index(layer, cross.size(0), "layer", "decoder layers")
    if head is None:
        return cross[layer].mean(dim=0)
    head = check_index(head, cross.size(1), "head", "heads per layer")
    return cross[layer, head]


def hard_alignment(result: TranslationResult, layer: int = -1) -> list[tuple[int, int]]:
    """(source position, target position) pairs, 0-based, one per output token but EOS.

    Each output token is aligned to the source piece, EOS excluded, with the highest
    encoder-decoder attention of decoder layer ``layer`` (default: the last) averaged over
    heads. A blank input, or a source made of EOS alone, gives no pairs.

    Raises:
        ValueError: No attention maps (translate with ``return_attention=True``), or
            ``layer`` out of range.
    """
    if result.attention_maps is None and not result.src_tokens:
        return []  # a blank input line
    matrix = alignment_matrix(result, layer)  # (T, S)
    n_target, n_source = matrix.size(0) - 1, matrix.size(1) - 1  # without the EOS row/column
    if n_target < 1 or n_source < 1:
        return []
    best = matrix[:n_target, :n_source].argmax(dim=1)  # (T-1,)
    return [(int(src), tgt) for tgt, src in enumerate(best.tolist())]


def format_alignment(pairs: list[tuple[int, int]]) -> str:
    """Pharaoh format: ``"0-0 1-2 2-1"`` (source-target, space-separated)."""
    return " ".join(f"{src}-{tgt}" for src, tgt in pairs)


def format_translation(
    number: int, result: TranslationResult, n_best: int | None, alignment_layer: int | None = None
) -> str:
    """The output line(s) of one translation, newline-terminated, in one of three formats:

    * plain: the text on one line (line breaks in it become spaces);
    * ``n_best`` (Moses/fairseq n-best): ``"i ||| text ||| score"`` per hypothesis, best first,
      ``i`` the 0-based input line ``number`` and score the hypothesis' log-probability
      divided by the length penalty;
    * ``alignment_layer`` (a decoder layer, the result holding attention):
      ``"text<TAB>i-j i-j ..."``, the hard alignment of that layer in the Pharaoh format
      (:func:`format_alignment`); tabs in the text become spaces.
    """
    from aiayn.text.lines import one_line

    if alignment_layer is not None:
        pairs = hard_alignment(result, layer=alignment_layer)
        return f"{one_line(result.text).replace(chr(9), ' ')}\t{format_alignment(pairs)}\n"
    if n_best is None:
        return one_line(result.text) + "\n"
    return "".join(
        f"{number} ||| {one_line(h.text)} ||| {h.score:.4f}\n" for h in result.hypotheses
    )
