"""torch.compile with an eager fallback (the compiled model computes the same function); how
many threads decoding picks; the CPU's attention kernels compute Eq. 1 as the fused kernel does;
oneDNN's products in training give the loss and gradients of `nn.Linear`. (The packed linear
layers of decoding: tests/decode/test_packing.py.)"""

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
    compiler_missing,
    cpu_attention,
    maybe_compile,
    onednn_linear_missing,
    quantize_int8,
    use_cpu_attention,
    using_cpu_attention,
)
from aiayn.attention import MultiHeadAttention, fused_attention
from aiayn.model import Transformer
from model_dirs import tiny_model

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
    model = tiny_model(300, preset="tiny", seed=0, dropout=0.0).train()
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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++")
def test_compiled_loss_is_the_whole_logits_loss_in_the_graph() -> None:
    """Compiled, `forward` with a target scores the whole logits inside the graph (the eager
    path's chunked loss would split it): the same loss sums and gradients, with padding and
    with the empty rows of fixed batch shapes; one graph, no break."""
    model = tiny_model(300, preset="tiny", seed=0, dropout=0.0).train()
    src = torch.randint(4, 300, (4, 9))
    src[1, 6:] = model.config.pad_id
    src[3, 1:] = model.config.pad_id  # an empty row: EOS-like source, no label
    tgt = torch.randint(4, 300, (4, 8))
    target = torch.randint(4, 300, (4, 8))
    target[0, 5:] = model.config.pad_id
    target[3] = model.config.pad_id

    def loss_and_grads(m: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        sums = m(src, tgt, target, label_smoothing=0.1, src_padded=True)
        sums.loss.backward()
        return [sums.loss.detach(), sums.nll, sums.tokens], [p.grad for p in model.parameters()]

    eager = loss_and_grads(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(src, tgt, target, label_smoothing=0.1, src_padded=True)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = loss_and_grads(maybe_compile(model, CPU))
    for got, want in zip(compiled[0], eager[0], strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


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


@pytest.mark.parametrize(("is_causal", "additive"), [(True, False), (False, False), (False, True)])
def test_bf16_training_on_a_cpu_runs_attention_in_float32(is_causal: bool, additive: bool) -> None:
    """Under `--cpu-bf16` the fused kernel's backward is slow in bf16, so with gradients wanted
    attention is computed in float32 (more precise too) and returned in bf16: the output is the
    float32 one rounded, the gradients those of float32. Without gradients it stays bf16. A
    mask in the additive form (as a decoding step's cache lays it out, in the model's dtype)
    is taken to float32 with the inputs."""
    torch.manual_seed(0)
    t = FEW_QUERIES + 4  # the fused kernel's path (a few queries take two bmm)
    q, k, v = (torch.randn(3, 2, t, 16) for _ in range(3))
    mask = None if is_causal else torch.rand(3, 1, 1, t) > 0.2
    mask = mask if mask is None else mask.logical_or(torch.arange(t) == 0)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    full = [t.detach().float().requires_grad_() for t in low]
    given = mask
    if additive:
        given = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill_(~mask, float("-inf"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cpu_attention(*low, given, is_causal=is_causal)
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


def test_a_plain_model_runs_the_fused_kernel_and_the_cpu_kernels_give_its_outputs() -> None:
    """Without a hook the model computes Eq. 1 with PyTorch's fused kernel; with
    `use_cpu_attention` (training and decoding on a CPU) the same outputs, gradients and
    decoding steps, the short target and the steps taking the few-query path."""
    torch.manual_seed(0)
    plain = tiny_model(dropout=0.0, attention_dropout=0.0)
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


def test_cpu_kernels_for_a_block_give_the_models_their_own_back() -> None:
    models = [tiny_model(), tiny_model()]
    with pytest.raises(RuntimeError, match="inside"), using_cpu_attention(models):
        assert all(attention_kernels(m) == {cpu_attention} for m in models)
        raise RuntimeError("inside")
    assert all(attention_kernels(m) == {fused_attention} for m in models)
    use_cpu_attention(models[0])
    with using_cpu_attention(models):
        pass
    assert attention_kernels(models[0]) == {cpu_attention}
    assert attention_kernels(models[1]) == {fused_attention}


# -- oneDNN products in training --------------------------------------------------------------

needs_onednn = pytest.mark.skipif(
    onednn_linear_missing() is not None, reason=f"no oneDNN packing: {onednn_linear_missing()}"
)


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
def test_onednn_products_give_the_loss_and_gradients_of_the_plain_path(share) -> None:
    """Every linear layer at least 256 wide, and the chunked loss's two products, run on oneDNN;
    the loss and every gradient equal those of `nn.Linear`, twice in a row and after an Adam
    step (the products read the weights as they are now).

    GELU, not ReLU: at ReLU's kink float32 rounding alone can flip a pre-activation's sign
    between two correct products, and with it a whole gradient entry. On an AMD EPYC with AVX2
    one pre-activation of -1.0e-7 (float64) did so, and the last decoder layer's first
    feed-forward weight gradient differed by 6% between two paths that each match float64."""
    model = tiny_model(
        300, d_model=256, d_ff=512, n_heads=4,
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


def test_int8_weights_have_a_scale_per_row_so_a_large_row_leaves_the_others_fine() -> None:
    """One scale per weight would be set by its largest row and round every small row coarsely;
    a scale per row keeps each row's own precision."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight[0] *= 100  # one row far larger than the rest
    x = torch.randn(16, 64)
    per_tensor = copy.deepcopy(linear)
    per_tensor.qconfig = torch.ao.quantization.default_dynamic_qconfig
    with torch.inference_mode():
        exact = linear(x)[:, 1:]
        [per_row_layer] = quantize_int8(torch.nn.Sequential(linear))
        assert per_row_layer.weight().qscheme() == torch.per_channel_affine
        per_row_error = (per_row_layer(x)[:, 1:] - exact).abs().max()
        [per_tensor_layer] = quantize_int8(torch.nn.Sequential(per_tensor))
        per_tensor_error = (per_tensor_layer(x)[:, 1:] - exact).abs().max()
    assert per_row_error < per_tensor_error / 10
