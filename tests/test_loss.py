"""Tests for aiayn.loss: label-smoothed cross-entropy (§5.4) and perplexity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.loss import label_smoothed_loss, perplexity, projected_label_smoothed_loss

PAD = 0
LN2 = math.log(2)


def _logits_from_probs(probs: list[list[list[float]]]) -> torch.Tensor:
    """Logits whose softmax is exactly `probs` (the log of a distribution is one choice)."""
    return torch.tensor(probs, dtype=torch.float64).log()


def test_hand_computed_example() -> None:
    """One sentence, V = 4, three positions: two real targets, then a pad.

    Every real position predicts p = (1/8, 1/4, 1/2, 1/8) over classes 0..3, so
    -log p = (3, 2, 1, 3)·ln 2. The smoothed target puts 1 - ε on the reference and ε/V on
    every class (the pad class too), so the smoothing term is the mean, 9/4·ln 2, and
        position 0, target 2 (p = 1/2): nll = 1·ln 2, loss = 0.9·1 + 0.1·9/4 = 1.125·ln 2
        position 1, target 1 (p = 1/4): nll = 2·ln 2, loss = 0.9·2 + 0.1·9/4 = 2.025·ln 2
        position 2, pad: ignored, whatever the model predicts there.
    """
    p = [1 / 8, 1 / 4, 1 / 2, 1 / 8]
    logits = _logits_from_probs([[p, p, [0.97, 0.01, 0.01, 0.01]]])  # (B=1, T=3, V=4)
    target = torch.tensor([[2, 1, PAD]])
    sums = label_smoothed_loss(logits, target, epsilon=0.1, pad_id=PAD)
    assert sums.n_tokens == 2
    assert sums.nll.item() == pytest.approx(3 * LN2, rel=1e-6)
    assert sums.loss.item() == pytest.approx((1.125 + 2.025) * LN2, rel=1e-6)


def test_loss_is_a_sum_over_tokens_not_a_mean() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    target = torch.randint(1, 7, (2, 5))
    whole = label_smoothed_loss(logits, target, epsilon=0.1, pad_id=PAD)
    first = label_smoothed_loss(logits[:1], target[:1], epsilon=0.1, pad_id=PAD)
    second = label_smoothed_loss(logits[1:], target[1:], epsilon=0.1, pad_id=PAD)
    assert whole.loss.item() == pytest.approx(first.loss.item() + second.loss.item(), rel=1e-6)
    assert whole.n_tokens == first.n_tokens + second.n_tokens == 10


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_matches_torch_cross_entropy(epsilon: float) -> None:
    """Parity with the reference: F.cross_entropy(label_smoothing=ε, ignore_index=pad)."""
    torch.manual_seed(1)
    logits = torch.randn(3, 6, 11)
    target = torch.randint(1, 11, (3, 6))
    target[0, 4:] = PAD
    target[2, 1:] = PAD
    sums = label_smoothed_loss(logits, target, epsilon=epsilon, pad_id=PAD)
    reference = F.cross_entropy(
        logits.reshape(-1, 11),
        target.reshape(-1),
        ignore_index=PAD,
        label_smoothing=epsilon,
        reduction="sum",
    )
    plain = F.cross_entropy(
        logits.reshape(-1, 11), target.reshape(-1), ignore_index=PAD, reduction="sum"
    )
    assert sums.n_tokens == int((target != PAD).sum()) == 18 - 2 - 5
    assert sums.loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert sums.nll.item() == pytest.approx(plain.item(), rel=1e-5)


def test_no_smoothing_is_the_nll() -> None:
    logits = torch.randn(2, 4, 9)
    target = torch.randint(1, 9, (2, 4))
    sums = label_smoothed_loss(logits, target, epsilon=0.0, pad_id=PAD)
    assert torch.equal(sums.loss, sums.nll)


def test_padding_positions_get_no_gradient() -> None:
    logits = torch.randn(1, 3, 5, requires_grad=True)
    target = torch.tensor([[1, 2, PAD]])
    sums = label_smoothed_loss(logits, target, epsilon=0.1, pad_id=PAD)
    sums.loss.backward()
    assert logits.grad[0, 2].abs().sum() == 0
    assert logits.grad[0, :2].abs().sum() > 0
    assert not sums.nll.requires_grad  # for logging only


def test_bf16_logits_are_computed_in_float32() -> None:
    logits = torch.randn(2, 3, 8)
    target = torch.randint(1, 8, (2, 3))
    low = label_smoothed_loss(logits.bfloat16(), target, epsilon=0.1, pad_id=PAD)
    assert low.loss.dtype == torch.float32
    exact = label_smoothed_loss(logits.bfloat16().float(), target, epsilon=0.1, pad_id=PAD)
    assert torch.equal(low.loss, exact.loss)


def test_perplexity() -> None:
    assert perplexity(6 * LN2, 3) == pytest.approx(4.0)  # mean NLL ln 4
    assert perplexity(0.0, 5) == 1.0
    assert perplexity(1e9, 1) == pytest.approx(math.exp(100.0), rel=1e-6)  # capped, finite
    assert math.isnan(perplexity(0.0, 0))


@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
def test_projected_loss_equals_projection_then_loss_with_its_gradients(chunk_tokens: int) -> None:
    """Chunked projection + loss: the same sums and the same gradients for hidden and weight
    as the plain path, padding included (rows 2.. of sentence 1 are padding)."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 11, (2, 7))
    target[1, 2:] = 0
    plain = label_smoothed_loss(hidden @ weight.t(), target, epsilon=0.1, pad_id=0)
    (3.0 * plain.loss).backward()
    expected_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = projected_label_smoothed_loss(
        hidden, weight, target, epsilon=0.1, pad_id=0, chunk_tokens=chunk_tokens
    )
    (3.0 * chunked.loss).backward()
    assert chunked.n_tokens == plain.n_tokens == 9
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked.nll, plain.nll, rtol=1e-6, atol=0)
    # Both paths compute in float32 (the loss's log-softmax), summing in another order: the
    # rounding scales with the largest entries, not each one (one small entry of dL/dW was off
    # by 1.5e-5 of itself on an AVX2 CPU), so the absolute tolerance follows the largest.
    for grad, expected in zip((hidden.grad, weight.grad), expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6 * expected.abs().max())


def test_projected_loss_without_gradients_keeps_none() -> None:
    hidden, weight = torch.randn(1, 3, 4), torch.randn(5, 4)
    with torch.no_grad():
        sums = projected_label_smoothed_loss(
            hidden, weight, torch.tensor([[1, 2, 0]]), epsilon=0.1, pad_id=0
        )
    plain = label_smoothed_loss(
        hidden @ weight.t(), torch.tensor([[1, 2, 0]]), epsilon=0.1, pad_id=0
    )
    torch.testing.assert_close(sums.loss, plain.loss)


def test_projected_loss_under_no_grad_computes_no_gradients_for_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Validation runs under no_grad on the model's parameters, which require gradients: one
    product per chunk (the projection), none for gradients, and the same sums."""
    hidden = torch.randn(1, 3, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    target = torch.tensor([[1, 2, 3]])
    expected = projected_label_smoothed_loss(hidden, weight, target, epsilon=0.1, pad_id=0)
    products = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *args: products.append(1) or linear(*args))
    with torch.no_grad():
        sums = projected_label_smoothed_loss(
            hidden, weight, target, epsilon=0.1, pad_id=0, chunk_tokens=2
        )
    assert len(products) == 2  # two chunks of rows, one projection each
    torch.testing.assert_close(sums.loss, expected.loss.detach())
    torch.testing.assert_close(sums.nll, expected.nll)
