"""The incremental-decoding cache: everything a search keeps between decoder steps.

`Transformer.init_cache` builds one per search; `Transformer.decode_step` reads and writes it
only through its methods (`self_qkv_weights`, `append_self`, `cross`), so no layer knows the
tensor layout; the search sees it only through `reorder` (`search.ReorderableCache`).

Shapes use the glossary of `attention.py`; R = N·K rows are the K hypotheses of each of N
source sentences, sentence-major.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DecoderCache:
    """Everything incremental decoding keeps between steps, as one typed object.

    Rows are hypotheses, grouped by source sentence: R = N·K rows hold the K hypotheses of
    each of N sentences, sentence-major (K = 1 for greedy search, the beam size for beam
    search). Self-attention keys/values are per row, preallocated for `max_len` positions and
    filled one position per step. Encoder-decoder keys/values are per *sentence*, projected
    once from `memory`: the K hypotheses of a sentence attend over them as K queries, so they
    are never copied per beam.

    The stacked self-attention projections [W^Q; W^K; W^V] of each decoder layer are built
    once per search and live here, not on the model: weights cannot change during one search,
    while between two searches an optimizer may update them in place without any trace a
    cache on the module could key on (fused Adam leaves `Tensor._version` alone).

    `reorder` moves rows in place when it can, copying only the rows that change: on a CPU
    that is where a beam-search step spends its time outside the matrix products, and search
    keeps each parent's best child in the parent's row so that few rows change. Otherwise it
    gathers every row into a second, preallocated buffer and swaps the two; either way a
    decoding step allocates no cache memory (fresh multi-megabyte buffers on every step cost
    more than the gather itself on a CPU).

    Attributes:
        self_k: (L, R, H, max_len, d_k) self-attention keys, valid up to `length`.
        self_v: (L, R, H, max_len, d_v).
        cross_k: (L, N, H, S, d_k) encoder-decoder keys (a view: they are stored transposed,
            (L, N, H, d_k, S) in memory, so that Q Kᵀ of Eq. 1 reads Kᵀ as it lies; on a
            CPU that product then runs ~3x faster than with K as the projection leaves it).
        cross_v: (L, N, H, S, d_v).
        src_key_mask: (N, S) True = real source token, or None without padding.
        length: Number of target positions already fed.

    What a step reads per layer is laid out once, not at every step: each layer's view of the
    keys and values (again when the rows are gathered anew or fewer), and its encoder-decoder
    keys, values and mask (again when sentences leave). The mask a layer gets is additive,
    0 over real tokens and -inf over padding, as PyTorch's attention kernels take a float mask.
    """

    def __init__(
        self,
        self_k: Tensor,
        self_v: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        src_key_mask: Tensor | None,
        length: int = 0,
        self_qkv: list[tuple[Tensor, Tensor] | None] | None = None,
    ) -> None:
        self._buffers = [(self_k, self_v), (torch.empty_like(self_k), torch.empty_like(self_v))]
        self._use_rows(self_k, self_v)
        self._cross_kt = cross_k.transpose(-2, -1).contiguous()  # (L, N, H, d_k, S)
        self.cross_v = cross_v
        self.src_key_mask = src_key_mask  # also lays out what `cross` returns
        self.length = length
        self._self_qkv = self_qkv or [None] * self_k.size(0)

    def _use_rows(self, self_k: Tensor, self_v: Tensor) -> None:
        """Make (L, R, H, max_len, d) `self_k`, `self_v` the cache's rows, and their layers'
        views what `append_self` writes to."""
        self.self_k, self.self_v = self_k, self_v
        self._layer_k, self._layer_v = self_k.unbind(0), self_v.unbind(0)

    @property
    def src_key_mask(self) -> Tensor | None:
        """(N, S) True = real source token, or None without padding."""
        return self._src_key_mask

    @src_key_mask.setter
    def src_key_mask(self, mask: Tensor | None) -> None:
        self._src_key_mask = mask
        self._lay_out_cross()

    def _lay_out_cross(self) -> None:
        """What `cross` returns for each layer, for the sentences there are now."""
        additive = None
        if self._src_key_mask is not None:  # (N, 1, 1, S): 0 = may attend, -inf = padding
            additive = torch.zeros(
                self._src_key_mask.shape, dtype=self.cross_v.dtype, device=self.cross_v.device
            ).masked_fill_(~self._src_key_mask, float("-inf"))[:, None, None, :]
        self._cross = [
            (kt.transpose(-2, -1), v, additive)
            for kt, v in zip(self._cross_kt.unbind(0), self.cross_v.unbind(0), strict=True)
        ]

    @property
    def cross_k(self) -> Tensor:
        """(L, N, H, S, d_k) encoder-decoder keys, a view of their transposed storage."""
        return self._cross_kt.transpose(-2, -1)

    @property
    def batch_size(self) -> int:
        """R, the number of rows (hypotheses)."""
        return self.self_k.size(1)

    @property
    def n_sentences(self) -> int:
        """N, the number of source sentences."""
        return self._cross_kt.size(1)

    @property
    def max_len(self) -> int:
        return self.self_k.size(3)

    def self_qkv_weights(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """Layer `layer`'s stacked [W^Q; W^K; W^V] weight and bias for this search, or None
        (a decoding copy's self-attention holds its own: `decode.packing.StackedSelfAttention`)."""
        return self._self_qkv[layer]

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new position's self-attention k, v (R, H, 1, d) of `layer`; return the
        keys and values of every position so far, (R, H, length + 1, d).

        No mask is needed over them: every stored position may be attended (§3.2.3).
        (Written with `narrow`, not `self_k[layer, :, :, t] = ...`: under `torch.compile` an
        integer index makes the graph specialise on every position, a new compilation per step.)
        """
        t = self.length
        keys, values = self._layer_k[layer], self._layer_v[layer]
        keys.narrow(2, t, 1).copy_(k)
        values.narrow(2, t, 1).copy_(v)
        return keys.narrow(2, 0, t + 1), values.narrow(2, 0, t + 1)

    def cross(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Encoder-decoder keys and values (N, H, S, d) of `layer`, and the additive mask
        (N, 1, 1, S) over the source, 0 = may attend, -inf = padding (None without padding)."""
        return self._cross[layer]

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> DecoderCache:
        """Keep rows `index` (R',) and sentences `sentences` (N',), in place; returns self.

        Row i of the result is row `index[i]`; rows may repeat (beam search expands a beam
        into several) or vanish. `sentences` selects the source sentences that stay (None: all
        of them, in order). The new rows must stay grouped: rows j·K'..(j+1)·K'-1, with
        K' = R'/N', must be hypotheses of sentence `sentences[j]`.

        Cost: the rows with `index[i] != i` are copied, in place, when every one of them comes
        from a row that stays where it is or lies past the new last row (on a CPU, and when
        that is under 3/4 of the rows); otherwise every row is gathered anew.
        """
        n_rows = index.numel()
        if sentences is not None:
            self._cross_kt = self._cross_kt.index_select(1, sentences)
            self.cross_v = self.cross_v.index_select(1, sentences)
            mask = self.src_key_mask
            self.src_key_mask = None if mask is None else mask.index_select(0, sentences)
        if n_rows % max(self.n_sentences, 1):
            raise ValueError(f"{n_rows} rows cannot be grouped into {self.n_sentences} sentences")
        moves = self._rows_to_move_in_place(index)
        if moves is not None:
            self._move_rows(*moves)
            if n_rows < self.batch_size:
                self._use_rows(self.self_k[:, :n_rows], self.self_v[:, :n_rows])
        else:
            self._gather_rows(index)
        return self

    def _rows_to_move_in_place(self, index: Tensor) -> tuple[list[int], list[int]] | None:
        """The rows i with `index[i] != i` and their sources `index[i]`, if copying them in
        place, in any order, gives the reordered cache and is worth it; else None (gather)."""
        n_rows = index.numel()
        if self.self_k.device.type != "cpu" or n_rows > self.batch_size:
            return None  # a GPU gathers all rows faster than it launches a copy per row
        # In Python over the R' indices: a few microseconds, where tensor operations on so few
        # numbers would cost a dozen calls into PyTorch at every step.
        index_of = index.tolist()
        moved = [i for i, source in enumerate(index_of) if source != i]
        if 4 * len(moved) >= 3 * n_rows:
            return None
        sources = [index_of[i] for i in moved]
        rows = self.batch_size
        for source in sources:
            if not 0 <= source < rows:
                return None  # not a row: the gather raises
            if source < n_rows and index_of[source] != source:
                return None  # a source inside the new rows must stay, or a copy overwrites it
        return moved, sources

    def _move_rows(self, rows: list[int], sources: list[int]) -> None:
        """Copy row `sources[j]` over row `rows[j]` for every j (positions so far only)."""
        if not rows:
            return
        t = self.length
        keys = self.self_k[:, :, :, :t].unbind(1)
        values = self.self_v[:, :, :, :t].unbind(1)
        torch._foreach_copy_(
            [keys[i] for i in rows] + [values[i] for i in rows],
            [keys[i] for i in sources] + [values[i] for i in sources],
        )

    def _gather_rows(self, index: Tensor) -> None:
        """Gather rows `index` into the spare buffer and make it the current one."""
        n_rows = index.numel()
        t = self.length
        spare_k, spare_v = self._buffers[1]
        if spare_k.size(1) < n_rows:  # more rows than ever before (beam expansion): grow once
            spare_k = self.self_k.new_empty(self.self_k.size(0), n_rows, *self.self_k.shape[2:])
            spare_v = self.self_v.new_empty(self.self_v.size(0), n_rows, *self.self_v.shape[2:])
        new_k, new_v = spare_k[:, :n_rows], spare_v[:, :n_rows]
        torch.index_select(self.self_k[:, :, :, :t], 1, index, out=new_k[:, :, :, :t])
        torch.index_select(self.self_v[:, :, :, :t], 1, index, out=new_v[:, :, :, :t])
        self._buffers = [(spare_k, spare_v), self._buffers[0]]
        self._use_rows(new_k, new_v)
