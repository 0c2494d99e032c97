"""BENCHMARKS.md from the records in bench/results/: `make benchmarks-page`.

    python bench/page.py           # rewrite BENCHMARKS.md
    python bench/page.py --check   # exit 1 where BENCHMARKS.md is not what the records make
    python bench/page.py --stamp OUT/records.jsonl --commit C   # add the source hashes of
        # commit C to records made where git could not say (a copy of the tree on a GPU machine)

The page opens with what to expect (one line a setup, a machine's together), then the commands
that reproduce every table, then per task one table per machine and kind of run, its rows from
the latest record of each setup. A row says "older source" where a path its task exercises has
a git hash other than the one its record stored and a different code (`older`: comments and
docstrings aside).
A table with current rows shows those alone; of one measurement (a table's title) on the
current source, the machine measured last shows its table and the others are named in one line
(the summary at the top gives their results); a machine with a current table of a task shows no
older one of it; where the same measurement has current rows on another machine only, its older
tables are named in one line, as are all the tables of a task with no current row (its summary
lines stay, marked older source). The records keep every figure. A clone without the records'
commits cannot tell, and refuses (a shallow one).
A table leaves out the rows of a peer its command did not ask for and the columns no row
fills, and names the notes said under its machine's first table rather than repeat them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from runner import (
    RESULTS,
    ROOT,
    SOURCES,
    git,
    markdown_table,
    missing_commits,
    same_code,
    source_hashes,
)

PAGE = ROOT / "BENCHMARKS.md"
OLDER = "older source"
UNKNOWN = "source not recorded"
UNCOMMITTED = "uncommitted source"

TASKS = {
    "demo": (
        "The first run: `make demo`",
        "`aiayn demo`, what `make demo` runs once `.venv` is set up, timed from launch to exit: "
        "it writes its number corpus, trains the `demo` preset, scores the held-out numbers and "
        "translates the samples.",
        "make bench-demo",
    ),
    "train": (
        "Training: `aiayn train` against `fairseq-train`",
        "Both trainers on the same BPE segmentation, pairs, model and settings, one after the "
        "other in interleaved rounds of equal wall time, each read from its own tokens/s log.",
        "make bench-train DATA=DATA FAIRSEQ_BIN=FAIRSEQ_BIN",
    ),
    "recipe": (
        "Quality: the CPU recipe in its time budget",
        "`aiayn train -c recipes/bible-en-es-cpu.yaml` until its budget ends it, then "
        "`aiayn evaluate` on the validation set (beam 4).",
        "make bench-study DATA=DATA RUNS=recipe",
    ),
    "translate": (
        "Translating a file: `aiayn translate` against CTranslate2",
        "Each system translates the same file in a process of its own, timed from launch to exit "
        "(start-up, loading, decoding, writing), rounds interleaved. CTranslate2 runs its API on "
        "`aiayn export --to ctranslate2` both ways: its threads inside each batch "
        "(`intra_threads`) and one batch per thread (`inter_threads`, as aiayn's workers do).",
        "make bench-translate MODEL=MODEL DATA=DATA",
    ),
    "serve": (
        "Serving: `aiayn serve` under load",
        "`aiayn serve` in its own process, a load generator in another, one verse a request.",
        "make bench-serve MODEL=MODEL DATA=DATA",
    ),
    "gpu": (
        "GPU",
        "`make gpu-check`: training `base` at the paper's update size (batches of up to "
        "25,000 tokens a side) against `torch.nn.Transformer`, and the user's job as whole "
        "commands.",
        "make gpu-check OUT=DIR",
    ),
    "study": (
        "The small-data study",
        "The runs of docs/small-data.md, each changing one setting of the recipe.",
        "python bench/study.py run DATA runs/study",
    ),
}
"""Per task: the heading, what it measures, and the command that reproduces its tables."""


def load(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every record of every results file, in file order."""
    return [
        json.loads(line)
        for path in sorted(results.glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def current_hashes(records: list[dict[str, Any]]) -> dict[str, str] | None:
    """This tree's hash of every path a record stored, and HEAD's commit under "HEAD"; None
    without git."""
    paths = sorted({p for r in records for p in r.get("sources") or {} if p != "src"})
    hashes = source_hashes(paths) if paths else {}
    head = git("rev-parse", "HEAD")
    return None if hashes is None or head is None else {**hashes, "HEAD": head}


def older(rec: dict[str, Any], current: dict[str, str]) -> bool:
    """Whether the code of a path the record's task exercises has changed since it was measured.
    Where a path's hash differs, `same_code` compares the record's commit with HEAD: a change
    to comments and docstrings alone leaves the figures current. A record that measured
    uncommitted changes, or one whose commit git cannot compare, counts as older."""
    stored = {p: h for p, h in (rec.get("sources") or {}).items() if p != "src"}
    changed = tuple(sorted(p for p, h in stored.items() if current.get(p) != h))
    if not changed:
        return False
    if rec.get("uncommitted", True) or not rec.get("commit") or "HEAD" not in current:
        return True
    return not same_code(rec["commit"], current["HEAD"], narrowed(rec.get("task"), changed))


def narrowed(task: str | None, paths: tuple[str, ...]) -> tuple[str, ...]:
    """`paths` as the task's `SOURCES` name them now: a folder it has since narrowed to some of
    its files (a record stores the folder) counts by those files alone."""
    now = SOURCES.get(task or "", ())
    return tuple(f for p in paths for f in ([s for s in now if s.startswith(p + "/")] or [p]))


def tables(records: list[dict[str, Any]]) -> dict[str, list[list[dict[str, Any]]]]:
    """Per task, its tables (one per machine and kind of run, the latest first), each the
    latest record of every setup, in the order the setups were first measured."""
    latest: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for rec in sorted(records, key=lambda r: r["date"]):
        key = (rec["task"], rec["machine"]["name"], rec["table"])
        latest[key][rec["setup"]] = rec
    by_task: dict[str, list[list[dict]]] = defaultdict(list)
    for (task, *_), setups in latest.items():
        by_task[task].append(sorted(setups.values(), key=lambda r: r.get("order", 0)))
    for found in by_task.values():
        found.sort(key=lambda t: max(r["date"] for r in t), reverse=True)
    return by_task


def present(
    found: list[list[dict[str, Any]]], current: dict[str, str]
) -> list[tuple[list[dict[str, Any]], str]]:
    """A task's tables, each with how the page shows it: "full" (its rows), "elsewhere" (named
    in one line: the same measurement is shown in full for a machine measured later) or
    "older" (named in one line: all older source). A table with current setups keeps those
    alone, and of the tables of one measurement (their title) on the current source only the
    latest machine's is shown in full, the others' results being in the summary. A table whose
    every setup is older source is left out where its machine has a current table of the task,
    and named where another machine's table of its columns (or more: the same measurement) is
    current. The page states what is true now, the records keep the rest."""

    def names(t: list[dict[str, Any]]) -> set[str]:
        return {c[0] for c in t[0]["columns"]}

    def fresh(r: dict[str, Any]) -> bool:
        return is_current(r, current)

    # A table with current setups shows those alone.
    found = [[r for r in t if fresh(r)] or t for t in found]
    now = [t for t in found if any(fresh(r) for r in t)]

    def machine(t: list[dict[str, Any]]) -> str:
        return t[0]["machine"]["name"]

    shown: list[tuple[list[dict[str, Any]], str]] = []
    full_titles: set[str] = set()
    for t in found:  # the latest first
        if t in now:
            how = "elsewhere" if t[0]["table"] in full_titles else "full"
            full_titles.add(t[0]["table"])
        elif any(machine(t) == machine(n) for n in now):
            continue  # its machine has a current table of the task
        else:
            how = "older" if any(names(t) <= names(n) for n in now) else "full"
        shown.append((t, how))
    return shown


def heading(found: list[dict[str, Any]]) -> list[str]:
    """A table's heading: what it measures and on which machine."""
    table, machine = found[0]["table"], found[0]["machine"]["name"]
    return [f"### {table[:1].upper() + table[1:]}: {machine}", ""]


def named_tables_text(found: list[list[dict[str, Any]]], why: str) -> list[str]:
    """Tables the page names rather than shows, in one line: each by what it measures, machine
    and dates, with where their figures are and why they are not shown (`why`)."""
    if not found:
        return []
    dates = [", ".join(sorted({r["date"][:10] for r in t})) for t in found]
    each = "; ".join(
        f"{t[0]['table']}, {t[0]['machine']['name']} ({when})"
        for t, when in zip(found, dates, strict=True)
    )
    return [f"{why} (bench/results/{found[0][0]['task']}.jsonl keeps the figures): {each}.", ""]


OLDER_WHY = "On an older source, which the commands above measure again"
ELSEWHERE_WHY = "On the current source too, each with its results in the summary above"


def is_current(rec: dict[str, Any], current: dict[str, str]) -> bool:
    """Whether `rec` measured the source as it is now (its row says only its date)."""
    return measured(rec, current) == rec["date"][:10]


def measured(rec: dict[str, Any], current: dict[str, str]) -> str:
    if not rec.get("sources"):
        return f"{rec['date'][:10]}, {UNKNOWN}"
    if rec.get("uncommitted"):
        return f"{rec['date'][:10]}, {UNCOMMITTED}"
    return rec["date"][:10] + (f", {OLDER}" if older(rec, current) else "")


def stamp(path: Path, commit: str) -> None:
    """Give the records of `path` that lack them `commit`'s hash and source hashes."""
    from runner import SOURCES

    full = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    if full is None:
        sys.exit(f"page: git does not know commit {commit!r}")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    for rec in records:
        if not rec.get("sources"):
            hashes = source_hashes(("src", *SOURCES[rec["task"]]), full)
            rec.update(commit=full, sources=hashes, uncommitted=False)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_text(lines, encoding="utf-8")


def peer_versions(rec: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in rec["versions"].items() if v)


NOT_ASKED = "not measured: no "
"""How a row of a peer the command was not given says so ("not measured: no --fairseq-bin
given"): the page leaves it out (a row not measured for another reason stays)."""


def asked_for(row: dict[str, Any], columns: list[list[str]]) -> bool:
    """Whether a row is more than its name and that the command did not ask for it."""
    values = [row.get(key) for key, _ in columns[1:]]
    return any(v not in (None, "") and not str(v).startswith(NOT_ASKED) for v in values)


def shown_columns(columns: list[list[str]], rows: list[dict[str, Any]]) -> list[list[str]]:
    """The columns that some row fills."""
    return [c for c in columns if any(row.get(c[0]) not in (None, "") for row in rows)]


def notes_text(notes: list[str], said: set[str]) -> list[str]:
    """A table's notes, those already said word for word under an earlier table of its machine
    in this section named by their labels ("Model: ..." is "Model"); `said` learns the rest."""
    again = [n for n in notes if n in said]
    said.update(notes)
    if not again:
        return [f"- {n}" for n in notes]
    labels = [n.split(":")[0].lower() for n in again]
    named = ", ".join(labels[:-1]) + " and " + labels[-1] if len(labels) > 1 else labels[0]
    named = named[:1].upper() + named[1:]
    return [f"- {named}: as said above for this machine.",
            *(f"- {n}" for n in notes if n not in again)]  # fmt: skip


def table_text(
    found: list[dict[str, Any]], current: dict[str, str], said: set[str] | None = None
) -> list[str]:
    """One table per machine and kind of run: per setup, its command and versions, its rows
    (each saying when it was measured, and whether on an older source; a row of a peer the
    command did not ask for left out, and a column no row fills) and its notes (those said
    under an earlier table of the machine, in `said`, given by their labels; none where an
    earlier setup of this table gave them all)."""
    said = set() if said is None else said
    in_table: set[str] = set()
    lines = heading(found)
    i = 0
    while i < len(found):
        # Setups of one row each, of the same columns and without notes (the study's runs,
        # the recipe's), share one table; a setup of several rows keeps its own, under its name.
        group = [found[i]]
        while (i + len(group) < len(found) and not group[-1].get("notes")
               and len(found[i]["rows"]) == len(found[i + len(group)]["rows"]) == 1
               and found[i + len(group)]["columns"] == found[i]["columns"]):  # fmt: skip
            group.append(found[i + len(group)])
        i += len(group)
        columns = [*group[0]["columns"], ["measured", "measured"]]
        rows = [{**row, "measured": measured(rec, current)} for rec in group for row in rec["rows"]
                if asked_for(row, group[0]["columns"])]  # fmt: skip
        columns = shown_columns(columns, rows)
        # Commands that differ only by the run's name (the study's runs, its setup, or the
        # recipe's, a column of their one row) are given once.
        shared = {(r["command"].replace(run_name(r), "NAME"), peer_versions(r)) for r in group}
        named = all(run_name(r) in r["command"] for r in group)
        if len(group) > 1 and named and len(shared) == 1:
            ((command, versions),) = shared
            lines += [f"Each row's run NAME: `{command}`; {versions}.", ""]
        else:
            for rec in group:
                lines += [f"{rec['setup'][:1].upper() + rec['setup'][1:]}: `{rec['command']}`; "
                          f"{peer_versions(rec)}.", ""]  # fmt: skip
        lines += [markdown_table(columns, rows), ""]
        notes = group[-1].get("notes", [])
        if not set(notes) <= in_table:  # notes given under this heading already are not repeated
            lines += [*notes_text(notes, said), ""]
        in_table.update(notes)
    return lines


def run_name(rec: dict[str, Any]) -> str:
    """The name of the run a record measured: its one row's "run", else its setup."""
    rows = rec["rows"]
    return (rows[0].get("run") or rec["setup"]) if len(rows) == 1 else rec["setup"]


HEADER = """\
# Benchmarks

What to expect from aiayn on a machine like yours, against the tools you would otherwise use.
`make benchmarks-page` writes this page from `bench/results/` (a line of JSON a run: command,
machine, versions, every round's figures); edit those, not this page. The machines are shared
cloud machines whose speed varies from run to run: compare the rows of one table. "Older
source" marks a row measured before the code its task exercises last changed (comments aside);
its command measures it again. The summary gives every machine's current results; below it,
a measurement shows its latest machine's current table, and names its other machines' tables in
one line; a task with no current row keeps its summary lines and names its tables in one line.

## What to expect
"""
COMMANDS = """\
The commands, from the repository root after the README's Install (`DATA`: a folder made by
`aiayn prepare bible-en-es DATA`, which holds `train.*` and `valid.*`; `MODEL`: a trained model
directory; `make bench DATA=DATA MODEL=MODEL` runs the four CPU tasks):"""


def render(records: list[dict[str, Any]], current: dict[str, str]) -> str:
    by_task = tables(records)
    lines = [HEADER, "| task | machine | measured | result |", "| --- | --- | --- | --- |"]
    for task, (heading, *_) in TASKS.items():
        summed = [rec for found in by_task.get(task, []) for rec in found if rec.get("summary")]
        # A task measured on the current source shows only those rows here; the tables below
        # keep the rest.
        fresh = [rec for rec in summed if is_current(rec, current)]
        # One row a setup, a machine's together (in the order the tables below come).
        shown = fresh or summed
        order = {m: i for i, m in enumerate(dict.fromkeys(r["machine"]["name"] for r in shown))}
        for rec in sorted(shown, key=lambda r: order[r["machine"]["name"]]):
            machine, when = rec["machine"]["name"], measured(rec, current)
            said = f"{rec['setup']}: {rec['summary']}"
            lines.append(f"| {heading.split(':')[0]} | {machine} | {when} | {said} |")
    lines += ["", COMMANDS, "", "```sh"]
    lines += [f"{spec[2]:<56}# {spec[0].split(':')[0]}" for spec in TASKS.values()]
    lines += ["```", ""]
    for task, (heading, what, _) in TASKS.items():
        if task not in by_task:
            continue
        lines += [f"## {heading}", "", what, ""]
        said: dict[str, set[str]] = defaultdict(set)  # per machine, the notes said in this task
        named: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)
        found_shown = present(by_task[task], current)
        # A task with no current row at all is history: the summary quotes it, marked older
        # source, and its tables are named in one line.
        now = any(is_current(r, current) for t, _ in found_shown for r in t)
        for found, how in found_shown:
            if how == "full" and now:
                lines += table_text(found, current, said[found[0]["machine"]["name"]])
            else:
                named["elsewhere" if how == "elsewhere" else "older"].append(found)
        lines += named_tables_text(named["elsewhere"], ELSEWHERE_WHY)
        lines += named_tables_text(named["older"], OLDER_WHY)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is current")
    parser.add_argument("--stamp", type=Path, help="a records file to give source hashes")
    parser.add_argument("--commit", help="with --stamp: the commit the records measured")
    args = parser.parse_args(argv)
    if args.stamp:
        if not args.commit:
            parser.error("--stamp needs --commit")
        return stamp(args.stamp, args.commit) or 0
    records = load()
    current = current_hashes(records)
    if current is None:
        print("page: git cannot say this tree's source hashes (no repository here)")
        return 2
    if lacking := missing_commits(sorted({r["commit"] for r in records if r.get("commit")})):
        print(f"page: this clone lacks commit(s) the records measured ({lacking[0][:12]}...), so "
              "it cannot tell which rows are current: git fetch --unshallow")  # fmt: skip
        return 2
    text = render(records, current)
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print("BENCHMARKS.md is not what bench/results/ makes: run `make benchmarks-page`")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
