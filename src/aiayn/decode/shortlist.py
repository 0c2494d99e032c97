"""A lexical shortlist: for each source piece, the target pieces a translation of it is likely to
use, so that decoding scores only those (Marian's ``--shortlist``, CTranslate2's vocabulary
map).

What it holds. For every source id seen in the training data, its ``per_source`` best target ids
by the Dice coefficient of sentence-level co-occurrence, ``2·c(s, t) / (c(s) + c(t))``, where
c counts the sentence pairs in which a piece occurs (Dice ranks a source piece's specific
translations above the target pieces that occur everywhere, which co-occurrence counts alone, or
p(t | s) estimated from them, would put first); and the ``frequent`` most frequent target ids,
with EOS and UNK, allowed for every sentence. Ties are broken by the smaller id: the same data
always give the same shortlist.

How it is used. A batch may generate the union of its source ids' lists and the always-allowed
ids (`Shortlist.allowed`); aiayn's search projects onto those alone and renormalises over them
(`aiayn.decode.restricted`), CTranslate2 reads the same lists as its ``vmap.txt``
(``aiayn export --to ctranslate2``).

Where it lives. A model directory's ``shortlist.safetensors``: CSR-style arrays (``offsets``,
``targets``, ``always``) and the settings as the file's metadata, written by ``aiayn train`` at
the end of training and by ``aiayn shortlist`` for an existing model. This module imports no
torch: building one and exporting it need none.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

from aiayn.errors import CorruptCheckpointError, UserValueError
from aiayn.model_dir import CHECKSUMS_FILE, add_files
from aiayn.text.tokenizer import EOS_ID, UNK_ID, SplitTokenizer, Tokenizer

__all__ = [
    "DEFAULT_FREQUENT",
    "DEFAULT_PER_SOURCE",
    "SHORTLIST_FILE",
    "Shortlist",
    "build_shortlist",
    "build_shortlist_from_text",
    "model_shortlist",
    "read_shortlist",
    "write_shortlist",
]

logger = logging.getLogger(__name__)

SHORTLIST_FILE = "shortlist.safetensors"
"""The shortlist's name in a model directory."""
DEFAULT_PER_SOURCE = 50
"""Target ids kept per source id (Marian's usual ``--shortlist lex.s2t 100 50``: 50 per word)."""
DEFAULT_FREQUENT = 100
"""Most frequent target ids allowed for every sentence (Marian's usual 100)."""

_FORMAT = "aiayn-shortlist"
_VERSION = "1"
_CHUNK_PAIRS = 4_000_000  # co-occurrence pairs counted at once: about 100 MB of work arrays


@dataclass(frozen=True, eq=False)
class Shortlist:
    """Per source id, the target ids its translations may use; and the ids always allowed.

    Attributes:
        offsets: (src_vocab_size + 1,) int64: source id s's targets are
            ``targets[offsets[s]:offsets[s + 1]]``, best first.
        targets: int32 target ids.
        always: Sorted int32 target ids allowed for every sentence: the most frequent, EOS and
            UNK.
        tgt_vocab_size: The model's target vocabulary size.
        per_source: The most target ids kept per source id when it was built.
        frequent: The most frequent target ids it allows everywhere.
    """

    offsets: np.ndarray
    targets: np.ndarray
    always: np.ndarray
    tgt_vocab_size: int
    per_source: int
    frequent: int

    @property
    def src_vocab_size(self) -> int:
        return len(self.offsets) - 1

    def targets_of(self, source_id: int) -> np.ndarray:
        """The target ids kept for one source id, best first (none for an id never seen)."""
        if not 0 <= source_id < self.src_vocab_size:
            return self.targets[:0]
        return self.targets[self.offsets[source_id] : self.offsets[source_id + 1]]

    def allowed(self, sources: Iterable[Sequence[int]]) -> np.ndarray:
        """The sorted int64 target ids a batch of sources (id lists) may generate: the union of
        every source id's targets and the always-allowed ids. Ids outside the source vocabulary
        add nothing."""
        arrays = [np.asarray(s, dtype=np.int64).ravel() for s in sources]
        ids = np.unique(np.concatenate(arrays)) if arrays else np.zeros(0, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.src_vocab_size)]
        starts, ends = self.offsets[ids], self.offsets[ids + 1]
        picked = self.targets[_ranges(starts, ends)]
        return np.union1d(self.always, picked).astype(np.int64)

    def to_bytes(self) -> bytes:
        """The shortlist as the bytes of a safetensors file (`read_shortlist` reads them)."""
        arrays = {
            "offsets": np.ascontiguousarray(self.offsets, dtype=np.int64),
            "targets": np.ascontiguousarray(self.targets, dtype=np.int32),
            "always": np.ascontiguousarray(self.always, dtype=np.int32),
        }
        metadata = {
            "format": _FORMAT,
            "version": _VERSION,
            "score": "dice",
            "tgt_vocab_size": str(self.tgt_vocab_size),
            "per_source": str(self.per_source),
            "frequent": str(self.frequent),
        }
        return _sorted_header(save_arrays(arrays, metadata=metadata))

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "shortlist") -> Shortlist:
        """A shortlist from `to_bytes`'s bytes, checked (`where` names it in errors).

        Raises:
            CorruptCheckpointError: Not a shortlist, or inconsistent arrays.
        """
        try:
            arrays = load_arrays(data)
            metadata = _metadata(data)
        except (SafetensorError, ValueError) as error:
            raise CorruptCheckpointError(f"{where} is not a shortlist: {error}") from None
        if metadata.get("format") != _FORMAT or metadata.get("version") != _VERSION:
            raise CorruptCheckpointError(
                f"{where} is not a version-{_VERSION} aiayn shortlist (metadata {metadata})"
            )
        try:
            shortlist = cls(
                offsets=arrays["offsets"],
                targets=arrays["targets"],
                always=arrays["always"],
                tgt_vocab_size=int(metadata["tgt_vocab_size"]),
                per_source=int(metadata["per_source"]),
                frequent=int(metadata["frequent"]),
            )
        except (KeyError, ValueError) as error:
            raise CorruptCheckpointError(f"{where} is incomplete: {error}") from None
        if problem := shortlist._problem():
            raise CorruptCheckpointError(f"{where} is corrupt: {problem}")
        return shortlist

    def _problem(self) -> str | None:
        offsets, targets, always = self.offsets, self.targets, self.always
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
            return "offsets must start at 0"
        if np.any(np.diff(offsets) < 0) or offsets[-1] != len(targets):
            return "offsets must rise to the number of targets"
        for name, ids in (("targets", targets), ("always", always)):
            if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.tgt_vocab_size)):
                return f"{name} must be ids below {self.tgt_vocab_size}"
        if EOS_ID not in always:
            return "EOS must always be allowed"
        return None


def _metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors file's bytes (its header's ``__metadata__``)."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return header.get("__metadata__", {}) or {}


def _sorted_header(data: bytes) -> bytes:
    """A safetensors file's bytes with its header's keys in sorted order: safetensors writes
    them in a Rust HashMap's order, random per call (`aiayn.model_dir._sort_header_metadata`
    does the same to a file), and the same shortlist must be the same bytes. The header keeps
    its length (the same compact JSON, padded), so every array keeps its offset."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    if len(text) > length:  # never: the same JSON
        return data
    return data[:8] + text.ljust(length) + data[8 + length :]


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(starts[i], ends[i])`` over i, without a Python loop."""
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    begins = np.cumsum(lengths) - lengths  # where each range begins in the result
    return np.repeat(starts - begins, lengths) + np.arange(total)


def read_shortlist(path: str | Path, *, tgt_vocab_size: int | None = None) -> Shortlist:
    """A shortlist file, checked, and checked against the model's target vocabulary size.

    Raises:
        CorruptCheckpointError: Not a shortlist, or one of another vocabulary.
    """
    path = Path(path)
    shortlist = Shortlist.from_bytes(path.read_bytes(), where=str(path))
    if tgt_vocab_size is not None and shortlist.tgt_vocab_size != tgt_vocab_size:
        raise CorruptCheckpointError(
            f"{path} is for a target vocabulary of {shortlist.tgt_vocab_size} pieces, the "
            f"model's has {tgt_vocab_size}: make it again (aiayn shortlist)"
        )
    return shortlist


def model_shortlist(directory: str | Path, tgt_vocab_size: int) -> Shortlist | None:
    """A model directory's shortlist, or None where it has none.

    `aiayn.model_dir.load_model_dir` has checked it against checksums.json already; a
    shortlist.safetensors that checksums.json does not list (copied in by hand) is not the
    model's, and is left unread with a warning.

    Raises:
        CorruptCheckpointError: The shortlist is not one, or is another vocabulary's.
    """
    directory = Path(directory)
    path = directory / SHORTLIST_FILE
    if not path.is_file():
        return None
    try:
        listed = SHORTLIST_FILE in json.loads((directory / CHECKSUMS_FILE).read_text())
    except (OSError, ValueError, TypeError):
        listed = False
    if not listed:
        logger.warning(
            "%s is not in %s: not the model's, left unread (aiayn shortlist writes one)",
            path,
            CHECKSUMS_FILE,
        )
        return None
    return read_shortlist(path, tgt_vocab_size=tgt_vocab_size)


def write_shortlist(directory: str | Path, shortlist: Shortlist) -> None:
    """Add `shortlist` to a model directory (replacing any), atomically with its checksum
    (`aiayn.model_dir.add_files`)."""
    add_files(Path(directory), {SHORTLIST_FILE: shortlist.to_bytes()})


# -- building ---------------------------------------------------------------------------------


def build_shortlist(
    pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
    *,
    src_vocab_size: int,
    tgt_vocab_size: int,
    per_source: int = DEFAULT_PER_SOURCE,
    frequent: int = DEFAULT_FREQUENT,
) -> Shortlist:
    """The shortlist of a parallel corpus of token ids (without BOS and EOS).

    Counts, for every (source id, target id), the sentence pairs that hold both (each pair
    counted once per sentence pair, however often its pieces repeat), and keeps per source id
    its ``per_source`` best targets by Dice (see the module docstring). Vectorised with NumPy,
    a bounded number of pairs at a time: 30,000 sentence pairs take a few seconds.

    Raises:
        UserValueError: A setting out of range, or an id outside the vocabulary.
    """
    if per_source < 1:
        raise UserValueError(f"per_source ({per_source}) must be at least 1")
    if frequent < 0:
        raise UserValueError(f"frequent ({frequent}) must be at least 0")
    counts = _Counts(src_vocab_size, tgt_vocab_size)
    chunk: list[tuple[np.ndarray, np.ndarray]] = []
    pending = 0
    for src, tgt in pairs:
        chunk.append((np.asarray(src, np.int64), np.asarray(tgt, np.int64)))
        pending += len(chunk[-1][0]) * len(chunk[-1][1])  # at most this many pairs
        if pending >= _CHUNK_PAIRS:
            counts.add(chunk)
            chunk, pending = [], 0
    counts.add(chunk)
    return counts.shortlist(per_source, frequent)


def build_shortlist_from_text(
    pairs: Iterable[tuple[str, str]],
    tokenizer: Tokenizer | SplitTokenizer,
    *,
    src_vocab_size: int,
    tgt_vocab_size: int,
    per_source: int = DEFAULT_PER_SOURCE,
    frequent: int = DEFAULT_FREQUENT,
) -> Shortlist:
    """`build_shortlist` of (source, target) sentences, tokenised by the model's tokenizer
    10,000 pairs at a time."""

    def ids() -> Iterable[tuple[list[int], list[int]]]:
        chunk: list[tuple[str, str]] = []
        for pair in pairs:
            chunk.append(pair)
            if len(chunk) == 10_000:
                yield from _encoded(chunk)
                chunk = []
        yield from _encoded(chunk)

    def _encoded(chunk: list[tuple[str, str]]) -> Iterable[tuple[list[int], list[int]]]:
        if not chunk:
            return []
        src = tokenizer.encode_batch([s for s, _ in chunk])
        tgt = tokenizer.encode_target_batch([t for _, t in chunk])
        return zip(src, tgt, strict=True)

    return build_shortlist(
        ids(),
        src_vocab_size=src_vocab_size,
        tgt_vocab_size=tgt_vocab_size,
        per_source=per_source,
        frequent=frequent,
    )


class _Counts:
    """Co-occurrence counts of (source id, target id) pairs, counted a chunk of sentence pairs
    at a time and merged as they grow (each merge at least doubles what is merged: the cost of
    merging stays within a few times that of the last merge)."""

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int) -> None:
        self.v_s, self.v_t = src_vocab_size, tgt_vocab_size
        self.keys = np.zeros(0, dtype=np.int64)  # s * V_t + t, sorted, distinct
        self.pair_counts = np.zeros(0, dtype=np.int64)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # chunks' keys and counts
        self.src_sentences = np.zeros(src_vocab_size, dtype=np.int64)  # c(s)
        self.tgt_sentences = np.zeros(tgt_vocab_size, dtype=np.int64)  # c(t)
        self.tgt_tokens = np.zeros(tgt_vocab_size, dtype=np.int64)  # occurrences of t

    def add(self, chunk: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Count a chunk of sentence pairs (source ids, target ids)."""
        if not chunk:
            return
        src, n_src = self._distinct([s for s, _ in chunk], self.v_s, "source")
        tgt, n_tgt = self._distinct([t for _, t in chunk], self.v_t, "target")
        self.tgt_tokens += np.bincount(np.concatenate([t for _, t in chunk]), minlength=self.v_t)
        self.src_sentences += np.bincount(src, minlength=self.v_s)
        self.tgt_sentences += np.bincount(tgt, minlength=self.v_t)
        # Every source id of a sentence with every target id of it: the source id repeated
        # n_tgt times, beside the sentence's targets.
        per_src = np.repeat(n_tgt, n_src)  # targets each source id meets
        tgt_start = np.cumsum(n_tgt) - n_tgt  # where each sentence's targets begin
        starts = np.repeat(tgt_start, n_src)
        pairs = src.repeat(per_src) * self.v_t + tgt[_ranges(starts, starts + per_src)]
        pairs.sort()
        self.pending.append(_runs(pairs, np.ones_like(pairs)))
        if sum(len(k) for k, _ in self.pending) > max(len(self.keys), _CHUNK_PAIRS):
            self._merge()

    def _distinct(
        self, rows: list[np.ndarray], size: int, side: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's distinct ids, row after row, and how many each row has."""
        ids = np.concatenate(rows)
        if ids.size and (ids.min() < 0 or ids.max() >= size):
            bad = int(ids.max() if ids.max() >= size else ids.min())
            raise UserValueError(f"a {side} id ({bad}) is outside the vocabulary of {size} pieces")
        row = np.repeat(np.arange(len(rows), dtype=np.int64), [len(r) for r in rows])
        keys = np.unique(row * size + ids)
        return keys % size, np.bincount(keys // size, minlength=len(rows))

    def _merge(self) -> None:
        keys = np.concatenate([self.keys, *(k for k, _ in self.pending)])
        counts = np.concatenate([self.pair_counts, *(c for _, c in self.pending)])
        order = keys.argsort()
        self.keys, self.pair_counts = _runs(keys[order], counts[order])
        self.pending = []

    def shortlist(self, per_source: int, frequent: int) -> Shortlist:
        self._merge()
        src, tgt = self.keys // self.v_t, self.keys % self.v_t
        c = self.pair_counts
        dice = 2 * c / (self.src_sentences[src] + self.tgt_sentences[tgt])
        # By source, best first; the pairs come sorted by (source, target), so the two stable
        # sorts leave equal scores in the order of their ids.
        order = np.argsort(-dice, kind="stable")
        order = order[np.argsort(src[order], kind="stable")]
        src, tgt = src[order], tgt[order]
        group_start = np.searchsorted(src, src, side="left")
        keep = np.arange(len(src)) - group_start < per_source
        src, tgt = src[keep], tgt[keep]
        offsets = np.zeros(self.v_s + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(np.bincount(src, minlength=self.v_s))
        seen = np.flatnonzero(self.tgt_tokens)
        by_frequency = seen[np.lexsort((seen, -self.tgt_tokens[seen]))][:frequent]
        specials = [i for i in (EOS_ID, UNK_ID) if i < self.v_t]
        always = np.union1d(by_frequency, specials).astype(np.int32)
        logger.debug(
            "shortlist: %d source ids, %d targets, %d always allowed",
            int(np.count_nonzero(np.diff(offsets))),
            len(tgt),
            len(always),
        )
        return Shortlist(
            offsets=offsets,
            targets=tgt.astype(np.int32),
            always=always,
            tgt_vocab_size=self.v_t,
            per_source=per_source,
            frequent=frequent,
        )


def _runs(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted `keys` with their `counts` → each distinct key once, with its counts summed."""
    if keys.size == 0:
        return keys, counts
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    return keys[starts], np.add.reduceat(counts, starts)
