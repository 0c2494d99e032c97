"""Tests of ``aiayn prepare``, one file per module of :mod:`aiayn.text.prepare`.

A package (not a plain folder) so that these files' basenames (``test_hf.py``, ...) cannot collide
with test modules elsewhere under ``tests/``. It also holds the two helpers every recipe's tests
share: the CLI entry point and a strict reader of the written files.
"""

from __future__ import annotations

from pathlib import Path

from aiayn.cli import main


def read_lines(path: Path) -> list[str]:
    """A written file's lines, checking its line ends: ``\\n`` only, the last line included."""
    data = path.read_bytes()
    assert data.endswith(b"\n") and b"\r" not in data, path
    return data.decode("utf-8").split("\n")[:-1]


def run(*argv: str) -> int:
    """``aiayn prepare ARGV...`` (paths may be given as Path objects); its exit status."""
    return main(["prepare", *map(str, argv)])
