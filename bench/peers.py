"""The peers of bench/gpu_check.py, built with the same shapes as an aiayn model.

- `nn.Transformer`: `ReferenceTransformer`, wrapped to do the same work as aiayn's model.
- CTranslate2: our model's own weights converted to a CTranslate2 `TransformerSpec` by
  `aiayn.interop.ctranslate2` (post-norm, ReLU, our sinusoidal table), so CTranslate2 decodes
  the very same function.
- aiayn's own search with every output forced to one length (`FixedLength`), so that every
  system does the same work whatever random weights prefer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.acceleration import use_cpu_attention
from aiayn.cache import DecoderCache
from aiayn.config import ModelConfig
from aiayn.decode.search import DecodingOptions, beam_search, greedy_search
from aiayn.model import Transformer, sinusoidal_positional_encoding
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID


class ReferenceTransformer(nn.Module):
    """`torch.nn.Transformer` wrapped to do the same work as `aiayn.model.Transformer`.

    Same embedding ×√d_model, sinusoidal positions and embedding dropout; one matrix shared by
    both embeddings and the pre-softmax projection; post-norm layers with the same epsilon; the
    final stack LayerNorms that `nn.Transformer` always adds are removed (post-norm has none),
    and dropout sits where the paper and aiayn put it: on sub-layer outputs and embeddings only.
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.d_model, self.pad_id = c.d_model, c.pad_id
        self.embedding = nn.Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id)
        nn.init.normal_(self.embedding.weight, std=c.d_model**-0.5)
        self.register_buffer(
            "positions", sinusoidal_positional_encoding(c.max_positions, c.d_model), False
        )
        self.embed_dropout = nn.Dropout(c.dropout)
        self.transformer = nn.Transformer(
            d_model=c.d_model,
            nhead=c.n_heads,
            num_encoder_layers=c.n_encoder_layers,
            num_decoder_layers=c.n_decoder_layers,
            dim_feedforward=c.d_ff,
            dropout=c.dropout,
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=c.norm_first,
        )
        if not c.norm_first:
            self.transformer.encoder.norm = None
            self.transformer.decoder.norm = None
        # nn.Transformer also drops out attention probabilities and the FFN's inner activations
        # with the same p; the paper (§5.4) and aiayn's defaults do neither. Left in, they cost
        # the reference 2-3x on CPU (attention dropout forces SDPA's unfused math path).
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout = nn.Identity()  # inside the FFN, between ReLU and linear2
            for module in layer.modules():
                if isinstance(module, nn.MultiheadAttention):
                    module.dropout = c.attention_dropout

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens) * math.sqrt(self.d_model) + self.positions[: tokens.size(1)]
        return self.embed_dropout(x)

    def forward(self, src_tokens: Tensor, tgt_tokens: Tensor) -> Tensor:
        """Source (B, S), shifted target (B, T) → logits (B, T, V)."""
        t = tgt_tokens.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt_tokens.device)
        src_pad = src_tokens == self.pad_id  # nn.Transformer: True = ignore
        src_pad = src_pad if bool(src_pad.any()) else None
        x = self.transformer(
            self.embed(src_tokens),
            self.embed(tgt_tokens),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return F.linear(x, self.embedding.weight)  # (B, T, V)


def forward_flops(c: ModelConfig, batch: int, s: int, t: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of one teacher-forced forward pass: every linear layer
    and the attention products QKᵀ and AV (the causal half counted in full, as computed)."""
    hk, hv, d = c.n_heads * c.d_k, c.n_heads * c.d_v, c.d_model

    def attention(q_len: int, kv_len: int) -> int:
        projections = q_len * d * hk + kv_len * d * (hk + hv) + q_len * hv * d
        return 2 * (projections + q_len * kv_len * (hk + hv))

    ffn = 2 * 2 * d * c.d_ff
    encoder = c.n_encoder_layers * (attention(s, s) + s * ffn)
    decoder = c.n_decoder_layers * (attention(t, t) + attention(t, s) + t * ffn)
    return batch * (encoder + decoder + 2 * t * d * c.tgt_vocab_size)


class FixedLength(torch.nn.Module):
    """The model with EOS masked out before `out_len` tokens, so every hypothesis has exactly
    `out_len` tokens (search then forces EOS)."""

    def __init__(self, model: Transformer, out_len: int) -> None:
        super().__init__()
        self.model, self.out_len = model, out_len

    def encode(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.encode(src_tokens)

    def init_cache(self, memory, src_key_mask, max_len: int) -> DecoderCache:
        return self.model.init_cache(memory, src_key_mask, max_len)

    def decode_step(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        log_probs = self.model.decode_step(tokens, cache)
        if cache.length <= self.out_len:  # this step predicts output token cache.length - 1
            log_probs[:, EOS_ID] = float("-inf")
        return log_probs


def aiayn_search(
    decoder: nn.Module, src: torch.Tensor, out_len: int
) -> Callable[[str], list[list[int]]]:
    """run(mode) of aiayn's own search over `decoder`, every output forced to `out_len`."""
    # out_len - 1 tokens, then EOS (forced): out_len decoding steps, like the peers'.
    fixed = FixedLength(use_cpu_attention(decoder), out_len - 1)  # as Translator on a CPU
    ids = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
    options = DecodingOptions(max_len_a=0.0, max_len_b=out_len - 1)  # beam 4, α 0.6

    def aiayn_run(mode: str) -> list[list[int]]:
        with torch.inference_mode():
            if mode == "greedy":
                hyps = greedy_search(fixed, src, **ids, options=options)
            else:
                hyps = [h[0] for h in beam_search(fixed, src, **ids, options=options)]
        return [h.tokens for h in hyps]

    return aiayn_run


def same_outputs(ours: list[list[int]], theirs: list[list[int]] | None, prefix: bool = False):
    """Fraction of sentences whose outputs are equal (`prefix`: ours a prefix of theirs, for
    CTranslate2, whose outputs may run on past our forced EOS); None without outputs."""
    if not theirs:
        return None
    equal = [a == (b[: len(a)] if prefix else b) for a, b in zip(ours, theirs, strict=True)]
    return sum(equal) / len(equal)


# --------------------------------------------------------------------------------------------
# CTranslate2, converted from an aiayn model (aiayn.interop.ctranslate2)
# --------------------------------------------------------------------------------------------


def vocabulary(size: int) -> list[str]:
    """Token strings for ids 0..size-1, as the conversion names them (no tokenizer here)."""
    from aiayn.interop.ctranslate2 import id_tokens

    return id_tokens(size)


def ct2_convert(model: Transformer, output_dir: Path, quantization: str | None) -> Path:
    """Write `model` as a CTranslate2 model directory (weights stored as `quantization`)."""
    from aiayn.interop.ctranslate2 import convert_model

    return convert_model(model, output_dir, quantization)


def ct2_ids(outputs, size: int) -> list[list[int]]:
    index = {name: i for i, name in enumerate(vocabulary(size))}
    return [[index[t] for t in out.hypotheses[0]] for out in outputs]
