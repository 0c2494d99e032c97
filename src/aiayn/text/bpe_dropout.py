"""BPE-dropout: the training pairs segmented anew every epoch (not in the paper).

The paper segments its corpus once with byte-pair encoding (§5.1). BPE-dropout (Provilkov,
Emelianenko and Voita, 2020, "BPE-Dropout: Simple and Effective Subword Regularization") applies
the same merges to each word but skips every candidate merge with probability ``p`` at each
step, so a word comes out in pieces of its own BPE vocabulary that are sometimes smaller than
usual ("▁the" as "▁th" "e"). Trained on a different segmentation each epoch, a model sees each
word spelled in several ways, which regularises it where the corpus is small; translation and
validation keep the plain segmentation.

How the pairs of an epoch are made (:class:`BPEDropout`):

1. The binarised corpus (aiayn.text.corpus) is split into words: a word starts at a piece that
   begins with "▁", SentencePiece's mark of a space, or at the sentence's start. Words are
   counted once per distinct spelling (type).
2. Each type is segmented ``samples`` times with dropout, by :func:`segment`, from the merges of
   the vocabulary (a SentencePiece BPE model scores a piece by when it was merged: the higher,
   the earlier). Each type's plain segmentation is segmented again without dropout and checked
   against the cached ids: a type where the two differ (a character outside the vocabulary,
   which byte fallback spells in bytes) is never resegmented.
3. Each epoch, every occurrence of a word takes one of its type's segmentations, drawn from
   ``(seed, epoch)``; a pair that would then exceed ``max_len`` keeps its plain segmentation.

Everything is drawn from the seed with this module's own generators: the same run segments each
epoch the same way on every rank and after a resume (SentencePiece's own sampling,
``enable_sampling``, draws from a generator that its seed does not make reproducible from one
process to the next).

Shapes: ``N`` pairs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aiayn.text.corpus import DataError, ParallelDataset

logger = logging.getLogger(__name__)

WORD_MARK = "▁"  # SentencePiece's mark of a space, at the start of a word's first piece

# Where more than this share of the words differ from their cached segmentation when segmented
# again without dropout, the vocabulary is not a BPE model this module can read (a unigram one).
_MAX_UNREPRODUCED = 0.05


@dataclass(frozen=True)
class Merges:
    """What BPE needs of a vocabulary: each piece's id and score, and the pieces that start a
    word.

    Attributes:
        ids: Piece string → id, for the pieces BPE produces (normal pieces, not the special
            ones or the byte pieces).
        scores: Piece string → score; BPE merges the adjacent pair whose concatenation scores
            highest first.
        starts_word: ``(V,)`` bool, whether id ``i``'s piece starts with "▁".
        pieces: Id → piece string, for every id.
    """

    ids: dict[str, int]
    scores: dict[str, float]
    starts_word: np.ndarray
    pieces: list[str]

    @classmethod
    def of(cls, pieces: Sequence[str], scores: Sequence[float], normal: Sequence[bool]) -> Merges:
        """From each id's piece, score and whether it is a normal piece."""
        kept = [i for i in range(len(pieces)) if normal[i]]
        return cls(
            ids={pieces[i]: i for i in kept},
            scores={pieces[i]: float(scores[i]) for i in kept},
            starts_word=np.array([p.startswith(WORD_MARK) for p in pieces], dtype=bool),
            pieces=list(pieces),
        )


def segment(word: str, merges: Merges, dropout: float, rng: random.Random) -> list[int] | None:
    """The ids of ``word`` after BPE with dropout, or None where a character of it is not a piece.

    Starts from the characters and merges, again and again, the adjacent pair whose
    concatenation is the highest-scoring piece (the leftmost of equals), as SentencePiece's BPE
    does; with ``dropout`` > 0 each candidate pair is left out of that choice with that
    probability, drawn anew at every merge (Provilkov et al., 2020). It ends when no candidate
    is left: with ``dropout`` 0, the plain segmentation.
    """
    symbols = list(word)
    scores = merges.scores
    while len(symbols) > 1:
        best, best_score = -1, 0.0
        for i in range(len(symbols) - 1):
            score = scores.get(symbols[i] + symbols[i + 1])
            if score is None or (dropout and rng.random() < dropout):
                continue
            if best < 0 or score > best_score:
                best, best_score = i, score
        if best < 0:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    ids = [merges.ids.get(s) for s in symbols]
    return None if None in ids else ids  # type: ignore[return-value]


@dataclass(frozen=True)
class _Side:
    """One side of the corpus as words: its types, their segmentations, each pair's words.

    Attributes:
        occurrences: ``(W,)`` the type of each word of the side, pair after pair.
        pair_of: ``(W,)`` the pair each word belongs to.
        starts: ``(types, samples + 1)`` where each segmentation begins in ``store``; column 0
            is the plain one.
        lengths: ``(types, samples + 1)`` its number of pieces.
        store: Every segmentation's ids, one after the other.
    """

    occurrences: np.ndarray
    pair_of: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    store: np.ndarray


class EpochPairs:
    """The training pairs of one epoch, as `ParallelDataset` offers them: the lengths that
    batching reads and ``(src_ids, tgt_ids)`` per index."""

    def __init__(
        self, tokens: tuple[np.ndarray, np.ndarray], offsets: tuple[np.ndarray, np.ndarray]
    ) -> None:
        self._tokens, self._offsets = tokens, offsets
        self.src_lengths = np.diff(offsets[0])
        self.tgt_lengths = np.diff(offsets[1])

    def __len__(self) -> int:
        return len(self.src_lengths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} pairs")
        (src, tgt), (src_at, tgt_at) = self._tokens, self._offsets
        return src[src_at[i] : src_at[i + 1]], tgt[tgt_at[i] : tgt_at[i + 1]]


class BPEDropout:
    """Each epoch's segmentation of a binarised corpus under BPE-dropout (the module's steps).

    Attributes:
        dropout: The probability of skipping a merge.
        samples: Segmentations made per distinct word.
        resegmented: The share of the corpus's words that BPE-dropout segments in more than
            one way.
    """

    def __init__(
        self,
        data: ParallelDataset,
        merges: Merges,
        *,
        dropout: float,
        seed: int,
        max_len: int,
        samples: int = 8,
    ) -> None:
        """Splits ``data`` into words and segments every type ``samples`` times.

        Raises:
            DataError: The vocabulary's segmentation cannot be reproduced (not a BPE model).
        """
        if not 0.0 < dropout < 1.0:
            raise DataError(f"BPE-dropout ({dropout}) must be in (0, 1)")
        self.dropout, self.samples, self.seed, self.max_len = dropout, samples, seed, max_len
        self._plain = data
        types = _Types(merges, dropout, samples, random.Random(f"bpe-dropout {seed}"))
        sides = [_words(*data.flat(side), merges, types) for side in ("src", "tgt")]
        if types.unreproduced > _MAX_UNREPRODUCED * len(types.segmentations):
            raise DataError(
                f"bpe_dropout: {types.unreproduced} of {len(types.segmentations)} distinct words "
                "do not come out of the vocabulary's merges as they are cached: BPE-dropout "
                "needs a BPE vocabulary (aiayn's own, or one trained with --model_type=bpe)"
            )
        table = _table(types.segmentations, samples)
        self._sides = [_Side(occurrences, pair_of, *table) for occurrences, pair_of in sides]
        varies = np.array(types.varies, dtype=bool)
        words = np.concatenate([occurrences for occurrences, _ in sides])
        self.resegmented = float(varies[words].mean()) if len(words) else 0.0

    def epoch(self, epoch: int) -> EpochPairs:
        """The pairs of ``epoch``: every word in one of its type's segmentations, drawn from
        ``(seed, epoch)``; a pair longer than ``max_len`` on either side keeps its plain one."""
        rng = np.random.default_rng([self.seed, epoch, 0xB9E])
        n_pairs = len(self._plain)
        draws = [rng.integers(1, self.samples + 1, len(s.occurrences)) for s in self._sides]
        lengths = [_pair_lengths(s, d, n_pairs) for s, d in zip(self._sides, draws, strict=True)]
        too_long = (lengths[0] > self.max_len) | (lengths[1] > self.max_len)
        tokens, offsets = [], []
        for side, draw in zip(self._sides, draws, strict=True):
            draw[too_long[side.pair_of]] = 0
            ids, at = _assemble(side, draw, n_pairs)
            tokens.append(ids)
            offsets.append(at)
        return EpochPairs((tokens[0], tokens[1]), (offsets[0], offsets[1]))


class _Types:
    """The distinct words met so far, numbered as they come, each with its segmentations: the
    plain one, then `samples` with dropout (all plain where BPE does not reproduce the cached
    one, counted in `unreproduced`)."""

    def __init__(self, merges: Merges, dropout: float, samples: int, rng: random.Random) -> None:
        self.merges, self.dropout, self.samples, self.rng = merges, dropout, samples, rng
        self.numbers: dict[bytes, int] = {}
        self.segmentations: list[list[list[int]]] = []
        self.varies: list[bool] = []
        self.unreproduced = 0

    def number(self, key: bytes, plain: np.ndarray) -> int:
        """The type of the word whose cached ids are ``plain`` (``key`` their bytes)."""
        t = self.numbers.get(key)
        if t is None:
            t = self.numbers[key] = len(self.segmentations)
            segmentations = self._segment(plain.tolist())
            self.segmentations.append(segmentations)
            self.varies.append(any(s != segmentations[0] for s in segmentations))
        return t

    def _segment(self, plain: list[int]) -> list[list[int]]:
        merges, rng = self.merges, self.rng
        word = "".join(merges.pieces[i] for i in plain)
        if len(word) < 2:
            return [plain] * (self.samples + 1)
        if segment(word, merges, 0.0, rng) != plain:
            self.unreproduced += 1
            return [plain] * (self.samples + 1)
        drawn = [segment(word, merges, self.dropout, rng) for _ in range(self.samples)]
        return [plain, *(d if d is not None else plain for d in drawn)]


def _words(
    tokens: np.ndarray, offsets: np.ndarray, merges: Merges, types: _Types
) -> tuple[np.ndarray, np.ndarray]:
    """One side's words as type numbers, and the pair of each."""
    tokens = np.asarray(tokens, dtype=np.int64)
    first = merges.starts_word[tokens]
    first[offsets[:-1][offsets[:-1] < len(tokens)]] = True  # every pair's first piece
    word_at = np.flatnonzero(first)
    word_end = np.append(word_at[1:], len(tokens))
    pair_of = np.searchsorted(offsets, word_at, side="right") - 1
    raw = tokens.astype(np.int32).tobytes()
    occurrences = np.fromiter(
        (
            types.number(raw[4 * a : 4 * b], tokens[a:b])
            for a, b in zip(word_at.tolist(), word_end.tolist(), strict=True)
        ),
        dtype=np.int64,
        count=len(word_at),
    )
    return occurrences, pair_of


def _table(
    segmentations: list[list[list[int]]], samples: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every type's segmentations as flat arrays: ``(types, samples + 1)`` starts and lengths
    into one store of ids."""
    lengths = np.array([[len(s) for s in segs] for segs in segmentations], dtype=np.int64)
    lengths = lengths.reshape(len(segmentations), samples + 1)
    starts = (np.cumsum(lengths.ravel()) - lengths.ravel()).reshape(lengths.shape)
    store = np.fromiter(
        (i for segs in segmentations for s in segs for i in s),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    return starts, lengths, store


def _pair_lengths(side: _Side, draw: np.ndarray, n_pairs: int) -> np.ndarray:
    """``(N,)`` each pair's length on this side with the drawn segmentations."""
    pieces = side.lengths[side.occurrences, draw]
    return np.bincount(side.pair_of, weights=pieces, minlength=n_pairs).astype(np.int64)


def _assemble(side: _Side, draw: np.ndarray, n_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """The side's ids with the drawn segmentations, and each pair's offsets into them."""
    begin = side.starts[side.occurrences, draw]
    count = side.lengths[side.occurrences, draw]
    total = int(count.sum())
    # Piece j of the side comes from store[begin[w] + (j - first piece of word w)].
    word_first = np.cumsum(count) - count
    index = np.arange(total) + np.repeat(begin - word_first, count)
    ids = side.store[index]
    per_pair = np.bincount(side.pair_of, weights=count, minlength=n_pairs).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(per_pair)])
    return ids, offsets
