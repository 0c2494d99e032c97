"""The shell blocks of the docs, as the tests read and run them: test_readme.py (README.md's
blocks against a demo model) and test_tutorial.py (docs/tutorial.md at a tiny scale).

A block is marked by the line `<!-- test: runnable ... -->` right before its ```sh fence; it
may use `.venv/bin/aiayn` as a reader's checkout has it (:func:`reader_checkout`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import aiayn

ROOT = Path(__file__).parents[2]
MARKER = "<!-- test: runnable"


@dataclass(frozen=True)
class CodeBlock:
    """A fenced block: its language, its text, and the line right before its fence (its
    marker, if any)."""

    language: str
    text: str
    before: str

    @property
    def runnable(self) -> bool:
        return self.before.startswith(MARKER)


def code_blocks(path: Path, *languages: str) -> list[CodeBlock]:
    """Each block of ``path`` fenced as one of ``languages`` (default: ```sh), in order."""
    text = path.read_text(encoding="utf-8")
    names = "|".join(map(re.escape, languages or ("sh",)))
    fence = re.compile(rf"^```({names})\n(.*?)^```", re.DOTALL | re.MULTILINE)
    blocks = []
    for match in fence.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append(CodeBlock(match.group(1), match.group(2), before))
    return blocks


def aiayn_commands(block: str) -> list[list[str]]:
    """The arguments of each `aiayn` command line (continuations joined, comments, here-strings
    and redirections cut); lines that elide arguments with `...` are left out."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0] not in ("aiayn", ".venv/bin/aiayn") or "..." in words:
            continue
        args = []
        for word in words[1:]:
            if word in ("<<<", "<", ">", "|", "&&", ";", "&"):
                break
            args.append(word)
        commands.append(args)
    return commands


def reader_checkout(folder: Path) -> dict[str, str]:
    """Make ``folder`` look like a reader's checkout to the docs' commands: a `.venv/bin/aiayn`
    that runs the aiayn under test (even if it is not installed); returns their environment."""
    launcher = folder / ".venv" / "bin" / "aiayn"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m aiayn "$@"\n')
    launcher.chmod(0o755)
    source = str(Path(aiayn.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}


def run_block(
    block: str, cwd: Path, env: dict[str, str], *, language: str = "sh", timeout: float = 600
) -> str:
    """Run a shell block with bash (-euo pipefail), or a Python block, in ``cwd``; fail the
    test unless it exits 0 and every `-o` output it names exists and is not empty. Returns its
    stdout."""
    interpreter = {"sh": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}
    run = subprocess.run(
        [*interpreter[language], block],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{block}\n{run.stderr[-3000:]}"
    for args in aiayn_commands(block):
        if "-o" in args:
            assert (cwd / args[args.index("-o") + 1]).stat().st_size > 0, args
    return run.stdout
