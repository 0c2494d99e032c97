"""Parallel text → cached binary token files → batches of roughly equal length (§5.1).

The pipeline has three stages, each usable on its own (the first two here):

1. **Reading** (:func:`read_parallel`, :func:`read_tsv`): stream sentence pairs from two aligned
   files or one tab-separated file, checking alignment and encoding up front so that a broken
   corpus fails with the file and line number instead of a misaligned model.
2. **Binarizing** (:func:`binarize`, :func:`load_or_build`): encode every pair once with the
   tokenizer, drop pairs outside the length limits, and store the ids as flat memory-mapped
   arrays. The cache is keyed on the inputs, the tokenizer and the filter settings, so a
   second run (or every rank of a distributed run) opens it instantly.
3. **Batching** lives in :mod:`aiayn.text.batching` (``make_batches``, ``shard_batches``,
   ``collate``): batches by a token budget, grouped by length (§5.1).

Shapes: ``B`` batch size, ``S`` source length, ``T`` target length. Lengths stored in the cache
and returned by :class:`ParallelDataset` exclude the EOS/BOS that ``batching.collate`` adds.

Typical use with a ``torch.utils.data.DataLoader``::

    dataset, stats = load_or_build(src, tgt, None, tokenizer, cache_root, max_len=256)
    batches = make_batches(dataset.src_lengths, dataset.tgt_lengths,
                           max_tokens=25_000, seed=0, epoch=epoch)
    batches = shard_batches(batches, rank, world_size)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from aiayn.errors import UserValueError
from aiayn.parts import part, remove, remove_dead

logger = logging.getLogger(__name__)

# Bump when the on-disk layout changes, so old caches are rebuilt rather than misread.
CACHE_FORMAT_VERSION = 1

_READ_CHUNK_BYTES = 1 << 20
_META = "meta.json"

T = TypeVar("T")


class DataError(UserValueError):
    """A corpus, cache or batching setting is unusable; the message names file, line and cause."""


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def count_lines(path: Path) -> int:
    """Counts lines the way the readers split them: on ``\\n`` bytes, like ``wc -l``.

    A last line without a trailing newline still counts. Splitting on bytes (not with Python's
    text mode, which also breaks on U+2028 and friends) keeps the count identical to the
    number of pairs :func:`read_parallel` yields.
    """
    n_lines = 0
    last = b"\n"
    with Path(path).open("rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            n_lines += chunk.count(b"\n")
            last = chunk[-1:]
    return n_lines + (last != b"\n")


def read_parallel(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    """Streams ``(source, target)`` pairs from two line-aligned files.

    Both files are counted before anything is yielded, because a single missing line shifts
    every later pair and silently teaches the model garbage. Lines are stripped of surrounding
    whitespace; empty lines are kept (the length filter in :func:`binarize` drops them).

    Raises:
        DataError: A file is missing, the line counts differ (both files and counts are
            named), or a line is not valid UTF-8 (file and 1-based line number are named).
    """
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    check_corpus_files(src_path, tgt_path)
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise DataError(
            f"parallel files are not aligned: {src_path} has {n_src} lines but "
            f"{tgt_path} has {n_tgt} lines"
        )
    return _read_parallel(src_path, tgt_path)


def _read_parallel(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    with src_path.open("rb") as src_f, tgt_path.open("rb") as tgt_f:
        for lineno, (src_raw, tgt_raw) in enumerate(zip(src_f, tgt_f, strict=True), start=1):
            yield (
                decode_line(src_raw, src_path, lineno).strip(),
                decode_line(tgt_raw, tgt_path, lineno).strip(),
            )


def read_tsv(path: Path) -> Iterator[tuple[str, str]]:
    """Streams ``(source, target)`` pairs from a file with one ``source<TAB>target`` per line.

    Each field is stripped of surrounding whitespace; an empty field is allowed (and later
    dropped by the length filter), but a line must have exactly one tab.

    Raises:
        DataError: The file is missing, a line does not have exactly two fields, or a line is
            not valid UTF-8; the message names the file and the 1-based line number.
    """
    path = Path(path)
    check_corpus_files(path)
    return _read_tsv(path)


def _read_tsv(path: Path) -> Iterator[tuple[str, str]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            fields = decode_line(raw, path, lineno).rstrip("\r\n").split("\t")
            if len(fields) != 2:
                raise DataError(
                    f"{path}:{lineno}: expected 2 tab-separated fields (source, target), "
                    f"found {len(fields)}"
                )
            yield fields[0].strip(), fields[1].strip()


def decode_line(raw: bytes, path: Path, lineno: int) -> str:
    """One line of a corpus as text, or a DataError naming the file, line and cause.

    NUL is valid UTF-8, but in a corpus it means binary data or a broken conversion, and the
    tokenizer would learn it as a character: it is refused too.
    """
    if (nul := raw.find(b"\0")) >= 0:
        raise DataError(f"{path}:{lineno}: NUL byte at byte {nul} of the line (binary data?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}:{lineno}: invalid UTF-8 at byte {err.start} of the line ({err.reason})"
        ) from err
    return text.removeprefix("\ufeff") if lineno == 1 else text


def check_corpus_files(*paths: Path) -> None:
    """Each path is a readable UTF-8 text file, as far as its first bytes tell.

    A UTF-16 file (Windows tools write them) would otherwise be reported as misaligned, since
    its newlines are two bytes wide, or as invalid UTF-8 somewhere inside.
    """
    for path in paths:
        if path.is_dir():
            raise DataError(f"data file {path} is a directory, not a file")
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
        with path.open("rb") as f:
            head = f.read(4096)
        if head.startswith((b"\xff\xfe", b"\xfe\xff")) or head.count(b"\0") > len(head) // 4:
            raise DataError(f"data file {path} looks like UTF-16; convert it to UTF-8")


# --------------------------------------------------------------------------------------------
# Binarizing and caching
# --------------------------------------------------------------------------------------------


class BatchEncoder(Protocol):
    """What :func:`binarize` needs from a tokenizer (``aiayn.text.tokenizer.Tokenizer`` fits)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def sha256(self) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


@dataclass(frozen=True)
class FilterStats:
    """How many pairs the length filter saw and why it dropped the others.

    Each dropped pair is counted once, under the first rule it breaks, in the order
    too_short, too_long, bad_ratio.
    """

    total: int
    kept: int
    too_short: int
    too_long: int
    bad_ratio: int

    def __str__(self) -> str:
        return (
            f"kept {self.kept} of {self.total} pairs (dropped: {self.too_short} too short, "
            f"{self.too_long} too long, {self.bad_ratio} bad length ratio)"
        )


def _token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the cache and the page-cache footprint for any vocabulary up to 65536."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def _check_filter_settings(max_len: int, min_len: int, max_ratio: float | None) -> None:
    if max_len < 1:
        raise DataError(f"max_len ({max_len}) must be at least 1")
    if not 0 <= min_len <= max_len:
        raise DataError(f"min_len ({min_len}) must be between 0 and max_len ({max_len})")
    if max_ratio is not None and max_ratio < 1:
        raise DataError(f"max_ratio ({max_ratio}) must be at least 1")


def _drop_reason(
    src_len: int, tgt_len: int, max_len: int, min_len: int, max_ratio: float | None
) -> str | None:
    if src_len < min_len or tgt_len < min_len:
        return "too_short"
    if src_len > max_len or tgt_len > max_len:
        return "too_long"
    if max_ratio is not None:
        longer, shorter = max(src_len, tgt_len), max(min(src_len, tgt_len), 1)
        if longer / shorter > max_ratio:
            return "bad_ratio"
    return None


def binarize(
    pairs: Iterable[tuple[str, str]],
    tokenizer: BatchEncoder,
    out_dir: Path,
    *,
    max_len: int,
    min_len: int = 1,
    max_ratio: float | None = None,
    chunk_size: int = 10_000,
    source: str = "<pairs>",
    meta: dict[str, Any] | None = None,
) -> FilterStats:
    """Encodes and filters ``pairs`` into flat token files in ``out_dir``.

    Pairs are encoded ``chunk_size`` at a time (sources with ``tokenizer.encode_batch``, targets
    with ``tokenizer.encode_target_batch``: a split tokenizer cuts them with different models)
    and appended to disk, so memory stays flat whatever the corpus size. The layout is::

        src.bin, tgt.bin              all token ids, concatenated (dtype in meta.json)
        src_offsets.npy, tgt_offsets.npy
                                      int64, n_examples + 1 entries; example i is
                                      tokens[offsets[i]:offsets[i + 1]]
        meta.json                     written last: its presence marks a complete cache

    Args:
        pairs: ``(source, target)`` text pairs, e.g. from :func:`read_parallel`.
        tokenizer: Anything with ``encode_batch``, ``encode_target_batch``, ``vocab_size`` and
            ``sha256``.
        out_dir: Directory to write into (created if needed).
        max_len: Drop pairs with more subword tokens than this on either side, not counting
            the BOS/EOS the model adds.
        min_len: Drop pairs with fewer tokens than this on either side (1 drops empty lines).
        max_ratio: Drop pairs whose longer side is more than this many times the shorter one;
            ``None`` keeps all ratios.
        chunk_size: Pairs encoded per ``encode_batch`` call.
        source: Names of the inputs, used in log and error messages.
        meta: Extra fields to record in ``meta.json`` (``load_or_build`` stores its key here).

    Returns:
        The filter counts, also stored in ``meta.json``.

    Raises:
        DataError: The settings are out of range, or no pair survives filtering (the message
            gives the counts and ``source``).
    """
    _check_filter_settings(max_len, min_len, max_ratio)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = _token_dtype(tokenizer.vocab_size)
    src_lengths, tgt_lengths = array("q"), array("q")
    dropped = {"too_short": 0, "too_long": 0, "bad_ratio": 0}
    total = 0
    started = time.perf_counter()

    with (out_dir / "src.bin").open("wb") as src_f, (out_dir / "tgt.bin").open("wb") as tgt_f:
        for chunk in _chunked(pairs, chunk_size):
            total += len(chunk)
            src_ids = tokenizer.encode_batch([src for src, _ in chunk])
            tgt_ids = tokenizer.encode_target_batch([tgt for _, tgt in chunk])
            kept_src, kept_tgt = [], []
            for src, tgt in zip(src_ids, tgt_ids, strict=True):
                reason = _drop_reason(len(src), len(tgt), max_len, min_len, max_ratio)
                if reason is not None:
                    dropped[reason] += 1
                    continue
                kept_src.append(src)
                kept_tgt.append(tgt)
                src_lengths.append(len(src))
                tgt_lengths.append(len(tgt))
            np.fromiter(itertools.chain.from_iterable(kept_src), dtype=dtype).tofile(src_f)
            np.fromiter(itertools.chain.from_iterable(kept_tgt), dtype=dtype).tofile(tgt_f)
            logger.debug("encoded %d pairs from %s", total, source)

    stats = FilterStats(total=total, kept=len(src_lengths), **dropped)
    if stats.kept == 0:
        raise DataError(
            f"the corpus {source} is empty after filtering: {stats} "
            f"(max_len={max_len}, min_len={min_len}, max_ratio={max_ratio})"
        )
    for side, lengths in (("src", src_lengths), ("tgt", tgt_lengths)):
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
        np.save(out_dir / f"{side}_offsets.npy", offsets)

    record = {
        **(meta or {}),
        "format": CACHE_FORMAT_VERSION,
        "source": source,
        "token_dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_sha256": tokenizer.sha256,
        "max_len": max_len,
        "min_len": min_len,
        "max_ratio": max_ratio,
        "stats": asdict(stats),
    }
    (out_dir / _META).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    logger.info("binarized %s in %.1fs: %s", source, time.perf_counter() - started, stats)
    return stats


def _chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


class ParallelDataset:
    """Read-only, memory-mapped token ids of a binarized corpus.

    Opening is instant and costs no memory beyond the offsets: ids are paged in from disk when
    an example is read. Pickling (as ``DataLoader`` workers do) sends only the directory, and
    each worker maps the files itself instead of receiving a copy of the corpus.

    Attributes:
        directory: The cache directory written by :func:`binarize`.
        src_lengths: ``(N,)`` int64 source lengths, without EOS.
        tgt_lengths: ``(N,)`` int64 target lengths, without BOS/EOS.
        stats: The filter counts recorded when the cache was built.
    """

    def __init__(self, directory: Path) -> None:
        """Opens a complete cache directory.

        Raises:
            DataError: ``meta.json`` is missing or unreadable (an incomplete cache).
        """
        self.directory = Path(directory)
        self._open()

    def _open(self) -> None:
        meta = _read_meta(self.directory)
        if meta is None:
            raise DataError(f"{self.directory} is not a complete data cache (no valid {_META})")
        self.meta = meta
        self.stats = FilterStats(**meta["stats"])
        dtype = np.dtype(meta["token_dtype"])
        self._src_offsets = np.load(self.directory / "src_offsets.npy")
        self._tgt_offsets = np.load(self.directory / "tgt_offsets.npy")
        self._src_tokens = _map_tokens(self.directory / "src.bin", dtype)
        self._tgt_tokens = _map_tokens(self.directory / "tgt.bin", dtype)
        self.src_lengths = np.diff(self._src_offsets)
        self.tgt_lengths = np.diff(self._tgt_offsets)

    def __len__(self) -> int:
        return len(self.src_lengths)

    def target_counts(self, vocab_size: int) -> np.ndarray:
        """``(vocab_size,)`` int64: how often each id occurs in the targets."""
        return np.bincount(self._tgt_tokens, minlength=vocab_size)[:vocab_size]

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(src_ids, tgt_ids)`` of one example, without BOS/EOS."""
        i = int(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} examples")
        i %= len(self)
        return (
            self._src_tokens[self._src_offsets[i] : self._src_offsets[i + 1]],
            self._tgt_tokens[self._tgt_offsets[i] : self._tgt_offsets[i + 1]],
        )

    def flat(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """One side's ids, pair after pair, and the ``(N + 1,)`` offsets where each pair's
        begin: ``side`` is "src" or "tgt"."""
        if side == "src":
            return self._src_tokens, self._src_offsets
        if side == "tgt":
            return self._tgt_tokens, self._tgt_offsets
        raise ValueError(f"side ({side!r}) must be 'src' or 'tgt'")

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self._open()

    def __repr__(self) -> str:
        return f"ParallelDataset({str(self.directory)!r}, n={len(self)})"


def _map_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    # np.memmap refuses empty files; a corpus whose kept pairs are all empty (min_len=0) has one.
    if path.stat().st_size == 0:
        return np.empty(0, dtype=dtype)
    # A plain ndarray view slices several times faster than the np.memmap subclass.
    return np.memmap(path, dtype=dtype, mode="r").view(np.ndarray)


def _read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / _META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == CACHE_FORMAT_VERSION else None


def _file_identity(path: Path) -> dict[str, Any]:
    """What the cache key knows of an input: editing or replacing the file changes it."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def load_or_build(
    src_path: Path | None,
    tgt_path: Path | None,
    tsv_path: Path | None,
    tokenizer: BatchEncoder,
    cache_root: Path,
    *,
    max_len: int,
    min_len: int = 1,
    max_ratio: float | None = None,
    chunk_size: int = 10_000,
) -> tuple[ParallelDataset, FilterStats]:
    """Opens the binarized cache of a corpus, building it first if needed.

    Give either ``src_path`` and ``tgt_path`` or ``tsv_path``. The cache lives in a
    subdirectory of ``cache_root`` named after the first input and a key over: the inputs'
    absolute paths, sizes and modification times, the tokenizer's SHA-256, the filter settings
    and the cache format. Any change to these builds a new cache; the same inputs reuse it
    without reading the text.

    The cache is written to a temporary directory and renamed into place only once complete,
    so an interrupted run never leaves something that looks valid, and processes building the
    same cache at once (e.g. every rank of a distributed job) simply use whichever finishes
    first.

    Args:
        src_path: Source side of a line-aligned pair of files.
        tgt_path: Target side of a line-aligned pair of files.
        tsv_path: A ``source<TAB>target`` file, instead of the pair.
        tokenizer: Encodes the text; its ``sha256`` is part of the key.
        cache_root: Directory holding one subdirectory per cached corpus.
        max_len: See :func:`binarize`.
        min_len: See :func:`binarize`.
        max_ratio: See :func:`binarize`.
        chunk_size: See :func:`binarize`.

    Returns:
        The dataset and the filter counts of the build that produced it.

    Raises:
        DataError: The inputs are missing, malformed or filtered down to nothing.
    """
    _check_filter_settings(max_len, min_len, max_ratio)
    inputs = _input_files(src_path, tgt_path, tsv_path)
    check_corpus_files(*inputs)
    key_fields = {
        "format": CACHE_FORMAT_VERSION,
        "inputs": [_file_identity(path) for path in inputs],
        "tokenizer_sha256": tokenizer.sha256,
        "max_len": max_len,
        "min_len": min_len,
        "max_ratio": max_ratio,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()
    cache_root = Path(cache_root)
    cache_dir = cache_root / f"{inputs[0].name}-{key[:16]}"
    source = " + ".join(str(path) for path in inputs)

    if _is_complete(cache_dir, key):
        logger.info("reusing data cache %s for %s", cache_dir, source)
    else:
        logger.info("building data cache %s for %s", cache_dir, source)
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp_dir = part(cache_dir)
        remove_dead(cache_dir)  # what killed builds left (this process's too)
        tmp_dir.mkdir()
        try:
            pairs = read_tsv(inputs[0]) if tsv_path is not None else read_parallel(*inputs)
            binarize(
                pairs,
                tokenizer,
                tmp_dir,
                max_len=max_len,
                min_len=min_len,
                max_ratio=max_ratio,
                chunk_size=chunk_size,
                source=source,
                meta={"key": key, "inputs": key_fields["inputs"]},
            )
            _publish(tmp_dir, cache_dir, key)
        finally:
            remove(tmp_dir)

    dataset = ParallelDataset(cache_dir)
    return dataset, dataset.stats


def _input_files(src_path: Path | None, tgt_path: Path | None, tsv_path: Path | None) -> list[Path]:
    if tsv_path is not None and src_path is None and tgt_path is None:
        return [Path(tsv_path)]
    if tsv_path is None and src_path is not None and tgt_path is not None:
        return [Path(src_path), Path(tgt_path)]
    raise DataError(
        "give either src_path and tgt_path (line-aligned files) or tsv_path, not both or "
        f"neither (got src_path={src_path}, tgt_path={tgt_path}, tsv_path={tsv_path})"
    )


def _is_complete(cache_dir: Path, key: str) -> bool:
    meta = _read_meta(cache_dir)
    return meta is not None and meta.get("key") == key


def _publish(tmp_dir: Path, cache_dir: Path, key: str) -> None:
    """Moves a finished build into place, tolerating a concurrent builder of the same key."""
    if cache_dir.exists() and not _is_complete(cache_dir, key):
        logger.warning("removing incomplete data cache %s", cache_dir)
        shutil.rmtree(cache_dir, ignore_errors=True)
    try:
        os.rename(tmp_dir, cache_dir)
    except OSError:
        if not _is_complete(cache_dir, key):
            raise
        logger.info("another process finished %s first; using its copy", cache_dir)
