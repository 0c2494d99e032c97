"""The README's blocks marked runnable run, against a demo model trained in this session
(conftest.py). That every `aiayn` command line in it and in docs/ parses is tests/test_docs.py's.

A block is marked by the line `<!-- test: runnable ... -->` right before its ```sh fence; it
may use `.venv/bin/aiayn` and `demo_run/` as a reader's checkout has them after `make demo`
(doc_blocks.py reads and runs the blocks; test_tutorial.py runs docs/tutorial.md's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.demo import DemoResult

from .doc_blocks import ROOT, code_blocks, reader_checkout, run_block


def test_the_readme_has_runnable_blocks() -> None:
    assert any(block.runnable for block in code_blocks(ROOT / "README.md"))


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
