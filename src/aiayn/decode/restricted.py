"""Decoding over part of the target vocabulary: a model whose steps score only given ids.

A shortlist (`aiayn.decode.shortlist`) allows a batch a few thousand of the vocabulary's ids.
`RestrictedModel` wraps a `Transformer` for one batch: the pre-softmax projection's rows of
those ids are taken once (§3.4's W restricted to them), each step projects the decoder's
output onto them alone and normalises over them, and the search maps the columns back to ids
(`aiayn.decode.search`'s ``vocab``). Its log-probabilities are the full model's renormalised
over the allowed ids, ``log p(t) - log Σ_{t' allowed} p(t')``, up to float32 rounding (the
products are the same sums over d_model in smaller matrices): a search over them is the full
search restricted to those ids (tests/decode/test_restricted.py).

The model is reached through its hook `Transformer.decode_step_hidden`; the paper's modules
know nothing of this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.cache import DecoderCache
from aiayn.decode.packing import PackedLinear
from aiayn.model import Transformer

__all__ = ["RestrictedModel", "project_onto"]


def project_onto(
    projection: nn.Module, vocab: Tensor, weight: Tensor | None = None
) -> Callable[[Tensor], Tensor]:
    """x (N, D) → logits (N, V') of the output rows `vocab` (V',) of a linear layer.

    An `nn.Linear` (float32 or bf16) and a `PackedLinear` on MKL's kernel keep only those rows
    of their weight (and bias), taken here, once. A `PackedLinear` on oneDNN's kernel, whose
    weight is in oneDNN's opaque layout, gets a packed copy of those rows of `weight`, the
    dense weight it was packed from (a tied projection's: the target embedding), where given.
    An int8 layer (dynamic quantization to qint8, `acceleration.quantize_int8`) gets a layer of
    those rows of its int8 weight, their scales and zero points unchanged: each output is the
    same integer sum scaled the same way. Any other layer (oneDNN's without `weight`, dynamic
    quantization to float16 or an unusual scheme) computes every output and keeps those
    columns: the same values, without the saving in the product.
    """
    if isinstance(projection, torch.ao.nn.quantized.dynamic.Linear):
        weight = projection.weight()
        if weight.is_quantized and weight.qscheme() in INT8_SCHEMES:
            return _int8_rows(projection, weight, vocab)
    if type(projection) is nn.Linear:
        rows = projection.weight.detach().index_select(0, vocab)
        bias = None if projection.bias is None else projection.bias.detach()[vocab]
        return lambda x: F.linear(x, rows, bias)
    if isinstance(projection, PackedLinear):
        bias = None if projection.bias is None else projection.bias[vocab]
        if projection.kernel == "mkl":
            columns = projection.packed_weight.index_select(1, vocab).contiguous()  # (D, V')
            if bias is None:
                return lambda x: x @ columns
            return lambda x: torch.addmm(bias, x, columns)
        if weight is not None:
            linear = torch.nn.utils.skip_init(
                nn.Linear, projection.in_features, len(vocab), bias=bias is not None
            )
            linear.weight = nn.Parameter(weight.detach().index_select(0, vocab), False)
            if bias is not None:
                linear.bias = nn.Parameter(bias, False)
            return PackedLinear(linear, kernel=projection.kernel)
    return lambda x: projection(x).index_select(1, vocab)


PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
INT8_SCHEMES = (*PER_TENSOR, torch.per_channel_affine, torch.per_channel_symmetric)
"""The quantization schemes of an int8 weight whose rows `project_onto` takes."""


def _int8_rows(projection: Any, weight: Tensor, vocab: Tensor) -> nn.Module:
    """A dynamically quantized linear layer of the output rows `vocab` of `projection`'s
    quantized `weight`.

    The rows are dequantized and quantized again with the same scale and zero point (per
    tensor or per row): a value on the grid comes back as the same integer. The layer keeps
    `projection`'s version, which decides how its input is quantized.
    """
    rows = weight.dequantize().index_select(0, vocab)
    if weight.qscheme() in PER_TENSOR:
        q_rows = torch.quantize_per_tensor(
            rows, weight.q_scale(), weight.q_zero_point(), weight.dtype
        )
    else:
        scales = weight.q_per_channel_scales().index_select(0, vocab)
        zero_points = weight.q_per_channel_zero_points().index_select(0, vocab)
        q_rows = torch.quantize_per_channel(rows, scales, zero_points, 0, weight.dtype)
    bias = projection.bias()
    layer = type(projection)(projection.in_features, len(vocab), dtype=weight.dtype)
    layer.set_weight_bias(q_rows, None if bias is None else bias.index_select(0, vocab))
    layer.version = projection.version
    return layer


class RestrictedModel:
    """A `Transformer` for one batch whose `decode_step` scores only the target ids `vocab`.

    An `aiayn.decode.search.IncrementalModel`: encoding and the cache are the model's own;
    `decode_step` returns (N, V') float32 log-probabilities, column j for id ``vocab[j]``,
    normalised over those ids. Made per batch (its projection rows are the batch's).
    """

    def __init__(self, model: Transformer, vocab: Tensor) -> None:
        """`vocab`: (V',) sorted, distinct long target ids on the model's device."""
        self.model = model
        self.vocab = vocab
        tied = model.config.share_embeddings in ("all", "decoder")
        weight = model.tgt_embed.embedding.weight if tied else None  # the projection's
        self._project = project_onto(model.output_projection, vocab, weight)

    def encode(self, src_tokens: Tensor) -> tuple[Any, Tensor | None]:
        return self.model.encode(src_tokens)

    def init_cache(self, memory: Tensor, src_key_mask: Tensor | None, max_len: int) -> DecoderCache:
        return self.model.init_cache(memory, src_key_mask, max_len)

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        logits = self._project(self.model.decode_step_hidden(tokens, cache))  # (N, V')
        return F.log_softmax(logits, dim=-1, dtype=torch.float32)
