"""Process-wide settings, made by the entry points and by no library object.

PyTorch's thread count, oneDNN's kernel cache and TorchInductor's error handling belong to the
whole process: a `Translator` or a `Trainer` that set them would reconfigure the notebook or
service that built it. So the library takes them as they are, and the programs that own the
process (`aiayn`'s commands, `aiayn serve`, the benchmarks) set them here, once, at start.

    from aiayn import runtime
    runtime.configure(threads=2)  # what `aiayn translate --threads 2` does
"""

from __future__ import annotations

import os

ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def configure(
    *,
    threads: int | None = None,
    onednn_kernels: int | None = None,
    compile_errors_fall_back: bool | None = None,
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
    """
    if threads is not None:
        if threads < 0:
            raise ValueError(f"threads ({threads}) must be >= 0 (0 = PyTorch's default)")
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
    if onednn_kernels is not None and not any(v in os.environ for v in ONEDNN_CACHE_VARIABLES):
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(onednn_kernels)
    if compile_errors_fall_back is not None:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = compile_errors_fall_back
