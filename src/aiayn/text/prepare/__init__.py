"""Parallel corpora → the line-aligned plain text that ``aiayn train --src/--tgt`` reads.

Every recipe of ``aiayn prepare`` (``wmt14-en-de``, ``iwslt14-de-en``, ``hf`` in
:mod:`aiayn.text.prepare.hf`; ``bible-en-es`` in :mod:`aiayn.text.prepare.bible`) turns its records
into
``(source, target)`` pairs and hands them, split by split, to :func:`write_corpus`, which does the
same for all of them:

- **Cleaning** (:func:`clean_text`): Unicode NFC; control characters and every run of whitespace
  (tabs, newlines, U+2028, no-break spaces, ...) become one space; both ends are trimmed. One
  sentence is then exactly one line, and line *i* of ``train.en`` translates line *i* of
  ``train.de``.
- **Dropping** (each dropped pair is counted once, under the first reason it meets):
  ``empty_<lang>`` — a side is empty after cleaning, in any split (an empty line teaches nothing);
  ``too_long`` — a side of a *training* pair has more than ``max_chars`` characters. That is a
  guard against garbage (a whole document on one line), not the length filter of §5.1, which
  ``aiayn train`` applies to tokens. Validation and test pairs are never dropped for length, so
  that scores stay comparable with published ones.
- **Files**: ``{split}.{lang}`` in UTF-8 with ``\\n`` line ends, written under a temporary name and
  renamed once complete, then ``manifest.json``: where the data came from, the pairs per split and
  the dropped pairs per reason. A folder with a manifest holds a complete corpus.
"""

from __future__ import annotations

import json
import logging
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiayn import __version__
from aiayn.errors import UserValueError
from aiayn.parts import part, remove_dead

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
DEFAULT_MAX_CHARS = 2000
TRAIN_SPLIT = "train"

# C0 and C1 control characters that str.split() does not already treat as whitespace.
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f]")


class PrepareError(UserValueError):
    """A corpus cannot be prepared: missing package or data, bad record, unusable output folder."""


def clean_text(text: str | None) -> str:
    """One sentence as one line: NFC, controls and whitespace runs → one space, trimmed.

    ``None`` (a missing side in a dataset record) becomes the empty string.
    """
    if not text:
        return ""
    text = unicodedata.normalize("NFC", _CONTROL.sub(" ", text))
    return " ".join(text.split())


@dataclass(frozen=True)
class Split:
    """One output split and where its pairs come from.

    Attributes:
        name: Output name, the files' stem: ``train``, ``valid`` or ``test``.
        origin: Where the pairs come from, for the manifest (e.g. "split 'validation'").
        pairs: ``(source, target)`` texts, uncleaned; or ``(source, target, ref)`` when
            ``refs`` is set, ``ref`` naming the pair (written to ``{name}.ref``).
        refs: Whether ``pairs`` carry a reference as third item.
        dropped: Pairs the recipe itself left out before this point, per reason.
    """

    name: str
    origin: str
    pairs: Iterable[tuple[Any, ...]]
    refs: bool = False
    dropped: Mapping[str, int] = field(default_factory=dict)


def check_out_dir(out_dir: Path, *, force: bool) -> None:
    """Refuses to write over a prepared corpus unless ``force``; called before any download."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"output folder {out_dir} is a file")
    if (out_dir / MANIFEST_FILE).exists() and not force:
        raise PrepareError(
            f"{out_dir} already holds a prepared corpus ({MANIFEST_FILE}); pass --force to "
            "overwrite it"
        )


def write_corpus(
    out_dir: Path,
    splits: Sequence[Split],
    *,
    src_lang: str,
    tgt_lang: str,
    source: Mapping[str, Any],
    max_chars: int = DEFAULT_MAX_CHARS,
    force: bool = False,
) -> dict[str, Any]:
    """Cleans, filters and writes every split, then the manifest (see the module docstring).

    Args:
        out_dir: Output folder, created if needed.
        splits: The splits, in the order they are written.
        src_lang: Source language code, the suffix of the source files.
        tgt_lang: Target language code.
        source: Where the data came from, copied into the manifest.
        max_chars: Longest side, in characters, of a training pair; 0 for no limit.
        force: Overwrite an existing corpus.

    Returns:
        The manifest, as written to ``out_dir/manifest.json``.

    Raises:
        PrepareError: The folder already holds a corpus (and not ``force``), the two languages
            are the same, or a split has no pair left.
    """
    out_dir = Path(out_dir)
    if src_lang == tgt_lang:
        raise PrepareError(f"source and target language are both {src_lang!r}")
    if max_chars < 0:
        raise PrepareError(f"max_chars ({max_chars}) must be >= 0 (0: no limit)")
    check_out_dir(out_dir, force=force)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # a corpus is complete only with one
    reports = {}
    for split in splits:
        limit = max_chars if split.name == TRAIN_SPLIT else 0
        reports[split.name] = _write_split(out_dir, split, src_lang, tgt_lang, limit)
        logger.info("%s: %d pairs (%s)", split.name, reports[split.name]["pairs"], split.origin)
    manifest = {
        "aiayn_version": __version__,
        "source": dict(source),
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        "cleaning": (
            "NFC; control characters and whitespace runs (tabs, newlines) -> one space; trimmed; "
            "pairs with an empty side dropped; training pairs with a side over max_chars "
            "characters dropped"
        ),
        "max_chars": max_chars or None,
        "splits": reports,
    }
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    (out_dir / MANIFEST_FILE).write_text(text, encoding="utf-8")
    return manifest


def _write_split(
    out_dir: Path, split: Split, src_lang: str, tgt_lang: str, max_chars: int
) -> dict[str, Any]:
    names = {src_lang: f"{split.name}.{src_lang}", tgt_lang: f"{split.name}.{tgt_lang}"}
    if split.refs:
        names["ref"] = f"{split.name}.ref"
    paths = {key: out_dir / name for key, name in names.items()}
    partial = {key: part(path) for key, path in paths.items()}
    for path in paths.values():
        remove_dead(path)  # what killed runs left (this process's too)
    dropped: Counter[str] = Counter(split.dropped)
    read = kept = 0
    handles = {key: path.open("w", encoding="utf-8", newline="\n") for key, path in partial.items()}
    try:
        for item in split.pairs:
            read += 1
            src, tgt = clean_text(item[0]), clean_text(item[1])
            reason = _drop_reason(src, tgt, src_lang, tgt_lang, max_chars)
            if reason:
                dropped[reason] += 1
                continue
            handles[src_lang].write(src + "\n")
            handles[tgt_lang].write(tgt + "\n")
            if split.refs:
                handles["ref"].write(clean_text(item[2]) + "\n")
            kept += 1
    except BaseException:
        for key, handle in handles.items():
            handle.close()
            partial[key].unlink(missing_ok=True)
        raise
    for handle in handles.values():
        handle.close()
    if kept == 0:
        for path in partial.values():
            path.unlink()
        raise PrepareError(
            f"split {split.name!r} ({split.origin}) has no usable pair: {read} read, "
            f"dropped: {dict(dropped) or 'none'}"
        )
    for key, path in paths.items():
        os.replace(partial[key], path)
    return {
        "origin": split.origin,
        "files": names,
        "pairs": kept,
        "read": read,
        "dropped": dict(sorted(dropped.items())),
    }


def _drop_reason(src: str, tgt: str, src_lang: str, tgt_lang: str, max_chars: int) -> str | None:
    if not src:
        return f"empty_{src_lang}"
    if not tgt:
        return f"empty_{tgt_lang}"
    if max_chars and max(len(src), len(tgt)) > max_chars:
        return "too_long"
    return None


def describe_manifest(manifest: Mapping[str, Any], out_dir: Path) -> str:
    """One line per split: pairs and dropped pairs, then where the manifest is.

    What ``aiayn prepare`` prints when it is done, so that a dropped-pairs count that looks wrong
    is seen before a day of training on the corpus.
    """
    lines = []
    for name, report in manifest["splits"].items():
        dropped = ", ".join(f"{n} {reason}" for reason, n in report["dropped"].items())
        files = " ".join(str(Path(out_dir) / f) for f in report["files"].values())
        lines.append(f"{name}: {report['pairs']:,} pairs (dropped: {dropped or 'none'})  {files}")
    lines.append(f"manifest: {Path(out_dir) / MANIFEST_FILE}")
    return "\n".join(lines)
