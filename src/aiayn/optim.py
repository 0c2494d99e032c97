"""Optimisation of §5.3: Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 and the schedule of Eq. 3.

Besides Eq. 3 (`inverse_sqrt`, the paper's, which never anneals) there are schedules that know
where the run ends and decay to zero there (`DECAYING`; not in the paper, docs/training.md):
the same linear warm-up to the same peak, then a linear decay (Li et al. 2020, "Budgeted
Training", found it the strong default for a fixed budget), a cosine one, or Eq. 3 with a
linear cool-down over the last `COOLDOWN_FRACTION` of the run. Every rate is a pure function
of the step and the end, so a resumed run sets the same rates.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCHEDULES = ("inverse_sqrt", "linear", "cosine", "inverse_sqrt_cooldown")
DECAYING = ("linear", "cosine", "inverse_sqrt_cooldown")
COOLDOWN_FRACTION = 0.2  # inverse_sqrt_cooldown: the last 20% of the updates


def learning_rate(step: int, *, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5), times `scale`.

    The rate grows linearly for the first `warmup_steps` updates and then decays with the
    inverse square root of the step. `step` counts optimizer updates from 1.
    """
    if step < 1:
        raise ValueError(f"step ({step}) must be >= 1: Eq. 3 is defined for steps 1, 2, ...")
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def scheduled_rate(
    schedule: str,
    step: int,
    *,
    d_model: int,
    warmup_steps: int,
    scale: float = 1.0,
    end: int | None = None,
) -> float:
    """The learning rate of update `step` (from 1) under `schedule`, for a run that ends at
    update `end`.

    Every schedule warms up as Eq. 3 does (linearly, to Eq. 3's peak
    d_model^-0.5 · warmup_steps^-0.5 · scale at `warmup_steps`). Then:

    - ``inverse_sqrt``: Eq. 3 (`learning_rate`); `end` is not used.
    - ``linear``: a straight line from the peak to 0 at `end`.
    - ``cosine``: half a cosine from the peak to 0 at `end`.
    - ``inverse_sqrt_cooldown``: Eq. 3, times a factor falling linearly from 1 to 0 over the
      last `COOLDOWN_FRACTION` of the updates (never before the warm-up ends).

    The decaying schedules give exactly 0 at `end` and after it, so the run's last update is
    the one at the bottom of the decay. Where `end` comes before the warm-up ends (a very short
    run), the rate ramps up until `end` and is 0 there.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule ({schedule!r}) must be one of {', '.join(SCHEDULES)}")
    eq3 = learning_rate(step, d_model=d_model, warmup_steps=warmup_steps, scale=scale)
    if schedule == "inverse_sqrt":
        return eq3
    if end is None or end < 1:
        raise ValueError(f"schedule {schedule!r} needs the run's last update (end={end!r})")
    if step >= end:
        return 0.0
    if schedule == "inverse_sqrt_cooldown":
        start = max(end - math.ceil(COOLDOWN_FRACTION * end), min(warmup_steps, end - 1))
        return eq3 * min(1.0, (end - step) / max(end - start, 1))
    if step <= warmup_steps:
        return eq3  # the ramp, shared with Eq. 3
    progress = (step - warmup_steps) / (end - warmup_steps)  # in (0, 1): warmup < step < end
    peak = learning_rate(warmup_steps, d_model=d_model, warmup_steps=warmup_steps, scale=scale)
    if schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, *, betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-9
) -> torch.optim.Adam:
    """Adam as in §5.3. The learning rate is set before every update from `scheduled_rate`, so
    the schedule is a pure function of the step and resumes exactly.

    PyTorch's fused Adam (one kernel for all parameters, on CPU and CUDA) does the same update as
    the per-parameter loop, in a few percent of a training step less; a test checks that both
    give the same weights to float32 rounding.
    """
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=betas, eps=eps, fused=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
