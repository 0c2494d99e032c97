"""Line-oriented text files, as ``aiayn translate``, ``evaluate`` and ``score`` read and write
them: one sentence per line, in and out, whatever bytes a line holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from aiayn.errors import UserFileNotFoundError
from aiayn.text.corpus import decode_line

__all__ = ["one_line", "read_lines"]


def read_lines(source: str | Path | BinaryIO, name: str | None = None) -> Iterator[str]:
    """Yields the lines of a UTF-8 file or binary stream, without their line endings.

    Lines are split on ``\\n`` bytes only (as ``wc -l`` and ``aiayn.text.corpus.count_lines`` do),
    and a UTF-8 byte-order mark on the first line is dropped.

    Args:
        source: A path, or an open binary stream such as ``sys.stdin.buffer``.
        name: How messages name a stream (default: its ``name`` attribute).

    Raises:
        DataError: A line is not valid UTF-8; the message names the file and 1-based line.
        UserFileNotFoundError: The path does not exist (a ``FileNotFoundError``).
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise UserFileNotFoundError(f"input file {path} does not exist")
        with path.open("rb") as f:
            yield from read_lines(f, name=str(path))
        return
    label = Path(name or getattr(source, "name", "<stream>"))
    for lineno, raw in enumerate(source, start=1):
        yield decode_line(raw, label, lineno).rstrip("\r\n")


def one_line(text: str) -> str:
    """``text`` with line breaks replaced by spaces, so one output line per input line holds
    even if the model generated a newline (possible through byte-fallback pieces)."""
    return text.replace("\r", " ").replace("\n", " ")
