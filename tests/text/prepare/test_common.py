"""Tests for what every ``aiayn prepare`` recipe shares (:mod:`aiayn.text.prepare`).

Cleaning, dropping, the files and the manifest are checked here on in-memory pairs, without any
recipe's optional dependency; test_hf.py and test_bible.py check the recipes end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.text.prepare import (
    MANIFEST_FILE,
    PrepareError,
    Split,
    clean_text,
    describe_manifest,
    write_corpus,
)

from . import read_lines

SOURCE = {"name": "test pairs"}


def splits(train: list, valid: list) -> list[Split]:
    return [Split("train", "made here", train), Split("valid", "made here", valid)]


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("  a  b ", "a b"),
        ("a\tb\nc\r\nd", "a b c d"),
        ("a\u2028b\u0085c\u00a0d", "a b c d"),
        ("e\u0301", "\u00e9"),
        ("a\x00b\x1bc\x7fd", "a b c d"),
        (None, ""),
        ("\n\t ", ""),
    ],
)
def test_clean_text_gives_one_nfc_line(raw: str | None, clean: str) -> None:
    assert clean_text(raw) == clean


def test_write_corpus_cleans_drops_and_counts(tmp_path: Path) -> None:
    train = [("a  b", "A\tB"), ("", "no source"), ("no target", " "), ("x" * 11, "long")]
    valid = [("y" * 11, "long, but valid is not length-filtered")]
    manifest = write_corpus(
        tmp_path, splits(train, valid), src_lang="en", tgt_lang="de", source=SOURCE, max_chars=10
    )
    assert read_lines(tmp_path / "train.en") == ["a b"]
    assert read_lines(tmp_path / "train.de") == ["A B"]
    assert read_lines(tmp_path / "valid.en") == ["y" * 11]
    assert json.loads((tmp_path / MANIFEST_FILE).read_text()) == manifest
    assert manifest["source"] == SOURCE
    train_report = manifest["splits"]["train"]
    assert (train_report["read"], train_report["pairs"]) == (4, 1)
    assert train_report["dropped"] == {"empty_de": 1, "empty_en": 1, "too_long": 1}
    assert manifest["splits"]["valid"]["dropped"] == {}
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_pairs_with_a_reference_write_a_ref_file(tmp_path: Path) -> None:
    pairs = [("a", "A", "Gen.1.1"), ("b", "B", " Gen.1.2\n")]
    split = Split("train", "made here", pairs, refs=True, dropped={"only_en": 2})
    manifest = write_corpus(tmp_path, [split], src_lang="en", tgt_lang="es", source=SOURCE)
    assert read_lines(tmp_path / "train.ref") == ["Gen.1.1", "Gen.1.2"]
    assert manifest["splits"]["train"]["files"]["ref"] == "train.ref"
    assert manifest["splits"]["train"]["dropped"] == {"only_en": 2}  # the recipe's own count


def test_describe_manifest_gives_a_line_per_split(tmp_path: Path) -> None:
    train = [("a", "A"), ("", "B")]
    manifest = write_corpus(
        tmp_path, splits(train, [("c", "C")]), src_lang="en", tgt_lang="de", source=SOURCE
    )
    lines = describe_manifest(manifest, tmp_path).splitlines()
    assert lines[0].startswith("train: 1 pairs (dropped: 1 empty_en)")
    assert f"{tmp_path / 'train.en'} {tmp_path / 'train.de'}" in lines[0]
    assert lines[1].startswith("valid: 1 pairs (dropped: none)")
    assert lines[2] == f"manifest: {tmp_path / MANIFEST_FILE}"


def test_an_existing_corpus_needs_force(tmp_path: Path) -> None:
    def write(**kwargs: bool) -> None:
        pairs = splits([("a", "A")], [("b", "B")])
        write_corpus(tmp_path, pairs, src_lang="en", tgt_lang="de", source=SOURCE, **kwargs)

    write()
    with pytest.raises(PrepareError, match="already holds a prepared corpus"):
        write()
    write(force=True)


def test_a_split_with_no_usable_pair_leaves_no_corpus(tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match=r"split 'valid' .* no usable pair: 1 read"):
        write_corpus(
            tmp_path,
            splits([("a", "A")], [("", "B")]),
            src_lang="en",
            tgt_lang="de",
            source=SOURCE,
        )
    assert not (tmp_path / MANIFEST_FILE).exists()
    assert not list(tmp_path.glob("valid.*"))


@pytest.mark.parametrize(
    ("langs", "max_chars", "message"),
    [(("en", "en"), 10, "both 'en'"), (("en", "de"), -1, "max_chars .-1. must be >= 0")],
)
def test_bad_options_are_errors(
    tmp_path: Path, langs: tuple[str, str], max_chars: int, message: str
) -> None:
    with pytest.raises(PrepareError, match=message):
        write_corpus(
            tmp_path / "out",
            splits([("a", "A")], [("b", "B")]),
            src_lang=langs[0],
            tgt_lang=langs[1],
            source=SOURCE,
            max_chars=max_chars,
        )
    assert not (tmp_path / "out").exists()
