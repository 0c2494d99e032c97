"""Process-wide settings, made by the entry points and by no library object.

PyTorch's thread count, oneDNN's kernel cache, TorchInductor's error handling and the limit on
open files belong to the whole process: a `Translator`, a `Trainer` or a server app that set
them would reconfigure the notebook or service that built it. So the library takes them as
they are, and the programs that own the process (`aiayn`'s commands, `aiayn serve`, the
benchmarks) set them here, once, at start.

    from aiayn import runtime
    runtime.configure(threads=2)  # what `aiayn translate --threads 2` does

Where each command sets what: `aiayn train` its `threads`, oneDNN's kernel cache for
``--cpu-bf16`` on a CPU and the compile fallback for ``--compile``
(`aiayn.train.trainer.runtime_settings`); the decoding commands their ``--threads``;
`aiayn serve` (`aiayn.serve.app.serve`) the limit on open files for ``--max-connections``.
"""

from __future__ import annotations

import contextlib
import os

from aiayn.errors import UserValueError

ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def configure(
    *,
    threads: int | None = None,
    onednn_kernels: int | None = None,
    compile_errors_fall_back: bool | None = None,
    open_files: int | None = None,
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
