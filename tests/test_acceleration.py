"""torch.compile with an eager fallback (the compiled model computes the same function); how
many threads decoding picks; the CPU's attention kernels compute Eq. 1 as the fused kernel does;
oneDNN-packed linear layers compute what `nn.Linear` computes."""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from aiayn import acceleration
from aiayn.acceleration import (
    FEW_QUERIES,
    PackedLinear,
    PackedSelfAttention,
    compiler_missing,
    cpu_attention,
    decoding_kernels,
    maybe_compile,
    mkl_missing,
    onednn_linear_missing,
    pack_linear_layers,
    use_cpu_attention,
    using_cpu_attention,
)
from aiayn.attention import MultiHeadAttention, fused_attention
from aiayn.config import preset
from aiayn.decode.options import DecodingOptions
from aiayn.decode.search import beam_search, greedy_search
from aiayn.model import PositionwiseFeedForward, Transformer

CPU = torch.device("cpu")


def test_without_a_cxx_compiler_the_model_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(acceleration.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler" in (compiler_missing(CPU) or "")
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="aiayn.acceleration"):
        assert maybe_compile(model, CPU) is model
    assert "running eagerly" in caplog.text


def test_compiling_leaves_the_fallback_to_the_program() -> None:
    """`maybe_compile` does not set TorchInductor's process-wide error fallback: the entry
    points do (``runtime.configure(compile_errors_fall_back=True)``, `aiayn train --compile`)."""
    before = torch._dynamo.config.suppress_errors
    maybe_compile(torch.nn.Linear(2, 2), CPU)  # compiles lazily, at the first call: cheap
    assert torch._dynamo.config.suppress_errors == before


def test_without_triton_cuda_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceleration.importlib.util, "find_spec", lambda name: None)
    assert compiler_missing(torch.device("cuda")) == "Triton is not installed"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++")
def test_compiled_training_step_equals_eager() -> None:
    """Forward (with padding) and gradients of the compiled model = the eager model's."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, dropout=0.0))
    src = torch.randint(4, 300, (3, 9))
    src[1, 6:] = model.config.pad_id
    tgt = torch.randint(4, 300, (3, 7))
    compiled = maybe_compile(model, CPU)
    assert compiled is not model
    eager_out = model(src, tgt)
    eager_out.square().mean().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(src, tgt)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


# -- the CPU's attention kernels ----------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_few_query_path_equals_the_fused_kernel(t: int, masked: bool) -> None:
    """Decoding steps (1 query per hypothesis, or a sentence's W beams) skip the fused kernel."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, t, 4), torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 6)
    mask = (
        (torch.arange(7) < torch.tensor([7, 3, 5])[:, None])[:, None, None, :] if masked else None
    )
    assert acceleration._few_queries_on_cpu(q, 0.0)
    out = cpu_attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("is_causal", [True, False])
def test_bf16_training_on_a_cpu_runs_attention_in_float32(is_causal: bool) -> None:
    """Under `--cpu-bf16` the fused kernel's backward is slow in bf16, so with gradients wanted
    attention is computed in float32 (more precise too) and returned in bf16: the output is the
    float32 one rounded, the gradients those of float32. Without gradients it stays bf16."""
    torch.manual_seed(0)
    t = FEW_QUERIES + 4  # the fused kernel's path (a few queries take two bmm)
    q, k, v = (torch.randn(3, 2, t, 16) for _ in range(3))
    mask = None if is_causal else torch.rand(3, 1, 1, t) > 0.2
    mask = mask if mask is None else mask.logical_or(torch.arange(t) == 0)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    full = [t.detach().float().requires_grad_() for t in low]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cpu_attention(*low, mask, is_causal=is_causal)
    expected = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=is_causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)
    out.float().sum().backward()
    expected.sum().backward()
    for a, b in zip(low, full, strict=True):
        torch.testing.assert_close(a.grad.float(), b.grad.bfloat16().float(), rtol=0, atol=0)
    assert not acceleration._bf16_training_on_cpu(*(t.detach() for t in low))
    with torch.no_grad():
        assert not acceleration._bf16_training_on_cpu(*low)


def attention_kernels(model: torch.nn.Module) -> set:
    return {m.kernel for m in model.modules() if isinstance(m, MultiHeadAttention)}


def test_a_plain_model_runs_the_fused_kernel_and_the_cpu_kernels_give_its_outputs(
    make_model,
) -> None:
    """Without a hook the model computes Eq. 1 with PyTorch's fused kernel; with
    `use_cpu_attention` (training and decoding on a CPU) the same outputs, gradients and
    decoding steps, the short target and the steps taking the few-query path."""
    torch.manual_seed(0)
    plain = make_model(dropout=0.0, attention_dropout=0.0)
    assert attention_kernels(plain) == {fused_attention}
    hooked = use_cpu_attention(copy.deepcopy(plain))
    assert attention_kernels(hooked) == {cpu_attention}
    assert attention_kernels(plain) == {fused_attention}  # the copy's alone
    src = torch.randint(4, 23, (3, 12))
    src[1, 7:] = plain.config.pad_id
    tgt = torch.randint(4, 23, (3, 6))  # at most FEW_QUERIES: the two-bmm path
    for model in (plain, hooked):
        model.train()
        model(src, tgt).square().mean().backward()
    for a, b in zip(plain.parameters(), hooked.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    with torch.inference_mode():
        for model in (plain, hooked):
            model.eval()
        torch.testing.assert_close(hooked(src, tgt), plain(src, tgt), atol=1e-5, rtol=1e-5)
        steps = []
        for model in (plain, hooked):
            memory, mask = model.encode(src)
            cache = model.init_cache(memory, mask, 4)
            steps.append([model.decode_step(torch.full((3,), t), cache) for t in (1, 5, 9)])
        for a, b in zip(*steps, strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_cpu_kernels_for_a_block_give_the_models_their_own_back(make_model) -> None:
    models = [make_model(), make_model()]
    with pytest.raises(RuntimeError, match="inside"), using_cpu_attention(models):
        assert all(attention_kernels(m) == {cpu_attention} for m in models)
        raise RuntimeError("inside")
    assert all(attention_kernels(m) == {fused_attention} for m in models)
    use_cpu_attention(models[0])
    with using_cpu_attention(models):
        pass
    assert attention_kernels(models[0]) == {cpu_attention}
    assert attention_kernels(models[1]) == {fused_attention}


# -- oneDNN-packed linear layers -------------------------------------------------------------

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


def _packed_and_plain(make_model, kernels: tuple[str, str]) -> tuple[Transformer, torch.nn.Module]:
    model = make_model(src_vocab_size=60, tgt_vocab_size=60, dropout=0.0).eval()
    kernel, output_kernel = kernels
    return model, pack_linear_layers(
        model, min_features=1, kernel=kernel, output_kernel=output_kernel
    )


@pytest.mark.parametrize("kernels", PACKINGS)
def test_packing_replaces_every_linear_layer_of_a_copy_and_leaves_the_model_alone(
    make_model, kernels: tuple[str, str]
) -> None:
    model, packed = _packed_and_plain(make_model, kernels)
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
    ) + len(layers)  # and one stacked [W^Q; W^K; W^V] per self-attention layer
    assert all(
        type(m.self_attn) is PackedSelfAttention
        and m.self_attn.qkv_proj.out_features == 3 * m.self_attn.q_proj.out_features
        and m.self_attn.stacked_qkv_weights() is None
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
def test_the_packed_copy_keeps_the_models_attention_kernels(make_model, kernel: str) -> None:
    model = use_cpu_attention(make_model())
    packed = pack_linear_layers(model, min_features=1, kernel=kernel)
    assert packed is not model and attention_kernels(packed) == {cpu_attention}
    plain = pack_linear_layers(make_model(), min_features=1, kernel=kernel)
    assert attention_kernels(plain) == {fused_attention}


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


@pytest.mark.parametrize("kernels", PACKINGS)
def test_the_packed_model_gives_the_same_log_probs_and_translations(
    make_model, kernels: tuple[str, str]
) -> None:
    """Forward with padding, one decoding step, and beam and greedy search (twice, as a server
    calls it): the same as the plain model up to float32 rounding, the same tokens."""
    model, packed = _packed_and_plain(make_model, kernels)
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


def test_without_onednn_packing_the_model_is_used_as_it_is(
    monkeypatch: pytest.MonkeyPatch, make_model
) -> None:
    model = make_model().eval()
    monkeypatch.setattr(acceleration.platform, "machine", lambda: "arm64")
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
        assert m <= acceleration.padded_rows(m) <= max(m, m * 9 // 8), m
    assert [acceleration.padded_rows(m) for m in range(1, 17)] == list(range(1, 17))
    assert {acceleration.padded_rows(m) for m in range(1024, 2048)} == set(range(1024, 2049, 128))


@needs_onednn
def test_a_packed_layer_at_a_padded_row_count_gives_the_rows_it_was_given() -> None:
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(2, 37, 16)  # 74 rows, padded to 80 for oneDNN
    assert acceleration.padded_rows(74) == 80
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


# -- oneDNN products in training --------------------------------------------------------------


def _loss_and_grads(model: Transformer, products) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    src = torch.randint(4, 300, (6, 9))
    tgt = torch.randint(4, 300, (6, 11))
    model.zero_grad(set_to_none=True)
    with products:
        sums = model(src, tgt[:, :-1], tgt[:, 1:], label_smoothing=0.1)
        sums.loss.backward()
    return sums.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_onednn
@pytest.mark.parametrize("share", ["all", "none"])
def test_onednn_products_give_the_loss_and_gradients_of_the_plain_path(make_model, share) -> None:
    """Every linear layer at least 256 wide, and the chunked loss's two products, run on oneDNN;
    the loss and every gradient equal those of `nn.Linear`, twice in a row and after an Adam
    step (the products read the weights as they are now).

    GELU, not ReLU: at ReLU's kink float32 rounding alone can flip a pre-activation's sign
    between two correct products, and with it a whole gradient entry. On an AMD EPYC with AVX2
    one pre-activation of -1.0e-7 (float64) did so, and the last decoder layer's first
    feed-forward weight gradient differed by 6% between two paths that each match float64."""
    model = make_model(
        src_vocab_size=300, tgt_vocab_size=300, d_model=256, d_ff=512, n_heads=4,
        dropout=0.0, attention_dropout=0.0, share_embeddings=share, activation="gelu",
    ).train()  # fmt: skip
    wrong = acceleration.onednn_products_wrong(model)
    if wrong is not None:  # the trainer refuses --onednn here (the next tests)
        pytest.skip(f"oneDNN's products are wrong on this CPU: {wrong}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        for _ in range(2):
            with torch.profiler.profile() as prof:
                loss, grads = _loss_and_grads(model, acceleration.OneDNNLinearProducts())
            plain_loss, plain_grads = _loss_and_grads(model, contextlib.nullcontext())
            calls = {e.key: e.count for e in prof.key_averages()}
            assert calls.get("mkldnn::_linear_pointwise", 0) > 0
            torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
            largest = max(g.abs().max() for g in plain_grads.values())
            for name, grad in plain_grads.items():  # k_proj.bias: exactly 0 but for rounding
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6 * largest)
        optimizer.step()


@needs_onednn
def test_the_onednn_check_finds_a_wrong_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """`onednn_products_wrong` compares oneDNN's y and dL/dx with float64 at every wide layer
    shape; a product that is off in a tail of rows (as a kernel bug would be) is reported."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(64, 64))
    assert acceleration.onednn_products_wrong(model) is None
    assert acceleration.onednn_products_wrong(torch.nn.Linear(64, 64)) is None  # nothing wide
    real = torch.ops.mkldnn._linear_pointwise

    class Ops:
        @staticmethod
        def _linear_pointwise(x, weight, bias, *args):
            y = real(x, weight, bias, *args)
            if weight.size(0) == 256 and x.size(0) > 1:  # dL/dx's product (W transposed)
                y[-5:] += 0.01  # a wrong tail of rows
            return y

    monkeypatch.setattr(acceleration.torch.ops, "mkldnn", Ops)
    wrong = acceleration.onednn_products_wrong(model)
    assert wrong is not None and "dL/dx of a 512x256 layer at 37 rows" in wrong


@needs_onednn
def test_onednn_products_leave_narrow_layers_bf16_and_other_functions_alone() -> None:
    wide, narrow = torch.nn.Linear(256, 256), torch.nn.Linear(64, 256)
    x, x_narrow = torch.randn(3, 5, 256, requires_grad=True), torch.randn(7, 64)
    with torch.profiler.profile() as prof, acceleration.OneDNNLinearProducts():
        y = wide(x)
        narrow(x_narrow)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert wide(x).dtype == torch.bfloat16
        y.sum().backward()
        with torch.no_grad():
            torch.testing.assert_close(wide(x), y, rtol=0, atol=0)  # no autograd: the same
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls["mkldnn::_linear_pointwise"] == 3  # wide forward, its dL/dx, no_grad forward
    torch.testing.assert_close(y, torch.nn.functional.linear(x, wide.weight, wide.bias))
    expected = torch.ones(15, 256) @ wide.weight
    torch.testing.assert_close(x.grad, expected.view(3, 5, 256), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_training_runs_its_products_on_onednn_only_when_asked() -> None:
    """The trainer's choice (`uses_onednn`): with --onednn (off by default), in float32 on an
    x86-64 CPU; not under bf16 autocast, with torch.compile or on CUDA."""
    from aiayn.config import TrainConfig
    from aiayn.train.update import uses_onednn

    cpu = torch.device("cpu")
    assert not uses_onednn(cpu, onednn=TrainConfig.onednn, bf16=False, compile=False)
    assert uses_onednn(cpu, onednn=True, bf16=False, compile=False)
    assert not uses_onednn(cpu, onednn=True, bf16=True, compile=False)
    assert not uses_onednn(cpu, onednn=True, bf16=False, compile=True)
    assert not uses_onednn(torch.device("cuda"), onednn=True, bf16=False, compile=False)


@needs_onednn
def test_the_chunked_loss_runs_both_its_products_on_onednn() -> None:
    """h Wᵀ and dL/dlogits · W of every chunk (dL/dW stays with torch.mm): the same loss and
    gradients as without the mode."""
    from aiayn.loss import projected_label_smoothed_loss

    torch.manual_seed(0)
    hidden = torch.randn(2, 25, 256, requires_grad=True)
    weight = torch.randn(300, 256, requires_grad=True)
    target = torch.randint(4, 300, (2, 25))
    results = []
    for products in (acceleration.OneDNNLinearProducts(), contextlib.nullcontext()):
        with torch.profiler.profile() as prof, products:
            sums = projected_label_smoothed_loss(
                hidden, weight, target, epsilon=0.1, pad_id=0, chunk_tokens=16
            )
            grads = torch.autograd.grad(sums.loss, (hidden, weight))
        calls = {e.key: e.count for e in prof.key_averages()}
        results.append((sums.loss, grads, calls.get("mkldnn::_linear_pointwise", 0)))
    (loss, grads, calls), (plain_loss, plain_grads, plain_calls) = results
    assert (calls, plain_calls) == (2 * 4, 0)  # 50 rows: 4 chunks of ≤ 16
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for got, expected in zip(grads, plain_grads, strict=True):  # float32 rounding of sums
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())


def test_by_default_onednn_runs_the_vocabulary_product_off_intel_cpus_and_mkl_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(acceleration, "onednn_linear_missing", lambda: None)
    monkeypatch.setattr(acceleration, "mkl_missing", lambda: None)
    monkeypatch.setattr(acceleration, "cpu_vendor", lambda: "GenuineIntel")
    assert not acceleration.packing_pays()  # MKL, PyTorch's own, is the faster there
    assert decoding_kernels() == ("mkl", "mkl")
    assert decoding_kernels(onednn=True) == ("onednn", "onednn")
    for vendor in ("AuthenticAMD", None):
        monkeypatch.setattr(acceleration, "cpu_vendor", lambda v=vendor: v)
        assert acceleration.packing_pays()
        assert decoding_kernels() == ("mkl", "onednn")  # oneDNN for the vocabulary's product
        assert decoding_kernels(onednn=False) == ("mkl", "mkl")
        assert decoding_kernels(onednn=True) == ("onednn", "onednn")
    assert decoding_kernels().output_projection == "onednn"
    monkeypatch.setattr(acceleration, "mkl_missing", lambda: "PyTorch was built without MKL")
    assert decoding_kernels() == ("onednn", "onednn") and decoding_kernels(onednn=False) is None
    monkeypatch.setattr(acceleration, "mkl_missing", lambda: None)
    monkeypatch.setattr(acceleration, "onednn_linear_missing", lambda: "no oneDNN packing")
    assert decoding_kernels() == ("mkl", "mkl")  # an AMD CPU without oneDNN: MKL for all
    monkeypatch.setattr(acceleration, "onednn_linear_missing", lambda: None)
    monkeypatch.setattr(acceleration, "onednn_linear_missing", lambda: "not an x86-64 CPU")
    assert not acceleration.packing_pays()
