"""`aiayn train`'s own process settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Which OMP_WAIT_POLICY the process holds when torch is first imported (OpenMP reads it then).
SPY = """
import builtins, os, sys
from aiayn.cli import main
real_import, seen = builtins.__import__, []
def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("OMP_WAIT_POLICY"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
status = main(sys.argv[1:])
print(seen, file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_train_waits_passively_unless_told_otherwise(
    tmp_path: Path, given: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    missing = str(tmp_path / "missing.en")
    args = ["train", "--src", missing, "--tgt", missing, "--out-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-c", SPY, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr  # the missing corpus, after torch is imported
    assert done.stderr.strip().splitlines()[-1] == repr([expected])
