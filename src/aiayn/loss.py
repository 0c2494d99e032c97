"""Label-smoothed cross-entropy (§5.4, "Label Smoothing", ε_ls = 0.1).

The smoothed target puts 1 - ε on the reference token and spreads ε uniformly over the whole
vocabulary (the same convention as `torch.nn.functional.cross_entropy(label_smoothing=ε)`):
    loss = (1 - ε) · (-log p(y)) + ε · mean_v(-log p(v)).
With a model's target side (`ModelConfig.target_side_output`) the vocabulary is that side's
pieces: ε is spread over them, the others having probability 0. Padding positions are ignored.
Sums, not means, are returned so that gradient accumulation and data-parallel training can
normalise by the true number of target tokens in an update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class LossSums:
    """Summed over the non-pad target tokens of a batch.

    Attributes:
        loss: Label-smoothed cross-entropy (what is optimised).
        nll: Plain negative log-likelihood (what perplexity is computed from).
        tokens: Number of non-pad target tokens, a 0-d tensor on the device: reading it
            waits for the device, which training (whose host knows its token counts from
            the batches) never does; `n_tokens` reads it.
    """

    loss: Tensor
    nll: Tensor
    tokens: Tensor

    @property
    def n_tokens(self) -> int:
        """The number of non-pad target tokens (waits for the device)."""
        return int(self.tokens)


def label_smoothed_loss(
    logits: Tensor,
    target: Tensor,
    *,
    epsilon: float,
    pad_id: int,
    allowed: Tensor | None = None,
) -> LossSums:
    """logits (B, T, V) and target (B, T) → summed smoothed loss and NLL over non-pad tokens.

    Computed in float32 even when the logits are bf16. With `allowed` (V,) bool, ε is spread
    over those pieces alone (a model's target side; the others have probability 0).
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    keep = target != pad_id  # (B, T)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    if allowed is None:
        smooth = -log_probs.mean(dim=-1)  # (B, T)
    else:
        smooth = -log_probs.masked_fill(~allowed, 0.0).sum(dim=-1) / allowed.sum()
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return LossSums(loss=loss, nll=nll.detach(), tokens=keep.sum())


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(mean NLL per token), capped to avoid overflow in early training."""
    if n_tokens == 0:
        return float("nan")
    return math.exp(min(nll_sum / n_tokens, 100.0))  # float64: exp(100) overflows float32


@torch.compiler.disable  # eager under torch.compile: a loop of chunks with its own backward
def projected_label_smoothed_loss(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    epsilon: float,
    pad_id: int,
    chunk_tokens: int = 1024,
) -> LossSums:
    """The pre-softmax projection (§3.4) and `label_smoothed_loss` together, in chunks of rows.

    `label_smoothed_loss(hidden @ weightᵀ, target)`, without ever holding the (B·T, V) logits,
    log-probabilities or their gradients at once: each chunk of `chunk_tokens` rows is
    projected, scored and differentiated in the forward pass (the gradient of the smoothed
    cross-entropy with respect to the logits is softmax − smoothed target, known there), and
    only the gradients for `hidden` (B·T, D) and `weight` (V, D) are kept for the backward
    pass. The same FLOPs as the plain path, less memory traffic; a test checks that loss and
    gradients equal the plain path's.

    Args:
        hidden: Decoder output (B, T, D), before the projection.
        weight: The projection (V, D): with weight sharing, the target embedding.
        target: (B, T) reference tokens; `pad_id` positions are ignored.

    Returns:
        Summed loss and NLL over non-pad tokens, as `label_smoothed_loss`.
    """
    tokens = (target != pad_id).sum()
    if not torch.is_grad_enabled():
        # An autograd.Function sees needs_input_grad from requires_grad alone, not from grad
        # mode: under no_grad (validation) it would compute and keep gradients for nothing.
        hidden, weight = hidden.detach(), weight.detach()
    loss, nll = _ProjectedLoss.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, target.reshape(-1), epsilon, pad_id,
        chunk_tokens,
    )  # fmt: skip
    return LossSums(loss=loss, nll=nll.detach(), tokens=tokens)


class _ProjectedLoss(torch.autograd.Function):
    """Forward computes the loss sums and, if gradients are wanted, d(loss)/d(hidden, weight)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        epsilon: float,
        pad_id: int,
        chunk_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        n, vocab = hidden.size(0), weight.size(0)
        loss = hidden.new_zeros((), dtype=torch.float32)
        nll = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.zeros_like(hidden) if wants_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_grad else None
        for start in range(0, n, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, n))
            h, t = hidden[rows], target[rows]
            keep = (t != pad_id).unsqueeze(-1)  # (n, 1)
            log_probs = F.log_softmax(F.linear(h, weight).float(), dim=-1)  # (n, V): h Wᵀ
            nll_rows = -log_probs.gather(-1, t.unsqueeze(-1)).masked_fill(~keep, 0.0)
            smooth_rows = -log_probs.mean(dim=-1, keepdim=True).masked_fill(~keep, 0.0)
            nll += nll_rows.sum()
            loss += (1.0 - epsilon) * nll_rows.sum() + epsilon * smooth_rows.sum()
            if wants_grad:
                # d loss / d logits = softmax − ((1 − ε)·onehot(y) + ε / V), 0 on padding.
                grad_logits = log_probs.exp_().sub_(epsilon / vocab)
                grad_logits.scatter_add_(
                    -1, t.unsqueeze(-1), grad_logits.new_full((t.numel(), 1), epsilon - 1.0)
                )
                grad_logits = grad_logits.masked_fill_(~keep, 0.0).to(h.dtype)
                grad_hidden[rows] = F.linear(grad_logits, weight.t())  # grad_logits W
                grad_weight += (grad_logits.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None,
            (grad_weight * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
        )
