"""Tests for aiayn.text.lines.output_lines: where a command's output lines go, and what is
left of an existing file when writing fails or the file system refuses a step. (What the
commands do with it is tested through the CLI in tests/cli/test_translate.py.)"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiayn.text import lines
from aiayn.text.lines import OutputError, output_lines


def test_no_path_or_an_empty_one_is_standard_output(capsys: pytest.CaptureFixture[str]) -> None:
    """`-o ""` (an empty $OUT) wrote to standard output before, as it still does."""
    for path in (None, ""):
        with output_lines(path) as out:
            out.write("one\n")
    assert capsys.readouterr().out == "one\none\n"


def test_a_file_is_replaced_only_when_the_block_ends_well(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("old\n", encoding="utf-8")
    out.chmod(0o600)
    with pytest.raises(RuntimeError), output_lines(out) as writer:
        writer.write("new\n")
        assert stat.S_IMODE(next(tmp_path.glob(".out.txt.tmp-*")).stat().st_mode) == 0o600
        raise RuntimeError("a bad line")
    assert out.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    with output_lines(out) as writer:
        writer.write("new\n")
    assert out.read_text(encoding="utf-8") == "new\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_a_file_that_is_not_writable_is_refused_as_open_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only file in a writable directory could be renamed over; open() refuses it.
    (os.access is played, since the tests may run as root, who may write anything.)"""
    out = tmp_path / "out.txt"
    out.write_text("kept\n", encoding="utf-8")
    monkeypatch.setattr(lines.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError) as raised, output_lines(out):
        pass
    assert raised.value.filename == str(out) and raised.value.errno == errno.EACCES
    assert out.read_text(encoding="utf-8") == "kept\n"


def test_where_the_rename_is_refused_the_output_is_copied_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file bind-mounted into a container cannot be renamed over (EBUSY), nor another user's
    in a sticky directory (EPERM): the output is copied into it rather than lost."""
    out = tmp_path / "out.txt"
    out.write_text("old\n", encoding="utf-8")

    def refused(source: object, target: object) -> None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(lines.os, "replace", refused)
    with output_lines(out) as writer:
        writer.write("new\n")
    assert out.read_text(encoding="utf-8") == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_when_nothing_can_put_the_output_in_place_it_is_kept_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.txt"

    def refused(*args: object) -> None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(lines.os, "replace", refused)
    monkeypatch.setattr(lines.shutil, "copyfileobj", refused)
    kept_in = r"the output is kept in .*\.out\.txt\.tmp-\d+"
    with pytest.raises(OutputError, match=kept_in), output_lines(out) as writer:
        writer.write("new\n")
    [kept] = tmp_path.glob(".out.txt.tmp-*")
    assert kept.read_text(encoding="utf-8") == "new\n"


@pytest.mark.skipif(not Path("/dev/stdout").exists(), reason="needs /dev/stdout")
def test_a_path_under_dev_is_written_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o /dev/stdout` with standard output redirected to a file: the file is written through
    the descriptor the caller holds, not replaced by a new one behind its back."""
    written: list[str] = []
    monkeypatch.setattr(lines, "_written_directly", lambda path: _recording(path, written))
    with output_lines("/dev/stdout") as writer:
        writer.write("x")
    assert written == ["/dev/stdout"]


@contextlib.contextmanager
def _recording(path: str | Path, written: list[str]) -> Iterator[lines.LineWriter]:
    """What `_written_directly` opens, recorded; the lines go to /dev/null."""
    written.append(str(path))
    with open(os.devnull, "w", encoding="utf-8") as sink:
        yield lines.LineWriter(sink, str(path))
