"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), in the paper's order.

§3.2 attention lives in `aiayn.attention`; this module has the rest of §3: the position-wise
feed-forward network (Eq. 2), embeddings ×√d_model and weight sharing (§3.4), positional
encoding (§3.5), encoder and decoder layers with residual + LayerNorm (§3.1), the stacks, the
final linear + softmax, and incremental decoding (encode once, a cache whose encoder-decoder
keys/values are projected once, one-token `decode_step`).

Shapes: B batch, S source length, T target length, H heads, D d_model, V vocabulary, L layers.
Padding is on the right. Masks are boolean, True = may attend (a decoding step's
encoder-decoder attention gets the additive form from its cache: `DecoderCache.cross`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.attention import MultiHeadAttention
from aiayn.cache import DecoderCache
from aiayn.config import ModelConfig

if TYPE_CHECKING:
    from aiayn.loss import LossSums

ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,  # Eq. 2
    "gelu": F.gelu,  # not the paper's: for imported models (docs/deviations.md)
    "swish": F.silu,  # x·sigmoid(x), OPUS-MT's Marian models
}


ATTENTION_KINDS = ("encoder", "decoder", "cross")
"""The attentions whose maps `Transformer.forward_with_attention` can return."""

OUTSIDE_TARGET_SIDE = -1e9
"""The fixed bias of the pre-softmax projection for a piece outside the target side
(`ModelConfig.target_side_output`): its probability underflows to exactly 0 in float32, and
finite, it keeps every average of the weights (EMA, checkpoint averaging) free of inf − inf."""


class Dropout(nn.Dropout):
    """§5.4 Residual Dropout: each element zeroed with probability p, the rest scaled by 1/(1 − p).

    `nn.Dropout` with its distribution and scaling, but on a CPU while training the keep-mask is
    drawn as U[0, 1) ≥ p (`torch.rand`, kept as a float mask): forward and backward together
    1.5-1.9x faster than `F.dropout`, whose `bernoulli_` is slow to draw on a CPU (an A/B of
    the two at the Bible recipe's shapes). It keeps a float mask where `F.dropout` keeps a bool
    one: 3 more bytes per element until the backward. In evaluation it returns x itself, as
    `nn.Dropout` does, without a call into PyTorch (decoding calls it four times per layer per
    step); elsewhere (CUDA, p = 0 or 1) it is `nn.Dropout`.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        if x.device.type != "cpu" or not 0.0 < self.p < 1.0:
            return super().forward(x)
        mask = torch.rand_like(x, dtype=torch.float32).ge_(self.p).mul_(1.0 / (1.0 - self.p))
        return x * mask.to(x.dtype)


class PositionwiseFeedForward(nn.Module):
    """Eq. 2: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately.

    `activation` replaces max(0, ·) for imported models ("gelu", "swish"); "relu" is Eq. 2.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class TokenEmbedding(nn.Module):
    """§3.4: learned embeddings whose weights are multiplied by √d_model.

    The weight may be shared with the other embedding and the pre-softmax projection (§3.4);
    sharing is done by the `Transformer`, which assigns the same `Parameter` object.
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens) * self.scale


def sinusoidal_positional_encoding(length: int, d_model: int) -> Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same).

    Computed in float64 and returned as float32, shape (length, d_model).
    """
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (length, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(D/2),)
    angle = position / torch.pow(10000.0, two_i / d_model)  # (length, ceil(D/2))
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


class SinusoidalPositionalEncoding(nn.Module):
    """§3.5: fixed sinusoids added to the embeddings; extended on the fly for longer inputs."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.d_model = d_model
        table = sinusoidal_positional_encoding(max_positions, d_model)
        self.register_buffer("table", table, persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """Encodings for positions offset .. offset+length-1: (length, D)."""
        end = offset + length
        if end > self.table.size(0):
            return sinusoidal_positional_encoding(end, self.d_model).to(self.table)[offset:]
        return self.table[offset:end]


class LearnedPositionalEmbedding(nn.Module):
    """Learned positional embeddings, the alternative of Table 3 row (E)."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        end = offset + length
        if end > self.embedding.num_embeddings:
            raise ValueError(
                f"sequence of {end} positions exceeds max_positions "
                f"({self.embedding.num_embeddings}) of the learned positional embedding"
            )
        positions = torch.arange(offset, end, device=self.embedding.weight.device)
        return self.embedding(positions)


class SublayerConnection(nn.Module):
    """§3.1 + §5.4: LayerNorm(x + Dropout(Sublayer(x))).

    With `norm_first` (pre-norm, not the paper's; see docs/deviations.md) it is
    x + Dropout(Sublayer(LayerNorm(x))), and the stack adds one final LayerNorm.
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(
        self, x: Tensor, sublayer: Callable[[Tensor], tuple[Tensor, Tensor | None]]
    ) -> tuple[Tensor, Tensor | None]:
        """Apply `sublayer` (which returns its output and optional attention) with the residual."""
        if self.norm_first:
            out, probs = sublayer(self.norm(x))
            return x + self.dropout(out), probs
        out, probs = sublayer(x)
        return self.norm(x + self.dropout(out)), probs


class EncoderLayer(nn.Module):
    """§3.1: multi-head self-attention, then the position-wise FFN, each with residual + norm."""

    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        n_heads: int,
        d_k: int,
        d_v: int,
        dropout: float,
        attention_dropout: float,
        norm_first: bool,
        eps: float,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, d_k, d_v, attention_dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, activation)
        self.self_attn_sublayer = SublayerConnection(d_model, dropout, norm_first, eps)
        self.feed_forward_sublayer = SublayerConnection(d_model, dropout, norm_first, eps)

    def forward(
        self, x: Tensor, src_key_mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, S, D) → (B, S, D), and self-attention probabilities (B, H, S, S) if asked."""
        mask = None if src_key_mask is None else src_key_mask[:, None, None, :]  # (B, 1, 1, S)
        x, probs = self.self_attn_sublayer(
            x, lambda h: self.self_attn(h, h, mask, need_weights=need_weights)
        )
        x, _ = self.feed_forward_sublayer(x, lambda h: (self.feed_forward(h), None))
        return x, probs


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, encoder-decoder attention over `memory`, then the FFN."""

    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        n_heads: int,
        d_k: int,
        d_v: int,
        dropout: float,
        attention_dropout: float,
        norm_first: bool,
        eps: float,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, d_k, d_v, attention_dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, d_k, d_v, attention_dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, activation)
        self.self_attn_sublayer = SublayerConnection(d_model, dropout, norm_first, eps)
        self.cross_attn_sublayer = SublayerConnection(d_model, dropout, norm_first, eps)
        self.feed_forward_sublayer = SublayerConnection(d_model, dropout, norm_first, eps)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        src_key_mask: Tensor | None,
        need_weights: bool = False,
        need_self_weights: bool | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Whole target at once. x (B, T, D), memory (B, S, D) → (B, T, D).

        Returns the output and, if asked, self-attention (B, H, T, T) and encoder-decoder
        attention (B, H, T, S) probabilities: `need_weights` asks for both, unless
        `need_self_weights` says otherwise for the self-attention.
        """
        need_self = need_weights if need_self_weights is None else need_self_weights
        mask = None if src_key_mask is None else src_key_mask[:, None, None, :]
        x, self_probs = self.self_attn_sublayer(
            x, lambda h: self.self_attn(h, h, is_causal=True, need_weights=need_self)
        )
        x, cross_probs = self.cross_attn_sublayer(
            x, lambda h: self.cross_attn(h, memory, mask, need_weights=need_weights)
        )
        x, _ = self.feed_forward_sublayer(x, lambda h: (self.feed_forward(h), None))
        return x, self_probs, cross_probs

    def step(self, x: Tensor, cache: DecoderCache, layer: int) -> Tensor:
        """One new position. x (R, D) → (R, D), one row per hypothesis; writes this position's
        K/V into `cache`.

        R = N·K rows: the K hypotheses of each of N source sentences, sentence-major. Rows stay
        2-D through every sublayer, so that no linear layer reshapes its input and output:
        each reshape is a call into PyTorch, a few microseconds at every layer of every step.
        """

        def self_attention(h: Tensor) -> tuple[Tensor, None]:
            stacked = cache.self_qkv_weights(layer)
            q, k, v = self.self_attn.project_qkv(h, stacked)  # (R, H, 1, d_k / d_v)
            keys, values = cache.append_self(layer, k, v)  # (R, H, t+1, d_k / d_v)
            return self.self_attn.attend_rows(q, keys, values), None

        def cross_attention(h: Tensor) -> tuple[Tensor, None]:
            # The K hypotheses of a sentence attend over the same memory, so they are its K
            # queries: (N, H, K, d_k), and the memory's K/V are never copied per beam.
            q = self.cross_attn.project_query_groups(h, cache.n_sentences)
            k, v, mask = cache.cross(layer)  # projected once per source: (N, H, S, d)
            return self.cross_attn.attend_rows(q, k, v, mask), None

        x, _ = self.self_attn_sublayer(x, self_attention)
        x, _ = self.cross_attn_sublayer(x, cross_attention)
        x, _ = self.feed_forward_sublayer(x, lambda h: (self.feed_forward(h), None))
        return x


class Encoder(nn.Module):
    """§3.1: a stack of N identical `EncoderLayer`s (plus a final norm when pre-norm)."""

    def __init__(self, layers: list[EncoderLayer], final_norm: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm

    def forward(
        self, x: Tensor, src_key_mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        maps = []
        for layer in self.layers:
            x, probs = layer(x, src_key_mask, need_weights)
            maps.append(probs)
        return self.final_norm(x), maps


class Decoder(nn.Module):
    """§3.1: a stack of N identical `DecoderLayer`s (plus a final norm when pre-norm)."""

    def __init__(self, layers: list[DecoderLayer], final_norm: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        src_key_mask: Tensor | None,
        need_weights: bool = False,
        need_self_weights: bool | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        self_maps, cross_maps = [], []
        for layer in self.layers:
            x, self_probs, cross_probs = layer(
                x, memory, src_key_mask, need_weights, need_self_weights
            )
            self_maps.append(self_probs)
            cross_maps.append(cross_probs)
        return self.final_norm(x), self_maps, cross_maps

    def step(self, x: Tensor, cache: DecoderCache) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer.step(x, cache, i)
        return self.final_norm(x)


def _allocate(module: nn.Module) -> None:
    """Give every parameter of `module` that is on the meta device CPU memory of its shape and
    dtype, its values not yet set (`Transformer(initialize=False)`). By hand, not with
    `nn.Module.to_empty`, whose first call costs 0.6 s per process (torch 2.13)."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if param.is_meta:
                empty = torch.empty(param.shape, dtype=param.dtype)
                setattr(owner, name, nn.Parameter(empty, requires_grad=param.requires_grad))


class Transformer(nn.Module):
    """The encoder-decoder Transformer of Figure 1.

    Built from a `ModelConfig` (the one object saved next to the weights); the submodules take
    plain scalars. Weight sharing (§3.4): with `share_embeddings="all"` the source embedding, the
    target embedding and the pre-softmax projection are the same `Parameter`; with "decoder" only
    the last two; with "none", none.
    """

    def __init__(self, config: ModelConfig, *, initialize: bool = True) -> None:
        """A model with weights drawn by `reset_parameters`.

        With ``initialize=False``, for a caller that loads every weight next (a model
        directory's loader, which checks that it did): no weight is drawn, neither by
        `reset_parameters` nor by PyTorch's own layers as they are made, and the encoder's and
        decoder's layers and the pre-softmax projection get memory that holds no values yet
        (built on the meta device, then `_allocate`d). Drawing them cost 0.4 s of a `base`
        model's start-up on a CPU, and PyTorch's own draws another 0.45–0.64 s (a 2-core AMD
        EPYC). The embeddings still draw theirs (PyTorch's meta device takes seconds, once per
        process, over an embedding's padding row), from a copy of the process's generator that
        is dropped after: loading a model leaves the caller's random stream as it was.
        """
        super().__init__()
        self.config = c = config
        # A loader's embeddings draw from a stream of their own: the caller's stays as it was.
        with contextlib.nullcontext() if initialize else torch.random.fork_rng(devices=[]):
            self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model, c.pad_id)
            self.tgt_embed = TokenEmbedding(c.tgt_vocab_size, c.d_model, c.pad_id)
        if c.positional_encoding == "sinusoidal":
            self.positions: nn.Module = SinusoidalPositionalEncoding(c.d_model, c.max_positions)
        else:
            self.positions = LearnedPositionalEmbedding(c.d_model, c.max_positions)
        self.embed_dropout = Dropout(c.dropout)
        layer = dict(d_model=c.d_model, d_ff=c.d_ff, n_heads=c.n_heads, d_k=c.d_k, d_v=c.d_v)
        layer |= dict(dropout=c.dropout, attention_dropout=c.attention_dropout)
        layer |= dict(norm_first=c.norm_first, eps=c.layer_norm_eps, activation=c.activation)
        with contextlib.nullcontext() if initialize else torch.device("meta"):
            self.encoder = Encoder(
                [EncoderLayer(**layer) for _ in range(c.n_encoder_layers)], self._final_norm()
            )
            self.decoder = Decoder(
                [DecoderLayer(**layer) for _ in range(c.n_decoder_layers)], self._final_norm()
            )
            self.output_projection = nn.Linear(
                c.d_model, c.tgt_vocab_size, bias=c.target_side_output
            )
        if initialize:
            self.reset_parameters()  # a zero bias: every piece scored until one is set
        else:
            _allocate(self)
        if c.target_side_output:  # set from the data, never learned
            self.output_projection.bias.requires_grad_(False)
        self._target_side: tuple[tuple[int | None, int, str], Tensor, Tensor, int] | None = None
        if c.share_embeddings in ("all", "decoder"):
            self.output_projection.weight = self.tgt_embed.embedding.weight
        if c.share_embeddings == "all":
            self.src_embed.embedding.weight = self.tgt_embed.embedding.weight

    def _final_norm(self) -> nn.Module:
        c = self.config
        return nn.LayerNorm(c.d_model, eps=c.layer_norm_eps) if c.norm_first else nn.Identity()

    def reset_parameters(self) -> None:
        """Xavier-uniform for projections, N(0, d_model^-½) for embeddings (as tensor2tensor),
        so that embeddings ×√d_model have unit scale; zero biases and a zero padding row.

        With `init` "fairseq", then as fairseq's Transformer: W^Q, W^K, W^V Xavier-uniform
        with gain 1/√2 and the feed-forward layers `nn.Linear`'s default, U(±1/√fan_in) for
        weights and biases alike (their biases, and W^Q, W^K, W^V's, are not zero)."""
        embeddings = [self.src_embed.embedding.weight, self.tgt_embed.embedding.weight]
        if isinstance(self.positions, LearnedPositionalEmbedding):
            embeddings.append(self.positions.embedding.weight)
        for param in embeddings:
            nn.init.normal_(param, mean=0.0, std=self.config.d_model**-0.5)
        with torch.no_grad():
            for token_embedding in (self.src_embed, self.tgt_embed):
                token_embedding.embedding.weight[self.config.pad_id].zero_()
        for module in (self.encoder, self.decoder, self.output_projection):
            for param in module.parameters():
                if param.dim() > 1:
                    nn.init.xavier_uniform_(param)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if self.config.init == "fairseq":
            for module in self.modules():
                if isinstance(module, MultiHeadAttention):
                    for linear in (module.q_proj, module.k_proj, module.v_proj):
                        linear.reset_parameters()
                        nn.init.xavier_uniform_(linear.weight, gain=2**-0.5)
                elif isinstance(module, PositionwiseFeedForward):
                    module.linear1.reset_parameters()
                    module.linear2.reset_parameters()

    # -- the target side (`ModelConfig.target_side_output`) --------------------------------

    def set_target_side(self, ids: Tensor) -> None:
        """Let the pre-softmax projection score only the target ids `ids` (and padding): a
        bias of 0 for them, `OUTSIDE_TARGET_SIDE` for every other piece."""
        bias = self.output_projection.bias
        if not self.config.target_side_output:
            raise ValueError("the model scores every piece (target_side_output is False)")
        with torch.no_grad():
            bias.fill_(OUTSIDE_TARGET_SIDE)
            bias[ids.to(bias.device)] = 0.0
            bias[self.config.pad_id] = 0.0
        self._target_side = None  # an inference tensor keeps no version to tell it changed

    def target_side(self) -> Tensor | None:
        """The sorted target ids the pre-softmax projection scores, or None for all of them
        (a model without `target_side_output`). Read from the bias, and kept until it
        changes (an inference tensor's bias keeps no version: until `set_target_side`, or
        the bias is another tensor)."""
        side = self._target_side_remap()
        return None if side is None else side[0]

    def _target_side_remap(self) -> tuple[Tensor, Tensor, int] | None:
        """(ids (V',), remap (V,): an id's column among them, padding's for an id outside,
        padding's column), or None without `target_side_output`."""
        if not self.config.target_side_output:
            return None
        bias = self.output_projection.bias
        version = None if bias.is_inference() else bias._version
        key = (version, bias.data_ptr(), str(bias.device))
        if self._target_side is None or self._target_side[0] != key:
            allowed = bias.detach() == 0
            ids = allowed.nonzero().squeeze(1)
            pad_column = int(allowed[: self.config.pad_id].sum())
            remap = torch.full_like(bias, pad_column, dtype=torch.long)
            remap[ids] = torch.arange(len(ids), device=bias.device)
            self._target_side = (key, ids, remap, pad_column)
        return self._target_side[1:]

    # -- the two halves of Figure 1 -------------------------------------------------------

    def src_key_mask(self, src_tokens: Tensor, padded: bool | None = None) -> Tensor | None:
        """(B, S) True = real token; None when the batch has no padding (fast SDPA path).

        Whether it has any is `padded` where the caller knows it on the host (a training
        batch's token count); else the tensor is asked, a value read back from it: on a GPU, a
        wait for the device to catch up. Under `torch.compile` the mask is always returned:
        that read would break the compiled graph in two.
        """
        if torch.compiler.is_compiling():
            return src_tokens != self.config.pad_id
        if padded is None:
            mask = src_tokens != self.config.pad_id
            return None if bool(mask.all()) else mask
        return src_tokens != self.config.pad_id if padded else None

    def encode(
        self, src_tokens: Tensor, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Source tokens (B, S) → `memory` (B, S, D) and the source key mask."""
        memory, src_key_mask, _ = self._encode(src_tokens, need_weights)
        return memory, src_key_mask

    def _encode(
        self, src_tokens: Tensor, need_weights: bool, src_padded: bool | None = None
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        src_key_mask = self.src_key_mask(src_tokens, src_padded)
        x = self.src_embed(src_tokens) + self.positions(src_tokens.size(1))
        memory, maps = self.encoder(self.embed_dropout(x), src_key_mask, need_weights)
        return memory, src_key_mask, maps

    def decode(
        self,
        tgt_tokens: Tensor,
        memory: Tensor,
        src_key_mask: Tensor | None,
        need_weights: bool = False,
        need_self_weights: bool | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Shifted target tokens (B, T) → logits (B, T, V) for the next token at each position."""
        x, self_maps, cross_maps = self._decode(
            tgt_tokens, memory, src_key_mask, need_weights, need_self_weights
        )
        return self.output_projection(x), self_maps, cross_maps

    def _decode(
        self,
        tgt_tokens: Tensor,
        memory: Tensor,
        src_key_mask: Tensor | None,
        need_weights: bool = False,
        need_self_weights: bool | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The decoder stack's output (B, T, D), before the pre-softmax projection."""
        x = self.tgt_embed(tgt_tokens) + self.positions(tgt_tokens.size(1))
        x = self.embed_dropout(x)
        return self.decoder(x, memory, src_key_mask, need_weights, need_self_weights)

    def forward(
        self,
        src_tokens: Tensor,
        tgt_tokens: Tensor,
        target: Tensor | None = None,
        *,
        label_smoothing: float = 0.0,
        src_padded: bool | None = None,
    ) -> Tensor | LossSums:
        """Teacher-forced pass: source (B, S), shifted target (B, T) → logits (B, T, V); or,
        given the reference `target` (B, T), the label-smoothed loss (§5.4) as `LossSums`.

        The softmax of §3.4 is left to the loss and to decoding, which is both faster and
        numerically safer. With `target`, the pre-softmax projection and the loss are computed
        together, a chunk of positions at a time (`loss.projected_label_smoothed_loss`): the
        (B·T, V) logits, log-probabilities and their gradients are never held at once, and
        the loss is in float32 under bf16 autocast. Under `torch.compile` the loss is the
        plain one over the whole logits (`loss.label_smoothed_loss`), in the same graph.
        Training and validation take this path through `forward` because
        DistributedDataParallel synchronises gradients only for a call of the module it wraps.

        Args:
            src_tokens: Source tokens (B, S), right-padded with `pad_id`.
            tgt_tokens: The target shifted right, BOS first (B, T).
            target: The tokens to predict at each position (B, T), `pad_id` where none.
            label_smoothing: ε_ls of §5.4 (with `target` only).
            src_padded: Whether any source row is padded, where the caller knows it without
                reading `src_tokens` (`Batch.src_padded`); None asks the tensor
                (`src_key_mask`), which on a GPU waits for the device.
        """
        memory, src_key_mask, _ = self._encode(
            src_tokens, need_weights=False, src_padded=src_padded
        )
        if target is None:
            logits, _, _ = self.decode(tgt_tokens, memory, src_key_mask)
            return logits
        hidden, _, _ = self._decode(tgt_tokens, memory, src_key_mask)
        # Imported here, not with the module: aiayn.loss imports torch._dynamo (~1.3 s, as long
        # as importing torch), which decoding, that never computes a loss, must not pay for.
        from aiayn.loss import label_smoothed_loss, projected_label_smoothed_loss

        pad_id, weight = self.config.pad_id, self.output_projection.weight
        if torch.compiler.is_compiling():
            # Compiled, the loss is part of the graph (the chunked loss's own loop would split
            # it in two): the whole logits, their softmax fused by the compiler.
            allowed = None
            if self.config.target_side_output:
                allowed = self.output_projection.bias == 0
                target = torch.where(allowed[target], target, pad_id)
            return label_smoothed_loss(
                self.output_projection(hidden),
                target,
                epsilon=label_smoothing,
                pad_id=pad_id,
                allowed=allowed,
            )
        if (side := self._target_side_remap()) is not None:
            # The target side's rows alone: the same loss as the whole logits with the
            # bias (whose other pieces have probability 0), smoothed over the target side.
            ids, remap, pad_id = side
            weight, target = weight.index_select(0, ids), remap[target]
        return projected_label_smoothed_loss(
            hidden, weight, target, epsilon=label_smoothing, pad_id=pad_id
        )

    def forward_with_attention(
        self, src_tokens: Tensor, tgt_tokens: Tensor, kinds: Collection[str] = ATTENTION_KINDS
    ) -> tuple[Tensor, AttentionMaps]:
        """Like `forward`, also returning the attention maps of `kinds` (all by default).

        Only the attentions whose maps are asked for take the explicit path (Eq. 1 with its
        probabilities); the others take the fused one and their maps are None, never made:
        the encoder's alone are (L, B, H, S, S), far more than the (L, B, H, T, S) of the
        cross-attention that alignments and the server show.
        """
        if unknown := set(kinds) - set(ATTENTION_KINDS):
            raise ValueError(f"unknown attention kinds {sorted(unknown)}: {ATTENTION_KINDS}")
        memory, src_key_mask, enc_maps = self._encode(src_tokens, "encoder" in kinds)
        logits, self_maps, cross_maps = self.decode(
            tgt_tokens, memory, src_key_mask, "cross" in kinds, "decoder" in kinds
        )
        maps = AttentionMaps(
            encoder=_stacked(enc_maps), decoder=_stacked(self_maps), cross=_stacked(cross_maps)
        )
        return logits, maps

    # -- incremental decoding -------------------------------------------------------------

    def init_cache(self, memory: Tensor, src_key_mask: Tensor | None, max_len: int) -> DecoderCache:
        """A cache for up to `max_len` target positions; encoder-decoder K/V projected once."""
        c = self.config
        b, n_layers = memory.size(0), c.n_decoder_layers
        cross = [layer.cross_attn.project_key_value(memory) for layer in self.decoder.layers]
        shape = (n_layers, b, c.n_heads, max_len)
        return DecoderCache(
            self_k=memory.new_zeros(*shape, c.d_k),
            self_v=memory.new_zeros(*shape, c.d_v),
            cross_k=torch.stack([k for k, _ in cross]),
            cross_v=torch.stack([v for _, v in cross]),
            src_key_mask=src_key_mask,
            self_qkv=[layer.self_attn.stacked_qkv_weights() for layer in self.decoder.layers],
        )

    def decode_step(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """Feed one token per row (B,) at position `cache.length`; return log-probs (B, V).

        Updates `cache` in place and advances its length: equal to the full `forward` pass at
        that position, because decoder self-attention is causal (§3.2.3).
        """
        logits = self.output_projection(self.decode_step_hidden(tokens, cache))  # (B, V)
        return F.log_softmax(logits, dim=-1, dtype=torch.float32)

    def decode_step_hidden(self, tokens: Tensor, cache: DecoderCache) -> Tensor:
        """`decode_step` up to the decoder stack's output (B, D), before the pre-softmax
        projection: the hook of a search that projects onto part of the vocabulary only
        (`aiayn.decode.restricted`). Updates `cache` as `decode_step` does."""
        t = cache.length
        if t >= cache.max_len:
            raise ValueError(f"decoder cache is full ({cache.max_len} positions)")
        x = self.tgt_embed(tokens) + self.positions(1, offset=t)  # (B, D)
        x = self.decoder.step(self.embed_dropout(x), cache)
        cache.length = t + 1
        return x


@dataclass
class AttentionMaps:
    """Attention probabilities of every layer and head, for pictures and alignments; None for
    a kind that was not asked for.

    Attributes:
        encoder: (L, B, H, S, S) encoder self-attention.
        decoder: (L, B, H, T, T) masked decoder self-attention.
        cross: (L, B, H, T, S) encoder-decoder attention.
    """

    encoder: Tensor | None
    decoder: Tensor | None
    cross: Tensor | None


def _stacked(maps: list[Tensor | None]) -> Tensor | None:
    """One layer's maps after another, (L, ...); None where the layers made none."""
    return None if maps[0] is None else torch.stack(maps)  # type: ignore[arg-type]
