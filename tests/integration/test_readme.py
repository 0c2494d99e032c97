"""The README's commands: every `aiayn` command line in it and in docs/ parses, and the blocks
marked runnable run, against a demo model trained in this session (conftest.py).

A block is marked by the line `<!-- test: runnable ... -->` right before its ```sh fence; it
may use `.venv/bin/aiayn` and `demo_run/` as a reader's checkout has them after `make demo`
(doc_blocks.py reads and runs the blocks; test_tutorial.py runs docs/tutorial.md's).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from aiayn.cli import build_parser
from aiayn.demo import DemoResult

from .doc_blocks import ROOT, aiayn_commands, code_blocks, reader_checkout, run_block

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_has_runnable_blocks() -> None:
    assert any(block.runnable for block in code_blocks(ROOT / "README.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_aiayn_command_in_the_docs_parses(path: Path) -> None:
    """Flags that were renamed or never existed fail here, without running anything."""
    for block in code_blocks(path):
        for args in aiayn_commands(block.text):
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
    env = reader_checkout(tmp_path)
    for block in code_blocks(ROOT / "README.md"):
        if block.runnable:
            run_block(block.text, tmp_path, env)
