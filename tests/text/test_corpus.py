"""Tests for aiayn.text.corpus: reading, binarizing/caching, token-budget batching and collation."""

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

from aiayn.text.batching import Batch, accumulation, collate, make_batches, shard_batches
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
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, SplitTokenizer, Tokenizer
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


def test_concurrent_builders_share_one_cache(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    class RacingEncoder(WordEncoder):
        """Lets a second process (here: a nested call) finish the same cache first."""

        def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
            if self.calls == 0:
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


# --- batching -----------------------------------------------------------------------------


def random_lengths(n: int, seed: int, max_len: int = 60) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, max_len + 1, n), rng.integers(0, max_len + 1, n)


@pytest.mark.parametrize("max_tokens", [61, 100, 257, 1000])
@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_respect_budget_and_cover_everything(max_tokens: int, shuffle: bool) -> None:
    src_lengths, tgt_lengths = random_lengths(2000, seed=max_tokens)
    batches = make_batches(
        src_lengths, tgt_lengths, max_tokens=max_tokens, seed=1, epoch=0, shuffle=shuffle
    )
    for batch in batches:
        assert len(batch) > 0
        assert len(batch) * (src_lengths[batch].max() + 1) <= max_tokens
        assert len(batch) * (tgt_lengths[batch].max() + 1) <= max_tokens
    assert sorted(np.concatenate(batches).tolist()) == list(range(2000))


def reference_batches(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int
) -> list[list[int]]:
    """The unshuffled batching rule, one example at a time."""
    order = np.lexsort((np.arange(len(src_lengths)), src_lengths, tgt_lengths))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order.tolist():
        padded = max(src_lengths[i], tgt_lengths[i]) + 1
        if current and (len(current) + 1) * max(longest, padded) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, padded)
    return [*batches, current]


@pytest.mark.parametrize("max_tokens", [61, 300, 5000])
def test_batches_match_the_one_at_a_time_reference(max_tokens: int) -> None:
    src_lengths, tgt_lengths = random_lengths(3000, seed=max_tokens)
    src_lengths[::7] = 0  # empty sides and wide ranges stress the windowed search
    batches = make_batches(
        src_lengths, tgt_lengths, max_tokens=max_tokens, seed=0, epoch=0, shuffle=False
    )
    assert [b.tolist() for b in batches] == reference_batches(src_lengths, tgt_lengths, max_tokens)


def test_batches_are_filled_greedily() -> None:
    # Equal lengths 9 (+1 = 10): a budget of 35 fits 3 per batch.
    batches = make_batches(np.full(10, 9), np.full(10, 9), max_tokens=35, seed=0, epoch=0)
    assert sorted(len(b) for b in batches) == [1, 3, 3, 3]


def test_batches_group_similar_lengths() -> None:
    src_lengths, tgt_lengths = random_lengths(2000, seed=0)
    batches = make_batches(src_lengths, tgt_lengths, max_tokens=500, seed=0, epoch=0)
    spread = np.mean([np.ptp(tgt_lengths[b]) for b in batches])
    assert spread <= 1.0


def test_batches_are_deterministic_per_seed_and_epoch() -> None:
    src_lengths, tgt_lengths = random_lengths(500, seed=3)

    def batches(seed: int, epoch: int) -> list[list[int]]:
        return [
            b.tolist()
            for b in make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=seed, epoch=epoch)
        ]

    assert batches(0, 0) == batches(0, 0)
    assert batches(0, 0) != batches(0, 1)
    assert batches(0, 0) != batches(1, 0)


def test_unshuffled_batches_are_sorted_and_ignore_seed() -> None:
    src_lengths, tgt_lengths = random_lengths(300, seed=4)
    a = make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=0, epoch=0, shuffle=False)
    b = make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=5, epoch=9, shuffle=False)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    order = np.concatenate(a)
    assert np.all(np.diff(tgt_lengths[order]) >= 0)


def test_example_longer_than_budget_is_an_error() -> None:
    with pytest.raises(DataError, match=r"max_tokens must be >= max_len \+ 1"):
        make_batches(np.array([3, 50]), np.array([3, 4]), max_tokens=50, seed=0, epoch=0)
    # Exactly max_len + 1 fits.
    assert len(make_batches(np.array([49]), np.array([3]), max_tokens=50, seed=0, epoch=0)) == 1


def test_make_batches_of_nothing() -> None:
    assert make_batches(np.array([]), np.array([]), max_tokens=10, seed=0, epoch=0) == []


@pytest.mark.parametrize("n_batches", [8, 10, 11])
def test_shards_are_equal_and_disjoint(n_batches: int) -> None:
    batches = [np.array([i]) for i in range(n_batches)]
    shards = [shard_batches(batches, rank, 4) for rank in range(4)]
    assert len({len(s) for s in shards}) == 1
    assert len(shards[0]) == n_batches // 4
    assert [int(b[0]) for b in shards[1]] == list(range(1, 4 * (n_batches // 4), 4))
    taken = sorted(int(b[0]) for shard in shards for b in shard)
    assert taken == list(range(4 * (n_batches // 4)))


def test_shard_rejects_bad_rank() -> None:
    with pytest.raises(DataError, match="rank"):
        shard_batches([1, 2], 2, 2)


# --- collation ----------------------------------------------------------------------------


def test_collate_shapes_and_contents() -> None:
    examples = [
        (np.array([5, 6, 7], dtype=np.uint16), np.array([8, 9], dtype=np.uint16)),
        (np.array([10], dtype=np.uint16), np.array([11, 12, 13, 14], dtype=np.uint16)),
    ]
    batch = collate(examples)
    assert isinstance(batch, Batch)
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    p, b, e = PAD_ID, BOS_ID, EOS_ID
    assert batch.src.tolist() == [[5, 6, 7, e], [10, e, p, p]]
    assert batch.tgt_in.tolist() == [[b, 8, 9, p, p], [b, 11, 12, 13, 14]]
    assert batch.tgt_out.tolist() == [[8, 9, e, p, p], [11, 12, 13, 14, e]]
    assert batch.n_src_tokens == int((batch.src != p).sum()) == 6
    assert batch.n_tgt_tokens == int((batch.tgt_out != p).sum()) == 8
    assert len(batch) == 2


def test_collate_respects_budget_of_make_batches() -> None:
    src_lengths, tgt_lengths = random_lengths(200, seed=7)
    examples = [
        (np.ones(s, np.int64), np.ones(t, np.int64))
        for s, t in zip(src_lengths, tgt_lengths, strict=True)
    ]
    for indices in make_batches(src_lengths, tgt_lengths, max_tokens=200, seed=0, epoch=0):
        batch = collate([examples[i] for i in indices])
        assert batch.src.numel() <= 200 and batch.tgt_in.numel() <= 200


def test_batch_to_device() -> None:
    batch = collate([(np.array([4]), np.array([5]))]).to("cpu")
    assert batch.src.device.type == "cpu"
    assert batch.n_tgt_tokens == 2


def test_dataloader_with_batch_sampler(parallel: tuple[Path, Path], tmp_path: Path) -> None:
    dataset, _ = load_or_build(*parallel, None, WordEncoder(), tmp_path / "cache", max_len=10)
    batches = make_batches(dataset.src_lengths, dataset.tgt_lengths, max_tokens=20, seed=0, epoch=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate)
    assert sum(len(batch) for batch in loader) == len(dataset)


def test_tokens_per_update_sets_accumulation() -> None:
    settings = dict(tokens_per_update=25_000, max_tokens=1000, accumulate=1)
    assert accumulation(**settings, world_size=1) == 25
    assert accumulation(**settings, world_size=8) == 4  # ceil(25000 / 8000)
    assert accumulation(**{**settings, "tokens_per_update": 0}, world_size=8) == 1


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
