"""The pages a user reads (README.md, docs/*.md, BENCHMARKS.md) state the present and name only
what exists: no commit hashes, issue numbers or history; every `aiayn` command in them parses and
names the files that `aiayn prepare` writes; docs/settings.md has a row for every setting, with
its default.

Fast: text and argparse only (no model, no torch work). The blocks are read as
tests/integration/doc_blocks.py reads them for the tests that run them.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from aiayn.cli import build_parser
from aiayn.config import ModelConfig, TrainConfig
from aiayn.decode.options import DecodingOptions
from aiayn.text.prepare.hf import STANDARD_SPLITS
from integration.doc_blocks import ROOT, CodeBlock, aiayn_commands, code_blocks

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = DOCS + [p for p in [ROOT / "BENCHMARKS.md"] if p.exists()]
SETTINGS = ROOT / "docs" / "settings.md"

HEX = re.compile(r"(?<![\w/#.-])[0-9a-f]{7,40}(?![\w-])")
# `issue 29`, `issue #29`, `issues 28 and 30`, `PR 12`, `(#28 item 6)`; a reference into another
# project (`pytorch#56297`, `OpenNMT/CTranslate2#2078`) and a link's anchor (`page.md#7-...`)
# are not this repository's.
ISSUE = re.compile(
    r"\b(?:issues?|pull request|PR)\s+#?\d+|(?<![\w/.)\]-])#\d+\b(?!-)", re.IGNORECASE
)
HISTORY = re.compile(
    r"old CLI|it used to|used to be|until this fix|as of commit|since commit|at commit"
    r"|before commit|the recipe before|the old recipe|the old default|old server|it was a \d"
    r"|earlier releases'? default|today's recipe|then scoring|model then\b|before it scored"
    r"|after the recipe took|(?<![.\w])[a-z][\w-]*#\d+\b(?!-)",
    re.IGNORECASE,
)


def git_commits(candidates: set[str]) -> set[str]:
    """Those of ``candidates`` that name a commit of this checkout; every one that looks like a
    hash (digits and letters) where there is no git checkout to ask."""
    if not (ROOT / ".git").exists():
        return {c for c in candidates if re.search(r"\d", c) and re.search(r"[a-f]", c)}
    ordered = sorted(candidates)
    answer = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objecttype)"],
        cwd=ROOT,
        input="".join(f"{c}^{{commit}}\n" for c in ordered),
        capture_output=True,
        text=True,
        check=True,
    )
    kinds = answer.stdout.splitlines()
    return {c for c, kind in zip(ordered, kinds, strict=True) if kind == "commit"}


def lines_matching(path: Path, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return [
        (number, match.group(0))
        for number, line in enumerate(text.splitlines(), 1)
        for match in pattern.finditer(line)
    ]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_no_commit_hash_issue_number_or_history(path: Path) -> None:
    hexes = lines_matching(path, HEX)
    commits = git_commits({h for _, h in hexes})
    found = [f"{path.name}:{n}: commit {h}" for n, h in hexes if h in commits]
    found += [f"{path.name}:{n}: {ref!r}" for n, ref in lines_matching(path, ISSUE)]
    found += [f"{path.name}:{n}: history {words!r}" for n, words in lines_matching(path, HISTORY)]
    assert not found, "say what is true now (git keeps the history):\n" + "\n".join(found)


def test_the_checks_find_what_they_are_for() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if head:
        assert git_commits({head, "0123abc"}) == {head}
    assert [m.group(0) for m in HEX.finditer(f"at {head or 'abc1234'}, see page.md#abc1234")] == [
        head or "abc1234"
    ]
    text = "issue 29, issues 28, (#28 item 6), pytorch#56297, tutorial.md#7-export, PR #3"
    assert [m.group(0) for m in ISSUE.finditer(text)] == ["issue 29", "issues 28", "#28", "PR #3"]
    assert HISTORY.search("(old CLI: a traceback)") and HISTORY.search("It used to hang")
    assert HISTORY.search("its output layer then scoring every piece")
    assert HISTORY.search("a random order, safetensors#584")
    assert not HISTORY.search("see tutorial.md#4-evaluate")


# What `aiayn prepare` writes into its output folder: a file per split and side (`train.en`,
# `valid.ref`) and manifest.json. `bible-en-es` has no test split.
PREPARED_FILE = re.compile(r"(?:\$\{?DATA\}?|\bDATA|\bdata/([\w-]+))/([\w.-]+)")


def prepared_files_named(text: str) -> list[tuple[str, str]]:
    """(corpus folder, file) for each path into a prepared corpus that ``text`` names: a
    placeholder `DATA`/`$DATA`, or `data/NAME`."""
    return [(m.group(1) or "DATA", m.group(2)) for m in PREPARED_FILE.finditer(text)]


def is_prepared_file(corpus: str, name: str) -> bool:
    if name == "manifest.json":
        return True
    split, _, side = name.partition(".")
    splits = set(STANDARD_SPLITS) - ({"test"} if corpus == "bible-en-es" else set())
    return split in splits and bool(re.fullmatch(r"[a-z]{2,3}|ref", side))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_aiayn_command_in_the_docs_parses_and_names_prepared_files(path: Path) -> None:
    """Flags that were renamed or never existed, and corpus files that `aiayn prepare` does not
    write (`DATA/dev.en`), fail here, without running anything."""
    shown = [  # a command shown with its output: `$ .venv/bin/aiayn ...` in a text block
        line[2:]
        for b in code_blocks(path, "text")
        for line in b.text.splitlines()
        if line[:2] == "$ "
    ]
    for block in [*code_blocks(path), *(CodeBlock("sh", line, "") for line in shown)]:
        for args in aiayn_commands(block.text):
            try:
                build_parser().parse_args(args)
            except SystemExit as error:
                pytest.fail(f"{path.name}: `aiayn {shlex.join(args)}` does not parse ({error})")
        for corpus, name in prepared_files_named(block.text):
            assert is_prepared_file(corpus, name), (
                f"{path.name}: {corpus}/{name} is not a file `aiayn prepare` writes "
                f"({', '.join(STANDARD_SPLITS)}.LANG, .ref, manifest.json)"
            )


def test_the_file_check_knows_the_prepared_names() -> None:
    assert prepared_files_named("--src $DATA/valid.en --ref DATA/dev.es data/wmt/test.de") == [
        ("DATA", "valid.en"),
        ("DATA", "dev.es"),
        ("wmt", "test.de"),
    ]
    assert is_prepared_file("DATA", "valid.ref") and not is_prepared_file("DATA", "dev.en")
    assert not is_prepared_file("bible-en-es", "test.en")


# docs/settings.md: one row per setting, `--flag` first, its default second.


def settings_rows() -> dict[str, str]:
    """{flag: its row's default cell}, for every table row of docs/settings.md whose first cell
    names flags (`--max-tokens`, `--model d_model=N`)."""
    rows = {}
    for line in SETTINGS.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3:
            continue
        for flag in re.findall(r"`(--model \w+|--[\w-]+)", cells[0]):
            rows.setdefault(flag, cells[1])
            rows.setdefault(flag.split(" ")[0], cells[1])  # `--model d_model=N` is `--model`
    return rows


def same_default(shown: str, value: object) -> bool:
    """Whether the page's default cell (its first word) says ``value``: `on`/`off` for a
    switch, `—` for unset, a number as a number."""
    if isinstance(value, bool):
        return shown == ("on" if value else "off")
    if value is None or value == {}:
        return shown == "—"
    if isinstance(value, (int, float)):
        try:
            return float(shown) == value
        except ValueError:
            return False
    return shown == str(value)


def check_rows(rows: dict[str, str], flags: dict[str, object]) -> list[str]:
    problems = []
    for flag, default in flags.items():
        if flag not in rows:
            problems.append(f"{flag}: no row")
            continue
        shown = rows[flag].replace("`", "").replace(",", "").split(" ")[0]
        if not same_default(shown, default):
            problems.append(f"{flag}: the row says {rows[flag]!r}, the default is {default!r}")
    return problems


def test_the_settings_page_has_every_training_setting_with_its_default() -> None:
    flags = {
        "--" + f.name.replace("_", "-"): f.default
        for f in dataclasses.fields(TrainConfig)
        if f.name != "model"
    }
    problems = check_rows(settings_rows(), flags)
    assert not problems, "docs/settings.md, training settings:\n" + "\n".join(problems)


def test_the_settings_page_has_every_model_field_with_the_base_default() -> None:
    base = ModelConfig(src_vocab_size=8, tgt_vocab_size=8)
    flags = {
        f"--model {f.name}": getattr(base, f.name) if f.name not in ("d_k", "d_v") else None
        for f in dataclasses.fields(ModelConfig)
        if f.name not in ("src_vocab_size", "tgt_vocab_size")
    }
    problems = check_rows(settings_rows(), flags)
    assert not problems, "docs/settings.md, model fields:\n" + "\n".join(problems)


def test_the_settings_page_has_every_decoding_default() -> None:
    fields = dataclasses.fields(DecodingOptions)
    flags = {"--" + f.name.replace("_", "-"): f.default for f in fields}
    problems = check_rows(settings_rows(), flags)
    assert not problems, "docs/settings.md, decoding defaults:\n" + "\n".join(problems)


@pytest.mark.parametrize("command", ["train", "translate", "evaluate"])
def test_the_settings_page_names_every_flag_of(command: str) -> None:
    """Flags that are no dataclass field (`--resume`, `--workers`, `--int8`) need a row too.
    (`aiayn serve`'s own flags are docs/serving.md's.)"""
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    given = {
        option
        for action in sub.choices[command]._actions
        if action.help != "==SUPPRESS=="
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    flags = {f for f in given if not (f.startswith("--no-") and "--" + f[5:] in given)}
    rows = settings_rows()
    missing = sorted(f for f in flags if f not in rows)
    assert not missing, f"docs/settings.md has no row for aiayn {command} {', '.join(missing)}"


def test_the_settings_page_lists_what_a_resume_may_change() -> None:
    from aiayn.train.rundir import RESUMABLE

    text = SETTINGS.read_text(encoding="utf-8")
    [listed] = re.findall(r"A resume may change only these\s+settings:(.*?)\.\n", text, re.S)
    named = {flag.lstrip("-").replace("-", "_") for flag in re.findall(r"`(--[\w-]+)`", listed)}
    assert named == set(RESUMABLE) - {"out_dir"}


SOURCE_PATH = re.compile(r"\b(?:bench|recipes|tools|tests|src/aiayn)/[\w/.-]*\w\.(?:py|yaml|sh)\b")
MAKE = re.compile(r"^\s*(?:sudo )?make ([\w-]+)", re.MULTILINE)  # a command in a block
INLINE_MAKE = re.compile(r"`(?:sudo )?make ([\w-]+)")  # and in the text


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_the_scripts_recipes_and_make_targets_the_docs_name_exist(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    named = {m.group(0) for m in SOURCE_PATH.finditer(text)}
    missing = sorted(name for name in named if not (ROOT / name).exists())
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    commands = "\n".join(block.text for block in code_blocks(path))
    named_targets = set(MAKE.findall(commands)) | set(INLINE_MAKE.findall(text))
    missing += sorted(f"make {t}" for t in named_targets - targets)
    assert not missing, f"{path.name} names what this checkout lacks: {', '.join(missing)}"
