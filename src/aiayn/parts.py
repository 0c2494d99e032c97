"""Parts: what a writer puts beside its output while it writes it, named after the writer's
process, so that what a killed writer left is found and removed by the next writer.

Every file or directory aiayn writes in place of another (a translation's ``-o``, a model
directory, a checkpoint, an export, a tokenizer, a data cache, a prepared corpus) is written as
``.NAME.tmp-PID`` beside NAME and renamed over it once complete; a directory being replaced is
first moved aside as ``.NAME.old-PID``. Nothing runs after a SIGKILL, so these may stay: before
it writes NAME (and again once NAME is in place), a writer calls :func:`remove_dead`, which
removes the parts of NAME whose process has ended. One exception: a moved-aside ``.old`` part
while NAME is missing (a kill between the two renames) may be the only copy, and is kept until
NAME is written again (:func:`aiayn.model_dir.resolve_model_dir` reads it meanwhile,
:func:`aiayn.train.rundir.remove_debris` puts it back). A scratch directory (:func:`scratch`:
a temporary export in ``/tmp``) is a part of a NAME that is never written.

A part under this process's own PID is an ended writer's if it was last changed before this
process imported this module (a process restarted in a container often gets the PID of the one
killed before it), else this process's own, in use (another thread's: a cache filled by two
threads at once); a process writes one NAME at a time. A part whose process is
running is kept, even where that process is not aiayn's (its PID was reused): a later writer
removes it once that process has ended. A PID is this machine's, so two machines writing the
same NAME at once over a shared file system may each take the other's part for a dead one; the
writer that loses its part then fails with an error rather than writing a wrong file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "dead_parts",
    "part",
    "remove",
    "remove_dead",
    "scratch",
    "swap_in",
    "system_scratch",
]

_PART = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)")
_STARTED = time.time()
"""When this process imported the module: every part it makes is changed after this, and
what an earlier process under the same PID left, before."""


def part(target: Path, kind: str = "tmp") -> Path:
    """This process's part of ``target``: ``.NAME.tmp-PID`` (being written) or, with ``kind``
    "old", ``.NAME.old-PID`` (the replaced ``target``, moved aside)."""
    assert kind in ("tmp", "old"), kind
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}")


def dead_parts(parent: Path) -> list[tuple[Path, str]]:
    """The parts in ``parent`` whose writer has ended, each with the name of its target,
    sorted."""
    return [(path, name) for path, name, pid in _parts(parent) if not _running(pid, path)]


def _parts(parent: Path) -> list[tuple[Path, str, int]]:
    """The parts in ``parent``, each with the name of its target and its writer's PID."""
    try:
        entries = sorted(parent.iterdir())
    except OSError:  # no such directory, or not ours to read: nothing of ours in it
        return []
    matches = ((path, _PART.fullmatch(path.name)) for path in entries)
    return [(path, _target(m["name"]), int(m["pid"])) for path, m in matches if m]


def _target(name: str) -> str:
    """The NAME that a part named after ``name`` is of, through parts of parts: a writer that
    hands its part to another writer (an import saving a model directory into its
    ``.NAME.tmp-PID``) leaves ``..NAME.tmp-PID.tmp-PID`` beside NAME if it is killed."""
    while match := _PART.fullmatch(name):
        name = match["name"]
    return name


def remove_dead(target: Path) -> None:
    """Remove the parts of ``target`` that ended writers left, and this process's own (it
    writes one NAME at a time, and is about to write this one), but a moved-aside ``.old`` one
    while ``target`` is missing (see the module docstring)."""
    target = Path(target)
    for path, name, pid in _parts(target.parent):
        ended = pid == os.getpid() or not _running(pid, path)
        if name == target.name and ended and not (_kind(path) == "old" and not target.exists()):
            remove(path)


def swap_in(new: Path, target: Path) -> None:
    """Put ``new``, a finished part of ``target``, in ``target``'s place: an existing
    ``target`` is first moved aside as this process's ``.old`` part and removed once ``new`` is
    there; then the parts ended writers left are removed (`remove_dead`). The one swap of every
    writer that replaces a directory (a model directory, an export). A kill between the two
    renames leaves the ``.old`` part as the only copy (see the module docstring); where the
    second rename fails, the moved-aside ``target`` is put back."""
    target = Path(target)
    old = part(target, "old")
    moved = target.exists()
    if moved:
        remove(old)
        os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        if moved:
            with contextlib.suppress(OSError):
                os.replace(old, target)
        raise
    if moved:
        remove(old)
    remove_dead(target)


@contextlib.contextmanager
def scratch(target: Path) -> Iterator[Path]:
    """A directory of this process's for the block (``target``'s part), removed after it; what
    killed processes left there is removed first. One at a time for a ``target`` in a process.
    """
    target = Path(target)
    remove_dead(target)
    path = part(target)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        remove(path)


def system_scratch(name: str) -> contextlib.AbstractContextManager[Path]:
    """`scratch` in the system's temporary directory (``/tmp/.NAME.tmp-PID``)."""
    return scratch(Path(tempfile.gettempdir()) / name)


def remove(path: Path) -> None:
    """Remove a file, link or directory tree, quietly (already gone, or not ours to remove)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _kind(path: Path) -> str:
    match = _PART.fullmatch(path.name)
    return match["kind"] if match else ""


def _running(pid: int, path: Path) -> bool:
    """Whether the process ``pid`` that made the part ``path`` is running: another process
    with that PID, or this one if it changed ``path`` since it started (see the module
    docstring)."""
    if pid == os.getpid():
        try:
            return path.lstat().st_mtime >= _STARTED
        except OSError:  # gone meanwhile
            return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # none, or no PID at all
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
