"""Tests for aiayn.optim: Adam of §5.3, the learning-rate schedule of Eq. 3 and the decaying
schedules that end at the run's last update."""

from __future__ import annotations

import copy
import itertools
import math
import typing

import pytest
import torch

from aiayn.config import Schedule
from aiayn.optim import (
    COOLDOWN_FRACTION,
    DECAYING,
    SCHEDULES,
    build_optimizer,
    learning_rate,
    scheduled_rate,
    set_learning_rate,
)
from model_dirs import tiny_model


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        # Eq. 3 for the base model (d_model 512, warmup 4000), worked out by hand:
        # d^-0.5 = 1 / sqrt(512) = 0.0441942, warmup^-1.5 = 3.95285e-6.
        (1, 1 / math.sqrt(512) * 1 * 4000**-1.5),  # 1.7469e-7: the first update
        (2000, 1 / math.sqrt(512) * 2000 * 4000**-1.5),  # half-way up the linear ramp
        (3999, 1 / math.sqrt(512) * 3999 * 4000**-1.5),  # the ramp, one step before the peak
        (4000, 1 / math.sqrt(512) / math.sqrt(4000)),  # the peak, 6.9877e-4: both terms agree
        (4001, 1 / math.sqrt(512) / math.sqrt(4001)),  # the inverse square-root decay
        (16000, 1 / math.sqrt(512) / math.sqrt(16000)),  # 4x the warm-up: half the peak
        (100_000, 1 / math.sqrt(512) / math.sqrt(100_000)),  # the last step of base training
    ],
)
def test_learning_rate_is_eq3(step: int, expected: float) -> None:
    assert learning_rate(step, d_model=512, warmup_steps=4000) == pytest.approx(expected, rel=1e-12)


def test_learning_rate_numbers() -> None:
    # The same schedule as literal numbers, so a mistake in both formula and test shows.
    assert learning_rate(4000, d_model=512, warmup_steps=4000) == pytest.approx(6.98771e-4, 1e-5)
    assert learning_rate(1, d_model=512, warmup_steps=4000) == pytest.approx(1.74693e-7, 1e-5)
    assert learning_rate(16000, d_model=512, warmup_steps=4000) == pytest.approx(3.49386e-4, 1e-5)


def test_learning_rate_peaks_at_the_end_of_warmup() -> None:
    rates = [learning_rate(s, d_model=64, warmup_steps=100) for s in range(1, 400)]
    assert max(rates) == rates[99]  # step 100
    assert all(a < b for a, b in itertools.pairwise(rates[:100]))  # rising
    assert all(a > b for a, b in itertools.pairwise(rates[99:]))  # then falling
    # Linear growth during warm-up, inverse square root after it.
    assert rates[49] == pytest.approx(rates[99] / 2)
    assert rates[399 - 1] == pytest.approx(rates[99] * math.sqrt(100 / 399))


def test_scale_multiplies_the_whole_schedule() -> None:
    for step in (1, 50, 100, 1000):
        base = learning_rate(step, d_model=256, warmup_steps=100)
        assert learning_rate(step, d_model=256, warmup_steps=100, scale=2.5) == pytest.approx(
            2.5 * base
        )


def test_learning_rate_scales_with_d_model() -> None:
    small = learning_rate(10, d_model=64, warmup_steps=100)
    large = learning_rate(10, d_model=256, warmup_steps=100)
    assert small == pytest.approx(2 * large)


@pytest.mark.parametrize("step", [0, -1])
def test_step_must_be_positive(step: int) -> None:
    with pytest.raises(ValueError, match=r"step \(-?\d+\) must be >= 1"):
        learning_rate(step, d_model=512, warmup_steps=4000)


def test_optimizer_is_adam_with_paper_settings() -> None:
    model = tiny_model()
    optimizer = build_optimizer(model)
    assert isinstance(optimizer, torch.optim.Adam)
    (group,) = optimizer.param_groups
    assert group["betas"] == (0.9, 0.98)
    assert group["eps"] == 1e-9
    # Shared weights (§3.4) are one parameter, updated once.
    assert len(group["params"]) == len(list(model.parameters()))
    assert len({id(p) for p in group["params"]}) == len(group["params"])


def test_set_learning_rate_drives_the_update() -> None:
    model = tiny_model()
    optimizer = build_optimizer(model, betas=(0.5, 0.6), eps=1e-6)
    assert optimizer.param_groups[0]["betas"] == (0.5, 0.6)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    set_learning_rate(optimizer, 0.0)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    set_learning_rate(optimizer, 1e-3)
    assert all(g["lr"] == 1e-3 for g in optimizer.param_groups)
    optimizer.step()
    # Adam's first steps move every weight by about lr in the direction of -sign(grad).
    delta = next(model.parameters()).detach() - before[0]
    assert torch.allclose(delta, torch.full_like(delta, -1e-3), rtol=1e-3)


def test_fused_adam_makes_the_same_updates_as_the_plain_loop() -> None:
    """build_optimizer uses PyTorch's fused Adam for speed; it must update like the reference."""
    torch.manual_seed(0)
    fused_model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    plain_model = copy.deepcopy(fused_model)
    fused = build_optimizer(fused_model)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    for step in range(1, 6):
        x = torch.randn(32, 8)
        for model, optimizer in ((fused_model, fused), (plain_model, plain)):
            set_learning_rate(optimizer, learning_rate(step, d_model=16, warmup_steps=2))
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# -- schedules that know their end (not in the paper: docs/training.md) ----------------------


def test_inverse_sqrt_is_eq3_whatever_the_end() -> None:
    for step in (1, 50, 100, 1000):
        eq3 = learning_rate(step, d_model=64, warmup_steps=100, scale=0.5)
        for end in (None, 10, 10_000):
            got = scheduled_rate(
                "inverse_sqrt", step, d_model=64, warmup_steps=100, scale=0.5, end=end
            )
            assert got == eq3


@pytest.mark.parametrize("schedule", DECAYING)
@pytest.mark.parametrize(("warmup", "end"), [(4, 6), (4, 9), (20, 57), (100, 400), (4000, 100_000)])
def test_a_decaying_schedule_warms_up_as_eq3_and_reaches_zero_at_the_last_update(
    schedule: str, warmup: int, end: int
) -> None:
    rates = [
        scheduled_rate(schedule, s, d_model=512, warmup_steps=warmup, end=end)
        for s in range(1, end + 3)
    ]
    eq3 = [learning_rate(s, d_model=512, warmup_steps=warmup) for s in range(1, end + 3)]
    assert rates[end - 1] == 0.0 and rates[end:] == [0.0, 0.0]  # at the last update, and after
    assert all(r > 0 for r in rates[: end - 1])  # every update before it learns
    cooldown_start = end - math.ceil(COOLDOWN_FRACTION * end)
    same_as_eq3 = cooldown_start if schedule == "inverse_sqrt_cooldown" else warmup
    assert rates[:same_as_eq3] == eq3[:same_as_eq3]  # the warm-up (and Eq. 3 up to the cool-down)
    after_peak = rates[warmup - 1 : end]
    assert all(a > b for a, b in itertools.pairwise(after_peak))  # falling all the way down


def test_linear_and_cosine_fall_from_eq3s_peak_as_their_names_say() -> None:
    peak = learning_rate(100, d_model=64, warmup_steps=100)
    kwargs = dict(d_model=64, warmup_steps=100, end=500)
    assert scheduled_rate("linear", 300, **kwargs) == pytest.approx(peak / 2)  # half-way down
    assert scheduled_rate("linear", 400, **kwargs) == pytest.approx(peak / 4)
    assert scheduled_rate("cosine", 300, **kwargs) == pytest.approx(peak / 2)
    assert scheduled_rate("cosine", 200, **kwargs) == pytest.approx(
        peak * (1 + math.cos(math.pi / 4)) / 2
    )
    # Eq. 3 with a cool-down: Eq. 3 until the last 20%, then Eq. 3 times a line down to 0.
    assert scheduled_rate("inverse_sqrt_cooldown", 400, **kwargs) == learning_rate(
        400, d_model=64, warmup_steps=100
    )
    assert scheduled_rate("inverse_sqrt_cooldown", 450, **kwargs) == pytest.approx(
        learning_rate(450, d_model=64, warmup_steps=100) / 2
    )


@pytest.mark.parametrize("schedule", DECAYING)
def test_an_end_inside_the_warm_up_ramps_up_until_it_and_is_zero_there(schedule: str) -> None:
    rates = [scheduled_rate(schedule, s, d_model=16, warmup_steps=10, end=4) for s in range(1, 5)]
    eq3 = [learning_rate(s, d_model=16, warmup_steps=10) for s in range(1, 4)]
    assert rates[:3] == pytest.approx(eq3, rel=0.5) and all(r > 0 for r in rates[:3])
    assert rates[3] == 0.0


def test_a_schedule_is_named_and_a_decaying_one_needs_its_end() -> None:
    with pytest.raises(ValueError, match=r"schedule \('exp'\) must be one of inverse_sqrt, linear"):
        scheduled_rate("exp", 1, d_model=16, warmup_steps=4, end=10)
    with pytest.raises(ValueError, match="needs the run's last update"):
        scheduled_rate("linear", 1, d_model=16, warmup_steps=4)


def test_train_config_and_plot_offer_the_schedules_of_optim() -> None:
    """TrainConfig.schedule (and `aiayn plot schedule --schedule`) name them without importing
    torch; they must stay the same list."""
    from aiayn.cli import build_parser

    assert typing.get_args(Schedule) == ("auto", *SCHEDULES)
    plot = build_parser()._subparsers._group_actions[0].choices["plot"]
    schedule = plot._subparsers._group_actions[0].choices["schedule"]
    [action] = [a for a in schedule._actions if a.dest == "schedule"]
    assert tuple(action.choices) == SCHEDULES
