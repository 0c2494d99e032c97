"""Tests for aiayn.text.corpus: reading, binarizing/caching, and batching a dataset (the batching
itself: tests/text/test_batching.py)."""

from __future__ import annotations

import hashlib
import os
import pickle
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.text.batching import collate, make_batches
from aiayn.text.corpus import (
    DataError,
    FilterStats,
    ParallelDataset,
    binarize,
    count_lines,
    load_or_build,
    read_parallel,
    read_tsv,
)
from aiayn.text.tokenizer import SplitTokenizer, Tokenizer
from interop_models import split_tokenizer_files


class WordEncoder:
    """A stand-in tokenizer: one id per whitespace-separated word, ids from a growing table."""

    def __init__(self, vocab_size: int = 1000, tag: str = "v1") -> None:
        self.vocab_size = vocab_size
        self.sha256 = hashlib.sha256(tag.encode()).hexdigest()
        self.calls = 0
        self._ids: dict[str, int] = {}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls += 1
        return [[self._id(word) for word in text.split()] for text in texts]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encode_batch(texts)  # one vocabulary for both sides

    def _id(self, word: str) -> int:
        return self._ids.setdefault(word, 4 + len(self._ids) % (self.vocab_size - 4))


class FailingEncoder(WordEncoder):
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise AssertionError("the cache should have been reused, not rebuilt")


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def sentence(n_words: int, start: int = 0) -> str:
    return " ".join(f"w{start + i}" for i in range(n_words))


@pytest.fixture
def parallel(tmp_path: Path) -> tuple[Path, Path]:
    src = [sentence(n) for n in (3, 5, 2, 7, 4)]
    tgt = [sentence(n, 100) for n in (4, 5, 3, 6, 4)]
    return write_lines(tmp_path / "train.en", src), write_lines(tmp_path / "train.de", tgt)


# --- reading ------------------------------------------------------------------------------


def test_count_lines_counts_a_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nb\nc")
    assert count_lines(path) == 3
    path.write_bytes(b"")
    assert count_lines(path) == 0
    path.write_bytes("a\u2028b\n".encode())
    assert count_lines(path) == 1


def test_read_parallel_strips_and_keeps_order(tmp_path: Path) -> None:
    src = tmp_path / "a.en"
    tgt = tmp_path / "a.de"
    src.write_bytes(b"\xef\xbb\xbfhello world\r\n  two  \n\nlast")
    tgt.write_bytes("hallo Welt\r\nzwei\n\nletzte über".encode())
    assert list(read_parallel(src, tgt)) == [
        ("hello world", "hallo Welt"),
        ("two", "zwei"),
        ("", ""),
        ("last", "letzte über"),
    ]


def test_line_count_mismatch_names_both_files_and_counts(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "x.en", ["a", "b", "c"])
    tgt = write_lines(tmp_path / "x.de", ["a", "b"])
    with pytest.raises(DataError) as err:
        read_parallel(src, tgt)
    message = str(err.value)
    assert str(src) in message and str(tgt) in message
    assert "3 lines" in message and "2 lines" in message


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "u.en", ["a", "b", "c", "d"])
    tgt = tmp_path / "u.de"
    tgt.write_bytes(b"a\nb\nc \xff\xfe d\nd\n")
    with pytest.raises(DataError, match=rf"{tgt.name}:3: invalid UTF-8"):
        list(read_parallel(src, tgt))


def test_missing_file_is_named(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "m.en", ["a"])
    with pytest.raises(DataError, match=r"m\.de does not exist"):
        read_parallel(src, tmp_path / "m.de")


def test_read_tsv(tmp_path: Path) -> None:
    path = tmp_path / "p.tsv"
    path.write_bytes(b"hello\thallo\r\n a b \t c d \nempty target\t\n")
    assert list(read_tsv(path)) == [("hello", "hallo"), ("a b", "c d"), ("empty target", "")]


@pytest.mark.parametrize("bad_line", ["no tab here", "one\ttwo\tthree"])
def test_bad_tsv_line_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    path = write_lines(tmp_path / "bad.tsv", ["a\tb", "c\td", bad_line, "e\tf"])
    with pytest.raises(DataError, match=r"bad\.tsv:3: expected 2 tab-separated fields"):
        list(read_tsv(path))


def test_invalid_utf8_in_tsv_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"a\tb\n\xc3\tx\n")
    with pytest.raises(DataError, match=r"bad\.tsv:2: invalid UTF-8"):
        list(read_tsv(path))


# --- binarizing and caching ---------------------------------------------------------------


def test_binarize_round_trips_ids(tmp_path: Path) -> None:
    pairs = [(sentence(n), sentence(n + 1, 50)) for n in (1, 4, 2, 3)]
    encoder = WordEncoder()
    stats = binarize(pairs, encoder, tmp_path / "out", max_len=10, chunk_size=3)
    assert stats == FilterStats(total=4, kept=4, too_short=0, too_long=0, bad_ratio=0)
    dataset = ParallelDataset(tmp_path / "out")
    assert len(dataset) == 4
    expected = (
        encoder.encode_batch([s for s, _ in pairs]),
        encoder.encode_batch([t for _, t in pairs]),
    )
    for i in range(4):
        src, tgt = dataset[i]
        assert src.tolist() == expected[0][i]
        assert tgt.tolist() == expected[1][i]
    np.testing.assert_array_equal(dataset.src_lengths, [1, 4, 2, 3])
    np.testing.assert_array_equal(dataset.tgt_lengths, [2, 5, 3, 4])
    with pytest.raises(IndexError):
        dataset[4]


def test_token_dtype_follows_vocab_size(tmp_path: Path) -> None:
    pairs = [("a b", "c")]
    binarize(pairs, WordEncoder(vocab_size=65_536), tmp_path / "small", max_len=5)
    binarize(pairs, WordEncoder(vocab_size=70_000), tmp_path / "large", max_len=5)
    assert ParallelDataset(tmp_path / "small")[0][0].dtype == np.uint16
    assert ParallelDataset(tmp_path / "large")[0][0].dtype == np.int32


def test_filter_counts(tmp_path: Path) -> None:
    pairs = [
        ("a b c", "d e f"),  # kept
        ("", "d"),  # too short
        ("a", "b"),  # kept
        (sentence(9), "x y"),  # too long (source 9 > 8)
        ("a b c d e f g h", "x"),  # ratio 8 > 3
        ("a b", "c d e f g h"),  # ratio 3: kept
    ]
    stats = binarize(pairs, WordEncoder(), tmp_path / "out", max_len=8, min_len=1, max_ratio=3)
    assert stats == FilterStats(total=6, kept=3, too_short=1, too_long=1, bad_ratio=1)
    dataset = ParallelDataset(tmp_path / "out")
    assert dataset.stats == stats
    np.testing.assert_array_equal(dataset.src_lengths, [3, 1, 2])
    np.testing.assert_array_equal(dataset.tgt_lengths, [3, 1, 6])


def test_empty_after_filtering_is_an_error(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"empty after filtering") as err:
        load_or_build(*parallel, None, WordEncoder(), tmp_path / "cache", max_len=1)
    message = str(err.value)
    assert "train.en" in message and "train.de" in message
    assert "kept 0 of 5" in message and "5 too long" in message
    # Nothing that looks like a cache is left behind.
    assert not any((tmp_path / "cache").glob("*/meta.json"))
    assert list((tmp_path / "cache").iterdir()) == []


def test_cache_is_reused(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    first, stats = load_or_build(*parallel, None, WordEncoder(), tmp_path / "cache", max_len=10)
    # Same inputs, same tokenizer hash: the text must not be encoded again.
    second, stats2 = load_or_build(
        *parallel, None, FailingEncoder(), tmp_path / "cache", max_len=10
    )
    assert second.directory == first.directory
    assert stats2 == stats
    assert [s.tolist() for s, _ in second] == [s.tolist() for s, _ in first]


@pytest.mark.parametrize(
    "change",
    ["edit_input", "tokenizer", "max_len", "min_len", "max_ratio"],
)
def test_cache_is_rebuilt_on_change(
    parallel: tuple[Path, Path], tmp_path: Path, change: str
) -> None:
    cache = tmp_path / "cache"
    settings = {"max_len": 10, "min_len": 1, "max_ratio": None}
    first, _ = load_or_build(*parallel, None, WordEncoder(), cache, **settings)
    encoder = WordEncoder()
    if change == "edit_input":
        write_lines(parallel[0], [sentence(n) for n in (1, 1, 1, 1, 1)])
        os.utime(parallel[0], ns=(0, 123))  # a distinct mtime even on coarse filesystems
    elif change == "tokenizer":
        encoder = WordEncoder(tag="v2")
    elif change == "max_len":
        settings["max_len"] = 6
    elif change == "min_len":
        settings["min_len"] = 3
    else:
        settings["max_ratio"] = 1.5
    second, _ = load_or_build(*parallel, None, encoder, cache, **settings)
    assert encoder.calls > 0
    assert second.directory != first.directory


def test_incomplete_cache_is_rebuilt(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, _ = load_or_build(*parallel, None, WordEncoder(), cache, max_len=10)
    (first.directory / "meta.json").unlink()  # as if a run died before finishing
    encoder = WordEncoder()
    second, _ = load_or_build(*parallel, None, encoder, cache, max_len=10)
    assert encoder.calls > 0
    assert second.directory == first.directory
    assert len(second) == 5


def test_concurrent_builders_share_one_cache(
    parallel: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"

    class RacingEncoder(WordEncoder):
        """Lets a second process (here: a nested call, under another running process's PID, as
        its temporary directory is named) finish the same cache first."""

        def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
            if self.calls == 0:
                with monkeypatch.context() as other_process:
                    other_process.setattr(os, "getpid", os.getppid)
                    load_or_build(*parallel, None, WordEncoder(), cache, max_len=10)
            return super().encode_batch(texts)

    dataset, stats = load_or_build(*parallel, None, RacingEncoder(), cache, max_len=10)
    assert stats.kept == len(dataset) == 5
    assert [p.name for p in cache.iterdir()] == [dataset.directory.name]  # no temp dirs left


def test_load_or_build_from_tsv(tmp_path: Path) -> None:
    tsv = write_lines(tmp_path / "p.tsv", ["a b\tc", "d\te f g"])
    dataset, stats = load_or_build(None, None, tsv, WordEncoder(), tmp_path / "cache", max_len=5)
    assert stats.kept == 2
    np.testing.assert_array_equal(dataset.tgt_lengths, [1, 3])


def test_load_or_build_needs_one_kind_of_input(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="either src_path and tgt_path"):
        load_or_build(parallel[0], None, None, WordEncoder(), tmp_path, max_len=5)
    with pytest.raises(DataError, match="either src_path and tgt_path"):
        load_or_build(*parallel, parallel[0], WordEncoder(), tmp_path, max_len=5)


def test_load_or_build_with_real_tokenizer(tmp_path: Path) -> None:
    rng = random.Random(0)
    words_en = ["the", "cat", "sat", "on", "a", "mat", "dog", "runs"]
    words_de = ["der", "Hund", "läuft", "über", "die", "Brücke", "einundzwanzig"]
    src = write_lines(tmp_path / "t.en", [" ".join(rng.choices(words_en, k=5)) for _ in range(50)])
    tgt = write_lines(tmp_path / "t.de", [" ".join(rng.choices(words_de, k=5)) for _ in range(50)])
    tokenizer = Tokenizer.train([src, tgt], tmp_path / "tok.model", vocab_size=300)
    dataset, stats = load_or_build(src, tgt, None, tokenizer, tmp_path / "cache", max_len=64)
    assert stats.kept == 50
    src_ids, tgt_ids = dataset[7]
    assert tokenizer.decode(src_ids.tolist()) == src.read_text("utf-8").splitlines()[7]
    assert tokenizer.decode(tgt_ids.tolist()) == tgt.read_text("utf-8").splitlines()[7]


def test_dataset_pickles_without_copying_the_corpus(
    parallel: tuple[Path, Path], tmp_path: Path
) -> None:
    dataset, _ = load_or_build(*parallel, None, WordEncoder(), tmp_path / "cache", max_len=10)
    blob = pickle.dumps(dataset)
    assert len(blob) < 500
    clone = pickle.loads(blob)
    assert [t.tolist() for _, t in clone] == [t.tolist() for _, t in dataset]


# --- batches of a dataset -------------------------------------------------------------------


def test_dataloader_with_batch_sampler(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    dataset, _ = load_or_build(*parallel, None, WordEncoder(), tmp_path / "cache", max_len=10)
    batches = make_batches(dataset.src_lengths, dataset.tgt_lengths, max_tokens=20, seed=0, epoch=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate)
    assert sum(len(batch) for batch in loader) == len(dataset)


def test_binarize_encodes_targets_with_the_target_side_of_a_split_tokenizer(
    tmp_path: Path,
) -> None:
    """An imported Marian model cuts source and target text with different SentencePiece
    models: training data must hold the target model's ids, which the model learned to emit."""
    tokenizer = SplitTokenizer.load(split_tokenizer_files(tmp_path))
    pair = ("the cat sat on the mat", "die katze sass auf der matte")
    src = write_lines(tmp_path / "t.en", [pair[0]] * 3)
    tgt = write_lines(tmp_path / "t.de", [pair[1]] * 3)
    dataset, _ = load_or_build(src, tgt, None, tokenizer, tmp_path / "cache", max_len=64)
    src_ids, tgt_ids = (ids.tolist() for ids in dataset[0])
    assert src_ids == tokenizer.encode(pair[0])
    assert tgt_ids == tokenizer.encode_target(pair[1]) != tokenizer.encode(pair[1])
    assert tokenizer.decode(tgt_ids) == pair[1]
