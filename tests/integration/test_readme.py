"""The README's commands: every `aiayn` command line in it and in docs/ parses, and the blocks
marked runnable run, against a demo model trained in this session (conftest.py).

A block is marked by the line `<!-- test: runnable ... -->` right before its ```sh fence; it
may use `.venv/bin/aiayn` and `demo_run/` as a reader's checkout has them after `make demo`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import aiayn
from aiayn.cli import build_parser
from aiayn.demo import DemoResult

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- test: runnable"
FENCE = re.compile(r"^```sh\n(.*?)^```", re.DOTALL | re.MULTILINE)


def sh_blocks(path: Path) -> list[tuple[str, bool]]:
    """Each ```sh block of ``path`` as (its text, whether it is marked runnable)."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((match.group(1), before.startswith(MARKER)))
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


def test_the_readme_has_runnable_blocks() -> None:
    assert any(runnable for _, runnable in sh_blocks(ROOT / "README.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_aiayn_command_in_the_docs_parses(path: Path) -> None:
    """Flags that were renamed or never existed fail here, without running anything."""
    for block, _ in sh_blocks(path):
        for args in aiayn_commands(block):
            try:
                build_parser().parse_args(args)
            except SystemExit as error:
                pytest.fail(f"{path.name}: `aiayn {shlex.join(args)}` does not parse ({error})")


@pytest.mark.slow
def test_the_readmes_runnable_blocks_run_against_the_demo_model(
    demo: DemoResult, tmp_path: Path
) -> None:
    # a reader's checkout after `make demo`: .venv/bin/aiayn and demo_run/
    (tmp_path / "demo_run").symlink_to(Path(demo.model_dir).parent.parent)
    launcher = tmp_path / ".venv" / "bin" / "aiayn"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m aiayn "$@"\n')
    launcher.chmod(0o755)
    source = str(Path(aiayn.__file__).parents[1])  # the aiayn under test, even if not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    blocks = [block for block, runnable in sh_blocks(ROOT / "README.md") if runnable]
    for block in blocks:
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, f"exit {run.returncode}\n{block}\n{run.stderr[-3000:]}"
        for args in aiayn_commands(block):
            if "-o" in args:
                assert (tmp_path / args[args.index("-o") + 1]).stat().st_size > 0
