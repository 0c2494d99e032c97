"""What the CUDA tests share (tests/cuda is on sys.path under pytest, as tests/ is)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """float32 matrix products at `precision` ("highest" = IEEE float32, "high" = TF32 on
    CUDA's tensor cores) inside the block, PyTorch's setting restored after it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """‖out − reference‖ / ‖reference‖ in float64, on the CPU; NaN anywhere gives inf."""
    out, reference = out.detach().double().cpu(), reference.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - reference).norm() / reference.norm())
