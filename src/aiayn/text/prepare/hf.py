"""``aiayn prepare wmt14-en-de | iwslt14-de-en | hf``: translation datasets of the Hugging Face Hub.

The records are read with Hugging Face ``datasets`` (an optional dependency:
``pip install 'aiayn[data]'``) in the Hub's translation format, one record per pair::

    {"translation": {"de": "Wiederaufnahme der Sitzungsperiode", "en": "Resumption of the session"}}

and written by :func:`aiayn.text.prepare.write_corpus` as ``train``/``valid``/``test`` files.

========================  ====================================  ===============================
recipe                    dataset (config)                      splits → train / valid / test
========================  ====================================  ===============================
``wmt14-en-de``           ``wmt/wmt14`` (``de-en``)             train (4,508,785) / validation
                                                                = newstest2013 (3000) / test =
                                                                newstest2014, full (3003)
``iwslt14-de-en``         ``IWSLT/iwslt2017``                   train (206,112) / validation =
                          (``iwslt2017-de-en``), parquet        dev2010 (888) / test =
                          export                                tst2010-2015 (8079)
========================  ====================================  ===============================

IWSLT 2014 itself is not on the Hub in a form current ``datasets`` loads; IWSLT 2017 is the same
kind of data (TED talks, German–English) but not the same corpus as fairseq's
``prepare-iwslt14.sh`` (see docs/reproducing.md). Its Hub repository still has a loading script,
which ``datasets`` 4 and later refuse, so the recipe reads the Parquet files the Hub exports
for it (the ``refs/convert/parquet`` revision).

``data_dir`` reads the same records from a local copy instead of the Hub, through the same code:
a ``DatasetDict`` saved with ``save_to_disk``, or Parquet / JSON Lines files named after the
splits (``train.parquet``, ``validation-00000-of-00001.parquet``, ``test/0000.parquet``,
``train.jsonl``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiayn.text.prepare import DEFAULT_MAX_CHARS, PrepareError, Split, check_out_dir, write_corpus

logger = logging.getLogger(__name__)

# Output split → the dataset's split, for datasets that use the usual names.
STANDARD_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
PARQUET_EXPORT = "refs/convert/parquet"
_LOCAL_SUFFIXES = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
_BATCH = 10_000


@dataclass(frozen=True)
class HubSource:
    """A translation dataset on the Hub.

    Attributes:
        dataset: Repository id, e.g. ``wmt/wmt14``.
        config: Configuration (subset), e.g. ``de-en``; None for the default.
        splits: Output split → dataset split; a dataset split missing on the Hub is an error.
        parquet_export: Read the Parquet files the Hub exports for the dataset (its
            ``refs/convert/parquet`` revision) instead of the repository's own files: the way
            to datasets that still only have a loading script.
        revision: A branch, tag or commit of the repository; None for the default branch.
    """

    dataset: str
    config: str | None = None
    splits: Mapping[str, str] = field(default_factory=lambda: dict(STANDARD_SPLITS))
    parquet_export: bool = False
    revision: str | None = None

    def describe(self) -> str:
        config = f" ({self.config})" if self.config else ""
        return f"{self.dataset}{config}"


@dataclass(frozen=True)
class Recipe:
    """A named corpus: where it comes from and which way it translates."""

    source: HubSource
    src_lang: str
    tgt_lang: str


RECIPES = {
    "wmt14-en-de": Recipe(HubSource("wmt/wmt14", "de-en"), src_lang="en", tgt_lang="de"),
    "iwslt14-de-en": Recipe(
        HubSource("IWSLT/iwslt2017", "iwslt2017-de-en", parquet_export=True),
        src_lang="de",
        tgt_lang="en",
    ),
}


def prepare_hub(
    source: HubSource,
    out_dir: Path,
    *,
    src_lang: str,
    tgt_lang: str,
    data_dir: Path | None = None,
    cache_dir: Path | None = None,
    max_chars: int = DEFAULT_MAX_CHARS,
    force: bool = False,
) -> dict[str, Any]:
    """Reads ``source`` (or its local copy ``data_dir``) and writes the corpus into ``out_dir``.

    Args:
        source: The dataset and the splits to write.
        out_dir: Output folder.
        src_lang: Key of the source side in each record's ``translation``.
        tgt_lang: Key of the target side.
        data_dir: A local copy to read instead of the Hub (see the module docstring).
        cache_dir: Where ``datasets`` keeps downloads (default: its own, ``HF_DATASETS_CACHE``).
        max_chars: Longest side of a training pair, in characters; 0 for no limit.
        force: Overwrite a corpus already in ``out_dir``.

    Returns:
        The manifest.

    Raises:
        PrepareError: ``datasets`` is not installed, the dataset cannot be loaded (network,
            name, configuration), a split is missing, or records lack the languages.
    """
    check_out_dir(out_dir, force=force)
    datasets = _import_datasets()
    if data_dir is not None:
        loaded = _load_local(datasets, Path(data_dir), source.splits.values(), cache_dir)
        where = f"local copy {data_dir}"
    else:
        loaded = _load_hub(datasets, source, cache_dir)
        where = source.describe()
    splits = []
    for name, dataset_split in source.splits.items():
        if dataset_split not in loaded:
            have = ", ".join(sorted(loaded)) or "none"
            raise PrepareError(f"{where} has no split {dataset_split!r} (it has: {have})")
        records = loaded[dataset_split]
        _check_languages(records, src_lang, tgt_lang, f"{where}, split {dataset_split!r}")
        pairs = _pairs(records, src_lang, tgt_lang)
        splits.append(Split(name, f"split {dataset_split!r} of {where}", pairs))
    manifest_source = {
        "kind": "huggingface",
        "dataset": source.dataset,
        "config": source.config,
        "revision": PARQUET_EXPORT if source.parquet_export else source.revision,
        "data_dir": str(data_dir) if data_dir is not None else None,
        "datasets_version": datasets.__version__,
    }
    return write_corpus(
        out_dir,
        splits,
        src_lang=src_lang,
        tgt_lang=tgt_lang,
        source=manifest_source,
        max_chars=max_chars,
        force=force,
    )


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as err:
        raise PrepareError(
            "aiayn prepare reads Hugging Face datasets with the `datasets` library, which is "
            "not installed: pip install 'aiayn[data]' (or: pip install datasets)"
        ) from err
    return datasets


def _load_hub(datasets: Any, source: HubSource, cache_dir: Path | None) -> Any:
    """The dataset's splits, downloaded (or taken from the cache) by ``datasets``."""
    cache = str(cache_dir) if cache_dir is not None else None
    try:
        if source.parquet_export:
            root = f"hf://datasets/{source.dataset}@{PARQUET_EXPORT.replace('/', '%2F')}"
            config = source.config or "default"
            files = {s: f"{root}/{config}/{s}/*.parquet" for s in source.splits.values()}
            return datasets.load_dataset("parquet", data_files=files, cache_dir=cache)
        return datasets.load_dataset(
            source.dataset, source.config, revision=source.revision, cache_dir=cache
        )
    except Exception as err:  # network, authentication, unknown name or config: one clear line
        raise PrepareError(
            f"could not load {source.describe()} from the Hugging Face Hub ({_reason(err)}). "
            "Check the network connection and the dataset's name and configuration, or prepare "
            "from a local copy with --data-dir"
        ) from err


def _reason(err: Exception) -> str:
    """An exception as one line of at most ~400 characters, its type named."""
    reason = " ".join(f"{type(err).__name__}: {err}".split())
    return reason[:400] + " ..." if len(reason) > 400 else reason


def _load_local(datasets: Any, path: Path, splits: Any, cache_dir: Path | None) -> Any:
    """A ``save_to_disk`` folder, or Parquet / JSON files named after the splits."""
    if not path.is_dir():
        raise PrepareError(f"--data-dir {path} is not a folder")
    if (path / "dataset_dict.json").is_file():
        return _read_local(path, lambda: datasets.load_from_disk(str(path)))
    if (path / "dataset_info.json").is_file():
        raise PrepareError(
            f"{path} holds a single saved Dataset; save a DatasetDict with one entry per split"
        )
    data_files: dict[str, list[str]] = {}
    kinds = set()
    for split in splits:
        found = sorted(
            {
                p
                for pattern in (f"{split}.*", f"{split}-*", f"{split}/*")
                for p in path.glob(pattern)
                if p.suffix in _LOCAL_SUFFIXES
            }
        )
        if found:
            data_files[split] = [str(p) for p in found]
            kinds.update(_LOCAL_SUFFIXES[p.suffix] for p in found)
    if not data_files:
        raise PrepareError(
            f"--data-dir {path} has no dataset: expected a folder saved with "
            "DatasetDict.save_to_disk, or Parquet/JSON Lines files named after the splits "
            f"({', '.join(splits)})"
        )
    if len(kinds) > 1:
        raise PrepareError(f"--data-dir {path} mixes Parquet and JSON files; use one format")
    cache = str(cache_dir) if cache_dir is not None else None
    kind = kinds.pop()
    return _read_local(
        path, lambda: datasets.load_dataset(kind, data_files=data_files, cache_dir=cache)
    )


def _read_local(path: Path, load: Callable[[], Any]) -> Any:
    """``load()``, with what the user's files make ``datasets`` or pyarrow raise (a truncated
    Parquet file is pyarrow's ArrowInvalid, a ValueError) as one clear line."""
    try:
        return load()
    except (ValueError, OSError) as err:
        raise PrepareError(f"cannot read --data-dir {path}: {_reason(err)}") from err


def _check_languages(records: Any, src_lang: str, tgt_lang: str, where: str) -> None:
    """Fails before anything is written if the records cannot hold both languages."""
    if "translation" not in records.column_names:
        raise PrepareError(
            f"{where} has no 'translation' column (columns: {', '.join(records.column_names)})"
        )
    feature = records.features["translation"]
    languages = getattr(feature, "languages", None) or (
        list(feature) if isinstance(feature, dict) else None
    )
    if languages is None:
        raise PrepareError(f"{where}: 'translation' is not a mapping from language to text")
    for lang in (src_lang, tgt_lang):
        if lang not in languages:
            raise PrepareError(
                f"{where}: the translations have no {lang!r} side (they have: "
                f"{', '.join(sorted(languages))})"
            )


def _pairs(records: Any, src_lang: str, tgt_lang: str) -> Iterator[tuple[Any, Any]]:
    for batch in records.iter(batch_size=_BATCH):
        for translation in batch["translation"]:
            translation = translation or {}
            yield translation.get(src_lang), translation.get(tgt_lang)
