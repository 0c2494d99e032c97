"""BENCHMARKS.md is what bench/page.py makes of the records in bench/results/ (`make
benchmarks-page`), and the page marks a row whose source changed since it was measured."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import page  # noqa: E402
import runner  # noqa: E402


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return page.load()


@pytest.fixture(scope="module")
def current(records: list[dict[str, Any]]) -> dict[str, str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git checkout: the page's markers need this tree's source hashes")
    hashes = page.current_hashes(records)
    if hashes is None:
        pytest.skip("git cannot say this tree's source hashes")
    return hashes


@pytest.fixture(scope="module")
def history(records: list[dict[str, Any]], current: dict[str, str]) -> None:
    """The commits the records measured, which `page.older` compares (a shallow clone lacks)."""
    if runner.missing_commits(sorted({r["commit"] for r in records if r.get("commit")})):
        pytest.skip("this clone lacks commits the records measured: git fetch --unshallow")


def test_benchmarks_md_is_what_the_records_make(
    records: list[dict[str, Any]], current: dict[str, str], history: None
) -> None:
    made = page.render(records, current)
    assert (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8") == made, (
        "BENCHMARKS.md is not what bench/results/ makes: run `make benchmarks-page`"
    )


def test_the_page_is_short_and_states_the_present(
    records: list[dict[str, Any]], current: dict[str, str], history: None
) -> None:
    text = page.render(records, current)
    # One present table per measurement and setup, the other machines' named in a line each,
    # no history.
    assert len(text.splitlines()) <= 300
    assert "## What to expect" in "\n".join(text.splitlines()[:20])
    # a run of 7+ hex digits with a letter among them (a number such as 4194292 is not one)
    assert not re.search(r"\b(?=[0-9]*[a-f])[0-9a-f]{7,40}\b", text), "a commit hash on the page"
    assert not re.search(r"\bissue #?\d+|#\d+\b", text, re.IGNORECASE), "an issue number"
    assert not re.search(r"DATA/dev\.", text), "`aiayn prepare` writes valid.*, not dev.*"


def test_every_record_names_what_the_page_shows(records: list[dict[str, Any]]) -> None:
    for rec in records:
        assert rec["task"] in page.TASKS and rec["task"] in runner.SOURCES
        assert rec["machine"]["name"] and rec["date"] and rec["command"]
        assert rec["rows"] and all(len(c) == 2 for c in rec["columns"])
        now = {"src", *runner.SOURCES[rec["task"]]}  # or a folder it now names file by file
        for path in rec["sources"] or {}:
            assert path in now or any(s.startswith(path + "/") for s in now), path


def test_a_row_whose_source_changed_is_marked() -> None:
    paths = runner.SOURCES["translate"]
    fresh = {
        "task": "translate", "table": "a file", "setup": "a model", "date": "2030-01-01 00:00",
        "command": "python bench/translate.py -m MODEL --data DATA", "notes": [],
        "machine": {"name": "a CPU"}, "versions": {"torch": "2"}, "summary": "fast",
        "sources": {"src": "x", **runner.source_hashes(paths)},
        "columns": [["system", "system"], ["wall_s", "wall time, s (rounds)"]],
        "rows": [{"system": "aiayn translate", "wall_s": runner.figures([2.0, 1.0, 3.0])}],
    }  # fmt: skip
    text = page.render([fresh], page.current_hashes([fresh]))
    assert "| a file | a CPU | 2030-01-01 | fast |" not in text  # the task's name, not the table's
    assert "| aiayn translate | 2.0 (2.0, 1.0, 3.0) | 2030-01-01 |" in text
    changed = copy.deepcopy(fresh)
    changed["sources"]["src/aiayn/decode"] = "0" * 40
    # a current table of the task elsewhere (a task with none names its tables in one line)
    elsewhere = {**copy.deepcopy(fresh), "machine": {"name": "another CPU"}}
    elsewhere["columns"], elsewhere["rows"] = fresh["columns"][:1], [{"system": "aiayn"}]
    text = page.render([changed, elsewhere], page.current_hashes([changed]))
    assert f"| aiayn translate | 2.0 (2.0, 1.0, 3.0) | 2030-01-01, {page.OLDER} |" in text
    later = {**copy.deepcopy(fresh), "date": "2030-02-01 00:00"}  # the latest of a setup wins
    text = page.render([changed, later], page.current_hashes([changed, later]))
    assert "2030-02-01 |" in text and f", {page.OLDER} |" not in text


def test_a_change_to_comments_and_docstrings_leaves_a_row_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("git") is None:
        pytest.skip("no git")
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):  # as under a git hook
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runner, "ROOT", tmp_path)  # a repository of its own
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    a = 'class A:\n    """A."""\n\n    def f(self, x):\n        return x + 1  # one\n'
    first = {"lib/a.py": a, "lib/logo.png": "\x89PNG\n", "recipe.yaml": "a: 1  # one\n"}

    def commit(files: dict[str, str]) -> None:
        for old in tmp_path.glob("lib/*"):
            old.unlink()
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text(text, encoding="latin-1")
        subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
        subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)

    commit(first)
    rec = {"commit": runner.git("rev-parse", "HEAD"), "uncommitted": False,
           "sources": runner.source_hashes(("lib", "recipe.yaml"))}  # fmt: skip

    def older_after(changed: dict[str, str]) -> bool:
        commit({**first, **changed})
        return page.older(rec, page.current_hashes([rec]))

    assert not page.older(rec, page.current_hashes([rec]))
    docs = a.replace('"""A."""', '"""A, said again."""\n    # a comment').replace(
        "x):\n", 'x):\n        """Doc."""\n'
    )
    same = {"lib/a.py": docs, "recipe.yaml": "a: 1\n"}
    assert not older_after(same)  # other hashes, the same code
    current = page.current_hashes([rec])
    assert page.older({**rec, "uncommitted": True}, current)  # what it measured is not known
    assert page.older({**rec, "commit": "0" * 40}, current)  # a commit this clone lacks
    assert page.older({**rec, "commit": "--output=x"}, current) and not (tmp_path / "x").exists()
    assert older_after({"lib/a.py": a.replace("x + 1", "x + 2")})
    assert older_after({"lib/a.py": a.replace("# one", "\n    X = 'a string'")})
    assert older_after({"lib/a.py": a + 'f"{A}"\n'})  # an f-string is code
    assert older_after({"lib/logo.png": "\x89PNG\r\n"})  # not Python: its bytes
    assert older_after({"lib/b.py": ""})  # a file added
    assert older_after({"recipe.yaml": "a: 2\n"})  # the recipe's values
    assert not older_after({"recipe.yaml": "a: 1\n"})
    # A task whose sources now name a stored folder's files: other files of it do not count.
    monkeypatch.setitem(page.SOURCES, "t", ("lib/a.py", "recipe.yaml"))
    rec["task"] = "t"
    assert not older_after({"lib/b.py": "x = 1\n"})
    assert older_after({"lib/a.py": a.replace("x + 1", "x + 2")})


def test_another_machines_older_table_is_named_in_one_line(current: dict[str, str]) -> None:
    paths = runner.SOURCES["translate"]
    fresh = {
        "task": "translate", "table": "a file", "setup": "a model", "date": "2030-01-01 00:00",
        "command": "python bench/translate.py -m MODEL --data DATA", "notes": ["a note"],
        "machine": {"name": "CPU A"}, "versions": {"torch": "2"}, "summary": "fast",
        "sources": {"src": "x", **runner.source_hashes(paths)},
        "columns": [["system", "system"], ["wall_s", "wall time, s (rounds)"]],
        "rows": [{"system": "aiayn translate", "wall_s": runner.figures([2.0, 1.0, 3.0])}],
    }  # fmt: skip
    older = copy.deepcopy(fresh)
    older["machine"]["name"], older["summary"] = "CPU B", "slow"
    older["sources"]["src/aiayn/decode"] = "0" * 40
    older["rows"][0]["wall_s"] = runner.figures([9.0, 8.0, 7.0])
    peer = {**copy.deepcopy(fresh), "setup": "a peer", "summary": "faster"}
    text = page.render([fresh, older, peer], page.current_hashes([fresh]))
    assert "### A file: CPU B" not in text and "bench/results/translate.jsonl keeps" in text
    assert "keeps the figures): a file, CPU B (2030-01-01)." in text
    assert "8.0 (9.0, 8.0, 7.0)" not in text and "| 2.0 (2.0, 1.0, 3.0) |" in text
    assert "| CPU A | 2030-01-01 | a model: fast |" in text  # a row a setup
    assert "| CPU A | 2030-01-01 | a peer: faster |" in text
    assert "slow" not in text  # the summary shows the current rows alone
    # Without a current table of those columns, the older one keeps its rows.
    narrower = {**copy.deepcopy(fresh), "columns": fresh["columns"][:1]}
    narrower["rows"] = [{"system": "aiayn translate"}]
    older["columns"] = [*older["columns"], ["bleu", "BLEU"]]
    older["rows"][0]["bleu"] = 30.0
    text = page.render([narrower, older], page.current_hashes([narrower]))
    assert "8.0 (9.0, 8.0, 7.0)" in text
    # A task with no current row keeps its summary line and names its tables in one line.
    text = page.render([older], page.current_hashes([narrower]))
    assert "8.0 (9.0, 8.0, 7.0)" not in text
    assert "| CPU B | 2030-01-01, older source | a model: slow |" in text
    assert "keeps the figures): a file, CPU B (2030-01-01)." in text


def test_one_measurement_on_the_current_source_shows_the_machine_measured_last() -> None:
    """Of one measurement (a table's title) current on two machines, the page shows the table
    of the machine measured last and names the other's in one line; the summary at the top
    gives both machines' results."""
    paths = runner.SOURCES["serve"]
    later = {
        "task": "serve", "table": "one text a request", "setup": "a model",
        "date": "2030-01-02 00:00", "command": "python bench/serve.py -m MODEL",
        "summary": "30 requests/s", "machine": {"name": "CPU A"}, "versions": {"torch": "2"},
        "sources": {"src": "x", **runner.source_hashes(paths)},
        "columns": [["server", "server"], ["rps", "requests/s"]],
        "rows": [{"server": "aiayn serve", "rps": 29.8}],
    }  # fmt: skip
    earlier = {**copy.deepcopy(later), "machine": {"name": "CPU B"}, "date": "2030-01-01 00:00"}
    earlier["rows"], earlier["summary"] = [{"server": "aiayn serve", "rps": 17.4}], "17 requests/s"
    text = page.render([earlier, later], page.current_hashes([later]))
    assert "### One text a request: CPU A" in text and "| aiayn serve | 29.8 |" in text
    assert "### One text a request: CPU B" not in text and "| aiayn serve | 17.4 |" not in text
    assert "| CPU B | 2030-01-01 | a model: 17 requests/s |" in text  # in the summary
    assert (
        f"{page.ELSEWHERE_WHY} (bench/results/serve.jsonl keeps the figures): one text a "
        "request, CPU B (2030-01-01)."
    ) in text
    # Another measurement of CPU B's alone keeps its table.
    alone = {**copy.deepcopy(earlier), "table": "hostile requests"}
    text = page.render([earlier, later, alone], page.current_hashes([later]))
    assert "### Hostile requests: CPU B" in text
    # The summary keeps a machine's rows together, though its tables' dates interleave.
    third = {**copy.deepcopy(earlier), "machine": {"name": "CPU C"}, "table": "hostile requests"}
    third["summary"], third["date"] = "hostile on C", "2029-12-31 00:00"
    oldest = {**copy.deepcopy(earlier), "table": "batching", "date": "2029-12-30 00:00"}
    oldest["summary"] = "batching on B"
    text = page.render([earlier, later, third, oldest], page.current_hashes([later]))
    summary = [
        line.split(" | ")[3].removesuffix(" |")
        for line in text.splitlines()
        if line.startswith("| Serving")
    ]
    assert summary == ["a model: 30 requests/s", "a model: 17 requests/s",
                       "a model: batching on B", "a model: hostile on C"]  # fmt: skip


def test_a_record_is_one_line_of_json_with_the_machine_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["bench/translate.py", "-m", "MODEL", "--setup", "the 2+2 model", "--machine=CPU A"]
    monkeypatch.setattr(sys, "argv", [*argv, "--record", "r.jsonl", "--busy-ok"])
    rec = runner.record(
        "translate", table="t", setup="s", columns=[("system", "system")],
        rows=[{"system": "aiayn translate"}], summary="", peers=("no-such-peer",),
    )  # fmt: skip
    # The labels and the record's place are left out; what changes the measurement stays.
    assert rec["command"] == "python bench/translate.py -m MODEL --busy-ok"
    assert rec["machine"]["cores"] >= 1 and set(rec["machine"]["flags"]) <= {
        "AVX2", "AVX-512", "AVX512-BF16", "AMX"
    }  # fmt: skip
    assert rec["versions"]["no-such-peer"] is None and rec["versions"]["torch"]
    if rec["sources"] is not None:  # a git checkout
        assert set(rec["sources"]) == {"src", *runner.SOURCES["translate"]}
    args = type("Args", (), {"no_record": False, "record": tmp_path / "r.jsonl"})()
    runner.write(rec, args)
    runner.write(rec, args)
    lines = (tmp_path / "r.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [rec, rec]


def numbers_in(value: Any) -> set[float]:
    """Every number a record holds, in its fields and in its text."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int | float):
        return {float(value)}
    if isinstance(value, str):
        return {float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", value)}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(*(numbers_in(v) for v in value)) if value else set()
    return set()


def test_a_table_with_current_setups_shows_those_alone() -> None:
    paths = runner.SOURCES["recipe"]
    fresh = {
        "task": "recipe", "table": "the recipe", "setup": "corpus B", "date": "2030-01-02 00:00",
        "command": "python bench/study.py run DATA RUNS recipe", "summary": "BLEU 22",
        "machine": {"name": "CPU A"}, "versions": {"torch": "2"},
        "sources": {"src": "x", **runner.source_hashes(paths)},
        "columns": [["updates", "updates"], ["bleu", "BLEU"]],
        "rows": [{"updates": 1908, "bleu": 22.78}],
    }  # fmt: skip
    older = {**copy.deepcopy(fresh), "setup": "corpus A", "date": "2030-01-01 00:00"}
    older["sources"]["src/aiayn/train"] = "0" * 40
    older["rows"] = [{"updates": 2504, "bleu": 24.62}]
    text = page.render([older, fresh], page.current_hashes([fresh]))
    assert "22.78" in text and "24.62" not in text and "corpus A" not in text
    # An older setup of another command (another run of a study) or of other columns is left
    # out too: the records keep it.
    for change in ("command", "columns"):
        other = copy.deepcopy(older)
        other["command"] += " S2" if change == "command" else ""
        if change == "columns":
            other["columns"] = [*other["columns"], ["chrf", "chrF"]]
            other["rows"][0]["chrf"] = 46.06
        text = page.render([other, fresh], page.current_hashes([fresh]))
        assert "22.78" in text and "24.62" not in text and "older source" not in text
    # A table all on older source keeps its rows, marked, where its machine has no current table
    # of the task and no current table covers its measurement (its columns).
    stale = copy.deepcopy(older)
    stale["machine"] = {"name": "CPU B"}
    stale["table"] = "another measurement"
    stale["columns"] = [*stale["columns"], ["chrf", "chrF"]]
    text = page.render([stale, fresh], page.current_hashes([fresh]))
    assert "24.62" in text and "older source" in text


def test_the_readmes_results_come_from_records(records: list[dict[str, Any]]) -> None:
    """Each figure in the tables of README's results section is one a record holds (rounded as
    the README writes it): the README copies records, it does not measure."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("<!-- bible-results:start -->")[1].split("<!-- bible-results:end -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    body = [row for row in rows[2:] if not set(row) <= set("|-: ")]
    held = set().union(*(numbers_in(rec["rows"]) for rec in records))
    figures = re.findall(r"(?<![\w.])(\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+)(?![\w])", "\n".join(body))
    assert figures, "no figures found in README's results tables"
    for figure in figures:
        value, decimals = float(figure.replace(",", "")), len(figure.partition(".")[2])
        assert any(round(n, decimals) == value for n in held), f"README's {figure}: no record"


def test_a_machines_notes_are_said_once_and_empty_rows_and_columns_left_out() -> None:
    """A table that repeats notes of an earlier table of its machine names them instead; a row
    with nothing measured (a peer the command was not given) and a column no row fills are
    left out."""
    paths = runner.SOURCES["train"]
    first = {
        "task": "train", "table": "the recipe", "setup": "with the peer", "date": "2030-01-02",
        "command": "python bench/train.py --fairseq-bin BIN", "summary": "1.3x",
        "machine": {"name": "CPU A"}, "versions": {"torch": "2"},
        "sources": {"src": "x", **runner.source_hashes(paths)},
        "columns": [["trainer", "trainer"], ["tps", "tok/s"], ["vs", "× peer"]],
        "rows": [{"trainer": "aiayn", "tps": 2118, "vs": "1.28×"},
                 {"trainer": "peer", "tps": 1656, "vs": "1.00×"}],
        "notes": ["Model: 2+2 layers.", "Precision: float32.", "Load: 1.9."],
    }  # fmt: skip
    variants = {**copy.deepcopy(first), "table": "settings", "setup": "variants",
                "command": "python bench/train.py --variant x", "date": "2030-01-01"}  # fmt: skip
    variants["rows"] = [{"trainer": "aiayn", "tps": 1937, "vs": None},
                        {"trainer": "peer", "tps": "not measured: no --fairseq-bin given"},
                        {"trainer": "aiayn --x", "tps": 2241, "vs": None}]  # fmt: skip
    variants["notes"] = ["Model: 2+2 layers.", "Precision: float32.", "Load: 2.0."]
    other = {**copy.deepcopy(variants), "machine": {"name": "CPU B"}, "table": "more settings"}
    text = page.render([first, variants, other], page.current_hashes([first]))
    section = text.split("### Settings: CPU A")[1].split("###")[0]
    assert "- Model and precision: as said above for this machine." in section
    assert "- Load: 2.0." in section and "2+2 layers" not in section
    assert "| aiayn --x | 2241 |" in section and "not measured" not in section
    assert "× peer" not in section  # no row of this table compares with the peer
    assert "- Model: 2+2 layers." in text.split("### More settings: CPU B")[1]  # another machine

    # A second setup of the same table with the same notes adds none: they are right above.
    again = {**copy.deepcopy(variants), "setup": "more variants", "date": "2030-01-01 12:00",
             "command": "python bench/train.py --variant y"}  # fmt: skip
    again["rows"] = [{"trainer": "aiayn --y", "tps": 2000, "vs": None}]
    text = page.render([first, variants, again], page.current_hashes([first]))
    section = text.split("### Settings: CPU A")[1].split("###")[0]
    assert "| aiayn --x | 2241 |" in section and "| aiayn --y | 2000 |" in section
    assert section.count("as said above") == 1 and section.count("- Load: 2.0.") == 1
    after = section.split("| aiayn --y | 2000 |")[1]
    assert not after.strip().startswith("-")  # no notes after the second setup's rows


def test_setups_of_several_rows_keep_their_tables_and_older_tables_share_one_line() -> None:
    """Two models measured by the same command each get their table under their name (their
    rows cannot be told apart in one); another machine's older table of the same measurement
    is named in one line after the current ones."""
    paths = runner.SOURCES["translate"]
    first = {
        "task": "translate", "table": "810 sentences", "setup": "model A",
        "date": "2030-01-01 00:00", "command": "python bench/translate.py -m MODEL",
        "summary": "0.7x", "machine": {"name": "CPU A"}, "versions": {"torch": "2"},
        "sources": {"src": "x", **runner.source_hashes(paths)},
        "columns": [["system", "system"], ["wall", "wall time"]],
        "rows": [{"system": "aiayn", "wall": 16.7}, {"system": "peer", "wall": 11.9}],
    }  # fmt: skip
    second = {**copy.deepcopy(first), "setup": "model B", "date": "2030-01-02 00:00"}
    second["rows"] = [{"system": "aiayn", "wall": 15.9}, {"system": "peer", "wall": 9.3}]
    stale = {**copy.deepcopy(first), "machine": {"name": "CPU B"}, "date": "2029-12-31 00:00"}
    stale["sources"][paths[0]] = "0" * 40
    text = page.render([first, second, stale], page.current_hashes([first]))
    section = text.split("### 810 sentences: CPU A")[1]
    assert "Each row's run NAME" not in section
    order = ["Model A: `python bench/translate.py -m MODEL`", "| aiayn | 16.7 |",
             "Model B: `python bench/translate.py -m MODEL`", "| aiayn | 15.9 |"]  # fmt: skip
    assert [section.index(s) for s in order] == sorted(section.index(s) for s in order)
    assert "### 810 sentences: CPU B" not in text
    assert (
        f"{page.OLDER_WHY} (bench/results/translate.jsonl keeps the figures): 810 sentences, "
        "CPU B (2029-12-31)."
    ) in section
