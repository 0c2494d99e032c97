"""Batches of roughly equal length under a token budget (§5.1), sharding and collation.

"Sentence pairs were batched together by approximate sequence length. Each training batch
contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target
tokens." Batches are filled up to a token budget that counts padding, so no batch exceeds it.

`BatchShapes` pads every batch to one of a few fixed shapes instead (rows × width, about 16 of
them), so that a GPU can replay the training step as CUDA graphs captured once per shape
(`aiayn train --static-shapes`).

Shapes: ``B`` batch size, ``S`` source length, ``T`` target length.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from aiayn.text.corpus import DataError
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchShapes:
    """Fixed batch shapes: every batch padded to `rows(width)` rows of `width` tokens on both
    sides, `width` the narrowest of `widths` that holds its longest sentence, and the rows as
    many as `max_tokens` allows at that width. Rows beyond the batch's examples are empty
    (`collate`): they add nothing to the loss.

    `for_lengths` spaces the widths geometrically, each about 19% (2^¼) wider than the last,
    rounded up to a multiple of 8 (as tensor cores like them), the widest the longest sentence
    padded, ``max_len + 1``: a batch is padded by at most about a fifth of its longest
    sentence, never beyond ``max_len + 1`` positions, in about 16 shapes for sentences of up to
    256 tokens. A sentence wider than every width (longer than that `max_len`) gets a width of
    its own, rounded up to a multiple of 8.
    """

    max_tokens: int
    widths: tuple[int, ...]  # ascending, each at most max_tokens

    @classmethod
    def for_lengths(cls, max_len: int, max_tokens: int) -> BatchShapes:
        """Widths from 8 up to the longest padded sentence, ``max_len + 1``; one within 8 of
        it is left out."""
        widest = min(max_len + 1, max_tokens)
        widths, k = {widest}, 0
        while (width := _up_to_8(8 * 2 ** (k / 4))) <= widest - 8:
            widths.add(width)
            k += 1
        return cls(max_tokens=max_tokens, widths=tuple(sorted(widths)))

    def width(self, padded_len: int) -> int:
        """The width of a batch whose longest side needs `padded_len` tokens (EOS/BOS in)."""
        return int(self.widths_of(np.array([padded_len], dtype=np.int64))[0])

    def widths_of(self, padded_lens: np.ndarray) -> np.ndarray:
        """`width` of each of `padded_lens` (int64), at once."""
        widths = np.asarray(self.widths, dtype=np.int64)
        i = np.searchsorted(widths, padded_lens)
        beyond = i == len(widths)
        out = widths[np.minimum(i, len(widths) - 1)]
        out[beyond] = np.minimum(8 * -(-padded_lens[beyond] // 8), self.max_tokens)
        return out

    def rows(self, width: int) -> int:
        """The rows of every batch of that `width`."""
        return self.max_tokens // width


def _up_to_8(n: float) -> int:
    return 8 * math.ceil(n / 8)


def make_batches(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    *,
    max_tokens: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    shapes: BatchShapes | None = None,
) -> list[np.ndarray]:
    """Groups example indices into batches of similar length under a token budget (§5.1).

    Examples are sorted by (target length, source length) and cut greedily into consecutive
    batches; a batch takes the next example while ``batch_size * padded_len <= max_tokens``
    holds on both sides, where ``padded_len`` is the longest length in the batch plus one
    (the model appends EOS to the source and adds BOS/EOS to the target). The budget counts
    padding, so it is a hard limit on the tensor sizes :func:`collate` produces, and memory use
    is predictable.

    With ``shuffle=True`` examples of equal lengths are ordered by a permutation drawn from
    ``(seed, epoch)``, and so is the order of the batches: every epoch sees different batches,
    yet the same ``(seed, epoch)`` always gives the same ones (resumable, and identical on all
    ranks before :func:`shard_batches`). With ``shuffle=False`` ties keep index order and the
    batches stay sorted, which suits evaluation; ``seed`` and ``epoch`` are then unused.

    With `shapes` (whose ``max_tokens`` is this one), a batch's padded length is its
    `BatchShapes.width`, so that it fits the rows of that width (`collate` pads it to them),
    and examples are sorted by their width first, so that few batches mix widths.

    Args:
        src_lengths: ``(N,)`` source lengths without EOS.
        tgt_lengths: ``(N,)`` target lengths without BOS/EOS.
        max_tokens: Budget per batch and side, padding included (the paper used ~25000).
        seed: Seed of the shuffles.
        epoch: Varies the shuffles between epochs.
        shuffle: Whether to shuffle ties and batch order.
        shapes: Fixed batch shapes to cut for, or None for batches of any shape.

    Returns:
        int64 index arrays covering every example exactly once.

    Raises:
        DataError: ``max_tokens`` is not positive or one example alone exceeds it.
    """
    src_lengths = np.asarray(src_lengths, dtype=np.int64)
    tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64)
    if src_lengths.shape != tgt_lengths.shape or src_lengths.ndim != 1:
        raise DataError(
            f"src_lengths {src_lengths.shape} and tgt_lengths {tgt_lengths.shape} must be "
            "1-D arrays of the same length"
        )
    if max_tokens < 1:
        raise DataError(f"max_tokens ({max_tokens}) must be positive")
    if len(src_lengths) == 0:
        return []
    if min(src_lengths.min(), tgt_lengths.min()) < 0:
        raise DataError("lengths must be non-negative")
    padded = np.maximum(src_lengths, tgt_lengths) + 1
    worst = int(np.argmax(padded))
    if padded[worst] > max_tokens:
        raise DataError(
            f"example {worst} has {src_lengths[worst]} source and {tgt_lengths[worst]} target "
            f"tokens, {padded[worst]} with EOS/BOS, which alone exceeds max_tokens "
            f"({max_tokens}); max_tokens must be >= max_len + 1"
        )

    if shapes is not None:
        padded = shapes.widths_of(padded)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(padded)) if shuffle else np.arange(len(padded))
    keys = (src_lengths, tgt_lengths) if shapes is None else (src_lengths, tgt_lengths, padded)
    for key in keys:  # stable sorts, least significant key first
        order = order[np.argsort(_narrow(key[order]), kind="stable")]
    batches = np.split(order, _greedy_bounds(padded[order], max_tokens))

    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _narrow(lengths: np.ndarray) -> np.ndarray:
    """Casts to uint16 when possible: NumPy radix-sorts 16-bit keys, ~4x faster than int64."""
    return lengths.astype(np.uint16) if lengths.max() < 1 << 16 else lengths


def _greedy_bounds(padded: np.ndarray, max_tokens: int) -> list[int]:
    """End positions of greedy batches over ``padded`` lengths in batch order.

    Equivalent to adding examples one by one while ``size * running_max <= max_tokens``, but
    done a window at a time with NumPy: that product only grows, so the examples that fit are
    a prefix of the window. The window starts at twice the previous batch size and doubles
    until the batch closes, keeping the work proportional to the number of examples.
    """
    bounds: list[int] = []
    start, width = 0, 64
    while start < len(padded):
        # Every example costs at least padded[start] tokens, which caps the batch size.
        limit = min(len(padded) - start, max_tokens // int(padded[start]))
        width = min(width, limit)
        while True:
            running_max = np.maximum.accumulate(padded[start : start + width])
            fits = np.arange(1, width + 1) * running_max <= max_tokens
            size = int(np.count_nonzero(fits))
            if size < width or width == limit:
                break
            width = min(2 * width, limit)
        start += size
        bounds.append(start)
        width = 2 * size
    return bounds[:-1]


def shard_batches(batches: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Gives each of ``world_size`` ranks its share: batches ``rank, rank + world_size, ...``.

    Every rank gets the same number of batches, so no rank waits forever in an all-reduce; the
    last ``len(batches) % world_size`` batches are dropped for that (they differ every epoch
    when the batch order is shuffled). Call it with identical ``batches`` on every rank.

    Raises:
        DataError: ``rank`` is not in ``0..world_size-1``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank ({rank}) must be in 0..world_size-1 (world_size={world_size})")
    usable = len(batches) - len(batches) % world_size
    if usable == 0 and batches:
        logger.warning(
            "%d batches cannot be shared by %d ranks; every rank gets none",
            len(batches),
            world_size,
        )
    return list(batches[rank:usable:world_size])


def accumulation(
    *, tokens_per_update: int, max_tokens: int, accumulate: int, world_size: int
) -> int:
    """Batches per update and process: `accumulate`, or enough for `tokens_per_update`."""
    if tokens_per_update > 0:
        return max(1, math.ceil(tokens_per_update / (max_tokens * world_size)))
    return accumulate


def epoch_updates(
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    *,
    max_tokens: int,
    seed: int,
    epoch: int,
    accumulate: int,
    rank: int,
    world_size: int,
    shapes: BatchShapes | None = None,
) -> list[list[np.ndarray]]:
    """This rank's updates of an epoch, each a list of `accumulate` batches (index arrays);
    with `shapes`, batches cut for them (`make_batches`)."""
    batches = make_batches(
        src_lengths, tgt_lengths, max_tokens=max_tokens, seed=seed, epoch=epoch, shapes=shapes
    )
    mine = shard_batches(batches, rank, world_size)
    return [mine[i : i + accumulate] for i in range(0, len(mine), accumulate)]


@dataclass(frozen=True)
class Batch:
    """A padded batch of token ids, ready for teacher forcing.

    Attributes:
        src: ``(B, S)`` source ids followed by EOS, right-padded.
        tgt_in: ``(B, T)`` decoder input: BOS followed by the target ids, right-padded.
        tgt_out: ``(B, T)`` decoder labels: the target ids followed by EOS, right-padded; it is
            ``tgt_in`` shifted left by one, so position t predicts token t + 1.
        n_src_tokens: Non-pad tokens in ``src``.
        n_tgt_tokens: Non-pad tokens in ``tgt_out``, the number the loss is averaged over.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    n_src_tokens: int
    n_tgt_tokens: int

    def __len__(self) -> int:
        return self.src.shape[0]

    @property
    def src_padded(self) -> bool:
        """Whether any source row is padded, known on the host from the token count: the model
        need not read the source back from a GPU to ask (`Transformer.forward`)."""
        return self.n_src_tokens < self.src.numel()

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """Returns a copy with the tensors on ``device``."""
        return Batch(
            src=self.src.to(device, non_blocking=non_blocking),
            tgt_in=self.tgt_in.to(device, non_blocking=non_blocking),
            tgt_out=self.tgt_out.to(device, non_blocking=non_blocking),
            n_src_tokens=self.n_src_tokens,
            n_tgt_tokens=self.n_tgt_tokens,
        )

    def pin_memory(self) -> Batch:
        """Page-locks the tensors; ``DataLoader(pin_memory=True)`` calls this."""
        return Batch(
            src=self.src.pin_memory(),
            tgt_in=self.tgt_in.pin_memory(),
            tgt_out=self.tgt_out.pin_memory(),
            n_src_tokens=self.n_src_tokens,
            n_tgt_tokens=self.n_tgt_tokens,
        )


def collate(
    examples: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    shapes: BatchShapes | None = None,
) -> Batch:
    """Pads ``(src_ids, tgt_ids)`` pairs into a :class:`Batch` of int64 tensors.

    With `shapes`, both sides are padded to the batch's `BatchShapes.width` and the batch to
    that width's rows: a row past the examples is empty (EOS alone as its source, BOS alone as
    its decoder input, no label), which changes neither the loss nor its gradients.

    Raises:
        DataError: ``examples`` is empty, or more than `shapes` allows at their width.
    """
    if not examples:
        raise DataError("collate needs at least one example")
    src_lens = [len(src) for src, _ in examples]
    tgt_lens = [len(tgt) for _, tgt in examples]
    n_rows, src_width, tgt_width = len(examples), max(src_lens) + 1, max(tgt_lens) + 1
    if shapes is not None:
        src_width = tgt_width = shapes.width(max(src_width, tgt_width))
        if n_rows > shapes.rows(src_width):
            raise DataError(
                f"{n_rows} examples do not fit a batch of width {src_width}, which holds "
                f"{shapes.rows(src_width)} rows under max_tokens {shapes.max_tokens}"
            )
        n_rows = shapes.rows(src_width)

    src = np.full((n_rows, src_width), pad_id, dtype=np.int64)  # (B, S)
    tgt_in = np.full((n_rows, tgt_width), pad_id, dtype=np.int64)  # (B, T)
    tgt_out = np.full((n_rows, tgt_width), pad_id, dtype=np.int64)  # (B, T)
    for row, ((src_ids, tgt_ids), n_src, n_tgt) in enumerate(
        zip(examples, src_lens, tgt_lens, strict=True)
    ):
        src[row, :n_src] = src_ids
        src[row, n_src] = eos_id
        tgt_in[row, 0] = bos_id
        tgt_in[row, 1 : n_tgt + 1] = tgt_ids
        tgt_out[row, :n_tgt] = tgt_ids
        tgt_out[row, n_tgt] = eos_id
    src[len(examples) :, 0] = eos_id  # the empty rows of fixed shapes: no label
    tgt_in[len(examples) :, 0] = bos_id

    return Batch(
        src=torch.from_numpy(src),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        n_src_tokens=sum(src_lens) + n_rows,
        n_tgt_tokens=sum(tgt_lens) + len(examples),
    )
