"""The lexical shortlist (`aiayn.decode.shortlist`): built as a plain count of sentence-level
co-occurrences would rank it, stored in a model directory with its checksum, and the ids it allows
a batch."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from aiayn.decode import shortlist as shortlist_module
from aiayn.decode.shortlist import (
    SHORTLIST_FILE,
    Shortlist,
    build_shortlist,
    build_shortlist_from_text,
    model_shortlist,
    read_shortlist,
    write_shortlist,
)
from aiayn.errors import CorruptCheckpointError, UserValueError
from aiayn.model_dir import CHECKSUMS_FILE, WEIGHTS_FILE, load_model_dir, verify
from aiayn.text.tokenizer import EOS_ID, UNK_ID, Tokenizer
from model_dirs import CORPUS, tiny_model_dir

V_S, V_T = 40, 30


def random_corpus(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Pairs whose target holds (source id % 25) + 4 for many of its source ids: real
    associations among noise."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        src = [rng.randrange(4, V_S) for _ in range(rng.randrange(1, 9))]
        tgt = [s % 25 + 4 for s in src if rng.random() < 0.7]
        tgt += [rng.randrange(4, V_T) for _ in range(rng.randrange(0, 4))]
        pairs.append((src, tgt))
    return pairs


def reference(pairs, per_source: int, frequent: int) -> tuple[dict[int, list[int]], list[int]]:
    """The shortlist by plain Python counting: per source id its targets by Dice, ties by the
    smaller id; and the frequent ids (ties by the smaller id), with EOS and UNK."""
    c_st: Counter = Counter()
    c_s: Counter = Counter()
    c_t: Counter = Counter()
    tokens: Counter = Counter()
    for src, tgt in pairs:
        tokens.update(tgt)
        c_s.update(set(src))
        c_t.update(set(tgt))
        c_st.update((s, t) for s in set(src) for t in set(tgt))
    lists: dict[int, list[int]] = {}
    for s in c_s:
        ranked = sorted(
            (t for (s2, t) in c_st if s2 == s),
            key=lambda t: (-2 * c_st[s, t] / (c_s[s] + c_t[t]), t),
        )
        lists[s] = ranked[:per_source]
    common = sorted(tokens, key=lambda t: (-tokens[t], t))[:frequent]
    return lists, sorted(set(common) | {EOS_ID, UNK_ID})


@pytest.mark.parametrize(("per_source", "frequent"), [(3, 5), (50, 0)])
def test_the_shortlist_is_the_plain_count_of_co_occurrences(per_source: int, frequent: int):
    pairs = random_corpus(300)
    built = build_shortlist(
        pairs, src_vocab_size=V_S, tgt_vocab_size=V_T, per_source=per_source, frequent=frequent
    )
    lists, always = reference(pairs, per_source, frequent)
    for s in range(V_S):
        assert built.targets_of(s).tolist() == lists.get(s, []), s
    assert built.always.tolist() == always


def test_a_source_piece_ranks_its_translation_above_the_pieces_that_occur_everywhere():
    the, cat, katze, die = 5, 6, 7, 8  # "the" and "die" in every pair, "cat"/"katze" in some
    pairs = [([the, cat], [die, katze])] * 3 + [([the], [die])] * 20
    built = build_shortlist(pairs, src_vocab_size=10, tgt_vocab_size=10, per_source=1)
    assert built.targets_of(cat).tolist() == [katze]
    assert built.targets_of(the).tolist() == [die]


def test_counting_in_chunks_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    pairs = random_corpus(200, seed=1)
    whole = build_shortlist(pairs, src_vocab_size=V_S, tgt_vocab_size=V_T, per_source=4)
    monkeypatch.setattr(shortlist_module, "_CHUNK_PAIRS", 50)
    chunked = build_shortlist(pairs, src_vocab_size=V_S, tgt_vocab_size=V_T, per_source=4)
    assert chunked.to_bytes() == whole.to_bytes()


def test_the_same_data_give_the_same_bytes_and_the_bytes_give_the_shortlist_back():
    pairs = random_corpus(100)
    a = build_shortlist(pairs, src_vocab_size=V_S, tgt_vocab_size=V_T)
    b = build_shortlist(pairs, src_vocab_size=V_S, tgt_vocab_size=V_T)
    assert a.to_bytes() == b.to_bytes()
    back = Shortlist.from_bytes(a.to_bytes())
    for name in ("offsets", "targets", "always"):
        np.testing.assert_array_equal(getattr(back, name), getattr(a, name))
    assert (back.tgt_vocab_size, back.per_source, back.frequent) == (V_T, 50, 100)


def test_allowed_is_the_union_of_the_sources_lists_and_the_frequent_ids():
    pairs = random_corpus(200)
    built = build_shortlist(pairs, src_vocab_size=V_S, tgt_vocab_size=V_T, per_source=2, frequent=3)
    sources = [[5, 9, 9], [33], [999, -1]]  # ids out of the vocabulary add nothing
    expected = set(built.always.tolist())
    for s in (5, 9, 33):
        expected |= set(built.targets_of(s).tolist())
    allowed = built.allowed(sources)
    assert allowed.dtype == np.int64
    assert allowed.tolist() == sorted(expected)
    assert built.allowed([]).tolist() == built.always.tolist()


def test_bad_settings_and_ids_are_refused():
    with pytest.raises(UserValueError, match="per_source"):
        build_shortlist([], src_vocab_size=5, tgt_vocab_size=5, per_source=0)
    with pytest.raises(UserValueError, match="target id"):
        build_shortlist([([1], [7])], src_vocab_size=5, tgt_vocab_size=5)


def test_a_damaged_or_foreign_file_is_refused(tmp_path: Path):
    built = build_shortlist(random_corpus(50), src_vocab_size=V_S, tgt_vocab_size=V_T)
    path = tmp_path / SHORTLIST_FILE
    path.write_bytes(b"not a shortlist at all")
    with pytest.raises(CorruptCheckpointError, match="not a shortlist"):
        read_shortlist(path)
    path.write_bytes(built.to_bytes())
    with pytest.raises(CorruptCheckpointError, match="target vocabulary of 30"):
        read_shortlist(path, tgt_vocab_size=31)
    broken = Shortlist(
        offsets=built.offsets,
        targets=built.targets + V_T,  # ids past the vocabulary
        always=built.always,
        tgt_vocab_size=V_T,
        per_source=50,
        frequent=100,
    )
    with pytest.raises(CorruptCheckpointError, match="targets must be ids below 30"):
        Shortlist.from_bytes(broken.to_bytes())


def test_30000_pairs_take_seconds():
    """The size of the recipe's training data, ids drawn as Zipf's law draws a text's words
    (not a benchmark: a bound well above the 1-2 s it takes)."""
    import time

    rng = np.random.default_rng(0)

    def sentence(n: int) -> np.ndarray:
        return np.minimum(rng.zipf(1.2, n) + 3, 7999)

    pairs = [(sentence(25), sentence(27)) for _ in range(30_000)]
    began = time.monotonic()
    build_shortlist(pairs, src_vocab_size=8000, tgt_vocab_size=8000)
    assert time.monotonic() - began < 30


# -- in a model directory ----------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_model_dir(tmp_path)


def test_a_shortlist_joins_a_model_directory_with_its_checksum(model_dir: Path):
    tokenizer = Tokenizer.load(model_dir / "tokenizer.model")
    config = load_model_dir(model_dir).config
    pairs = [(CORPUS[i], CORPUS[i + 3]) for i in range(3)]
    built = build_shortlist_from_text(
        pairs,
        tokenizer,
        src_vocab_size=config.src_vocab_size,
        tgt_vocab_size=config.tgt_vocab_size,
    )
    weights_inode = (model_dir / WEIGHTS_FILE).stat().st_ino
    write_shortlist(model_dir, built)
    verify(model_dir)  # every file, the shortlist included, matches checksums.json
    checksums = json.loads((model_dir / CHECKSUMS_FILE).read_text())
    assert SHORTLIST_FILE in checksums
    assert (model_dir / WEIGHTS_FILE).stat().st_ino == weights_inode  # linked, not copied
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    read = model_shortlist(model_dir, config.tgt_vocab_size)
    assert read is not None and read.to_bytes() == built.to_bytes()
    # "the cat sat on the mat" -> "die katze sass auf der matte": "katze"'s pieces are allowed
    allowed = set(read.allowed([tokenizer.encode("the cat sat")]).tolist())
    assert set(tokenizer.encode("katze")) <= allowed
    write_shortlist(model_dir, built)  # again: replaced, still verified
    verify(model_dir)


def test_a_shortlist_copied_in_by_hand_is_not_the_models(
    model_dir: Path, caplog: pytest.LogCaptureFixture
):
    built = build_shortlist([([4], [5])], src_vocab_size=10, tgt_vocab_size=10)
    (model_dir / SHORTLIST_FILE).write_bytes(built.to_bytes())
    with caplog.at_level(logging.WARNING):
        assert model_shortlist(model_dir, 10) is None
    assert "not in checksums.json" in caplog.text
    assert model_shortlist(model_dir.parent, 10) is None  # no shortlist at all
