"""Tests for aiayn.attention: Eq. 1 as written against a float64 reference and against the fused
kernel multi-head attention runs by default, and multi-head attention (§3.2.2) against per-head
math and PyTorch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from aiayn import attention
from aiayn.attention import MultiHeadAttention, scaled_dot_product_attention

B, H, T, S, D_K, D_V = 3, 2, 5, 7, 4, 6
LENGTHS = (7, 3, 5)  # real source lengths; the rest of each row is padding


def key_mask(lengths: tuple[int, ...], s: int) -> Tensor:
    """(B, S) True = real key; padding on the right."""
    return torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]


def reference_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """Eq. 1 in float64, with the mask as a (B, H, T, S) boolean."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def random_qkv(t: int = T, s: int = S) -> tuple[Tensor, Tensor, Tensor]:
    return torch.randn(B, H, t, D_K), torch.randn(B, H, s, D_K), torch.randn(B, H, s, D_V)


def fused_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, is_causal: bool = False
) -> Tensor:
    """Eq. 1 by the kernel `MultiHeadAttention` runs by default."""
    kernel = MultiHeadAttention(4, 1, 4, 4).kernel
    assert kernel is attention.fused_attention
    return kernel(q, k, v, attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("fused", [False, True])
def test_eq1_matches_float64_reference_with_padding(fused: bool) -> None:
    q, k, v = random_qkv()
    mask = key_mask(LENGTHS, S)[:, None, None, :]  # (B, 1, 1, S)
    out = (
        fused_attention(q, k, v, mask) if fused else scaled_dot_product_attention(q, k, v, mask)[0]
    )
    expected = reference_attention(q, k, v, mask.expand(B, H, T, S))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_eq1_scales_by_sqrt_d_k_not_d_v(fused: bool) -> None:
    q, k, v = random_qkv()
    v = torch.randn(B, H, S, 3 * D_K)  # d_v != d_k
    out = fused_attention(q, k, v) if fused else scaled_dot_product_attention(q, k, v)[0]
    all_allowed = torch.ones(B, H, T, S, dtype=torch.bool)
    torch.testing.assert_close(
        out.double(), reference_attention(q, k, v, all_allowed), atol=1e-5, rtol=0
    )


def test_fused_and_explicit_agree_with_padding_mask() -> None:
    q, k, v = random_qkv()
    mask = key_mask(LENGTHS, S)[:, None, None, :]
    fused = fused_attention(q, k, v, mask)
    explicit, no_probs = scaled_dot_product_attention(q, k, v, mask)
    _, probs = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert no_probs is None and probs is not None
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
    unmasked = fused_attention(q, k, v)
    assert not torch.allclose(unmasked, fused, atol=1e-3)  # the mask matters here


def test_fused_and_explicit_agree_with_full_mask() -> None:
    q, k, v = random_qkv()
    mask = torch.rand(B, H, T, S) < 0.6
    mask[..., 0] = True  # every query may attend somewhere
    fused = fused_attention(q, k, v, mask)
    explicit, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        explicit.double(), reference_attention(q, k, v, mask), atol=1e-5, rtol=0
    )


def test_fused_and_explicit_agree_with_causal_mask() -> None:
    q, k, v = random_qkv(t=6, s=6)
    fused = fused_attention(q, k, v, is_causal=True)
    explicit, probs = scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
    lower = torch.ones(6, 6, dtype=torch.bool).tril().expand(B, H, 6, 6)
    torch.testing.assert_close(
        explicit.double(), reference_attention(q, k, v, lower), atol=1e-5, rtol=0
    )
    assert probs is not None
    assert (probs[..., ~lower[0, 0]] == 0).all()  # nothing above the diagonal
    assert (probs[..., lower[0, 0]] > 0).all()


def test_explicit_probabilities_are_distributions_over_real_keys() -> None:
    q, k, v = random_qkv()
    mask = key_mask(LENGTHS, S)
    _, probs = scaled_dot_product_attention(q, k, v, mask[:, None, None, :], need_weights=True)
    assert probs is not None and probs.shape == (B, H, T, S)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T), atol=1e-6, rtol=0)
    padded = ~mask[:, None, None, :].expand(B, H, T, S)
    assert (probs[padded] == 0).all()
    assert (probs[~padded] > 0).all()


def test_explicit_path_returns_probabilities_before_attention_dropout() -> None:
    q, k, v = random_qkv()
    _, probs = scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True)
    assert probs is not None
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T), atol=1e-6, rtol=0)


# -- multi-head attention (§3.2.2) ------------------------------------------------------------


def test_multi_head_equals_concatenated_heads_times_w_o() -> None:
    d_model, n_heads, d_k, d_v = 12, 3, 5, 7  # d_k, d_v != d_model / h, as in Table 3 (A), (B)
    mha = MultiHeadAttention(d_model, n_heads, d_k, d_v).eval()
    query, memory = torch.randn(B, T, d_model), torch.randn(B, S, d_model)
    mask = key_mask(LENGTHS, S)
    out, probs = mha(query, memory, mask[:, None, None, :], need_weights=True)
    assert out.shape == (B, T, d_model)
    assert probs is not None and probs.shape == (B, n_heads, T, S)

    heads = []
    for i in range(n_heads):
        q_rows, v_rows = slice(i * d_k, (i + 1) * d_k), slice(i * d_v, (i + 1) * d_v)
        w_q, b_q = mha.q_proj.weight[q_rows], mha.q_proj.bias[q_rows]
        w_k, b_k = mha.k_proj.weight[q_rows], mha.k_proj.bias[q_rows]
        w_v, b_v = mha.v_proj.weight[v_rows], mha.v_proj.bias[v_rows]
        allowed = mask[:, None, :].expand(B, T, S)
        head = reference_attention(
            query @ w_q.T + b_q, memory @ w_k.T + b_k, memory @ w_v.T + b_v, allowed
        )
        heads.append(head)
    expected = torch.cat(heads, dim=-1) @ mha.out_proj.weight.double().T
    expected = expected + mha.out_proj.bias.double()
    torch.testing.assert_close(out.detach().double(), expected.detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_multi_head_fused_and_explicit_agree(is_causal: bool) -> None:
    mha = MultiHeadAttention(16, 4, 4, 4, attention_dropout=0.3).eval()  # eval: no dropout
    x = torch.randn(B, 6, 16)
    mask = None if is_causal else key_mask((6, 2, 4), 6)[:, None, None, :]
    fused, _ = mha(x, x, mask, is_causal=is_causal)
    explicit, _ = mha(x, x, mask, is_causal=is_causal, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)


def test_multi_head_matches_torch_multihead_attention() -> None:
    d_model, n_heads = 16, 4
    ours = MultiHeadAttention(d_model, n_heads, d_model // n_heads, d_model // n_heads).eval()
    theirs = nn.MultiheadAttention(d_model, n_heads, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(
            torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
        )
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    query, memory = torch.randn(B, T, d_model), torch.randn(B, S, d_model)
    mask = key_mask(LENGTHS, S)
    out, probs = ours(query, memory, mask[:, None, None, :], need_weights=True)
    expected, expected_probs = theirs(
        query, memory, memory, key_padding_mask=~mask, average_attn_weights=False
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=0)


def test_attention_dropout_is_active_only_in_training() -> None:
    mha = MultiHeadAttention(16, 4, 4, 4, attention_dropout=0.5)
    x = torch.randn(B, T, 16)
    train_a, _ = mha(x, x)
    train_b, _ = mha(x, x)
    assert not torch.allclose(train_a, train_b)
    mha.eval()
    eval_a, _ = mha(x, x)
    eval_b, _ = mha(x, x)
    torch.testing.assert_close(eval_a, eval_b, atol=0, rtol=0)


def test_stacked_qkv_projection_equals_the_three_projections() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, n_heads=2, d_k=4, d_v=6)
    x = torch.randn(B, T, 16)
    separate = (mha.project_query(x), *mha.project_key_value(x))
    with torch.no_grad():
        stacked = mha.project_qkv(x)
        for a, b in zip(stacked, separate, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        mha.k_proj.weight.mul_(2.0)  # an update in place: the stack must follow
        torch.testing.assert_close(mha.project_qkv(x)[1], mha.project_key_value(x)[0])


def test_projections_follow_a_fused_adam_step_between_two_no_grad_passes() -> None:
    """Fused Adam updates weights without bumping `Tensor._version`; a stacked-weight cache
    keyed on it made every validation after the first use the first one's Q/K/V weights."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, n_heads=2, d_k=4, d_v=6)
    optimizer = torch.optim.Adam(mha.parameters(), lr=0.1, fused=True)
    x = torch.randn(B, T, 16)
    with torch.no_grad():
        mha.project_qkv(x)  # a first validation
    mha(x, x)[0].square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        after = mha.project_qkv(x)  # a second one, after the update
        separate = (mha.project_query(x), *mha.project_key_value(x))
    for a, b in zip(after, separate, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_stacked_qkv_projection_passes_gradients_to_the_three_matrices() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, n_heads=2, d_k=4, d_v=6)
    x = torch.randn(B, T, 16)
    q, k, v = mha.project_qkv(x)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    grads = [m.weight.grad.clone() for m in (mha.q_proj, mha.k_proj, mha.v_proj)]
    mha.zero_grad()
    q, (k, v) = mha.project_query(x), mha.project_key_value(x)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    for got, m in zip(grads, (mha.q_proj, mha.k_proj, mha.v_proj), strict=True):
        torch.testing.assert_close(got, m.weight.grad)


@pytest.mark.parametrize(
    ("fused", "dtype"), [(False, torch.float32), (False, torch.bfloat16), (True, torch.float32)]
)
def test_an_additive_float_mask_is_the_boolean_mask(fused: bool, dtype: torch.dtype) -> None:
    """The decoder cache hands encoder-decoder attention its source mask as 0 / -inf added to
    the scores (in the model's dtype); both kernels give exactly what the boolean mask gives."""
    q, k, v = (t.to(dtype) for t in random_qkv())
    allowed = key_mask(LENGTHS, S)[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    if fused:
        by_bool, by_float = fused_attention(q, k, v, allowed), fused_attention(q, k, v, additive)
    else:
        by_bool = scaled_dot_product_attention(q, k, v, allowed)[0]
        by_float = scaled_dot_product_attention(q, k, v, additive)[0]
    assert by_float.dtype == dtype
    torch.testing.assert_close(by_float, by_bool, atol=0, rtol=0)
    expected = reference_attention(q, k, v, allowed.expand(B, H, T, S))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(by_float.double(), expected, atol=tolerance, rtol=0)


def test_a_mask_is_boolean_or_floating_point() -> None:
    q, k, v = random_qkv()
    with pytest.raises(TypeError, match=r"boolean or floating point, not torch\.int64"):
        scaled_dot_product_attention(q, k, v, key_mask(LENGTHS, S)[:, None, None, :].long())


def test_a_decoding_steps_rows_attend_as_one_position_of_the_batch_does() -> None:
    """`DecoderLayer.step` keeps its rows 2-D: (R, D) rows project into (R, H, 1, d) heads,
    W hypotheses of a sentence attend over its keys together (`project_query_groups`), and
    `attend_rows` gives back rows (R, D): the numbers of `forward` at one position, with the
    boolean mask or its additive form."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, n_heads=2, d_k=4, d_v=6).eval()
    rows = torch.randn(6, 16)  # 3 sentences × 2 hypotheses, one position each
    memory = torch.randn(3, S, 16)
    allowed = key_mask(LENGTHS, S)[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    with torch.no_grad():
        q, k, v = mha.project_qkv(rows)
        assert q.shape == k.shape == (6, 2, 1, 4) and v.shape == (6, 2, 1, 6)
        for part, whole in zip((q, k, v), mha.project_qkv(rows[:, None]), strict=True):
            torch.testing.assert_close(part, whole, atol=0, rtol=0)
        self_attended = mha.attend_rows(q, k, v)
        expected, _ = mha(rows[:, None], rows[:, None])
        torch.testing.assert_close(self_attended, expected[:, 0], atol=0, rtol=0)
        queries = mha.project_query_groups(rows, 3)  # (3, H, 2, d_k)
        keys, values = mha.project_key_value(memory)
        expected, _ = mha(rows.view(3, 2, 16), memory, allowed)
        for mask in (allowed, additive):
            cross = mha.attend_rows(queries, keys, values, mask)
            torch.testing.assert_close(cross, expected.reshape(6, 16), atol=0, rtol=0)
