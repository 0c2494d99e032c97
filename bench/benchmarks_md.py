"""Writing a benchmark's results into BENCHMARKS.md, between the benchmark's own markers."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def replace_section(path: Path, start: str, end: str, section: str, intro: str = "") -> None:
    """Replace the text between the markers `start` and `end` in `path` with `section`.

    The first time (no markers yet), `intro` (a heading and a few words), then the markers and
    the section are appended at the end of the file.
    """
    block = f"{start}\n{section.strip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        intro = f"{intro.strip()}\n\n" if intro.strip() else ""
        text = text.rstrip("\n") + "\n\n" + intro + block + "\n"
    path.write_text(text, encoding="utf-8")
