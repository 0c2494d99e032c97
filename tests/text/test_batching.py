"""Tests for aiayn.text.batching (§5.1): batches of similar lengths that never exceed the token
budget, padding included, and cover every example once; shuffles drawn from (seed, epoch);
equal shards for every rank; updates of `accumulate` batches; collation into padded tensors;
fixed batch shapes (`BatchShapes`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from aiayn.text.batching import (
    Batch,
    BatchShapes,
    accumulation,
    collate,
    epoch_updates,
    make_batches,
    shard_batches,
)
from aiayn.text.corpus import DataError
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID

# -- batching ---------------------------------------------------------------------------------


def random_lengths(n: int, seed: int, max_len: int = 60) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, max_len + 1, n), rng.integers(0, max_len + 1, n)


@pytest.mark.parametrize("max_tokens", [61, 100, 257, 1000])
@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_respect_budget_and_cover_everything(max_tokens: int, shuffle: bool) -> None:
    src_lengths, tgt_lengths = random_lengths(2000, seed=max_tokens)
    batches = make_batches(
        src_lengths, tgt_lengths, max_tokens=max_tokens, seed=1, epoch=0, shuffle=shuffle
    )
    for batch in batches:
        assert len(batch) > 0
        assert len(batch) * (src_lengths[batch].max() + 1) <= max_tokens
        assert len(batch) * (tgt_lengths[batch].max() + 1) <= max_tokens
    assert sorted(np.concatenate(batches).tolist()) == list(range(2000))


def reference_batches(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int
) -> list[list[int]]:
    """The unshuffled batching rule, one example at a time."""
    order = np.lexsort((np.arange(len(src_lengths)), src_lengths, tgt_lengths))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order.tolist():
        padded = max(src_lengths[i], tgt_lengths[i]) + 1
        if current and (len(current) + 1) * max(longest, padded) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, padded)
    return [*batches, current]


@pytest.mark.parametrize("max_tokens", [61, 300, 5000])
def test_batches_match_the_one_at_a_time_reference(max_tokens: int) -> None:
    src_lengths, tgt_lengths = random_lengths(3000, seed=max_tokens)
    src_lengths[::7] = 0  # empty sides and wide ranges stress the windowed search
    batches = make_batches(
        src_lengths, tgt_lengths, max_tokens=max_tokens, seed=0, epoch=0, shuffle=False
    )
    assert [b.tolist() for b in batches] == reference_batches(src_lengths, tgt_lengths, max_tokens)


def test_batches_are_filled_greedily() -> None:
    # Equal lengths 9 (+1 = 10): a budget of 35 fits 3 per batch.
    batches = make_batches(np.full(10, 9), np.full(10, 9), max_tokens=35, seed=0, epoch=0)
    assert sorted(len(b) for b in batches) == [1, 3, 3, 3]


def test_batches_group_similar_lengths() -> None:
    src_lengths, tgt_lengths = random_lengths(2000, seed=0)
    batches = make_batches(src_lengths, tgt_lengths, max_tokens=500, seed=0, epoch=0)
    spread = np.mean([np.ptp(tgt_lengths[b]) for b in batches])
    assert spread <= 1.0


def test_batches_are_deterministic_per_seed_and_epoch() -> None:
    src_lengths, tgt_lengths = random_lengths(500, seed=3)

    def batches(seed: int, epoch: int) -> list[list[int]]:
        return [
            b.tolist()
            for b in make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=seed, epoch=epoch)
        ]

    assert batches(0, 0) == batches(0, 0)
    assert batches(0, 0) != batches(0, 1)
    assert batches(0, 0) != batches(1, 0)


def test_unshuffled_batches_are_sorted_and_ignore_seed() -> None:
    src_lengths, tgt_lengths = random_lengths(300, seed=4)
    a = make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=0, epoch=0, shuffle=False)
    b = make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=5, epoch=9, shuffle=False)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    order = np.concatenate(a)
    assert np.all(np.diff(tgt_lengths[order]) >= 0)


def test_example_longer_than_budget_is_an_error() -> None:
    with pytest.raises(DataError, match=r"max_tokens must be >= max_len \+ 1"):
        make_batches(np.array([3, 50]), np.array([3, 4]), max_tokens=50, seed=0, epoch=0)
    # Exactly max_len + 1 fits.
    assert len(make_batches(np.array([49]), np.array([3]), max_tokens=50, seed=0, epoch=0)) == 1


def test_make_batches_of_nothing() -> None:
    assert make_batches(np.array([]), np.array([]), max_tokens=10, seed=0, epoch=0) == []


@pytest.mark.parametrize(
    ("src_lengths", "tgt_lengths", "max_tokens", "message"),
    [
        ([3, 4], [3], 10, "same length"),
        ([[3]], [[3]], 10, "1-D"),
        ([3], [3], 0, "must be positive"),
        ([3, -1], [3, 2], 10, "non-negative"),
    ],
)
def test_make_batches_refuses_bad_lengths_and_budgets(
    src_lengths: list, tgt_lengths: list, max_tokens: int, message: str
) -> None:
    with pytest.raises(DataError, match=message):
        make_batches(
            np.array(src_lengths), np.array(tgt_lengths), max_tokens=max_tokens, seed=0, epoch=0
        )


def test_a_long_target_fills_the_budget_as_a_long_source_does() -> None:
    """Both sides count: the longer one sets the padded length of a batch."""
    by_source = make_batches(np.full(6, 9), np.full(6, 1), max_tokens=30, seed=0, epoch=0)
    by_target = make_batches(np.full(6, 1), np.full(6, 9), max_tokens=30, seed=0, epoch=0)
    assert sorted(map(len, by_source)) == sorted(map(len, by_target)) == [3, 3]


@pytest.mark.parametrize("n_batches", [8, 10, 11])
def test_shards_are_equal_and_disjoint(n_batches: int) -> None:
    batches = [np.array([i]) for i in range(n_batches)]
    shards = [shard_batches(batches, rank, 4) for rank in range(4)]
    assert len({len(s) for s in shards}) == 1
    assert len(shards[0]) == n_batches // 4
    assert [int(b[0]) for b in shards[1]] == list(range(1, 4 * (n_batches // 4), 4))
    taken = sorted(int(b[0]) for shard in shards for b in shard)
    assert taken == list(range(4 * (n_batches // 4)))


def test_shard_rejects_bad_rank() -> None:
    with pytest.raises(DataError, match="rank"):
        shard_batches([1, 2], 2, 2)


def test_fewer_batches_than_ranks_give_every_rank_none_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="aiayn.text.batching"):
        shards = [shard_batches([np.array([0]), np.array([1])], rank, 4) for rank in range(4)]
    assert shards == [[], [], [], []]
    assert "2 batches cannot be shared by 4 ranks" in caplog.text


# -- updates ----------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 3])
def test_epoch_updates_are_each_ranks_shard_in_groups_of_accumulate(accumulate: int) -> None:
    src_lengths, tgt_lengths = random_lengths(600, seed=2)
    settings = dict(max_tokens=300, seed=1, epoch=4, accumulate=accumulate, world_size=2)
    batches = make_batches(src_lengths, tgt_lengths, max_tokens=300, seed=1, epoch=4)
    for rank in range(2):
        updates = epoch_updates(src_lengths, tgt_lengths, rank=rank, **settings)
        mine = shard_batches(batches, rank, 2)
        assert [len(update) for update in updates[:-1]] == [accumulate] * (len(updates) - 1)
        assert 1 <= len(updates[-1]) <= accumulate
        flat = [batch.tolist() for update in updates for batch in update]
        assert flat == [batch.tolist() for batch in mine]  # in order, none left out


def test_tokens_per_update_sets_accumulation() -> None:
    settings = dict(tokens_per_update=25_000, max_tokens=1000, accumulate=1)
    assert accumulation(**settings, world_size=1) == 25
    assert accumulation(**settings, world_size=8) == 4  # ceil(25000 / 8000)
    assert accumulation(**{**settings, "tokens_per_update": 0}, world_size=8) == 1


def test_tokens_per_update_rounds_up_and_is_at_least_one_batch() -> None:
    settings = dict(max_tokens=1000, accumulate=7, world_size=2)
    assert accumulation(tokens_per_update=2001, **settings) == 2  # ceil(2001 / 2000)
    assert accumulation(tokens_per_update=10, **settings) == 1


# -- collation --------------------------------------------------------------------------------


def test_collate_shapes_and_contents() -> None:
    examples = [
        (np.array([5, 6, 7], dtype=np.uint16), np.array([8, 9], dtype=np.uint16)),
        (np.array([10], dtype=np.uint16), np.array([11, 12, 13, 14], dtype=np.uint16)),
    ]
    batch = collate(examples)
    assert isinstance(batch, Batch)
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    p, b, e = PAD_ID, BOS_ID, EOS_ID
    assert batch.src.tolist() == [[5, 6, 7, e], [10, e, p, p]]
    assert batch.tgt_in.tolist() == [[b, 8, 9, p, p], [b, 11, 12, 13, 14]]
    assert batch.tgt_out.tolist() == [[8, 9, e, p, p], [11, 12, 13, 14, e]]
    assert batch.n_src_tokens == int((batch.src != p).sum()) == 6
    assert batch.n_tgt_tokens == int((batch.tgt_out != p).sum()) == 8
    assert len(batch) == 2
    assert batch.src_padded  # the second row
    assert not collate([examples[0], examples[0]]).src_padded


def test_collate_respects_budget_of_make_batches() -> None:
    src_lengths, tgt_lengths = random_lengths(200, seed=7)
    examples = [
        (np.ones(s, np.int64), np.ones(t, np.int64))
        for s, t in zip(src_lengths, tgt_lengths, strict=True)
    ]
    for indices in make_batches(src_lengths, tgt_lengths, max_tokens=200, seed=0, epoch=0):
        batch = collate([examples[i] for i in indices])
        assert batch.src.numel() <= 200 and batch.tgt_in.numel() <= 200


def test_batch_to_device() -> None:
    batch = collate([(np.array([4]), np.array([5]))]).to("cpu")
    assert batch.src.device.type == "cpu"
    assert batch.n_tgt_tokens == 2


def test_collate_uses_the_given_special_ids_and_refuses_nothing() -> None:
    batch = collate([(np.array([4, 5]), np.array([6]))], pad_id=7, bos_id=8, eos_id=9)
    assert batch.src.tolist() == [[4, 5, 9]]
    assert batch.tgt_in.tolist() == [[8, 6]] and batch.tgt_out.tolist() == [[6, 9]]
    with pytest.raises(DataError, match="at least one example"):
        collate([])


# -- fixed shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(("max_len", "max_tokens"), [(60, 1000), (256, 12_500), (100, 102)])
def test_fixed_shapes_are_few_and_every_batch_fits_its_own(max_len: int, max_tokens: int) -> None:
    """Every batch cut for `BatchShapes` collates to its width's rows × width on both sides,
    within the budget; the examples are each batched once; the shapes are about 16."""
    shapes = BatchShapes.for_lengths(max_len, max_tokens)
    assert list(shapes.widths) == sorted(set(shapes.widths)) and shapes.widths[0] == 8
    assert shapes.widths[-1] == max_len + 1 and shapes.widths[-2] <= max_len - 7
    src_lengths, tgt_lengths = random_lengths(3000, seed=max_len, max_len=max_len)
    examples = [
        (np.full(s, 4, np.int64), np.full(t, 5, np.int64))
        for s, t in zip(src_lengths, tgt_lengths, strict=True)
    ]
    batches = make_batches(
        src_lengths, tgt_lengths, max_tokens=max_tokens, seed=0, epoch=1, shapes=shapes
    )
    assert sorted(np.concatenate(batches).tolist()) == list(range(3000))
    seen = set()
    for indices in batches:
        batch = collate([examples[i] for i in indices], shapes=shapes)
        rows, width = batch.src.shape
        assert batch.tgt_in.shape == batch.tgt_out.shape == (rows, width)
        assert width % 8 == 0 or width == max_len + 1
        assert rows == max_tokens // width and rows * width <= max_tokens
        longest = int(max(src_lengths[indices].max(), tgt_lengths[indices].max())) + 1
        assert longest <= width < max(1.19 * longest + 8, 16)  # padding ≤ ~a fifth, or < 8
        assert batch.n_tgt_tokens == int(tgt_lengths[indices].sum()) + len(indices)
        seen.add((rows, width))
    assert len(seen) <= 17
    for n in range(1, max_len + 2):  # the narrowest width that holds n tokens
        assert shapes.width(n) == min(w for w in shapes.widths if w >= n)


def test_a_sentence_wider_than_every_width_gets_one_of_its_own() -> None:
    shapes = BatchShapes(max_tokens=100, widths=(8, 16))
    assert [shapes.width(n) for n in (8, 9, 16, 17, 25, 99, 120)] == [8, 16, 16, 24, 32, 100, 100]
    assert shapes.widths_of(np.array([8, 9, 17, 25, 120])).tolist() == [8, 16, 24, 32, 100]
    assert BatchShapes.for_lengths(256, 12_500).widths == (
        8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 184, 216, 257
    )  # fmt: skip
    assert BatchShapes.for_lengths(16, 40).widths == (8, 17)


def test_fixed_shapes_pad_with_empty_rows_that_have_no_label() -> None:
    shapes = BatchShapes(max_tokens=24, widths=(8, 16, 24))
    examples = [(np.array([5, 6, 7]), np.array([8, 9])), (np.array([10]), np.array([11]))]
    batch = collate(examples, shapes=shapes)
    p, b, e = PAD_ID, BOS_ID, EOS_ID
    assert batch.src.tolist() == [[5, 6, 7, e] + [p] * 4, [10, e] + [p] * 6, [e] + [p] * 7]
    assert batch.tgt_in.tolist() == [[b, 8, 9] + [p] * 5, [b, 11] + [p] * 6, [b] + [p] * 7]
    assert batch.tgt_out.tolist() == [[8, 9, e] + [p] * 5, [11, e] + [p] * 6, [p] * 8]
    assert batch.n_tgt_tokens == int((batch.tgt_out != p).sum()) == 5
    assert batch.n_src_tokens == int((batch.src != p).sum()) == 7
    with pytest.raises(DataError, match="4 examples do not fit a batch of width 8, which holds 3"):
        collate(examples * 2, shapes=shapes)
