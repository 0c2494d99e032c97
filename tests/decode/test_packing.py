"""Tests for aiayn.decode.packing: a packed linear layer (oneDNN's blocked weights, or MKL's on
the weight stored transposed) computes what `nn.Linear` computes; a packed copy of a model gives
its log-probs and translations and leaves the model alone; and the kernels that float32 CPU
decoding picks by default."""

from __future__ import annotations

import copy
import platform

import pytest
import torch

from aiayn.acceleration import (
    cpu_attention,
    onednn_linear_missing,
    quantize_int8,
    use_cpu_attention,
)
from aiayn.attention import MultiHeadAttention, fused_attention
from aiayn.decode import packing
from aiayn.decode.options import DecodingOptions
from aiayn.decode.packing import (
    PackedLinear,
    StackedSelfAttention,
    decoding_kernels,
    mkl_missing,
    pack_linear_layers,
    stack_self_attention,
    stacked_linear,
)
from aiayn.decode.search import beam_search, greedy_search
from aiayn.model import PositionwiseFeedForward, Transformer
from model_dirs import tiny_model


def attention_kernels(model: torch.nn.Module) -> set:
    return {m.kernel for m in model.modules() if isinstance(m, MultiHeadAttention)}


needs_onednn = pytest.mark.skipif(
    onednn_linear_missing() is not None, reason=f"no oneDNN packing: {onednn_linear_missing()}"
)
needs_mkl = pytest.mark.skipif(mkl_missing() is not None, reason=f"no MKL: {mkl_missing()}")
KERNELS = [pytest.param("onednn", marks=needs_onednn), pytest.param("mkl", marks=needs_mkl)]
PACKINGS = [  # (every other layer's kernel, the pre-softmax projection's)
    pytest.param(("onednn", "onednn"), marks=needs_onednn),
    pytest.param(("mkl", "mkl"), marks=needs_mkl),
    pytest.param(("mkl", "onednn"), marks=[needs_mkl, needs_onednn]),  # AMD's default
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (5, 16), (300, 16), (3, 7, 16), (2, 1, 16)])
def test_a_packed_linear_layer_computes_what_nn_linear_computes(
    kernel: str, bias: bool, shape: tuple[int, ...]
) -> None:
    linear = torch.nn.Linear(16, 24, bias=bias)
    packed = PackedLinear(linear, kernel=kernel)
    x = torch.randn(shape)
    with torch.inference_mode():
        got, expected = packed(x), linear(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # a copy: later updates of the original layer are not seen
        linear.weight.add_(1.0)
    torch.testing.assert_close(packed(x), got)
    torch.testing.assert_close(copy.deepcopy(packed)(x), got)  # a copy of the packed layer


def _packed_and_plain(kernels: tuple[str, str]) -> tuple[Transformer, torch.nn.Module]:
    model = tiny_model(60, dropout=0.0)
    kernel, output_kernel = kernels
    return model, pack_linear_layers(
        model, min_features=1, kernel=kernel, output_kernel=output_kernel
    )


@pytest.mark.parametrize("kernels", PACKINGS)
def test_packing_replaces_every_linear_layer_of_a_copy_and_leaves_the_model_alone(
    kernels: tuple[str, str],
) -> None:
    model, packed = _packed_and_plain(kernels)
    assert packed is not model
    assert [m for m in packed.modules() if type(m) is torch.nn.Linear] == []
    kernel, output_kernel = kernels
    assert type(packed.output_projection) is PackedLinear
    assert packed.output_projection.kernel == output_kernel
    others = [m for m in packed.modules() if type(m) is PackedLinear]
    assert {m.kernel for m in others if m is not packed.output_projection} == {kernel}
    layers = [*packed.encoder.layers, *packed.decoder.layers]
    assert sum(type(m) is PackedLinear for m in packed.modules()) == sum(
        type(m) is torch.nn.Linear for m in model.modules()
    ) - 2 * len(layers)  # one stacked [W^Q; W^K; W^V] per self-attention layer for three
    c = model.config
    assert all(
        type(m.self_attn) is StackedSelfAttention
        and type(m.self_attn.qkv_proj) is PackedLinear
        and m.self_attn.qkv_proj.out_features == c.n_heads * (2 * c.d_k + c.d_v)
        and m.self_attn.stacked_qkv_weights() is None
        and not hasattr(m.self_attn, "q_proj")  # not kept: only the stacked product runs
        for m in layers
    )
    assert all(type(m.cross_attn) is MultiHeadAttention for m in packed.decoder.layers)
    ffns = [m for m in packed.modules() if isinstance(m, PositionwiseFeedForward)]
    assert ffns and all(m.linear1.relu and not m.linear2.relu for m in ffns)
    x = torch.randn(5, model.config.d_model)
    assert all(m.activation(x) is x for m in ffns)  # the first product applied the ReLU
    assert model.output_projection.weight is model.tgt_embed.embedding.weight  # still tied
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert attentions and all(type(m) is MultiHeadAttention for m in attentions)
    assert all(type(m) is torch.nn.Linear for a in attentions for m in a.children())


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_packed_copy_keeps_the_models_attention_kernels(kernel: str) -> None:
    model = use_cpu_attention(tiny_model())
    packed = pack_linear_layers(model, min_features=1, kernel=kernel)
    assert packed is not model and attention_kernels(packed) == {cpu_attention}
    plain = pack_linear_layers(tiny_model(), min_features=1, kernel=kernel)
    assert attention_kernels(plain) == {fused_attention}


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_self_attention_projects_as_the_three_projections_did(kernel: str) -> None:
    torch.manual_seed(0)
    attention = MultiHeadAttention(d_model=16, n_heads=2, d_k=8, d_v=4).eval()
    linears = [attention.q_proj, attention.k_proj, attention.v_proj]
    packed = StackedSelfAttention(attention, PackedLinear(linears, kernel=kernel))
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    with torch.no_grad():
        for got, expected in [
            (packed.project_qkv(x), attention.project_qkv(x)),
            ((packed.project_query(x),), (attention.project_query(x),)),
            (packed.project_key_value(memory), attention.project_key_value(memory)),
            (packed(x, x), attention(x, x)),
            (packed(x, memory), attention(x, memory)),  # not self-attention: apart
        ]:
            for a, b in zip(got, expected, strict=True):
                if b is not None:
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_packed_product_of_stacked_layers_with_relu_is_their_outputs_side_by_side(
    kernel: str,
) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, n) for n in (8, 8, 4)]
    x = torch.randn(2, 3, 16)
    expected = torch.cat([m(x) for m in layers], dim=-1)
    with torch.no_grad():
        stacked = PackedLinear(layers, kernel=kernel)
        torch.testing.assert_close(stacked(x), expected, atol=1e-5, rtol=1e-5)
        relu = PackedLinear(layers, relu=True, kernel=kernel)
        torch.testing.assert_close(relu(x), expected.relu(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(copy.deepcopy(relu)(x), expected.relu(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="same input size"):
        PackedLinear([torch.nn.Linear(16, 8), torch.nn.Linear(8, 8)], kernel=kernel)
    with pytest.raises(ValueError, match=r"kernel \('blas'\) must be one of onednn, mkl"):
        PackedLinear(layers, kernel="blas")


def test_stacked_self_attention_for_int8_computes_the_models_function_in_one_product() -> None:
    """`stack_self_attention` (what `--int8` quantizes): the model's log-probs, decoding step
    and beams up to float32 rounding; quantized, each self-attention is one int8 product."""
    torch.manual_seed(0)
    model = tiny_model(60, dropout=0.0)
    stacked = stack_self_attention(copy.deepcopy(model))
    layers = [*stacked.encoder.layers, *stacked.decoder.layers]
    c = model.config
    assert all(
        type(m.self_attn) is StackedSelfAttention
        and type(m.self_attn.qkv_proj) is torch.nn.Linear
        and m.self_attn.qkv_proj.out_features == c.n_heads * (2 * c.d_k + c.d_v)
        for m in layers
    )
    assert all(type(m.cross_attn) is MultiHeadAttention for m in stacked.decoder.layers)
    src, tgt = torch.randint(4, 60, (3, 9)), torch.randint(4, 60, (3, 6))
    src[1, 5:] = c.pad_id
    ids = dict(bos_id=1, eos_id=2, pad_id=c.pad_id)
    options = DecodingOptions(max_len_a=0.0, max_len_b=12, beam_size=3)
    with torch.inference_mode():
        torch.testing.assert_close(stacked(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)
        beams = [
            [h.tokens for h in hyps] for hyps in beam_search(stacked, src, **ids, options=options)
        ]
        assert beams == [
            [h.tokens for h in hyps] for hyps in beam_search(model, src, **ids, options=options)
        ]
    quantized = quantize_int8(stacked)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    assert all(type(m.self_attn.qkv_proj) is dynamic for m in [*quantized.encoder.layers])
    assert sum(type(m) is dynamic for m in quantized.modules()) == sum(
        type(m) is torch.nn.Linear for m in model.modules()
    ) - 2 * len(layers)  # one int8 product per self-attention layer for three
    with torch.inference_mode():
        torch.testing.assert_close(
            quantized(src, tgt).log_softmax(-1), model(src, tgt).log_softmax(-1), atol=0.02,
            rtol=0.03,
        )  # fmt: skip
    with pytest.raises(ValueError, match="same input size"):
        stacked_linear([torch.nn.Linear(16, 8), torch.nn.Linear(16, 8, bias=False)])


@pytest.mark.parametrize("kernels", PACKINGS)
def test_the_packed_model_gives_the_same_log_probs_and_translations(
    kernels: tuple[str, str],
) -> None:
    """Forward with padding, one decoding step, and beam and greedy search (twice, as a server
    calls it): the same as the plain model up to float32 rounding, the same tokens."""
    model, packed = _packed_and_plain(kernels)
    src = torch.randint(4, 60, (3, 9))
    src[1, 5:] = model.config.pad_id
    tgt = torch.randint(4, 60, (3, 6))
    ids = dict(bos_id=1, eos_id=2, pad_id=model.config.pad_id)
    options = DecodingOptions(max_len_a=0.0, max_len_b=12, beam_size=3)
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)
        memory, mask = model.encode(src)
        expected = model.decode_step(
            torch.ones(3, dtype=torch.long), model.init_cache(memory, mask, 4)
        )
        memory, mask = packed.encode(src)
        got = packed.decode_step(
            torch.ones(3, dtype=torch.long), packed.init_cache(memory, mask, 4)
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for _ in range(2):
            beams = [
                [h.tokens for h in hyps]
                for hyps in beam_search(packed, src, **ids, options=options)
            ]
            assert beams == [
                [h.tokens for h in hyps] for hyps in beam_search(model, src, **ids, options=options)
            ]
            greedy = [h.tokens for h in greedy_search(packed, src, **ids, options=options)]
            assert greedy == [h.tokens for h in greedy_search(model, src, **ids, options=options)]


@pytest.mark.parametrize("kernels", PACKINGS)
def test_packing_in_place_packs_the_model_itself_as_the_copy_is_packed(
    kernels: tuple[str, str],
) -> None:
    """`in_place` (a translator's freshly loaded model): the model itself comes back, with the
    copy's layers and kernels and the same log-probs; nothing is cloned first."""
    model, copied = _packed_and_plain(kernels)
    kernel, output_kernel = kernels
    plain = copy.deepcopy(model)
    packed = pack_linear_layers(
        model, min_features=1, kernel=kernel, output_kernel=output_kernel, in_place=True
    )
    assert packed is model
    assert [type(m) for m in packed.modules()] == [type(m) for m in copied.modules()]
    assert [m.kernel for m in packed.modules() if type(m) is PackedLinear] == [
        m.kernel for m in copied.modules() if type(m) is PackedLinear
    ]
    src = torch.randint(4, 60, (3, 9))
    tgt = torch.randint(4, 60, (3, 6))
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, tgt), copied(src, tgt))
        torch.testing.assert_close(packed(src, tgt), plain(src, tgt), atol=1e-5, rtol=1e-5)


def test_without_onednn_packing_the_model_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert "not an x86-64 CPU" in (onednn_linear_missing() or "")
    assert "not an x86-64 CPU" in (mkl_missing() or "")
    assert decoding_kernels() is None and decoding_kernels(onednn=False) is None
    for kernel in ("onednn", "mkl"):
        assert pack_linear_layers(model, min_features=1, kernel=kernel) is model
    assert pack_linear_layers(model, min_features=1, kernel="mkl", output_kernel="onednn") is model
    monkeypatch.undo()
    assert pack_linear_layers(model) is model  # d_model 32: too small to gain
    assert pack_linear_layers(model.to(torch.bfloat16), min_features=1) is model  # float32 only


@needs_onednn
def test_only_layers_with_enough_features_on_both_sides_are_packed() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    packed = pack_linear_layers(model)
    assert [type(m).__name__ for m in packed] == ["PackedLinear", "Linear"]


def test_padded_rows_round_up_by_at_most_an_eighth_to_8_sizes_per_octave() -> None:
    for m in range(1, 5000):
        assert m <= packing.padded_rows(m) <= max(m, m * 9 // 8), m
    assert [packing.padded_rows(m) for m in range(1, 17)] == list(range(1, 17))
    assert {packing.padded_rows(m) for m in range(1024, 2048)} == set(range(1024, 2049, 128))


@needs_onednn
def test_a_packed_layer_at_a_padded_row_count_gives_the_rows_it_was_given() -> None:
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(2, 37, 16)  # 74 rows, padded to 80 for oneDNN
    assert packing.padded_rows(74) == 80
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_by_default_onednn_runs_the_vocabulary_product_off_intel_cpus_and_mkl_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "onednn_linear_missing", lambda: None)
    monkeypatch.setattr(packing, "mkl_missing", lambda: None)
    monkeypatch.setattr(packing, "cpu_vendor", lambda: "GenuineIntel")
    # MKL, PyTorch's own, is the faster there
    assert not packing.onednn_pays_for_output_projection()
    assert decoding_kernels() == ("mkl", "mkl")
    assert decoding_kernels(onednn=True) == ("onednn", "onednn")
    for vendor in ("AuthenticAMD", None):
        monkeypatch.setattr(packing, "cpu_vendor", lambda v=vendor: v)
        assert packing.onednn_pays_for_output_projection()
        assert decoding_kernels() == ("mkl", "onednn")  # oneDNN for the vocabulary's product
        assert decoding_kernels(onednn=False) == ("mkl", "mkl")
        assert decoding_kernels(onednn=True) == ("onednn", "onednn")
    assert decoding_kernels().output_projection == "onednn"
    monkeypatch.setattr(packing, "mkl_missing", lambda: "PyTorch was built without MKL")
    assert decoding_kernels() == ("onednn", "onednn") and decoding_kernels(onednn=False) is None
    monkeypatch.setattr(packing, "mkl_missing", lambda: None)
    monkeypatch.setattr(packing, "onednn_linear_missing", lambda: "no oneDNN packing")
    assert decoding_kernels() == ("mkl", "mkl")  # an AMD CPU without oneDNN: MKL for all
    monkeypatch.setattr(packing, "onednn_linear_missing", lambda: None)
    monkeypatch.setattr(packing, "onednn_linear_missing", lambda: "not an x86-64 CPU")
    assert not packing.onednn_pays_for_output_projection()
