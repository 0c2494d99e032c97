"""The peer of bench/gpu_check.py's training stage, built with the same shapes as an aiayn
model: `torch.nn.Transformer` wrapped to do the same work (`ReferenceTransformer`), and the
FLOPs of a forward pass that both compute (`forward_flops`), the numerator of MFU.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model import sinusoidal_positional_encoding


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
