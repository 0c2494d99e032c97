"""One trainer per run directory: an advisory lock that the kernel drops when its holder dies.

Two trainers writing one run directory interleave their metrics and mix their checkpoints and
`model/`; a second `--resume` while the first still runs loses the first's records. So the
trainer holds `flock` on `train.lock` in the run directory for as long as it runs. The kernel
releases the lock when the process exits, however it exits (SIGKILL, OOM killer, power-off of
a node does not matter: a lock never outlives its process), so a crashed run never blocks the
next one, and no stale-lock guessing by PID is needed. The file itself stays; it holds the
holder's PID, host and start time only to say who is in the way.

Where `fcntl` does not exist (Windows) or the file system refuses locks, training goes on
unlocked, with a warning.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

LOCK_FILE = "train.lock"


class RunDirectoryLocked(RuntimeError):
    """Another live process is training in this run directory."""


@contextlib.contextmanager
def hold_run_lock(run_dir: Path, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Holds the run directory's lock for the `with` block.

    Args:
        run_dir: An existing directory.
        check: Run once the lock is held, before the holder is recorded: a run it refuses
            (by raising) leaves the lock file as it was.

    Raises:
        RunDirectoryLocked: Another process holds it; the message names its PID, host and
            start time.
    """
    path = Path(run_dir) / LOCK_FILE
    if fcntl is None:
        logger.warning("no fcntl here: %s is not protected from a second trainer", run_dir)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("cannot lock %s (%s): no protection from a second run", path, err)
            else:
                raise RunDirectoryLocked(
                    f"{run_dir} is in use by another trainer ({_describe_holder(path)}; "
                    f"lock file {path}): wait for it to end or stop it, or choose another "
                    "--out-dir"
                ) from None
        else:
            check()
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"PID {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: it is still starting"
