"""Errors a user can fix, as one family: what ``aiayn`` prints as one line, exit status 2.

An error belongs to :class:`UserError` when the person running aiayn can fix it without
touching aiayn's code: a file, a flag, a config value, a model or run directory, a corpus, a
missing optional extra, a full disk. Its message is the whole report, so it names what is wrong
(the file and line, the field and value) and, where it can, what to do.

Everything else (an ``IndexError`` in the search, a ``RuntimeError`` from inside torch, a
``ValueError`` from a shape check) is a bug in aiayn or below it: the CLI shows its traceback
and asks for it to be reported. So raise a ``UserError`` only where the cause is the user's
input, and let a broken invariant raise what it raises. One more kind is neither:
:class:`KilledError`, a process of aiayn's killed from outside (for memory), one line with exit
status 1.

The classes of the family keep the built-in base their callers catch (``ValueError``,
``FileNotFoundError``, ``ImportError``, ``RuntimeError``), so ``except ValueError`` around
``DecodingOptions(beam_size=0)`` and ``pytest.raises(ValueError)`` keep working. A module's own
error class (``aiayn.config.ConfigError``, ``aiayn.text.corpus.DataError``,
``aiayn.extras.MissingExtra``, ...) derives from ``UserError`` and that base (so does
:class:`CheckpointError`, defined here: model directories, exports and checkpoints all raise
it); a one-off check raises :class:`UserValueError` or
:class:`UserFileNotFoundError`.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "KilledError",
    "UserError",
    "UserFileNotFoundError",
    "UserValueError",
    "first_line",
]


class UserError(Exception):
    """Something the user gave cannot be used as it is; the message says what and how to fix it.

    What belongs here: bad input the user can fix (a file, a flag, a config value, a model
    directory, a run directory, a corpus), a missing optional extra, a full disk. What does not:
    anything that means aiayn itself is wrong, which must keep its traceback.
    """


class UserValueError(UserError, ValueError):
    """A value the user gave (a flag, an option, a setting, a file's content) is out of range or
    malformed. Also a ``ValueError``, as it was before the family existed."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist; the message names it. Also a
    ``FileNotFoundError``, as it was before the family existed."""


class CheckpointError(UserError, RuntimeError):
    """A model directory, an export or a checkpoint is missing, incomplete, corrupt or
    incompatible. (Also importable from `aiayn.model_dir`, which reads them.)"""


class CorruptCheckpointError(CheckpointError):
    """A file of a model directory or checkpoint is missing, truncated or does not match its
    checksum (as opposed to a sound directory that does not fit, e.g. another architecture)."""


class KilledError(RuntimeError):
    """A process doing aiayn's work was killed from outside (by the kernel for memory, most
    often): neither the user's mistake nor a bug in aiayn. The CLI prints it as one line with
    exit status 1 and no traceback; the message says what to lower."""


def first_line(error: BaseException) -> str:
    """The first line of a (third-party) error's message, or its type's name without one: what a
    one-line message quotes of a runtime's reason."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
