"""Tests for the Hugging Face recipes of ``aiayn prepare`` (:mod:`aiayn.text.prepare.hf`).

They run offline on a small dataset built here in the Hub's exact format
(``{"translation": {"de": ..., "en": ...}}``, with empty sides, embedded newlines and tabs,
non-NFC text and an overlong line), read both from local copies (``--data-dir``) and through
the Hub code path with ``datasets.load_dataset`` replaced by a stand-in.
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before `datasets` is imported anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from aiayn.text.corpus import read_parallel
from aiayn.text.prepare import MANIFEST_FILE

from . import read_lines, run

LONG = "lang " * 500  # 2500 characters: over the default --max-chars of 2000


def good_pairs(n: int, tag: str) -> list[dict[str, str]]:
    return [{"de": f"{tag} Satz {i}.", "en": f"{tag} sentence {i}."} for i in range(n)]


# Records in the Hub's translation format, and the lines they must become (en, de).
TRAIN = [
    *good_pairs(20, "train"),
    {"de": "", "en": "German side empty"},
    {"de": "Englische Seite leer", "en": "   "},
    {"de": "Zeilen\numbruch\tund Tab", "en": "line\r\nbreak\tand  tab"},
    {"de": "Cafe\u0301 am Fluss", "en": "cafe\u0301 by the river"},  # decomposed é: not NFC
    {"de": "Absatz\u2028Trenner", "en": "  paragraph\u2029separator  "},
    {"de": LONG, "en": "overlong German side"},
]
TRAIN_LINES = [
    *[(f"train sentence {i}.", f"train Satz {i}.") for i in range(20)],
    ("line break and tab", "Zeilen umbruch und Tab"),
    ("caf\u00e9 by the river", "Caf\u00e9 am Fluss"),
    ("paragraph separator", "Absatz Trenner"),
]
VALID = [*good_pairs(3, "valid"), {"de": LONG, "en": "kept: valid is not length-filtered"}]
VALID_LINES = [
    *[(f"valid sentence {i}.", f"valid Satz {i}.") for i in range(3)],
    ("kept: valid is not length-filtered", " ".join(LONG.split())),
]
TEST = [*good_pairs(2, "test"), {"de": "nur Deutsch", "en": ""}]
TEST_LINES = [(f"test sentence {i}.", f"test Satz {i}.") for i in range(2)]
SPLITS = {"train": TRAIN, "validation": VALID, "test": TEST}


@pytest.fixture(scope="module")
def hub_dataset() -> Any:
    """The records as a DatasetDict typed like wmt14's (a `Translation` feature)."""
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed")
    features = datasets.Features({"translation": datasets.Translation(languages=["de", "en"])})
    return datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"translation": records}, features=features)
            for name, records in SPLITS.items()
        }
    )


@pytest.fixture(scope="module")
def saved(hub_dataset: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hub") / "saved"
    hub_dataset.save_to_disk(str(path))
    return path


def assert_corpus(out: Path, src: str, tgt: str, expected: dict[str, list[tuple[str, str]]]):
    """Files line by line (en, de order in `expected`), accepted by aiayn's own reader."""
    for split, pairs in expected.items():
        en = read_lines(out / f"{split}.en")
        de = read_lines(out / f"{split}.de")
        assert list(zip(en, de, strict=True)) == pairs, split
        for line in en + de:
            assert line and line == line.strip() and "\t" not in line
            assert unicodedata.is_normalized("NFC", line)
        read = list(read_parallel(out / f"{split}.{src}", out / f"{split}.{tgt}"))
        assert read == [(a, b) if src == "en" else (b, a) for a, b in pairs]


def test_wmt14_from_a_saved_dataset_dict(saved: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "wmt14"
    assert run("wmt14-en-de", out, "--data-dir", saved) == 0
    assert_corpus(out, "en", "de", {"train": TRAIN_LINES, "valid": VALID_LINES, "test": TEST_LINES})
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["source"]["dataset"] == "wmt/wmt14"
    assert manifest["source"]["config"] == "de-en"
    assert manifest["source"]["data_dir"] == str(saved)
    assert (manifest["src_lang"], manifest["tgt_lang"]) == ("en", "de")
    splits = manifest["splits"]
    assert {name: s["pairs"] for name, s in splits.items()} == {"train": 23, "valid": 4, "test": 2}
    assert splits["train"]["read"] == len(TRAIN)
    assert splits["train"]["dropped"] == {"empty_de": 1, "empty_en": 1, "too_long": 1}
    assert splits["valid"]["dropped"] == {}
    assert splits["test"]["dropped"] == {"empty_en": 1}
    assert splits["train"]["files"] == {"en": "train.en", "de": "train.de"}
    assert "split 'validation'" in splits["valid"]["origin"]
    assert "train: 23 pairs" in capsys.readouterr().out


def write_copy(dataset: Any, folder: Path, layout: str) -> Path:
    """The dataset as files, in the layouts the Hub and its Parquet export use."""
    folder.mkdir()
    for split, records in dataset.items():
        if layout == "parquet":
            records.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
        elif layout == "parquet-export":
            (folder / split).mkdir()
            records.to_parquet(str(folder / split / "0000.parquet"))
        else:
            records.to_json(str(folder / f"{split}.jsonl"), force_ascii=False)
    return folder


@pytest.mark.parametrize("layout", ["parquet", "parquet-export", "jsonl"])
def test_file_copies_give_the_same_corpus(
    hub_dataset: Any, saved: Path, tmp_path: Path, layout: str
) -> None:
    copy = write_copy(hub_dataset, tmp_path / "copy", layout)
    assert run("wmt14-en-de", tmp_path / "a", "--data-dir", saved) == 0
    assert run("wmt14-en-de", tmp_path / "b", "--from-disk", copy, "--cache-dir", tmp_path) == 0
    for name in ("train.en", "train.de", "valid.en", "valid.de", "test.en", "test.de"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_iwslt_translates_german_to_english(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "iwslt"
    assert run("iwslt14-de-en", out, "--data-dir", saved) == 0
    assert_corpus(out, "de", "en", {"train": TRAIN_LINES})
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["source"]["dataset"] == "IWSLT/iwslt2017"
    assert (manifest["src_lang"], manifest["tgt_lang"]) == ("de", "en")


def test_max_chars_zero_keeps_long_training_pairs(saved: Path, tmp_path: Path) -> None:
    assert run("wmt14-en-de", tmp_path, "--data-dir", saved, "--max-chars", "0") == 0
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["splits"]["train"]["pairs"] == 24


@pytest.fixture
def fake_hub(hub_dataset: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """`datasets.load_dataset` answering from the local dataset, recording how it was called."""
    import datasets

    calls = []

    def load_dataset(path: str, name: str | None = None, **kwargs: Any) -> Any:
        calls.append((path, name, kwargs))
        return hub_dataset

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_recipes_ask_the_hub_for_the_right_datasets(fake_hub: list, tmp_path: Path) -> None:
    assert run("wmt14-en-de", tmp_path / "wmt", "--cache-dir", tmp_path / "cache") == 0
    assert run("iwslt14-de-en", tmp_path / "iwslt") == 0
    (wmt_path, wmt_config, wmt_kwargs), (iwslt_path, _, iwslt_kwargs) = fake_hub
    assert (wmt_path, wmt_config) == ("wmt/wmt14", "de-en")
    assert wmt_kwargs["cache_dir"] == str(tmp_path / "cache")
    # IWSLT 2017 has only a loading script: its Parquet export is read instead.
    assert iwslt_path == "parquet"
    export = "hf://datasets/IWSLT/iwslt2017@refs%2Fconvert%2Fparquet/iwslt2017-de-en"
    assert iwslt_kwargs["data_files"] == {
        split: f"{export}/{split}/*.parquet" for split in ("train", "validation", "test")
    }
    assert_corpus(tmp_path / "wmt", "en", "de", {"train": TRAIN_LINES, "test": TEST_LINES})
    assert_corpus(tmp_path / "iwslt", "de", "en", {"valid": VALID_LINES})


def test_generic_hf_dataset(fake_hub: list, tmp_path: Path) -> None:
    argv = ["hf", "someone/corpus", "de-en", tmp_path, "--src-lang", "de", "--tgt-lang", "en"]
    assert run(*argv, "--revision", "v2") == 0
    assert fake_hub[0][:2] == ("someone/corpus", "de-en")
    assert fake_hub[0][2]["revision"] == "v2"
    assert_corpus(tmp_path, "de", "en", {"train": TRAIN_LINES})


def test_network_failure_names_the_dataset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    import datasets

    def offline(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("Couldn't reach 'wmt/wmt14' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert run("wmt14-en-de", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "could not load wmt/wmt14 (de-en) from the Hugging Face Hub" in err
    assert "ConnectionError" in err and "--data-dir" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_missing_datasets_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    assert run("wmt14-en-de", tmp_path) == 2
    assert "pip install 'aiayn[data]'" in capsys.readouterr().err


def test_missing_language_is_a_clear_error(saved: Path, tmp_path: Path, capsys) -> None:
    argv = ["hf", "x/y", "fr-en", tmp_path, "--src-lang", "fr", "--tgt-lang", "en"]
    assert run(*argv, "--data-dir", saved) == 2
    err = capsys.readouterr().err
    assert "split 'train': the translations have no 'fr' side (they have: de, en)" in err
    assert not list(tmp_path.iterdir())  # checked before anything is written


def test_missing_split_is_a_clear_error(
    hub_dataset: Any, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    without_test = datasets.DatasetDict({k: v for k, v in hub_dataset.items() if k != "test"})
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: without_test)
    assert run("wmt14-en-de", tmp_path) == 2
    err = capsys.readouterr().err
    assert "wmt/wmt14 (de-en) has no split 'test' (it has: train, validation)" in err


def test_records_without_translation_column(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets")
    plain = datasets.Dataset.from_dict({"de": ["a"], "en": ["b"]})
    datasets.DatasetDict({s: plain for s in SPLITS}).save_to_disk(str(tmp_path / "plain"))
    assert run("wmt14-en-de", tmp_path / "out", "--data-dir", tmp_path / "plain") == 2
    assert "has no 'translation' column (columns: de, en)" in capsys.readouterr().err


def test_data_dir_without_a_dataset(tmp_path: Path, capsys) -> None:
    pytest.importorskip("datasets")
    (tmp_path / "empty").mkdir()
    assert run("wmt14-en-de", tmp_path / "out", "--data-dir", tmp_path / "empty") == 2
    assert "has no dataset" in capsys.readouterr().err


def test_existing_corpus_needs_force(saved: Path, tmp_path: Path, capsys) -> None:
    assert run("wmt14-en-de", tmp_path, "--data-dir", saved) == 0
    assert run("wmt14-en-de", tmp_path, "--data-dir", saved) == 2
    assert "already holds a prepared corpus" in capsys.readouterr().err
    assert run("wmt14-en-de", tmp_path, "--data-dir", saved, "--force") == 0


def test_split_with_no_usable_pair_leaves_no_corpus(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets")
    records = {"translation": [{"de": "", "en": "x"}]}
    datasets.DatasetDict({s: datasets.Dataset.from_dict(records) for s in SPLITS}).save_to_disk(
        str(tmp_path / "empty_sides")
    )
    out = tmp_path / "out"
    assert run("wmt14-en-de", out, "--data-dir", tmp_path / "empty_sides") == 2
    assert "split 'train'" in capsys.readouterr().err
    assert not list(out.iterdir())  # no manifest, no partial files


def test_a_truncated_parquet_file_is_one_line_naming_the_data_dir(tmp_path: Path, capsys) -> None:
    """pyarrow refuses it with ArrowInvalid, a ValueError: a user's file, not a bug in aiayn."""
    pytest.importorskip("datasets")
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation", "test"):
        (data / f"{split}.parquet").write_bytes(b"PAR1 not really parquet")
    assert run("wmt14-en-de", tmp_path / "out", "--data-dir", data) == 2
    err = capsys.readouterr().err  # after what `datasets` itself logs
    assert err.splitlines()[-1].startswith(f"aiayn prepare: error: cannot read --data-dir {data}: ")
    assert "Traceback" not in err
