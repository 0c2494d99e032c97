"""An exponential moving average of the weights (`TrainConfig.ema_decay`; not in the paper).

Marian's ``--exponential-smoothing`` is the model: after update t the average moves towards the
weights by 1 - d, with d = min(ema_decay, (1 + t) / (10 + t)), so that early in a run (when the
first weights are noise) it follows them closely and later averages over about
1 / (1 - ema_decay) updates. Marian's 1e-4 is ema_decay 0.9999 here. The average is kept in
float32 on the training device, updated by one fused kernel per update, and saved with every
checkpoint, so that a resumed run goes on with the same average, bit for bit.

`§6.1` of the paper averages the last checkpoints instead (`aiayn average`), after training;
the moving average is there during training, to validate and to save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# What a model directory of the run may hold, as logs and metadata name it, and in words.
WEIGHTS_NAMES = {"raw": "raw", "ema": "averaged (EMA)"}


class WeightAverage:
    """The exponential moving average of `model`'s parameters (its buffers are not learned)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay ({decay}) must be in (0, 1)")
        self.decay = decay
        named = list(model.named_parameters())  # shared weights (§3.4) once
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.average = [p.detach().float().clone() for p in self.params]

    def decay_at(self, step: int) -> float:
        """The decay after update `step` (from 1): `decay`, less early in the run."""
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights after update `step`."""
        weights = [p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.average, weights, 1.0 - self.decay_at(step))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average by parameter name, on the CPU (what the training state saves)."""
        return {
            name: a.detach().cpu().clone() for name, a in zip(self.names, self.average, strict=True)
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take the average of a checkpoint; its names and shapes must be this model's."""
        if set(state) != set(self.names):
            missing = sorted(set(self.names) - set(state))
            unexpected = sorted(set(state) - set(self.names))
            raise ValueError(
                f"the saved average does not fit the model (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]})"
            )
        with torch.no_grad():
            for name, average in zip(self.names, self.average, strict=True):
                if state[name].shape != average.shape:
                    raise ValueError(
                        f"the saved average of {name} has shape {tuple(state[name].shape)}, "
                        f"the model's {tuple(average.shape)}"
                    )
                average.copy_(state[name])

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block, its own weights again after it (an
        exact copy back: the optimizer goes on from the same weights)."""
        with torch.no_grad():
            raw = [p.detach().clone() for p in self.params]
            for p, average in zip(self.params, self.average, strict=True):
                p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, weights in zip(self.params, raw, strict=True):
                    p.copy_(weights)


def averaged_fields(valid: dict[str, Any]) -> dict[str, Any]:
    """The average's validation metrics (`validation.validation_metrics`'s keys) as
    `runlog.ValidRecord`'s `valid_ema_*` fields."""
    names = ("loss", "nll", "ppl", "bleu", "chrf")
    return {f"valid_ema_{n}": valid[f"valid_{n}"] for n in names if f"valid_{n}" in valid}


def better_weights(valid: dict[str, Any], metric: str) -> str:
    """Which weights a validation (raw `valid_*` and averaged `valid_ema_*` values) found
    better by `metric` ("loss": the NLL; "bleu"): "ema" where the average is strictly better,
    else "raw"."""
    if metric == "bleu":
        return "ema" if valid["valid_ema_bleu"] > valid["valid_bleu"] else "raw"
    return "ema" if valid["valid_ema_nll"] < valid["valid_nll"] else "raw"
