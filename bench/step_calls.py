"""Calls into PyTorch per decoding step, and where the search makes them (translate.py's
`--step-calls`): a profile that needs no clock.

At a decoding step's few rows, every call into PyTorch costs a few microseconds of Python,
bindings and dispatch however little it computes (16-18% of aiayn's CPU time on the 2-core AMD
EPYC in a `perf` profile, where CTranslate2's C++ spends almost none). A `TorchDispatchMode`
counts every operator while a `Translator` decodes real sentences on one thread, and puts each
call down to the model's `decode_step` or to the innermost aiayn function outside it (the
search's own work). Counts depend on the code and the sentences, not on the machine: they
compare two commits exactly where timings on these shared machines move by ±10%.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

import aiayn
from aiayn.decode.restricted import RestrictedModel
from aiayn.model import Transformer

PACKAGE = str(Path(aiayn.__file__).resolve().parent)
STEP = "the model's decoding step (decode_step)"


@dataclass
class StepCalls:
    """What `count_step_calls` counted."""

    steps: int = 0
    """`decode_step` calls: one per search step of every batch."""
    by_place: collections.Counter[str] = field(default_factory=collections.Counter)
    """Calls into PyTorch by where they were made: `STEP`, or ``module.function`` of the
    innermost aiayn function outside the step."""
    per_step: list[int] = field(default_factory=list)
    """Calls made from the start of each step to the start of the next (the step and the
    search's work after it)."""

    def per_search_step(self, place: str | None = None) -> float:
        """Calls per step, of every place or of one."""
        total = sum(self.by_place.values()) if place is None else self.by_place[place]
        return total / max(self.steps, 1)

    @property
    def most_in_one_step(self) -> int:
        return max(self.per_step, default=0)


def _place(frame: Any) -> str | None:
    """``module.function`` of the innermost frame in the aiayn package, or None."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(PACKAGE):
            module = filename[len(PACKAGE) + 1 : -3].replace("/", ".")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return None


class _Counter(TorchDispatchMode):
    def __init__(self, counted: StepCalls) -> None:
        super().__init__()
        self.counted = counted
        self.in_step = False
        self.since_step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        place = STEP if self.in_step else _place(sys._getframe(1)) or "outside aiayn"
        self.counted.by_place[place] += 1
        self.since_step += 1
        return func(*args, **(kwargs or {}))


Step = Callable[..., Any]
STEPPING = (Transformer, RestrictedModel)
"""The classes whose `decode_step` a search calls: the model itself, or (a model whose output
layer covers the target side, or with a shortlist) its restriction to some target ids, which
calls the model's `decode_step_hidden`, never its `decode_step`."""


@contextlib.contextmanager
def wrapped_decode_steps(wrap: Callable[[Step], Step]) -> Iterator[None]:
    """Within the block, every search's `decode_step` is `wrap(the real one)`."""
    real = [cls.decode_step for cls in STEPPING]
    for cls, step in zip(STEPPING, real, strict=True):
        cls.decode_step = wrap(step)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, step in zip(STEPPING, real, strict=True):
            cls.decode_step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def count_step_calls() -> Iterator[StepCalls]:
    """Count the calls into PyTorch that decoding makes in the block (`StepCalls`)."""
    counted = StepCalls()
    counter = _Counter(counted)

    def counting(decode_step: Step) -> Step:
        def counting_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if counted.steps:
                counted.per_step.append(counter.since_step)
            counter.since_step = 0
            counted.steps += 1
            counter.in_step = True
            try:
                return decode_step(self, *args, **kwargs)
            finally:
                counter.in_step = False

        return counting_step

    try:
        with wrapped_decode_steps(counting), counter:
            yield counted
    finally:
        if counted.steps:
            counted.per_step.append(counter.since_step)


def markdown(counted: StepCalls, layers: int, caption: str) -> str:
    """A table of calls per step by place, most first."""
    lines = [caption, "", "| where | calls per step |", "| --- | ---: |"]
    for place, _ in counted.by_place.most_common():
        per_step = counted.per_search_step(place)
        label = f"{place} ({per_step / layers:.1f} per decoder layer)" if place == STEP else place
        lines.append(f"| {label} | {per_step:.1f} |")
    lines.append(f"| **every call** | **{counted.per_search_step():.1f}** |")
    lines.append("")
    lines.append(
        f"{counted.steps} steps; the most calls in one step (and the search's work after it): "
        f"{counted.most_in_one_step}."
    )
    return "\n".join(lines)
