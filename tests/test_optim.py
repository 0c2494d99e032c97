"""Tests for aiayn.optim: Adam of §5.3 and the learning-rate schedule of Eq. 3."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from aiayn.optim import build_optimizer, learning_rate, set_learning_rate


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


def test_optimizer_is_adam_with_paper_settings(make_model) -> None:
    model = make_model()
    optimizer = build_optimizer(model)
    assert isinstance(optimizer, torch.optim.Adam)
    (group,) = optimizer.param_groups
    assert group["betas"] == (0.9, 0.98)
    assert group["eps"] == 1e-9
    # Shared weights (§3.4) are one parameter, updated once.
    assert len(group["params"]) == len(list(model.parameters()))
    assert len({id(p) for p in group["params"]}) == len(group["params"])


def test_set_learning_rate_drives_the_update(make_model) -> None:
    model = make_model()
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
