"""Tests for ``aiayn prepare bible-en-es`` (:mod:`aiayn.text.prepare.bible`).

The recipe is unit-tested on small markup strings and run end to end on Debian's SWORD modules
where they are installed (``make bible-deps``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from aiayn.text.corpus import read_parallel
from aiayn.text.prepare import MANIFEST_FILE, bible, clean_text
from aiayn.text.prepare.bible import align, book_names, fix_drop_caps, strip_osis

from . import read_lines, run

# -- markup, drop caps, alignment -----------------------------------------------------------


@pytest.mark.parametrize(
    ("markup", "text"),
    [
        # Strong's numbers around words; a footnote between two words leaves one space.
        (
            '<w lemma="strong:H0430">God</w><note placement="foot"><reference>1:1 </reference>'
            'The Hebrew word is “Elohim”.</note><w lemma="strong:H1254">created</w>.',
            "God created.",
        ),
        # A note before punctuation leaves nothing; cross references go too.
        ('twenty gerahs<note type="crossReference">Exod 30</note>); half', "twenty gerahs); half"),
        ("Behold,<note>n</note> I have given", "Behold, I have given"),
        ("“Aren’t you?”<note>n</note>", "“Aren’t you?”"),
        # Psalm titles are canonical text; section headings and speaker labels are not.
        (
            '<title canonical="true" type="psalm">A Psalm by David.</title> <l level="1"/>'
            "Yahweh, how my adversaries have increased!<l/>",
            "A Psalm by David. Yahweh, how my adversaries have increased!",
        ),
        ('<title type="section">The Creation</title>In the beginning', "In the beginning"),
        ("<speaker>Beloved</speaker> <l/>Let him kiss me", "Let him kiss me"),
        # Added words (italics in print) often touch their neighbours in the source.
        (
            '<w>para siempre</w><transChange type="added">es</transChange><w>su</w> misericordia',
            "para siempre es su misericordia",
        ),
        (
            'los reyes</w><transChange type="added">á la guerra</transChange>,',
            "los reyes á la guerra,",
        ),
        ("Jacob<lb/>Reuben", "Jacob Reuben"),
        ("TR &amp; NU read", "TR & NU read"),
        # Whatever follows the end of the book (the WEB's glossary) is not verse text.
        (
            'Amen. <div canonical="true" eID="gen1" osisID="Rev" type="book"/> <title>Glossary'
            "</title> Abaddon is Hebrew for destruction.",
            "Amen.",
        ),
    ],
)
def test_strip_osis(markup: str, text: str) -> None:
    assert clean_text(strip_osis(markup)) == text


def test_fix_drop_caps() -> None:
    verses = {
        "Gen.29.1": "Y SIGUIÓ Jacob su camino",
        "Gen.29.2": "y siguió mirando; siguió el pastor",  # "siguió" is an ordinary word
        "Ps.3.1": "Salmo de David. ¡OH Jehová, cuánto!",
        "Ps.4.1": "JEHOVÁ es mi pastor",
        "Ps.4.2": "Jehová, Jehová, oh jehová",  # mostly capitalised: a name
        "Ps.4.3": "Y ALELUYA",  # not a chapter's first verse: left alone
        "Jer.1.1": "LAS palabras de Jeremías",
    }
    fixed = fix_drop_caps(verses)
    assert fixed["Gen.29.1"] == "Y siguió Jacob su camino"
    assert fixed["Ps.3.1"] == "Salmo de David. ¡Oh Jehová, cuánto!"
    assert fixed["Ps.4.1"] == "Jehová es mi pastor"
    assert fixed["Ps.4.3"] == "Y ALELUYA"
    assert fixed["Jer.1.1"] == "Las palabras de Jeremías"


def test_align_by_reference_and_split_by_book() -> None:
    en = {"Gen.1.1": "a", "Ruth.1.1": "b", "Tob.1.1": "only en", "Mark.1.1": "c"}
    es = {"Gen.1.1": "A", "Ruth.1.1": "B", "Mark.1.1": "C", "Mal.4.6": "only es"}
    splits, missing = align(en, es)
    assert splits == {
        "train": [("a", "A", "Gen.1.1")],
        "valid": [("b", "B", "Ruth.1.1"), ("c", "C", "Mark.1.1")],
    }
    assert missing == {"train": Counter(only_en=1, only_es=1), "valid": Counter()}


def test_align_holds_test_books_out_of_train() -> None:
    en = {"Gen.1.1": "a", "Job.1.1": "b", "Job.1.2": "only en", "Mark.1.1": "c"}
    es = {"Gen.1.1": "A", "Job.1.1": "B", "Mark.1.1": "C"}
    splits, missing = align(en, es, test_books=("Job",))
    assert splits == {
        "train": [("a", "A", "Gen.1.1")],
        "valid": [("c", "C", "Mark.1.1")],
        "test": [("b", "B", "Job.1.1")],
    }
    assert missing == {"train": Counter(), "valid": Counter(), "test": Counter(only_en=1)}


def test_book_names_take_osis_or_english_names_in_any_case() -> None:
    assert book_names(["proverbs", " Job ", "", "PS", "Prov"]) == ("Job", "Ps", "Prov")
    assert book_names(["1 peter", "Song of Songs", "rev"]) == ("Song", "1Pet", "Rev")
    assert book_names([]) == ()
    assert len(bible.BOOKS) == 66 and set(bible.DEV_BOOKS) <= set(bible.BOOKS)


@pytest.mark.parametrize(
    ("books", "message"),
    [
        ("Job,Proverb", "unknown Bible book 'Proverb'; the books: Gen (Genesis), Exod (Exodus), "),
        ("Tob", "unknown Bible book 'Tob'"),  # the WEB has it; the Spanish module does not
        ("Job,mark,Ruth", "Ruth, Mark: a validation book cannot be a test book too"),
    ],
)
def test_bad_test_books_are_refused_in_one_line_before_anything_is_read(
    tmp_path: Path, books: str, message: str, capsys
) -> None:
    assert run("bible-en-es", tmp_path / "out", "--test-books", books) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "out").exists()


def test_missing_modules_say_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    pytest.importorskip("pysword")
    assert run("bible-en-es", tmp_path / "out", "--sword-dir", tmp_path) == 2
    err = capsys.readouterr().err
    assert "engWEB2015eb (Debian package sword-text-web)" in err
    command = "apt-get install sword-text-web sword-text-sparv"
    assert f"with: {'' if os.geteuid() == 0 else 'sudo '}{command}" in err
    for uid, how in ((0, "with: apt-get"), (1000, "with: sudo apt-get")):  # root needs no sudo
        monkeypatch.setattr(bible.os, "geteuid", lambda uid=uid: uid)
        assert run("bible-en-es", tmp_path / "out", "--sword-dir", tmp_path) == 2
        assert how in capsys.readouterr().err
    monkeypatch.setattr(bible.shutil, "which", lambda name: None)
    assert run("bible-en-es", tmp_path / "out", "--sword-dir", tmp_path) == 2
    assert "apt-get is not available here" in capsys.readouterr().err


def test_missing_pysword_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "pysword", None)
    assert run("bible-en-es", tmp_path / "out") == 2
    assert "pip install 'aiayn[data]'" in capsys.readouterr().err


# -- end to end on the installed modules ----------------------------------------------------

SWORD_CONF = bible.DEFAULT_SWORD_DIR / "mods.d"
MODULES_INSTALLED = all((SWORD_CONF / f"{m.name}.conf").is_file() for m in bible.MODULES.values())


needs_modules = pytest.mark.skipif(
    not MODULES_INSTALLED,
    reason=f"SWORD modules not installed in {SWORD_CONF} (make bible-deps, or: "
    f"{bible.INSTALL_COMMAND})",
)
FILES = [f"{split}.{kind}" for split in ("train", "valid") for kind in ("en", "es", "ref")]
# sha256 of FILES, one after the other, as Debian bookworm's modules give them without
# --test-books: a change to what every user gets must be made on purpose.
BOOKWORM_SHA256 = "24a4dda2c69efc3ffb9f1e0b42fdeadaa10d3ef6e8901255ad03203706adb8ea"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus `aiayn prepare bible-en-es` builds with its defaults, made once."""
    pytest.importorskip("pysword", reason="pysword is not installed")
    out = tmp_path_factory.mktemp("bible")
    assert run("bible-en-es", out) == 0
    return out


@needs_modules
def test_bible_corpus_from_the_installed_modules(corpus: Path) -> None:
    manifest = json.loads((corpus / MANIFEST_FILE).read_text())
    assert list(manifest["splits"]) == ["train", "valid"]  # no test split unless asked
    assert not list(corpus.glob("test.*"))
    origin = manifest["splits"]["train"]["origin"]
    assert origin == "every book in both modules except Ruth, Jonah, Mark"
    lines = {}
    for split in ("train", "valid"):
        en, es = read_lines(corpus / f"{split}.en"), read_lines(corpus / f"{split}.es")
        refs = read_lines(corpus / f"{split}.ref")
        assert len(en) == len(es) == len(refs) == manifest["splits"][split]["pairs"]
        assert list(read_parallel(corpus / f"{split}.en", corpus / f"{split}.es"))
        books = {ref.split(".")[0] for ref in refs}
        is_dev = {book in bible.DEV_BOOKS for book in books}
        assert is_dev == {split == "valid"}
        lines.update({ref: pair for ref, *pair in zip(refs, en, es, strict=True)})
    assert lines["Gen.1.1"] == [
        "In the beginning, God created the heavens and the earth.",
        "En el principio crió Dios los cielos y la tierra.",
    ]
    assert lines["Gen.29.1"][1].startswith("Y siguió Jacob su camino")
    assert lines["Ps.3.1"][0].startswith("A Psalm by David, when he fled from Absalom his son.")
    assert lines["Ps.3.1"][1].startswith("Salmo de David, cuando huía de delante de Absalom")
    assert "¡Oh Jehová" in lines["Ps.3.1"][1]
    assert "para siempre es su misericordia" in lines["Ps.118.3"][1]
    assert "Glossary" not in lines["Rev.22.21"][0]
    assert "Tob.1.1" not in lines  # the WEB's Deuterocanon has no Spanish side
    dropped = manifest["splits"]["train"]["dropped"]
    assert dropped["only_en"] > 0 and dropped["empty_es"] > 0
    modules = manifest["source"]["modules"]
    if (modules["en"]["version"], modules["es"]["version"]) == ("426.0", "2.60"):  # bookworm
        assert manifest["splits"]["train"]["pairs"] == 30267
        assert manifest["splits"]["valid"]["pairs"] == 810
        digest = hashlib.sha256(b"".join((corpus / f).read_bytes() for f in FILES))
        assert digest.hexdigest() == BOOKWORM_SHA256
    assert {ref.split(".")[0] for ref in lines} == set(bible.BOOKS)  # what --test-books takes


@needs_modules
def test_test_books_are_held_out_of_train(corpus: Path, tmp_path: Path) -> None:
    assert run("bible-en-es", tmp_path, "--test-books", "Job,Proverbs") == 0
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert list(manifest["splits"]) == ["train", "valid", "test"]
    assert manifest["splits"]["test"]["origin"] == "books Job, Prov"
    assert manifest["splits"]["train"]["origin"].endswith("except Ruth, Jonah, Mark, Job, Prov")

    def pairs(folder: Path, split: str) -> list[tuple[str, str, str]]:
        sides = (read_lines(folder / f"{split}.{kind}") for kind in ("ref", "en", "es"))
        return list(zip(*sides, strict=True))

    assert pairs(tmp_path, "valid") == pairs(corpus, "valid")
    everything = pairs(corpus, "train")
    is_test = [ref.split(".")[0] in ("Job", "Prov") for ref, *_ in everything]
    held_out = [p for p, test in zip(everything, is_test, strict=True) if test]
    assert pairs(tmp_path, "test") == held_out and len(held_out) > 1500
    assert pairs(tmp_path, "train") == [
        p for p, t in zip(everything, is_test, strict=True) if not t
    ]
    assert manifest["splits"]["test"]["pairs"] == len(held_out)
    modules = manifest["source"]["modules"]
    if (modules["en"]["version"], modules["es"]["version"]) == ("426.0", "2.60"):  # bookworm
        assert len(held_out) == 1976  # docs/reproducing.md says so
