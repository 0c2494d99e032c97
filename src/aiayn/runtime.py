"""Process-wide settings, made by the entry points and by no library object, how many CPU
threads a decoding command should take (`decoding_threads`), and what device ``--device``
names: "auto" resolved, the one rule for it (`auto_device`), and whether this machine has it
(`checked_device`).

PyTorch's thread count, oneDNN's kernel cache, TorchInductor's error handling, the C library's
memory allocator and the limit on open files belong to the whole process: a `Translator`, a
`Trainer` or a server app that set them would reconfigure the notebook or service that built
it. So the library takes them as they are, and the programs that own the process (`aiayn`'s
commands, `aiayn serve`, the benchmarks) set them here, once, at start.

    from aiayn import runtime
    runtime.configure(threads=2)  # what `aiayn translate --threads 2` does

Where each command sets what: `aiayn train` its `threads`, oneDNN's kernel cache for
``--cpu-bf16`` on a CPU and the compile fallback for ``--compile``
(`aiayn.train.trainer.runtime_settings`); the decoding commands their ``--threads``;
`aiayn serve` (`aiayn.serve.app.serve`) the limit on open files for ``--max-connections``;
`aiayn train`, `aiayn demo` and the commands that decode with PyTorch (`translate`, `evaluate`,
`score`, `attention`, `serve`) keep freed memory for reuse (`keep_freed_memory`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiayn.errors import UserValueError

if TYPE_CHECKING:
    import torch

ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def configure(
    *,
    threads: int | None = None,
    onednn_kernels: int | None = None,
    compile_errors_fall_back: bool | None = None,
    open_files: int | None = None,
    reuse_freed_memory: bool | None = None,
) -> None:
    """Set what belongs to the process; a None leaves that setting as it is.

    Args:
        threads: PyTorch's intra-op CPU threads (`torch.set_num_threads`); 0 keeps PyTorch's
            default (one per core).
        onednn_kernels: How many compiled kernels oneDNN keeps (its default: 1024), unless the
            user already chose with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``. oneDNN reads it once,
            at its first kernel, so it takes effect only before any oneDNN work in the process.
        compile_errors_fall_back: A `torch.compile`d model whose compilation fails at its first
            call runs eagerly instead of raising (``torch._dynamo.config.suppress_errors``).
        open_files: Raise the soft limit on open files (``RLIMIT_NOFILE``) to at least this, as
            far as the hard limit allows; never lowers it. A server needs one per connection.
        reuse_freed_memory: True: the C library's allocator keeps the memory tensors free for
            the next ones (`keep_freed_memory`); False or None leave it as it is.
    """
    if threads is not None:
        if threads < 0:
            raise UserValueError(f"threads ({threads}) must be >= 0 (0 = PyTorch's default)")
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
    if onednn_kernels is not None and not any(v in os.environ for v in ONEDNN_CACHE_VARIABLES):
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(onednn_kernels)
    if compile_errors_fall_back is not None:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = compile_errors_fall_back
    if open_files is not None:
        _raise_open_files_limit(open_files)
    if reuse_freed_memory:
        keep_freed_memory()


MAX_DECODING_THREADS = 4
"""Most CPU threads :func:`decoding_threads` picks; CTranslate2's default is 4 as well."""


def decoding_threads(cores: int | None = None, load: float | None = None) -> int:
    """CPU threads for a decoding command: the cores not already busy, from 1 to 4.

    PyTorch's default is one thread per core. When other processes keep the cores busy (a
    training run, a test suite), its OpenMP threads spin-wait for each other at every matrix
    product, and decoding gets many times slower: with beam search on a 2-core machine loaded
    by a training run (load average 3–6), 2 threads took 4–40x longer than 1 (tiny model,
    4 sentences: 0.2 s vs 4–9.5 s; base model, 32 sentences: 7 s vs 25–36 s). So count the
    busy cores out (`busy_cores`). Decoding's matrix products are small, so past a few
    threads little is gained; hence the cap of 4.

    Args:
        cores: Cores to share; default ``torch.get_num_threads()`` (PyTorch's default, when
            nothing has set it yet) where torch is imported, else the CPUs this process may
            run on (the CTranslate2 backend imports no torch).
        load: Busy cores; default `busy_cores()`.
    """
    return min(MAX_DECODING_THREADS, _free_cores(cores, load))


def _free_cores(cores: int | None, load: float | None) -> int:
    """The cores other processes leave free, at least 1 (defaults as for `decoding_threads`)."""
    if cores is None:
        cores = _available_cores()
    if load is None:
        load = busy_cores()
    return max(1, cores - round(load))


def threads_beyond_free_cores(
    threads: int, cores: int | None = None, load: float | None = None
) -> str | None:
    """Why ``threads`` asked for by hand (``--threads``) would slow decoding down, or None.

    More threads than the cores that other processes leave free (`busy_cores`) wait for each
    other at every matrix product: the 4–40x slowdown `decoding_threads` measured. That
    function keeps the default out of it; a number given by hand is taken as given, and this
    says what it will cost. 0 (PyTorch's default) is not checked.

    Args:
        threads: The threads asked for.
        cores: Cores to share; default as for `decoding_threads` (call this before
            `configure` sets PyTorch's count).
        load: Busy cores; default `busy_cores()`.
    """
    if threads <= 0:
        return None
    if cores is None:
        cores = _available_cores()
    if load is None:
        load = busy_cores()
    free = _free_cores(cores, load)
    if threads <= free:
        return None
    return (
        f"--threads {threads}: other processes keep {load:.1f} of the {cores} cores busy, and "
        f"threads that wait for each other at every matrix product can make decoding several "
        f"times slower; {free} would fit (without --threads, aiayn chooses by itself)"
    )


def busy_cores(average: float | None = None, runnable: int | None = None) -> float:
    """Cores that other processes keep busy: the 1-minute load average, but no more than the
    tasks runnable right now besides this one.

    The average alone remembers a run that has just ended for a minute or more: `aiayn
    evaluate` right after a 30-minute training run counted one of two cores busy and decoded
    on one thread. The runnable tasks (Linux's ``/proc/loadavg``) forget it at once, and
    count a training run's threads while it runs (its OpenMP threads spin, and stay
    runnable, between products); the average keeps a moment's burst of tasks from counting.

    Args:
        average: Default ``os.getloadavg()[0]`` (0 where there is none: Windows).
        runnable: Tasks runnable now, this process included; default from ``/proc/loadavg``
            (None where there is none: the average alone).
    """
    if average is None:
        try:
            average = os.getloadavg()[0]
        except (AttributeError, OSError):  # not on Windows
            average = 0.0
    if runnable is None:
        runnable = _runnable_tasks()
    if runnable is None:
        return average
    return min(average, float(max(0, runnable - 1)))


def _runnable_tasks() -> int | None:
    """The fourth field of ``/proc/loadavg`` ("3/412": 3 runnable of 412), or None."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _available_cores() -> int:
    if "torch" in sys.modules:
        return sys.modules["torch"].get_num_threads()
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS or Windows
        return os.cpu_count() or 1


def _raise_open_files_limit(needed: int) -> None:
    """The soft RLIMIT_NOFILE up to `needed` (at most the hard limit), where there is one."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    # Where it cannot, the caller's cap fits what is left (serve.connections.connection_cap).
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


MALLOC_MMAP_THRESHOLD = 32 * 2**20
"""Blocks from this size on come straight from the system (glibc's M_MMAP_THRESHOLD, and the
largest it takes on 64 bits); smaller ones from the heap, where a freed block is reused."""
MALLOC_TRIM_THRESHOLD = 256 * 2**20
"""glibc hands memory back to the system once this much is free at the top of its heap
(M_TRIM_THRESHOLD)."""
MALLOC_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)
"""glibc's own variables for what `keep_freed_memory` sets: a user who set one has chosen."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep the memory that tensors free for the next ones (up to
    `MALLOC_TRIM_THRESHOLD` of it), rather than hand it back to the system; returns whether
    it was set.

    A training update or a decoding step allocates and frees tensors of megabytes (the
    activations, the logits of every row over the vocabulary). By default glibc serves blocks
    that large with fresh pages from the system, or trims the freed ones off its heap, so that
    the next step takes its memory again page by page, each page a fault that the kernel answers
    by zeroing it. With this setting (BENCHMARKS.md; two CPU cores, the Bible recipe): 60
    training updates took 0.23 million page faults instead of 0.8–1.5 million and ran 1.02–1.21×
    faster (300 updates: 7 million faults saved, 1.04×); `aiayn translate` of the 809 validation
    sentences 177,000 instead of 303,000 (the same time, within the runs' spread). Nothing is
    set where the allocator is not glibc's (musl, macOS, Windows), or where the user chose its
    thresholds (``GLIBC_TUNABLES=glibc.malloc.…``, ``MALLOC_*_``): theirs stand. Memory freed
    stays with the process, up to `MALLOC_TRIM_THRESHOLD` above what it uses, for its next
    tensors.
    """
    if any(name in os.environ for name in MALLOC_VARIABLES):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
        libc = ctypes.CDLL("libc.so.6")
    except (AttributeError, ValueError, OSError):  # no confstr, not glibc, no libc.so.6
        return False
    # The mmap threshold first: setting either fixes both (glibc stops adjusting them).
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
        and libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


def auto_device(cuda_available: Callable[[], bool] | None = None, *, cpu_only: bool = False) -> str:
    """What ``--device auto`` names: "cuda" (the first CUDA GPU) where there is one, else "cpu";
    "cpu" with ``cpu_only``, for what runs there alone (int8 decoding).

    Args:
        cuda_available: Asks the runtime that will compute whether it has a CUDA GPU:
            PyTorch's ``torch.cuda.is_available`` where None (torch is imported then). The
            CTranslate2 backend asks CTranslate2 (`aiayn.decode.backends.ctranslate2`): its
            wheel has CUDA where PyTorch may be a CPU build, and that path imports no torch.
        cpu_only: Answer "cpu" without asking.
    """
    if cpu_only:
        return "cpu"
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available
    return "cuda" if cuda_available() else "cpu"


def device_type(name: str | torch.device, *, cpu_only: bool = False) -> str:
    """The type of device `--device` names ("cpu", "cuda", ...), "auto" resolved by
    `auto_device`, without checking that the device exists; torch is imported only for
    "auto"."""
    if name == "auto":
        return auto_device(cpu_only=cpu_only)
    return str(name).partition(":")[0]


def checked_device(name: str | torch.device, *, cpu_only: bool = False) -> torch.device:
    """`--device` as a `torch.device`: "auto" as `auto_device` resolves it for PyTorch. A
    name PyTorch does not know (a typo), and a CUDA device this machine lacks (CUDA on a
    CPU-only machine or PyTorch, a GPU index past the last), are refused in one line that says
    what there is.

    Raises:
        UserValueError: The device does not exist here.
    """
    import torch

    if name == "auto":
        return torch.device(auto_device(cpu_only=cpu_only))
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserValueError(f"--device {name}: give cpu, cuda, cuda:N or auto") from None
    if device.type != "cuda":  # the CPU, or another of PyTorch's devices (mps, xpu), as it is
        return device
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no CUDA GPU visible"
        raise UserValueError(
            f"--device {name}: this machine has no CUDA GPU for PyTorch "
            f"{torch.__version__} ({build}): use --device cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UserValueError(
            f"--device {name}: this machine shows {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
        )
    return device
