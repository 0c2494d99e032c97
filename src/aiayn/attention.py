"""Attention (§3.2): scaled dot-product attention (Eq. 1) and multi-head attention (§3.2.2).

Shape glossary, used in every comment of the package:
    B batch, S source length, T target length, H heads, D d_model,
    d_k / d_v per-head query-key / value size, V vocabulary, L layers, W beam.

Masks follow one convention everywhere: boolean, True = may attend (PyTorch SDPA's polarity),
named after what they gate (`src_key_mask`). One exception: a decoding step's encoder-decoder
attention gets the mask in the additive form PyTorch's kernels also take (0 = may attend,
-inf = may not), laid out once per batch by the decoder cache (`cache.DecoderCache.cross`).
The causal mask of the decoder is never built on the fast path: `is_causal=True` lets SDPA
pick its fastest kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """§3.2.1, Eq. 1: Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V, as written.

    The formula itself, which materialises the (T, S) probabilities and can return them (for
    pictures and alignments). `MultiHeadAttention` computes the same function with a fused
    kernel (`AttentionKernel`) unless the probabilities are asked for; tests check that the
    two agree.

    Args:
        q: Queries (B, H, T, d_k).
        k: Keys (B, H, S, d_k).
        v: Values (B, H, S, d_v).
        mask: Broadcastable to (B, H, T, S): boolean, True = may attend; or float, added to
            the scores (0 = may attend, -inf = may not), as PyTorch's fused kernel takes it.
        is_causal: Position t may only attend to positions <= t (§3.2.3, decoder
            self-attention). Only for T == S.
        dropout_p: Dropout on the attention probabilities (0 in the paper).
        need_weights: Also return the probabilities (B, H, T, S), before dropout.

    Returns:
        The attended values (B, H, T, d_v) and the probabilities or None.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if is_causal:
        t, s = scores.shape[-2:]
        causal_mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal_mask, float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None and mask.is_floating_point():
        scores = scores + mask
    elif mask is not None:
        raise TypeError(f"an attention mask is boolean or floating point, not {mask.dtype}")
    probs = scores.softmax(dim=-1, dtype=torch.float32)  # in float32, also for bf16
    if probs.dtype != v.dtype:
        probs = probs.to(v.dtype)
    attended = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return attended @ v, (probs if need_weights else None)


_SHAPE_FREE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The fused kernels that build nothing per shape: every SDPA backend but cuDNN's."""


def fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> Tensor:
    """Eq. 1 by PyTorch's fused `F.scaled_dot_product_attention` (the default
    `AttentionKernel`); on a GPU by any of the kernels the caller allows but cuDNN's.

    cuDNN's attention, which PyTorch prefers for bf16 on Hopper GPUs, builds a graph for every
    new shape: ~10 ms of CPU per call on an H100 (torch 2.11). A training run, each batch of
    its own length, and a beam search, a key longer by one at every step, then spend most of
    their time building graphs: `aiayn translate --bf16` ran 5x slower than float32, and bf16
    training 9x slower than TF32 (BENCHMARKS.md, GPU). The other fused kernels compile nothing
    per shape. The switch is PyTorch's process-wide one, turned off for the call and back on
    after it: a thread decoding beside it at that moment may get cuDNN's kernel once, at worst
    slower, never wrong. Under `torch.compile`, the compiler traces `sdpa_kernel` with every
    backend but cuDNN's instead, which also allows those the caller had turned off. PyTorch
    offers no narrower choice outside the compiler (`sdpa_kernel` sets the same process-wide
    switch, torch 2.13), so this stays in the default kernel rather than behind a hook
    (tests/test_layers.py: `PLATFORM_CODE_IN_THE_PAPER`).
    """
    if not query.is_cuda:  # the CPU's hot path: the call alone
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    attend = partial(
        F.scaled_dot_product_attention,
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
    )  # fmt: skip
    if torch.compiler.is_compiling():  # the compiler traces this context, not a switch
        with sdpa_kernel(_SHAPE_FREE_BACKENDS):
            return attend()
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return attend()
    torch.backends.cuda.enable_cudnn_sdp(False)  # for this call; back on below
    try:
        return attend()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


AttentionKernel = Callable[..., Tensor]
"""Eq. 1 over projected heads, called as PyTorch's fused kernel is:
``kernel(q, k, v, attn_mask=mask, dropout_p=p, is_causal=c)`` → (B, H, T, d_v); the mask
boolean (True = may attend) or additive (float, added to the scores), as PyTorch's takes it.

`MultiHeadAttention.kernel` is `fused_attention`, PyTorch's `F.scaled_dot_product_attention`
(which never materialises the (T, S) probabilities); `aiayn.acceleration` may install another
that computes the same function faster on some machine, for the callers that opt in."""


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q,
    K W_i^K, V W_i^V).

    The h per-head projections are stored as one matrix each (`q_proj`: D → h·d_k, and so on),
    which is the same linear map computed in one GEMM. d_k and d_v may differ from D / h, as in
    Table 3 rows (A) and (B).

    Attributes:
        kernel: Computes Eq. 1 over the projected heads (`AttentionKernel`): PyTorch's fused
            `F.scaled_dot_product_attention` (`fused_attention`).
            `aiayn.acceleration.use_cpu_attention` installs one that runs faster on a CPU, for
            training and decoding there.
    """

    def __init__(
        self, d_model: int, n_heads: int, d_k: int, d_v: int, attention_dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.attention_dropout = attention_dropout
        self.q_proj = nn.Linear(d_model, n_heads * d_k)
        self.k_proj = nn.Linear(d_model, n_heads * d_k)
        self.v_proj = nn.Linear(d_model, n_heads * d_v)
        self.out_proj = nn.Linear(n_heads * d_v, d_model)
        self.kernel: AttentionKernel = fused_attention

    def split_heads(self, x: Tensor, head_size: int) -> Tensor:
        """(B, T, H·d) → (B, H, T, d); rows of one position each (B, H·d) → (B, H, 1, d)."""
        if x.dim() == 2:  # a decoding step's rows: one view, as T = 1
            return x.view(x.size(0), self.n_heads, 1, head_size)
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, head_size).transpose(1, 2)

    def stacked_qkv_weights(self) -> tuple[Tensor, Tensor] | None:
        """[W^Q; W^K; W^V] and their biases stacked: (H·(2·d_k + d_v), D) and (H·(2·d_k + d_v),).

        The same linear map as the three projections apart, in one GEMM of thrice the width,
        which runs faster, most of all for the few rows of a decoding step. Built anew on each
        call, so it is always the current weights (nothing is kept on the module); a decoding
        search builds it once and keeps it in its `DecoderCache`. None for layers that are not
        `nn.Linear` (`decode.packing.StackedSelfAttention`, float32 or int8 decoding's, holds
        its own stacked product).
        """
        linears = (self.q_proj, self.k_proj, self.v_proj)
        if not all(isinstance(m, nn.Linear) for m in linears):
            return None
        return torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears])

    def project_qkv(
        self, x: Tensor, stacked: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's three projections of the same x (B, T, D) → q, k, v (B, H, T, d);
        of a decoding step's rows x (B, D) → (B, H, 1, d).

        Args:
            x: The input (B, T, D), or (B, D) for one position.
            stacked: `stacked_qkv_weights()` built earlier for the current weights (a decoding
                search passes the ones its cache holds); None builds them here.
        """
        stacked = stacked if stacked is not None else self.stacked_qkv_weights()
        if stacked is None:
            return self.project_query(x), *self.project_key_value(x)
        return self.split_qkv(F.linear(x, *stacked))

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The stacked projections' output (B, T, H·(2·d_k + d_v)) → q, k, v (B, H, T, d);
        for one position (B, H·(2·d_k + d_v)) → (B, H, 1, d)."""
        q, k, v = qkv.split(
            [self.n_heads * self.d_k, self.n_heads * self.d_k, self.n_heads * self.d_v], dim=-1
        )
        return (
            self.split_heads(q, self.d_k),
            self.split_heads(k, self.d_k),
            self.split_heads(v, self.d_v),
        )

    def project_query(self, x: Tensor) -> Tensor:
        """(B, T, D) → queries (B, H, T, d_k); (B, D) → (B, H, 1, d_k)."""
        return self.split_heads(self.q_proj(x), self.d_k)

    def project_query_groups(self, x: Tensor, groups: int) -> Tensor:
        """Rows (G·T, D), T consecutive rows per group → queries (G, H, T, d_k).

        A beam search step's rows are the T = K hypotheses of each of G sentences; as one
        sentence's K queries they attend over its memory together (`DecoderLayer.step`).
        """
        q = self.q_proj(x)  # (G·T, H·d_k)
        return q.view(groups, -1, self.n_heads, self.d_k).transpose(1, 2)

    def project_key_value(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S, D) → keys (B, H, S, d_k) and values (B, H, S, d_v).

        The decoder cache calls this once per source for encoder-decoder attention.
        """
        return self.split_heads(self.k_proj(x), self.d_k), self.split_heads(
            self.v_proj(x), self.d_v
        )

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        *,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Eq. 1 over already projected heads, then Concat(...) W^O: (B, T, D).

        Eq. 1 is computed by `kernel`, or, when the probabilities are asked for, by
        `scaled_dot_product_attention` (the formula as written), which returns them too.
        """
        dropout_p = self.attention_dropout if self.training else 0.0
        if need_weights:
            out, probs = scaled_dot_product_attention(
                q, k, v, mask, is_causal=is_causal, dropout_p=dropout_p, need_weights=True
            )
        else:
            out = self.kernel(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
            probs = None
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_v)  # (B, T, H·d_v)
        return self.out_proj(out), probs

    def attend_rows(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """`attend` for a decoding step, without probabilities: Eq. 1 over projected heads,
        q (B, H, T, d_k), then Concat(...) W^O as rows (B·T, D), the layout of the step's
        other sublayers (`DecoderLayer.step`)."""
        dropout_p = self.attention_dropout if self.training else 0.0
        out = self.kernel(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=False)
        return self.out_proj(out.transpose(1, 2).reshape(-1, self.n_heads * self.d_v))

    def forward(
        self,
        query: Tensor,
        key_value: Tensor,
        mask: Tensor | None = None,
        *,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from `query` (B, T, D) over `key_value` (B, S, D).

        Self-attention passes the same tensor twice; encoder-decoder attention passes the
        decoder state as query and the encoder output (`memory`) as key_value (§3.2.3).

        Returns:
            Output (B, T, D) and, with need_weights, probabilities (B, H, T, S).
        """
        if query is key_value:  # self-attention
            q, k, v = self.project_qkv(query)
        else:
            q = self.project_query(query)
            k, v = self.project_key_value(key_value)
        return self.attend(q, k, v, mask, is_causal=is_causal, need_weights=need_weights)
