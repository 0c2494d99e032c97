"""``aiayn prepare bible-en-es``: a verse-aligned English–Spanish Bible from Debian's SWORD modules.

Both texts are public domain and ship as Debian packages, so the corpus needs no download beyond
``apt-get``:

============  ===================  ==============================================  ==============
side          Debian package       SWORD module                                    versification
============  ===================  ==============================================  ==============
``en``        ``sword-text-web``   ``engWEB2015eb``: World English Bible           NRSVA
``es``        ``sword-text-sparv`` ``spaRV1909eb``: Reina-Valera 1909              KJV
============  ===================  ==============================================  ==============

The modules are read with `pysword <https://pypi.org/project/pysword/>`_ from the SWORD data
folder (``/usr/share/sword`` on Debian). Each verse's OSIS markup is stripped to plain text
(:func:`strip_osis`), verses are aligned by their OSIS reference (``Gen.1.1``: same book,
chapter and verse in both), and the corpus is split by book: ``valid`` = Ruth, Jonah and Mark
(810 pairs), ``train`` = every other book both modules have (30,267 pairs with Debian bookworm's
packages).

What this leaves as it is: a reference present in one module only (the Deuterocanon of the WEB,
or a verse one versification has and the other lacks) is dropped and counted; a verse empty on
either side is dropped and counted. Where the two editions number verses differently (a clause
moved to the next verse, 3 John 1:14-15, ...), the aligned pairs are a verse off for a few lines;
the corpus does not realign them by hand.
"""

from __future__ import annotations

import functools
import html
import logging
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.text.prepare import DEFAULT_MAX_CHARS, PrepareError, Split, check_out_dir, write_corpus

logger = logging.getLogger(__name__)

DEFAULT_SWORD_DIR = Path("/usr/share/sword")
DEV_BOOKS = ("Ruth", "Jonah", "Mark")  # OSIS book names


@dataclass(frozen=True)
class Module:
    """A SWORD Bible module and the Debian package that installs it."""

    name: str
    package: str
    drop_caps: bool  # chapters open with an all-capitals word (a printed drop cap)


MODULES = {
    "en": Module("engWEB2015eb", "sword-text-web", drop_caps=False),
    "es": Module("spaRV1909eb", "sword-text-sparv", drop_caps=True),
}
INSTALL_COMMAND = "sudo apt-get install " + " ".join(m.package for m in MODULES.values())

# -- markup ---------------------------------------------------------------------------------

# Elements dropped with their content: notes (footnotes, cross references) and non-canonical
# titles (section headings); speaker labels in the Song of Songs are not part of the verse.
_DROPPED = re.compile(
    r"<note\b[^>]*/>|<note\b.*?</note>"
    r"|<title\b(?![^>]*canonical=\"true\")[^>]*>.*?</title>"
    r"|<speaker\b[^>]*>.*?</speaker>",
    re.DOTALL,
)
# Words the translators added (italics in print) are often set against their neighbours with
# no space in the source: "para siempre</w><transChange>es</transChange><w>su".
_ADDED = re.compile(r"</?transChange\b[^>]*>")
# Elements that separate text like a line break: poetry lines, paragraphs, list items, ...
_BREAK = re.compile(r"</?(?:l|lg|lb|p|div|list|item|chapter|title|table|row|cell)\b[^>]*>")
_TAG = re.compile(r"<[^>]*>")
# The end of a book: what follows in the last verse's entry (a glossary) is not Bible text.
_BOOK_END = re.compile(r"<div\b(?=[^>]*\beID=)(?=[^>]*\btype=\"book\")[^>]*>")
_GAP = "\x00"  # where dropped content or an added-word boundary was; see _close_gap
_ENDS_WORD = ".,;:!?’”)]»"
_STARTS_WORD = "“‘([¿¡«"


def strip_osis(markup: str) -> str:
    """The plain text of one verse of OSIS markup.

    Notes, section headings and speaker labels are dropped with their content, and so is
    anything after the end of the book; canonical titles (the Psalms' superscriptions, part of
    the text) and every other element keep their text. Where a note was, or where an added word
    (``transChange``) touches its neighbours, a space separates two words ("God<note/>created"
    → "God created") but nothing comes before punctuation ("gerahs<note/>);" → "gerahs);").
    Whitespace is left for :func:`aiayn.text.prepare.clean_text` to collapse.
    """
    book_end = _BOOK_END.search(markup)
    if book_end:
        markup = markup[: book_end.start()]
    text = _DROPPED.sub(_GAP, markup)
    text = _ADDED.sub(_GAP, text)
    text = _BREAK.sub(" ", text)
    text = _TAG.sub("", text)
    text = re.sub(f"{_GAP}+", _close_gap, text)
    return html.unescape(text)


def _close_gap(match: re.Match[str]) -> str:
    text, start, end = match.string, match.start(), match.end()
    before = text[start - 1] if start else " "
    after = text[end] if end < len(text) else " "
    word_before = before.isalnum() or before in _ENDS_WORD
    word_after = after.isalnum() or after in _STARTS_WORD
    return " " if word_before and word_after else ""


_CAPS_WORD = re.compile(r"\b[^\W\d_]{2,}\b")
_SENTENCE_START = re.compile(r"(?:^|[.!?:][\s“‘]*|[¡¿“‘]\s*)$")
_WORD = re.compile(r"[^\W\d_]+")


def fix_drop_caps(verses: dict[str, str]) -> dict[str, str]:
    """ "Y SIGUIÓ Jacob" → "Y siguió Jacob": the capitalised first word of each chapter.

    Reina-Valera prints each chapter's first word in capitals, a printed drop cap. The word
    becomes a name ("JEHOVÁ" → "Jehová") if the module mostly writes it capitalised, else an
    ordinary word, capitalised only where a sentence starts ("¡OH Jehová" → "¡Oh Jehová").
    """
    counts = Counter(w for text in verses.values() for w in _WORD.findall(text))
    fixed = dict(verses)
    for ref, text in verses.items():
        if ref.endswith(".1"):
            fixed[ref] = _fix_drop_cap(text, counts)
    return fixed


def _fix_drop_cap(text: str, counts: Counter[str]) -> str:
    for match in _CAPS_WORD.finditer(text):
        word = match.group()
        if not word.isupper():
            continue
        lower, title = word.lower(), word.capitalize()
        at_start = _SENTENCE_START.search(text[: match.start()]) is not None
        new = title if at_start or counts[title] > counts[lower] else lower
        return text[: match.start()] + new + text[match.end() :]
    return text


# -- alignment ------------------------------------------------------------------------------


def align(
    en: dict[str, str], es: dict[str, str]
) -> tuple[dict[str, list[tuple[str, str, str]]], dict[str, Counter[str]]]:
    """Pairs verses with the same OSIS reference, in the order of ``en``; splits them by book.

    Returns:
        Per split (``train``, ``valid``): the ``(en, es, ref)`` triples, and the references
        found in one module only, counted as ``only_en`` and ``only_es``.
    """
    pairs: dict[str, list[tuple[str, str, str]]] = {"train": [], "valid": []}
    missing: dict[str, Counter[str]] = {"train": Counter(), "valid": Counter()}
    for ref, text in en.items():
        split = _split_of(ref)
        if ref in es:
            pairs[split].append((text, es[ref], ref))
        else:
            missing[split]["only_en"] += 1
    for ref in es.keys() - en.keys():
        missing[_split_of(ref)]["only_es"] += 1
    return pairs, missing


def _split_of(ref: str) -> str:
    return "valid" if ref.split(".", 1)[0] in DEV_BOOKS else "train"


# -- reading SWORD modules ------------------------------------------------------------------


def read_module(sword_dir: Path, module: Module) -> Iterator[tuple[str, str]]:
    """Yields ``(OSIS reference, plain text)`` for every verse slot of the module, in order."""
    from pysword.modules import SwordModules

    library = SwordModules(str(sword_dir))
    library.parse_modules()
    bible = library.get_bible_from_module(module.name)
    # pysword inflates a whole compressed book for every verse it returns; keeping the last
    # blocks turns minutes into seconds (a private method: without it, only slower).
    if hasattr(bible, "_decompressed_text"):
        bible._decompressed_text = functools.lru_cache(maxsize=4)(bible._decompressed_text)
    for books in bible.get_structure().get_books().values():
        for book in books:
            for chapter, n_verses in enumerate(book.chapter_lengths, start=1):
                for verse in range(1, n_verses + 1):
                    markup = bible.get(
                        books=[book.osis_name], chapters=[chapter], verses=[verse], clean=False
                    )
                    yield f"{book.osis_name}.{chapter}.{verse}", strip_osis(markup)


def module_info(sword_dir: Path, module: Module) -> dict[str, str]:
    """The module's name, package, version and versification, from its ``.conf`` file."""
    from pysword.modules import SwordModules

    conf = SwordModules(str(sword_dir)).parse_modules()[module.name]
    return {
        "module": module.name,
        "package": module.package,
        "version": conf.get("version", "unknown"),
        "versification": conf.get("versification", "KJV"),
    }


def check_installed(sword_dir: Path) -> None:
    """Raises a `PrepareError` that says how to install what is missing."""
    try:
        import pysword  # noqa: F401
    except ImportError as err:
        raise PrepareError(
            "aiayn prepare bible-en-es reads the SWORD modules with pysword, which is not "
            "installed: pip install 'aiayn[data]' (or: pip install pysword)"
        ) from err
    missing = [m for m in MODULES.values() if not _conf_file(sword_dir, m.name)]
    if not missing:
        return
    what = ", ".join(f"{m.name} (Debian package {m.package})" for m in missing)
    message = f"the SWORD module(s) {what} are not installed in {sword_dir}. Install with: "
    message += INSTALL_COMMAND
    if shutil.which("apt-get") is None:
        message += (
            " — but apt-get is not available here: on a system without Debian packages, "
            "install the SWORD modules WEB and RV1909 another way (e.g. CrossWire's module "
            "installer) and pass their folder with --sword-dir"
        )
    raise PrepareError(message)


def _conf_file(sword_dir: Path, name: str) -> Path | None:
    folder = Path(sword_dir) / "mods.d"
    if not folder.is_dir():
        return None
    return next((p for p in folder.glob("*.conf") if p.stem.lower() == name.lower()), None)


# -- the recipe -----------------------------------------------------------------------------


def prepare_bible(
    out_dir: Path,
    *,
    sword_dir: Path = DEFAULT_SWORD_DIR,
    max_chars: int = DEFAULT_MAX_CHARS,
    force: bool = False,
) -> dict[str, Any]:
    """Builds ``train``/``valid`` ``.en``/``.es``/``.ref`` files and the manifest in ``out_dir``."""
    check_out_dir(out_dir, force=force)
    check_installed(sword_dir)
    texts = {}
    for lang, module in MODULES.items():
        verses = dict(read_module(sword_dir, module))
        logger.info("%s: %d verse slots in %s", lang, len(verses), module.name)
        texts[lang] = fix_drop_caps(verses) if module.drop_caps else verses
    pairs, missing = align(texts["en"], texts["es"])
    origins = {
        "train": "every book in both modules except " + ", ".join(DEV_BOOKS),
        "valid": "books " + ", ".join(DEV_BOOKS),
    }
    splits = [
        Split(name, origins[name], pairs[name], refs=True, dropped=missing[name])
        for name in ("train", "valid")
    ]
    source = {
        "kind": "sword",
        "sword_dir": str(sword_dir),
        "modules": {lang: module_info(sword_dir, m) for lang, m in MODULES.items()},
        "alignment": "same OSIS reference (book.chapter.verse) in both modules",
    }
    return write_corpus(
        out_dir,
        splits,
        src_lang="en",
        tgt_lang="es",
        source=source,
        max_chars=max_chars,
        force=force,
    )
