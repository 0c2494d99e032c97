"""Data-parallel context from torchrun's environment: rank, world size, device, collectives.

`torchrun --nproc_per_node=K -m aiayn train ...` sets RANK, WORLD_SIZE and LOCAL_RANK; without
them the run is a single process and every collective below is a no-op. GPUs talk over NCCL,
CPUs over gloo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aiayn.errors import UserValueError
from aiayn.runtime import checked_device, device_type


@dataclass
class Distributed:
    """Rank and world size from torchrun's environment (a single process without it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (any picklable object), indexed by rank."""
        if not self.enabled:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Sum floats over all ranks (float64, so token counts stay exact)."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def sum_on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over all ranks, left on its device: unlike `sum`, the host does not
        wait for the result (NCCL queues the collective on the GPU's stream)."""
        if self.enabled:
            dist.all_reduce(tensor)
        return tensor


def init_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name == "auto":
        device_name = device_type(device_name)
    if world_size > 1 and device_name.startswith("cuda:"):
        raise UserValueError(
            f"--device {device_name}: under torchrun each process trains on GPU LOCAL_RANK, so "
            "one GPU for all would fail; pass --device cuda (or auto), and choose the GPUs "
            "with CUDA_VISIBLE_DEVICES"
        )
    cuda_ranks = device_name == "cuda" and world_size > 1 and torch.cuda.is_available()
    if cuda_ranks and local_rank >= (count := torch.cuda.device_count()):
        raise UserValueError(
            f"torchrun process {local_rank} (LOCAL_RANK) has no GPU: this machine shows "
            f"{count}; start at most --nproc_per_node={count}"
        )
    if device_name == "cuda":
        # Process k of a torchrun trains on GPU k; a single process on GPU 0 (of those that
        # CUDA_VISIBLE_DEVICES shows): `train` makes it CUDA's current device while it runs.
        device_name = f"cuda:{local_rank}"
    device = checked_device(device_name)
    context = Distributed(rank=rank, world_size=world_size, local_rank=local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # Rank 0 validates (and decodes, with valid_bleu) while the others wait at a barrier:
        # allow that longer than the default collective timeout (10 minutes with NCCL).
        dist.init_process_group(backend=backend, timeout=timedelta(hours=2))
    return context, device
