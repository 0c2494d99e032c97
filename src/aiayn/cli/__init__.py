"""The `aiayn` command: info, train, average, demo, shortlist, translate, evaluate, score,
attention, serve, plot, prepare, export, import.

Each subcommand is a small function that turns flags into explicit arguments for the library.
What a command raises is reported by one rule (:func:`main`): an error the user can fix
(:class:`aiayn.errors.UserError`: bad config, data, flags, files) is one line with exit status 2,
never a traceback; anything else is a bug, shown with its traceback and a line asking for a
report, exit status 1. The commands live by family, each module with an ``add(subparsers)`` that
registers its commands and their ``run`` functions:

- :mod:`aiayn.cli.train`: info, train, average, demo
- :mod:`aiayn.cli.translate`: translate, evaluate, score, attention
- :mod:`aiayn.cli.serve`: serve
- :mod:`aiayn.cli.shortlist`: shortlist
- :mod:`aiayn.cli.plot`, :mod:`aiayn.cli.prepare`
- :mod:`aiayn.cli.interop`: export, import

:mod:`aiayn.cli.parser` is argparse with "did you mean" for a misspelt command or flag;
:mod:`aiayn.cli.flags` turns dataclass fields into flags; :mod:`aiayn.cli.common` holds what
several commands share (loading the model, the search flags, the progress bar), and
:mod:`aiayn.cli.output_dir` the one rule of what ``-o`` of average, export and import may
replace. Building the parser imports no torch, so ``aiayn --help`` is fast.
"""

from __future__ import annotations

import _thread
import argparse
import atexit
import errno
import gc
import logging
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from aiayn import __version__
from aiayn.cli import interop, plot, prepare, serve, shortlist, train, translate
from aiayn.cli.flags import (
    add_dataclass_flags,
    attribute_docs,
    dataclass_from_args,
    dataclass_values,
    parse_assignments,
)
from aiayn.cli.parser import ArgumentParser
from aiayn.cli.train import train_config_from_args
from aiayn.errors import KilledError, UserError

__all__ = [
    "add_dataclass_flags",
    "attribute_docs",
    "build_parser",
    "dataclass_from_args",
    "dataclass_values",
    "entry_point",
    "main",
    "parse_assignments",
    "train_config_from_args",
]

logger = logging.getLogger("aiayn")

# In the order `aiayn --help` lists them.
_COMMAND_FAMILIES = (train, shortlist, translate, serve, plot, prepare, interop)


# What an OSError about a path the user gave may say: the path is missing, of the wrong kind,
# not theirs to read or write, or on a full or read-only disk. Not EBADF, EMFILE, EINVAL, EIO,
# ...: those are aiayn's or the machine's, and keep their traceback.
_PATH_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOENT", "ENOTDIR", "EISDIR", "EEXIST", "EACCES", "EPERM", "EROFS", "ENOSPC",
        "EDQUOT", "ENAMETOOLONG", "ELOOP",
    )
    if hasattr(errno, name)
)  # fmt: skip

# What an OSError may say of the disk, with or without a path: it is full, or a quota or a file
# size limit is reached. Never aiayn's to fix, wherever the write was.
_DISK_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, name)
)

_REPORT = (
    "this is a bug in aiayn, not a mistake of yours: please report it with the traceback above"
)


def _is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is one a user can fix, printed as one line with exit status 2.

    That is a :class:`~aiayn.errors.UserError`; an ``argparse.ArgumentError`` (a flag's value,
    should a command check it after parsing; errors found while parsing already exit 2 through
    argparse); or an ``OSError`` *about a path*, its ``filename`` set and its errno one of
    :data:`_PATH_ERRNOS` (``open("missing.txt")``, a directory given as a file, a file that is
    not the user's to read, a full disk); or an ``OSError`` of a full disk, a quota or a file
    size limit (:data:`_DISK_ERRNOS`) with no path (a ``write`` names none). Everything else,
    a plain ``ValueError`` or ``FileNotFoundError`` without a file name included, is a bug:
    where aiayn checks what a user gave, it raises a ``UserError``.
    """
    if isinstance(error, (UserError, argparse.ArgumentError)):
        return True
    if not isinstance(error, OSError):
        return False
    return error.errno in _DISK_ERRNOS or (
        error.filename is not None and error.errno in _PATH_ERRNOS
    )


def _message(error: BaseException) -> str:
    """The one line of an error the user can fix: its own text, but for a full disk, a quota
    or a file size limit, which a failed ``write`` reports without saying where or why."""
    if isinstance(error, OSError) and error.errno in _DISK_ERRNOS and error.filename is None:
        return (
            f"{error.strerror}: a file could not be written (the disk is full, or a quota or a "
            "file size limit is reached)"
        )
    return str(error)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, translate, inspect.",
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in _COMMAND_FAMILIES:
        family.add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command ``argv`` (default: ``sys.argv[1:]``) and returns its exit status.

    0 on success; 2 for an error the user can fix (:func:`_is_user_error`), one line on stderr,
    ``aiayn COMMAND: error: MESSAGE``, as argparse prints a bad flag (``-v`` adds the
    traceback); 130 on Ctrl-C; 141 (128 + SIGPIPE, as a shell reports ``yes | head``), without a
    word, when whatever read standard output has gone (``aiayn translate ... | head``); 1, one
    line, for a process of aiayn's killed from outside (:class:`~aiayn.errors.KilledError`); 1 for
    anything else, a bug: its traceback, then a line asking for a report. A command's own exit
    status (``SystemExit``) passes through.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    ctrl_c = _CtrlC()
    try:
        with ctrl_c:
            try:
                return args.run(args)
            except KeyboardInterrupt:
                return ctrl_c.interrupted()
            except Exception as error:
                if not ctrl_c.pressed.is_set():
                    return _report(error, args)
                return ctrl_c.interrupted()  # an error of what Ctrl-C stopped half-way (an import)
    except KeyboardInterrupt:  # repeated before the first was handled
        return ctrl_c.interrupted()


class _CtrlC:
    """Ctrl-C, for the length of a command, as Python raises it (KeyboardInterrupt), but raised
    again every second until the command has ended by it: a library may lose the first one
    (numpy interrupted while torch imports it goes on without it, or fails later with an
    ImportError), and the command must not go on as if nothing had been pressed. Only where
    Ctrl-C is Python's to handle (not ignored by the parent, in the main thread)."""

    def __init__(self) -> None:
        self.pressed, self.handled = threading.Event(), threading.Event()
        self._previous: Any = None
        self._said = False

    def __enter__(self) -> _CtrlC:
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _interrupt(self, signum: int, frame: Any) -> None:
        if self.handled.is_set():
            return
        if not self.pressed.is_set():
            self.pressed.set()
            threading.Thread(target=self._again, name="aiayn-ctrl-c", daemon=True).start()
        raise KeyboardInterrupt

    def interrupted(self) -> int:
        """Ctrl-C has ended the command: no more repeats, one "interrupted" line, 130."""
        self.handled.set()
        if not self._said:
            self._said = True
            print("interrupted", file=sys.stderr)
        return 130

    def _again(self) -> None:
        while not self.handled.wait(1.0):
            _thread.interrupt_main()

    def __exit__(self, *exc: object) -> None:
        self.handled.set()
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._interrupt:
            signal.signal(signal.SIGINT, self._previous)


def _report(error: Exception, args: argparse.Namespace) -> int:
    """Print what a command raised by the rule of :func:`main`; its exit status."""
    if isinstance(error, BrokenPipeError) and _reader_gone(sys.stdout):
        _discard_standard_output()
        return 141
    killed = isinstance(error, KilledError)  # neither the user's mistake nor a bug
    if not killed and not _is_user_error(error):
        traceback.print_exc()
        print(f"aiayn {args.command}: {_REPORT}", file=sys.stderr)
        return 1
    if args.verbose:
        traceback.print_exc()
    print(f"aiayn {args.command}: error: {_message(error)}", file=sys.stderr)
    return 1 if killed else 2


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe whose reading end is closed: the process that read it (a
    ``head``) has ended. Asked of the file descriptor (``poll`` reports an error on such a pipe),
    not guessed from the exception: a BrokenPipeError may come from any pipe or socket."""
    try:
        fd = stream.fileno()
        poll = select.poll()
    except (AttributeError, OSError, ValueError):  # no file (a test's StringIO), no poll
        return False
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _discard_standard_output() -> None:
    """Point file descriptor 1 at /dev/null, so that flushing what is left of standard output
    as the process ends raises no second BrokenPipeError (Python's documented way, in the
    notes on SIGPIPE of the ``signal`` module)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def entry_point() -> NoReturn:
    """The ``aiayn`` executable and ``python -m aiayn``: :func:`main` on the command line, then
    exit with its status.

    A command's work is done when :func:`main` returns: its files are written and closed,
    its worker processes joined. What Python's shutdown does after that, with PyTorch and a
    model loaded, is free hundreds of thousands of objects one by one, memory the process's end
    frees anyway: 0.23–0.27 s after ``aiayn translate`` of 809 lines, a tenth of a one-line
    command's time (AMD EPYC, 2 cores; BENCHMARKS.md). So the executable first moves every live
    object to the garbage collector's permanent generation (``gc.freeze``), so that collections
    from then on skip them; then, when nothing else needs the usual exit (`_may_end_at_once`:
    no other thread, which could still be writing; no profiler, tracer, debugger or coverage
    tool, which write their results after the program returns to them), it runs the exit
    handlers (``atexit``: logging's flush, multiprocessing's joins), flushes standard output and
    error (Python's and C's), and ends the process at once (``os._exit``). Otherwise, or if
    standard output or error cannot be flushed (a closed pipe), it exits the usual way. Only
    here, where the process ends: :func:`main` itself, which tests and scripts call many times
    in one process, does neither.
    """
    try:
        status = main()
    finally:
        gc.freeze()
    if isinstance(status, int) and _may_end_at_once():
        atexit._run_exitfuncs()  # what the usual exit runs first
        if _flush_standard_streams():
            import ctypes

            ctypes.CDLL(None).fflush(None)  # C's own buffers (a library's printf), as exit() does
            os._exit(status)
    raise SystemExit(status)


def _may_end_at_once() -> bool:
    """Whether the process may end without Python's usual exit: on a POSIX system, with no
    other thread running, no profiler or tracer (``sys.setprofile``, ``sys.settrace``: cProfile,
    ``trace``, coverage) nor a tool of ``sys.monitoring`` (Python >= 3.12) watching, and no
    interactive prompt to come (``python -i``)."""
    if os.name != "posix" or threading.active_count() != 1 or sys.flags.inspect:
        return False
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return False
    monitoring = getattr(sys, "monitoring", None)
    return monitoring is None or all(monitoring.get_tool(i) is None for i in range(6))


def _flush_standard_streams() -> bool:
    """Flush standard output and error (those in ``sys`` and the originals, where a command
    swapped them); False if one cannot be (a closed pipe: the usual exit reports it). A stream
    that is None (Python started with that file descriptor closed) is left alone."""
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    try:
        for stream in {id(s): s for s in streams if s is not None}.values():
            stream.flush()
    except (OSError, ValueError):
        return False
    return True
