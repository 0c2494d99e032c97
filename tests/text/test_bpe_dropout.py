"""BPE-dropout: plain BPE reproduced against SentencePiece, each epoch lossless, reproducible."""

from __future__ import annotations

import random

import numpy as np
import pytest

from aiayn.text.bpe_dropout import BPEDropout, Merges, segment
from aiayn.text.corpus import DataError, ParallelDataset, load_or_build
from aiayn.text.tokenizer import Tokenizer

WORDS_EN = ["the", "shepherd", "returned", "unto", "Jerusalem", "rejoicing", "and", "sang"]
WORDS_ES = ["el", "pastor", "volvió", "á", "Jerusalén", "regocijándose", "y", "cantó", "Señor"]


@pytest.fixture(scope="module")
def bible(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, ParallelDataset]:
    """A joint BPE vocabulary and the binarised pairs of a small corpus of long words."""
    directory = tmp_path_factory.mktemp("bible")
    rng = random.Random(0)
    src_lines = [" ".join(rng.choices(WORDS_EN, k=rng.randint(1, 9))) for _ in range(200)]
    tgt_lines = [" ".join(rng.choices(WORDS_ES, k=rng.randint(1, 9))) for _ in range(200)]
    src, tgt = directory / "train.en", directory / "train.es"
    src.write_text("".join(line + "\n" for line in src_lines), encoding="utf-8")
    tgt.write_text("".join(line + "\n" for line in tgt_lines), encoding="utf-8")
    tokenizer = Tokenizer.train([src, tgt], directory / "tok.model", vocab_size=400)
    data, _ = load_or_build(src, tgt, None, tokenizer, directory / "cache", max_len=64)
    return tokenizer, data


def merges_of(tokenizer: Tokenizer) -> Merges:
    return Merges.of(*tokenizer.piece_table())


def texts(tokenizer: Tokenizer, pairs: ParallelDataset | object, side: int) -> list[str]:
    return [tokenizer.decode(pairs[i][side].tolist()) for i in range(len(pairs))]  # type: ignore[index]


def test_without_dropout_segment_is_sentencepiece_bpe(bible: tuple[Tokenizer, ParallelDataset]):
    tokenizer, _ = bible
    merges = merges_of(tokenizer)
    rng = random.Random(0)
    for word in {*WORDS_EN, *WORDS_ES, "Jerusalénes", "pastorcillo", "rejoicingunto"}:
        expected = tokenizer.encode(word)
        assert segment("▁" + word, merges, 0.0, rng) == expected, word
    assert segment("▁xyz", merges, 0.0, rng) is None  # x, z: bytes for SentencePiece


def test_with_dropout_a_word_comes_in_smaller_pieces_that_spell_it(
    bible: tuple[Tokenizer, ParallelDataset],
):
    tokenizer, _ = bible
    merges, rng = merges_of(tokenizer), random.Random(1)
    drawn = {tuple(segment("▁regocijándose", merges, 0.3, rng)) for _ in range(50)}  # type: ignore[arg-type]
    plain = tuple(tokenizer.encode("regocijándose"))
    assert plain in drawn and len(drawn) > 5
    assert all(tokenizer.decode(list(ids)) == "regocijándose" for ids in drawn)
    assert all(len(ids) >= len(plain) for ids in drawn)
    assert segment("▁xyz", merges, 0.3, rng) is None  # not pieces: left to the cached ids


def test_every_epoch_spells_the_same_text_in_other_pieces(
    bible: tuple[Tokenizer, ParallelDataset],
):
    tokenizer, data = bible
    sampler = BPEDropout(data, merges_of(tokenizer), dropout=0.1, seed=1, max_len=64)
    assert 0.0 < sampler.resegmented < 1.0
    one, two = sampler.epoch(1), sampler.epoch(2)
    for side in (0, 1):
        plain = texts(tokenizer, data, side)
        assert texts(tokenizer, one, side) == plain
        assert texts(tokenizer, two, side) == plain
    assert len(one) == len(data)
    assert one.src_lengths.sum() > data.src_lengths.sum()
    assert one.tgt_lengths.sum() > data.tgt_lengths.sum()
    assert not np.array_equal(one.tgt_lengths, two.tgt_lengths)


def test_an_epoch_is_the_same_from_the_same_seed_and_differs_from_another(
    bible: tuple[Tokenizer, ParallelDataset],
):
    """Twice in one process, as a resumed run or another rank would make it."""
    tokenizer, data = bible
    merges = merges_of(tokenizer)
    first = BPEDropout(data, merges, dropout=0.1, seed=1, max_len=64).epoch(3)
    again = BPEDropout(data, merges, dropout=0.1, seed=1, max_len=64).epoch(3)
    other = BPEDropout(data, merges, dropout=0.1, seed=2, max_len=64).epoch(3)
    pairs = range(len(data))
    assert all(np.array_equal(first[i][1], again[i][1]) for i in pairs)
    assert not all(np.array_equal(first[i][1], other[i][1]) for i in pairs)


def test_a_pair_too_long_with_dropout_keeps_its_plain_segmentation(
    bible: tuple[Tokenizer, ParallelDataset],
):
    tokenizer, data = bible
    longest = int(max(data.src_lengths.max(), data.tgt_lengths.max()))
    sampler = BPEDropout(data, merges_of(tokenizer), dropout=0.3, seed=1, max_len=longest)
    pairs = sampler.epoch(1)
    assert max(pairs.src_lengths.max(), pairs.tgt_lengths.max()) <= longest
    kept = [i for i in range(len(data)) if len(data[i][1]) == longest]
    assert all(np.array_equal(pairs[i][1], data[i][1]) for i in kept)


def test_a_vocabulary_whose_merges_do_not_reproduce_the_data_is_refused(
    bible: tuple[Tokenizer, ParallelDataset],
):
    tokenizer, data = bible
    pieces, scores, normal = tokenizer.piece_table()
    reversed_order = Merges.of(pieces, [-s for s in scores], normal)
    with pytest.raises(DataError, match="needs a BPE vocabulary"):
        BPEDropout(data, reversed_order, dropout=0.1, seed=1, max_len=64)


@pytest.mark.parametrize("dropout", [0.0, 1.0, -0.1])
def test_a_dropout_outside_0_1_is_refused(bible: tuple[Tokenizer, ParallelDataset], dropout: float):
    tokenizer, data = bible
    with pytest.raises(DataError, match="must be in"):
        BPEDropout(data, merges_of(tokenizer), dropout=dropout, seed=1, max_len=64)


def test_flat_sides_are_the_pairs(bible: tuple[Tokenizer, ParallelDataset]):
    _, data = bible
    tokens, offsets = data.flat("tgt")
    assert np.array_equal(tokens[offsets[3] : offsets[4]], data[3][1])
    with pytest.raises(ValueError, match="side"):
        data.flat("both")
