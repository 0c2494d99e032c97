"""The options of decoding (beam search, greedy search, sampling) with the paper's defaults,
and the length penalties they name.

:class:`DecodingOptions` and the penalties are re-exported by :mod:`aiayn.decode.search`, where they
belong; they live in this module, which imports no torch, so that ``aiayn --help`` and the
commands that do not decode can build their flags from it without paying for importing torch
(most of a short command's start-up).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from aiayn.errors import UserValueError

__all__ = [
    "LENGTH_PENALTIES",
    "MAX_FINITE_LENGTH_PENALTY",
    "DecodingOptions",
    "LengthPenalty",
    "LengthPenaltyKind",
    "StoppingRule",
    "gnmt_length_penalty",
    "length_penalty_fn",
    "max_output_length",
    "no_length_penalty",
    "power_length_penalty",
]

LengthPenaltyKind = Literal["gnmt", "power", "none"]
"""The length penalties of :data:`LENGTH_PENALTIES`."""

LengthPenalty = Callable[[int, float], float]

StoppingRule = Literal["exact", "finished", "heuristic"]
"""When beam search ends a sentence (:func:`aiayn.decode.search.beam_search` says how each one
works)."""


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """``((5 + length) / 6) ** alpha`` of Wu et al. (2016, Eq. 14), used by the paper (§6.1)."""
    return ((5 + length) / 6) ** alpha


def power_length_penalty(length: int, alpha: float) -> float:
    """``length ** alpha``: what fairseq, Marian and Hugging Face call the length penalty."""
    return float(length) ** alpha


def no_length_penalty(length: int, alpha: float) -> float:
    """Rank by raw log-probability (favours short outputs)."""
    return 1.0


LENGTH_PENALTIES: dict[str, LengthPenalty] = {
    "gnmt": gnmt_length_penalty,
    "power": power_length_penalty,
    "none": no_length_penalty,
}


def length_penalty_fn(kind: str) -> LengthPenalty:
    """The length penalty named ``kind`` ("gnmt", "power" or "none")."""
    if kind not in LENGTH_PENALTIES:
        valid = ", ".join(repr(k) for k in LENGTH_PENALTIES)
        raise UserValueError(f"length_penalty_kind ({kind!r}) must be one of {valid}")
    return LENGTH_PENALTIES[kind]


MAX_FINITE_LENGTH_PENALTY = 10.0
"""Largest α `DecodingOptions` accepts: a guard of the arithmetic, not a policy. Useful values
lie in 0–2; far beyond, ``length ** α`` overflows a float (α ≈ 400 for a length of 5), and up
to 10 the penalty of a 100,000-token output stays finite. (A server allows its requests less:
``aiayn.serve.settings.SERVER_MAX_LENGTH_PENALTY``.)"""


def max_output_length(src_len: int, max_len_a: float, max_len_b: float) -> int:
    """Tokens a sentence may generate before EOS is forced: ``int(a * src_len + b)``, at
    least 0, ``src_len`` counting the source's EOS (the paper's "input length + 50", §6.1,
    with the defaults). The one home of the rule: aiayn's search, `Translator`'s bounds and
    the CTranslate2 backend all ask here."""
    return max(0, int(max_len_a * src_len + max_len_b))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode: beam search (the default), greedy search or sampling.

    The defaults are the paper's (§6.1) but one: beam size 4, maximum output length = input
    length + 50; the length penalty ranks by log-probability / |Y|^1 (fairseq's, CTranslate2's
    and Hugging Face's), not by the paper's GNMT penalty with α = 0.6, which scored lower on
    every model measured (docs/small-data.md); a sentence's search stops by the "heuristic"
    rule, and no output is empty (``min_len`` 1), which the paper does not say
    (docs/deviations.md says why for all three). Every value is checked once, here, with a
    message naming the field and the value (a `UserValueError`, hence a ``ValueError``).
    Frozen, hence hashable: requests with equal options can share a batch.

    The attribute descriptions below are also the help of ``aiayn translate``'s flags
    (``aiayn.cli.add_dataclass_flags``); they must not restate the defaults, which the
    flags' help takes from the fields.

    Attributes:
        beam_size: Hypotheses kept per sentence (W); 1 = greedy search.
        length_penalty: α of the length penalty; 0 ranks by raw log-probability.
        length_penalty_kind: gnmt: ((5 + |Y|) / 6)^α as in the paper; power: |Y|^α as in
            fairseq, Marian and Hugging Face; none: no penalty.
        max_len_a: An output may have up to int(a * source length + b) tokens before EOS,
            the source length counting its EOS.
        max_len_b: See max_len_a.
        min_len: Tokens an output has at least: EOS may not come before them (fairseq's
            --min-len, CTranslate2's min_decoding_length); 0 allows the empty output. The
            maximum length wins where it is shorter.
        n_best: Hypotheses returned per sentence, best first (at most the beam size; with
            sampling, the number of independent samples).
        stopping: When beam search ends a sentence: exact: once no live beam could beat its
            worst kept hypothesis even at the maximum length (never changes the result);
            finished: once it has beam-size finished hypotheses (fairseq, CTranslate2,
            Marian); heuristic: once no live beam could beat it if it ended at the next step
            (Hugging Face's early_stopping=False).
        sampling: Sample outputs (ancestral sampling) instead of searching; the beam size
            and the length penalty are then unused.
        temperature: Sampling temperature; log-probabilities are divided by it.
        top_k: Sample among the k most probable tokens; 0 = no limit.
        top_p: Nucleus sampling: sample among the most probable tokens holding this much
            probability, in (0, 1]; 1 = no limit.
        shortlist: Score only the target pieces the model's lexical shortlist allows each
            batch (its shortlist.safetensors, a CTranslate2 export's vmap.txt), renormalised
            over them: faster, and may change the output (docs/settings.md).
    """

    beam_size: int = 4
    length_penalty: float = 1.0
    length_penalty_kind: LengthPenaltyKind = "power"
    max_len_a: float = 1.0
    max_len_b: float = 50
    min_len: int = 1
    n_best: int = 1
    stopping: StoppingRule = "heuristic"
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    shortlist: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_size) or self.beam_size < 1:
            raise UserValueError(f"beam_size ({self.beam_size!r}) must be an integer >= 1")
        if not _is_int(self.n_best) or self.n_best < 1:
            raise UserValueError(f"n_best ({self.n_best!r}) must be an integer >= 1")
        if not self.sampling and self.n_best > self.beam_size:
            raise UserValueError(
                f"n_best ({self.n_best}) must be <= beam_size ({self.beam_size}); "
                "raise the beam size or use sampling"
            )
        alpha = self.length_penalty
        if not (_is_number(alpha) and 0 <= alpha <= MAX_FINITE_LENGTH_PENALTY):
            raise UserValueError(
                f"length_penalty ({alpha!r}) must be a number between 0 and "
                f"{MAX_FINITE_LENGTH_PENALTY}"
            )
        kinds = get_args(LengthPenaltyKind)
        if self.length_penalty_kind not in kinds:
            valid = ", ".join(repr(k) for k in kinds)
            raise UserValueError(
                f"length_penalty_kind ({self.length_penalty_kind!r}) must be one of {valid}"
            )
        rules = get_args(StoppingRule)
        if self.stopping not in rules:
            valid = ", ".join(repr(r) for r in rules)
            raise UserValueError(f"stopping ({self.stopping!r}) must be one of {valid}")
        for name in ("max_len_a", "max_len_b"):
            value = getattr(self, name)
            if not (_is_number(value) and 0 <= value < math.inf):
                raise UserValueError(f"{name} ({value!r}) must be a finite number >= 0")
        if not _is_int(self.min_len) or self.min_len < 0:
            raise UserValueError(f"min_len ({self.min_len!r}) must be an integer >= 0")
        if not isinstance(self.sampling, bool):
            raise UserValueError(f"sampling ({self.sampling!r}) must be True or False")
        if not (_is_number(self.temperature) and 0 < self.temperature < math.inf):
            raise UserValueError(
                f"temperature ({self.temperature!r}) must be a finite number > 0; "
                "use greedy search (beam_size 1) for 0"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise UserValueError(f"top_k ({self.top_k!r}) must be an integer >= 0 (0 = no limit)")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise UserValueError(f"top_p ({self.top_p!r}) must be in (0, 1] (1 = no limit)")
        if not isinstance(self.shortlist, bool):
            raise UserValueError(f"shortlist ({self.shortlist!r}) must be True or False")

    @property
    def rows_per_sentence(self) -> int:
        """Decoder rows one sentence occupies: n_best samples, or W beams (1 for greedy)."""
        return self.n_best if self.sampling else self.beam_size
