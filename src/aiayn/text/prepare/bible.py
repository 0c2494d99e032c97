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
packages). Books named with ``--test-books`` (``test_books``) are held out of ``train`` as a
``test`` split: a second held-out check, of another genre if the books are (Job and Proverbs,
poetry and wisdom, against the narrative of the validation books); by default there is none.

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
import os
import re
import shutil
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.text.prepare import DEFAULT_MAX_CHARS, PrepareError, Split, check_out_dir, write_corpus

logger = logging.getLogger(__name__)

DEFAULT_SWORD_DIR = Path("/usr/share/sword")
# The books both modules have, in their order: OSIS name → English name.
BOOKS = {
    "Gen": "Genesis", "Exod": "Exodus", "Lev": "Leviticus", "Num": "Numbers",
    "Deut": "Deuteronomy", "Josh": "Joshua", "Judg": "Judges", "Ruth": "Ruth",
    "1Sam": "1 Samuel", "2Sam": "2 Samuel", "1Kgs": "1 Kings", "2Kgs": "2 Kings",
    "1Chr": "1 Chronicles", "2Chr": "2 Chronicles", "Ezra": "Ezra", "Neh": "Nehemiah",
    "Esth": "Esther", "Job": "Job", "Ps": "Psalms", "Prov": "Proverbs", "Eccl": "Ecclesiastes",
    "Song": "Song of Songs", "Isa": "Isaiah", "Jer": "Jeremiah", "Lam": "Lamentations",
    "Ezek": "Ezekiel", "Dan": "Daniel", "Hos": "Hosea", "Joel": "Joel", "Amos": "Amos",
    "Obad": "Obadiah", "Jonah": "Jonah", "Mic": "Micah", "Nah": "Nahum", "Hab": "Habakkuk",
    "Zeph": "Zephaniah", "Hag": "Haggai", "Zech": "Zechariah", "Mal": "Malachi",
    "Matt": "Matthew", "Mark": "Mark", "Luke": "Luke", "John": "John", "Acts": "Acts",
    "Rom": "Romans", "1Cor": "1 Corinthians", "2Cor": "2 Corinthians", "Gal": "Galatians",
    "Eph": "Ephesians", "Phil": "Philippians", "Col": "Colossians", "1Thess": "1 Thessalonians",
    "2Thess": "2 Thessalonians", "1Tim": "1 Timothy", "2Tim": "2 Timothy", "Titus": "Titus",
    "Phlm": "Philemon", "Heb": "Hebrews", "Jas": "James", "1Pet": "1 Peter", "2Pet": "2 Peter",
    "1John": "1 John", "2John": "2 John", "3John": "3 John", "Jude": "Jude", "Rev": "Revelation",
}  # fmt: skip
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
INSTALL_COMMAND = "apt-get install " + " ".join(m.package for m in MODULES.values())
"""The command that installs the modules, as root (`sudo` before it otherwise)."""

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


def book_names(names: Iterable[str]) -> tuple[str, ...]:
    """The OSIS names of books given by OSIS or English name, any case, in the Bible's order.

    ``["job", "Proverbs"]`` → ``("Job", "Prov")``; empty names are skipped.

    Raises:
        PrepareError: A name is no book's, in one line that lists the books.
    """
    known = {name.lower(): osis for osis, english in BOOKS.items() for name in (osis, english)}
    chosen = set()
    for name in names:
        if not name.strip():
            continue
        osis = known.get(name.strip().lower())
        if osis is None:
            books = ", ".join(f"{osis_name} ({english})" for osis_name, english in BOOKS.items())
            raise PrepareError(f"unknown Bible book {name.strip()!r}; the books: {books}")
        chosen.add(osis)
    return tuple(osis for osis in BOOKS if osis in chosen)


def align(
    en: dict[str, str], es: dict[str, str], *, test_books: Collection[str] = ()
) -> tuple[dict[str, list[tuple[str, str, str]]], dict[str, Counter[str]]]:
    """Pairs verses with the same OSIS reference, in the order of ``en``; splits them by book.

    Args:
        en: English text per OSIS reference.
        es: Spanish text per OSIS reference.
        test_books: OSIS names of the books held out as a ``test`` split; none: no such split.

    Returns:
        Per split (``train``, ``valid``, and ``test`` if ``test_books``): the ``(en, es, ref)``
        triples, and the references found in one module only, counted as ``only_en`` and
        ``only_es``.
    """
    names = ("train", "valid", "test") if test_books else ("train", "valid")
    pairs: dict[str, list[tuple[str, str, str]]] = {name: [] for name in names}
    missing: dict[str, Counter[str]] = {name: Counter() for name in names}
    for ref, text in en.items():
        split = _split_of(ref, test_books)
        if ref in es:
            pairs[split].append((text, es[ref], ref))
        else:
            missing[split]["only_en"] += 1
    for ref in es.keys() - en.keys():
        missing[_split_of(ref, test_books)]["only_es"] += 1
    return pairs, missing


def _split_of(ref: str, test_books: Collection[str]) -> str:
    book = ref.split(".", 1)[0]
    return "valid" if book in DEV_BOOKS else "test" if book in test_books else "train"


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


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


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
    message += ("" if _is_root() else "sudo ") + INSTALL_COMMAND
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
    test_books: Iterable[str] = (),
    max_chars: int = DEFAULT_MAX_CHARS,
    force: bool = False,
) -> dict[str, Any]:
    """Builds ``train``/``valid`` ``.en``/``.es``/``.ref`` files and the manifest in ``out_dir``.

    Args:
        out_dir: Output folder, created if needed.
        sword_dir: Where the SWORD modules are installed.
        test_books: Books (OSIS or English names, see :func:`book_names`) held out of training
            as a ``test`` split, ``test.en``/``.es``/``.ref``; none (the default): no test split.
        max_chars: Longest side, in characters, of a training pair; 0 for no limit.
        force: Overwrite an existing corpus.

    Raises:
        PrepareError: A test book is unknown or a validation book, the folder already holds a
            corpus (and not ``force``), or pysword or a module is not installed.
    """
    test = book_names(test_books)
    both = [book for book in test if book in DEV_BOOKS]
    if both:
        raise PrepareError(
            f"{', '.join(both)}: a validation book cannot be a test book too (the validation "
            f"books are {', '.join(DEV_BOOKS)})"
        )
    check_out_dir(out_dir, force=force)
    check_installed(sword_dir)
    texts = {}
    for lang, module in MODULES.items():
        verses = dict(read_module(sword_dir, module))
        logger.info("%s: %d verse slots in %s", lang, len(verses), module.name)
        texts[lang] = fix_drop_caps(verses) if module.drop_caps else verses
    pairs, missing = align(texts["en"], texts["es"], test_books=test)
    origins = {
        "train": "every book in both modules except " + ", ".join((*DEV_BOOKS, *test)),
        "valid": "books " + ", ".join(DEV_BOOKS),
        "test": "books " + ", ".join(test),
    }
    splits = [
        Split(name, origins[name], split, refs=True, dropped=missing[name])
        for name, split in pairs.items()
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
