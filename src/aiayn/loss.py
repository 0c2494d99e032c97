"""Label-smoothed cross-entropy (§5.4, "Label Smoothing", ε_ls = 0.1).

The smoothed target puts 1 - ε on the reference token and spreads ε uniformly over the whole
vocabulary (the same convention as `torch.nn.functional.cross_entropy(label_smoothing=ε)`):
    loss = (1 - ε) · (-log p(y)) + ε · mean_v(-log p(v)).
Padding positions are ignored. Sums, not means, are returned so that gradient accumulation
and data-parallel training can normalise by the true number of target tokens in an update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor


@dataclass
class LossSums:
    """Summed over the non-pad target tokens of a batch.

    Attributes:
        loss: Label-smoothed cross-entropy (what is optimised).
        nll: Plain negative log-likelihood (what perplexity is computed from).
        n_tokens: Number of non-pad target tokens.
    """

    loss: Tensor
    nll: Tensor
    n_tokens: int


def label_smoothed_loss(logits: Tensor, target: Tensor, *, epsilon: float, pad_id: int) -> LossSums:
    """logits (B, T, V) and target (B, T) → summed smoothed loss and NLL over non-pad tokens.

    Computed in float32 even when the logits are bf16.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    keep = target != pad_id  # (B, T)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    smooth = -log_probs.mean(dim=-1)  # (B, T)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return LossSums(loss=loss, nll=nll.detach(), n_tokens=int(keep.sum()))


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp(mean NLL per token), capped to avoid overflow in early training."""
    if n_tokens == 0:
        return float("nan")
    return math.exp(min(nll_sum / n_tokens, 100.0))  # float64: exp(100) overflows float32
