"""Tests for aiayn.cache: `DecoderCache.reorder` keeps the rows beam search asks for, moving in
place the few rows that change when their sources stay put and gathering every row into its
spare buffer otherwise (no new memory per step); `append_self` and `cross` give the layers the
keys and values so far (and an additive source mask); and a reordered cache decodes on like the
reordered batch from scratch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from aiayn.cache import DecoderCache
from aiayn.model import Transformer
from aiayn.text.tokenizer import PAD_ID
from model_dirs import tiny_model

SRC_LENGTHS = (7, 4, 5)  # a padded source batch: S = 7
T = 6
L, H, MAX_LEN, D, S = 2, 2, 5, 3, 4  # layers, heads, positions, head width, source length


def batch(model: Transformer) -> tuple[Tensor, Tensor]:
    """Sentences of SRC_LENGTHS real tokens, right-padded, and random targets (3, T)."""
    c = model.config
    src = torch.randint(1, c.src_vocab_size, (len(SRC_LENGTHS), max(SRC_LENGTHS)))
    for row, n in enumerate(SRC_LENGTHS):
        src[row, n:] = PAD_ID
    return src, torch.randint(1, c.tgt_vocab_size, (len(SRC_LENGTHS), T))


def random_cache(n_sentences: int, beams: int, length: int = 3) -> DecoderCache:
    """A cache of `n_sentences` × `beams` rows holding `length` random positions."""
    rows = n_sentences * beams
    mask = torch.ones(n_sentences, S, dtype=torch.bool)
    mask[0, -1] = False
    return DecoderCache(
        torch.randn(L, rows, H, MAX_LEN, D),
        torch.randn(L, rows, H, MAX_LEN, D),
        torch.randn(L, n_sentences, H, S, D),
        torch.randn(L, n_sentences, H, S, D),
        mask,
        length=length,
    )


def filled(cache: DecoderCache) -> tuple[Tensor, Tensor]:
    """Copies of the self-attention keys and values of the positions fed so far."""
    t = cache.length
    return cache.self_k[:, :, :, :t].clone(), cache.self_v[:, :, :, :t].clone()


def assert_reordered(cache: DecoderCache, before: tuple[Tensor, Tensor], index: Tensor) -> None:
    for now, then in zip(filled(cache), before, strict=True):
        torch.testing.assert_close(now, then[:, index], atol=0, rtol=0)


# -- reorder: in place or gathered, never new memory per step ---------------------------------


def test_reorder_moves_the_changed_rows_in_place_when_their_sources_stay() -> None:
    cache = random_cache(2, 4)
    before, buffer = filled(cache), cache.self_k.data_ptr()
    index = torch.tensor([0, 0, 2, 3, 4, 5, 5, 7])  # rows 1 and 6 take their sibling's place
    assert cache.reorder(index) is cache
    assert cache.self_k.data_ptr() == buffer and cache.batch_size == 8
    assert_reordered(cache, before, index)


@pytest.mark.parametrize(
    "index",
    [
        pytest.param([1, 0, 2, 3, 4, 5, 6, 7], id="a swap: a source would be overwritten"),
        pytest.param([0, 0, 0, 0, 4, 4, 4, 4], id="3/4 of the rows move"),
    ],
)
def test_reorder_gathers_into_the_spare_buffer_and_back(index: list[int]) -> None:
    cache = random_cache(2, 4)
    first = cache.self_k.data_ptr()
    before = filled(cache)
    cache.reorder(torch.tensor(index))
    second = cache.self_k.data_ptr()
    assert second != first
    assert_reordered(cache, before, torch.tensor(index))
    before = filled(cache)
    cache.reorder(torch.tensor(index))
    assert cache.self_k.data_ptr() == first  # the two buffers take turns: nothing allocated
    assert_reordered(cache, before, torch.tensor(index))


def test_dropping_a_sentence_keeps_its_rows_out_and_selects_its_source() -> None:
    cache = random_cache(3, 2)
    before = filled(cache)
    cross = cache.cross_k.clone(), cache.cross_v.clone(), cache.src_key_mask.clone()
    index, sentences = torch.tensor([4, 5, 0, 0]), torch.tensor([2, 0])
    cache.reorder(index, sentences)
    assert (cache.batch_size, cache.n_sentences) == (4, 2)
    assert_reordered(cache, before, index)
    torch.testing.assert_close(cache.cross_k, cross[0][:, sentences], atol=0, rtol=0)
    torch.testing.assert_close(cache.cross_v, cross[1][:, sentences], atol=0, rtol=0)
    assert torch.equal(cache.src_key_mask, cross[2][sentences])


def test_expanding_into_beams_grows_the_rows() -> None:
    cache = random_cache(2, 1)
    before = filled(cache)
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    cache.reorder(index)
    assert cache.batch_size == 6 and cache.max_len == MAX_LEN
    assert_reordered(cache, before, index)


def test_reorder_refuses_rows_that_do_not_group_into_sentences() -> None:
    cache = random_cache(2, 2)
    with pytest.raises(ValueError, match="3 rows cannot be grouped into 2 sentences"):
        cache.reorder(torch.tensor([0, 1, 2]))


# -- what the layers read and write -----------------------------------------------------------


def test_append_self_stores_one_position_and_returns_every_position_so_far() -> None:
    cache = random_cache(1, 2, length=2)
    k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
    before = filled(cache)
    keys, values = cache.append_self(1, k, v)
    assert keys.shape == values.shape == (2, H, 3, D)
    torch.testing.assert_close(keys[:, :, :2], before[0][1], atol=0, rtol=0)
    torch.testing.assert_close(keys[:, :, 2:], k, atol=0, rtol=0)
    torch.testing.assert_close(values[:, :, 2:], v, atol=0, rtol=0)
    assert cache.length == 2  # decode_step advances it once all layers have appended


def test_cross_gives_each_layer_an_additive_source_mask_that_follows_the_sentences() -> None:
    cache = random_cache(2, 3)
    keys, values, mask = cache.cross(0)
    assert keys.shape == values.shape == (2, H, S, D)
    padding = torch.zeros(2, 1, 1, S)
    padding[0, 0, 0, -1] = float("-inf")  # sentence 0's last token is padding
    torch.testing.assert_close(mask, padding, atol=0, rtol=0)
    second_keys, second_values, _ = cache.cross(1)
    cache.reorder(torch.tensor([3, 4, 5]), torch.tensor([1]))  # only sentence 1 goes on
    keys, values, mask = cache.cross(1)
    torch.testing.assert_close(keys, second_keys[1:], atol=0, rtol=0)
    torch.testing.assert_close(values, second_values[1:], atol=0, rtol=0)
    torch.testing.assert_close(mask, padding[1:], atol=0, rtol=0)
    cache.src_key_mask = None
    assert cache.cross(1)[2] is None
    assert cache.self_qkv_weights(0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_with_the_additive_mask_is_the_step_with_the_boolean_one(dtype: torch.dtype) -> None:
    """The cache lays the source mask out once, additive and in the model's dtype; over a
    padded batch the steps give exactly the log-probabilities of the boolean mask."""
    from aiayn.acceleration import use_cpu_attention

    model = use_cpu_attention(tiny_model().to(dtype))
    src, _ = batch(model)
    steps = []
    with torch.inference_mode():
        memory, src_key_mask = model.encode(src)
        assert src_key_mask is not None
        for additive in (True, False):
            cache = model.init_cache(memory, src_key_mask, 4)
            _, _, mask = cache.cross(0)
            assert mask is not None and mask.dtype == dtype
            if not additive:
                boolean = src_key_mask[:, None, None, :]
                cache._cross = [(k, v, boolean) for k, v, _ in cache._cross]
            steps.append([model.decode_step(torch.full((3,), t), cache) for t in (1, 5, 9)])
    for a, b in zip(*steps, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# -- on the model: a reordered cache decodes on like the reordered batch ----------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_first": True}, {"positional_encoding": "learned"}],
    ids=["post-norm", "pre-norm", "learned-positions"],
)
def test_reordered_cache_continues_like_the_reordered_batch(overrides: dict[str, Any]) -> None:
    model = tiny_model(**overrides)
    src, tgt = batch(model)
    # As beam search does: expand each sentence to 2 beams, then drop sentence 1 and follow
    # beams to (repeated, permuted) parents within their sentence.
    steps = [(torch.tensor([0, 0, 1, 1, 2, 2]), None), (torch.tensor([1, 1, 4, 5]), [0, 2])]
    rows = torch.arange(src.size(0))  # the batch row each cache row decodes
    with torch.no_grad():
        memory, src_key_mask = model.encode(src)
        cache = model.init_cache(memory, src_key_mask, max_len=T)
        k = 0
        for index, sentences in steps:
            for t in range(k, k + 2):
                model.decode_step(tgt[rows, t], cache)
            k += 2
            kept = None if sentences is None else torch.tensor(sentences)
            cache = cache.reorder(index, kept)
            rows = rows[index]
            assert cache.batch_size == len(index) and cache.length == k
        continued = torch.stack(
            [model.decode_step(tgt[rows, t], cache) for t in range(k, T)], dim=1
        )
        from_scratch = model(src[rows], tgt[rows]).log_softmax(-1)[:, k:]
        torch.testing.assert_close(continued, from_scratch, atol=1e-5, rtol=0)


def test_cache_copies_only_moved_rows_in_place_and_continues_like_the_reordered_batch() -> None:
    """Reorders that beam search makes, one position apart: the cache moves in place the rows
    that change when their sources stay put (same buffer) and gathers every row otherwise;
    decoding then goes on exactly as the reordered batch from scratch."""
    model = tiny_model()
    src, tgt = batch(model)
    steps = [  # (index, sentences, moves in place?)
        (torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]), None, False),  # expand to 4 beams
        (torch.tensor([0, 0, 2, 3, 4, 5, 5, 7, 8, 9, 10, 11]), None, True),  # second children
        (torch.tensor([8, 9, 9, 11, 4, 5, 6, 4]), torch.tensor([2, 1]), True),  # back refills 0
        (torch.tensor([1, 0, 2, 3, 4, 5, 6, 7]), None, False),  # a swap: sources overwritten
    ]
    rows = torch.arange(src.size(0))  # the batch row each cache row decodes
    with torch.no_grad():
        cache = model.init_cache(*model.encode(src), max_len=T)
        for t, (index, sentences, in_place) in enumerate(steps):
            model.decode_step(tgt[rows, t], cache)
            buffer = cache.self_k.data_ptr()
            cache = cache.reorder(index, sentences)
            assert (cache.self_k.data_ptr() == buffer) == in_place
            rows = rows[index]
        k = len(steps)
        continued = torch.stack(
            [model.decode_step(tgt[rows, t], cache) for t in range(k, T)], dim=1
        )
        from_scratch = model(src[rows], tgt[rows]).log_softmax(-1)[:, k:]
        torch.testing.assert_close(continued, from_scratch, atol=1e-5, rtol=0)


def test_reorder_refuses_rows_that_cannot_be_grouped() -> None:
    model = tiny_model()
    src, _ = batch(model)
    with torch.no_grad():
        cache = model.init_cache(*model.encode(src), max_len=T)
        with pytest.raises(ValueError, match="grouped"):
            cache.reorder(torch.tensor([0, 1]))  # 2 rows for 3 sentences
        for not_a_row in (-1, 3):  # refused, not taken from the other end or beyond
            with pytest.raises((RuntimeError, IndexError)):
                cache.reorder(torch.tensor([0, 1, not_a_row]))
