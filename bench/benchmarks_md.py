"""Writing a benchmark's results into BENCHMARKS.md, between the benchmark's own markers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
MEASURED_PATHS = ("src", "bench")
"""The code a benchmark measures: a change here, not yet committed, is named in its commit line."""


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):  # no git, or a hung one
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit_line() -> str:
    """``Commit: `abc1234`.`` for the code being measured ("with uncommitted changes" in src/ or
    bench/ where there are some), or "" where git cannot say (no git, or no repository: a copy
    of the tree on a GPU machine)."""
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return ""
    changes = _git("status", "--porcelain", "--", *MEASURED_PATHS)
    dirty = " with uncommitted changes in src/ or bench/" if changes else ""
    return f"Commit: `{commit}`{dirty}."


def replace_section(path: Path, start: str, end: str, section: str, intro: str = "") -> None:
    """Replace the text between the markers `start` and `end` in `path` with `section`, and a
    last line naming the commit measured (`commit_line`).

    The first time (no markers yet), `intro` (a heading and a few words), then the markers and
    the section are appended at the end of the file.
    """
    stamp = commit_line()
    body = f"{section.strip()}\n\n{stamp}" if stamp else section.strip()
    block = f"{start}\n{body}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        intro = f"{intro.strip()}\n\n" if intro.strip() else ""
        text = text.rstrip("\n") + "\n\n" + intro + block + "\n"
    path.write_text(text, encoding="utf-8")
