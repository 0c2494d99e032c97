"""Line-oriented text files, as ``aiayn translate``, ``evaluate`` and ``score`` read and write
them: one sentence per line, in and out, whatever bytes a line holds."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from aiayn.errors import UserError, UserFileNotFoundError, UserValueError
from aiayn.parts import part, remove_dead
from aiayn.text.corpus import decode_line

__all__ = [
    "LineWriter",
    "OutputError",
    "check_input_file",
    "one_line",
    "output_lines",
    "read_lines",
]


def check_input_file(path: str | Path, what: str = "input file", reread: bool = False) -> Path:
    """``path``, which must exist and not be a directory: a regular file, or a pipe, a device
    or a process substitution (``-i <(...)``, ``-i /dev/stdin``), which can be read once. With
    ``reread`` (a command that counts the lines before it reads them), a regular file only.

    Raises:
        UserFileNotFoundError: It does not exist.
        UserValueError: It is a directory, or with ``reread`` not a regular file.
    """
    path = Path(path)
    if path.is_dir():
        raise UserValueError(f"{what} {path} is a directory, not a file")
    if not path.exists():
        raise UserFileNotFoundError(f"{what} {path} does not exist")
    if reread and not path.is_file():
        raise UserValueError(
            f"{what} {path} is not a regular file (a pipe?): this command reads it twice, "
            "to count its lines first; save it to a file"
        )
    return path


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
        UserValueError: The path is a directory.
    """
    if isinstance(source, (str, Path)):
        path = check_input_file(source)
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


class OutputError(UserError, OSError):
    """Writing the output failed for a reason the user can fix (a full disk, a quota, a file
    too large for the file system): one line naming where the output went."""


class LineWriter:
    """Writes a command's output lines to ``stream``; an error writing them is an
    `OutputError` naming ``name`` (where the output goes), not a traceback. A reader gone from a
    pipe stays a ``BrokenPipeError``, which the command line ends quietly on."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self.stream, self.name = stream, name

    def write(self, text: str) -> None:
        with self._named_errors():
            self.stream.write(text)

    def flush(self) -> None:
        with self._named_errors():
            self.stream.flush()

    def close(self, failed: bool = False) -> None:
        """Closes the stream; after a failure, quietly (what is left in its buffer would fail
        again and hide the first error)."""
        if failed:
            with contextlib.suppress(OSError):
                self.stream.close()
            return
        with self._named_errors():
            self.stream.close()

    @contextlib.contextmanager
    def _named_errors(self) -> Iterator[None]:
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as error:
            if error.filename is not None or error.errno not in _WRITE_ERRNOS:
                raise
            raise OutputError(f"cannot write {self.name}: {error.strerror}") from error


_WRITE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS") if hasattr(errno, name)
)


@contextlib.contextmanager
def output_lines(path: str | Path | None) -> Iterator[LineWriter]:
    """A `LineWriter` for standard output (``path`` None or "") or for the file ``path``.

    The file is written beside ``path`` under a temporary name (`aiayn.parts.part`) and renamed
    over it when the block ends without an error. So a command that fails or is stopped part way
    (a bad line found in its input, a full disk, Ctrl-C) leaves an existing file as it was and no
    partial one (a killed one, its temporary file, which the next run to ``path`` removes), and
    output written over a hard link of the input, or over the file the input is
    redirected from, no longer empties the input before it is read. A symbolic link is written
    through; an existing file keeps its permissions (its owner, group and other hard links
    are a new file's), and one that is not writable is refused, as ``open`` refuses it.

    Written directly instead, as ``open(path, "w")`` does: what is not a regular file
    (``/dev/null``, a pipe), a path under ``/dev`` or ``/proc`` (``-o /dev/stdout`` is the
    caller's own standard output, whatever it points to), and a file in a directory where no
    other file can be made. Where the rename is refused at the end (a file bind-mounted into a
    container, another user's file in a sticky directory), the output is copied into the file,
    and if that fails too the temporary file is kept and named.
    """
    if not path:
        yield LineWriter(sys.stdout, "standard output")
        return
    target = Path(os.path.realpath(path))
    try:
        kept = os.stat(target)
    except FileNotFoundError:
        kept = None
    special = os.path.abspath(path).startswith(("/dev/", "/proc/"))
    if special or (kept is not None and not stat.S_ISREG(kept.st_mode)):
        with _written_directly(path) as writer:
            yield writer
        return
    if kept is not None and not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    temporary = part(target)
    remove_dead(target)  # what killed runs to the same output left (this process's too)
    try:  # 0o666 less the umask, as open() would make it
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:  # no such directory, a directory not ours: open() says so, naming `path`
        with _written_directly(path) as writer:
            yield writer
        return
    try:
        if kept is not None:  # readable by no more than the file it replaces, from the start
            with contextlib.suppress(OSError):
                os.fchmod(fd, stat.S_IMODE(kept.st_mode))
        with _closed(LineWriter(open(fd, "w", encoding="utf-8", newline="\n"), str(path))) as out:
            yield out
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _put_in_place(temporary, target, path)


def _put_in_place(temporary: Path, target: Path, path: str | Path) -> None:
    """Rename the finished output over ``target``; where the rename is refused, copy it in."""
    try:
        os.replace(temporary, target)
        return
    except OSError:
        pass
    try:
        with temporary.open("rb") as source, open(target, "wb") as sink:
            shutil.copyfileobj(source, sink)
    except OSError as error:
        raise OutputError(
            f"cannot write {path}: {error.strerror}; the output is kept in {temporary}"
        ) from error
    with contextlib.suppress(OSError):
        os.unlink(temporary)


def _written_directly(path: str | Path) -> contextlib.AbstractContextManager[LineWriter]:
    return _closed(LineWriter(open(path, "w", encoding="utf-8", newline="\n"), str(path)))


@contextlib.contextmanager
def _closed(writer: LineWriter) -> Iterator[LineWriter]:
    """``writer`` for the block, then closed: flushed with its errors named, or after an
    error quietly."""
    try:
        yield writer
    except BaseException:
        writer.close(failed=True)
        raise
    writer.close()
