"""What this machine can speed up: `torch.compile` where it can run (eager PyTorch where it
cannot), whether the CPU computes in bf16 natively, the attention kernels that run fastest on a
CPU (`use_cpu_attention`), oneDNN's products in float32 CPU training (`OneDNNLinearProducts`),
and int8 weights for decoding on a CPU (`quantize_int8`). (How many threads decoding takes is
`aiayn.runtime.decoding_threads`; the weights that CPU decoding packs for its matrix products
are `aiayn.decode.packing`'s.)

One module for the speed-ups that change how the model runs but not what it computes, so that
training and translation ask the same questions of the machine in the same place. The model's
own modules (`aiayn.attention`, `aiayn.model`) compute the paper's formulas and know nothing of
this one: each speed-up here is a hook that a caller installs on its model, or a copy of the
model made for decoding, and a test checks that it computes what the plain model computes.

TorchInductor turns the model into generated C++ (CPU) or Triton (CUDA) kernels, fusing the
element-wise work around the matrix products (dropout, residual adds, ReLU, LayerNorm). It needs
a C++ compiler on the CPU and Triton on a GPU; where either is missing, or compilation fails on
this machine, training and decoding run eagerly, with one warning, instead of stopping. The
compiled model computes the same function (tests/test_acceleration.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import platform
import shutil
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.attention import MultiHeadAttention, fused_attention, scaled_dot_product_attention

logger = logging.getLogger(__name__)


def compiler_missing(device: torch.device) -> str | None:
    """Why `torch.compile` cannot run on `device` here, or None if it can."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        return None
    if device.type != "cpu":
        return f"no compiler backend for {device.type}"
    candidates = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        return "no C++ compiler found (set CXX or install g++)"
    return None


def maybe_compile(
    module: nn.Module, device: torch.device, mode: str | None = None, dynamic: bool | None = None
) -> nn.Module:
    """`torch.compile(module)`, or `module` itself (with a warning) where it cannot compile.

    A compilation that fails later, at the first call, raises, unless the program chose to fall
    back to eager execution there too: ``runtime.configure(compile_errors_fall_back=True)``
    (a process-wide TorchInductor setting), which ``aiayn train --compile`` does, so that a
    broken toolchain never stops a run; PyTorch then logs what failed. `mode` and `dynamic` are
    torch.compile's: "reduce-overhead" replays CUDA graphs on a GPU (one recorded per input
    shape); ``dynamic=True`` compiles once for every shape, where None compiles the first shape
    as it is and every later one for any shape (twice).
    """
    reason = compiler_missing(device)
    if reason is not None:
        logger.warning("torch.compile is not available (%s): running eagerly", reason)
        return module
    return torch.compile(module, mode=mode, dynamic=dynamic)


def native_bf16_cpu() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX), as oneDNN sees it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


ONEDNN_KERNELS_FOR_BF16_TRAINING = 16
"""How many compiled kernels oneDNN keeps for `--cpu-bf16` training (its default: 1024).

Every batch of a real run has a new shape, so oneDNN compiles new bf16 kernels for nearly every
update, and its cache of them grows the process for hundreds of updates; 16 cuts the peak
resident memory of a real run at the same tokens/s (BENCHMARKS.md, the `fairseq-train`
section, measures both). Decoding reuses a few dozen kernels at every step, which a cache of
16 would compile again and again, so only training in bf16 limits it. The cache belongs to the
process: `aiayn train` sets it (``runtime.configure(onednn_kernels=...)``) before any oneDNN
work, where the user has not set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``."""


FEW_QUERIES = 8
"""`cpu_attention` computes Eq. 1 as written (two batched products) for at most this many
queries per sequence."""


def cpu_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> Tensor:
    """Eq. 1 (§3.2.1), `F.scaled_dot_product_attention`'s function, by the kernel that runs
    fastest on a CPU (an `attention.AttentionKernel`; `use_cpu_attention` installs it).

    Two cases differ from the fused kernel (`attention.fused_attention`), which runs everywhere
    else:

    - A few queries (`_few_queries_on_cpu`): incremental decoding asks for one query per
      hypothesis, or a sentence's W beams; two batched matrix products then beat the fused
      kernel, which is built for long sequences (Eq. 1 as written: a training batch of
      sentences that short takes them too, without attention dropout).
    - bf16 with gradients (`_bf16_training_on_cpu`): under ``--precision bf16`` the fused
      kernel runs in float32, faster there and more precise.

    Tests check each against the fused kernel (tests/test_acceleration.py).
    """
    if _few_queries_on_cpu(query, dropout_p):
        out, _ = scaled_dot_product_attention(query, key, value, attn_mask, is_causal=is_causal)
        return out
    if _bf16_training_on_cpu(query, key, value):
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()  # an additive mask in the inputs' dtype
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(
                query.float(), key.float(), value.float(), attn_mask=attn_mask,
                dropout_p=dropout_p, is_causal=is_causal,
            )  # fmt: skip
        return out.to(query.dtype)
    return fused_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
    )


def _few_queries_on_cpu(q: Tensor, dropout_p: float) -> bool:
    """Incremental decoding asks for a handful of queries per sequence (one per hypothesis, or
    the W beams of a sentence). On a CPU, two batched matrix products then beat the fused
    kernel, which is built for long sequences; the result is the same (a test checks)."""
    return q.device.type == "cpu" and q.size(-2) <= FEW_QUERIES and dropout_p == 0.0


def _bf16_training_on_cpu(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """bf16 inputs on a CPU with gradients wanted. There the fused kernel is 1.6-1.8x as
    slow forward + backward in bf16 as in float32 (its backward above all;
    an A/B of the two), so training under `--cpu-bf16` runs it in float32, which
    is also the more precise. Forward only (decoding), bf16 is as fast or faster and stays."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v))
    )


def use_cpu_attention(model: nn.Module) -> nn.Module:
    """`model`, every `MultiHeadAttention` of which now computes Eq. 1 with `cpu_attention`.

    In place. For a model that trains or decodes on a CPU: the trainer installs it there, and
    decoding on the models it loads (`decode.backends.pytorch.load_model_dirs`). Off the CPU,
    `cpu_attention` is the default fused kernel itself (`attention.fused_attention`), so a model
    moved to a GPU later runs what a model made there runs.
    """
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.kernel = cpu_attention
    return model


@contextlib.contextmanager
def using_cpu_attention(models: Sequence[nn.Module]) -> Iterator[None]:
    """`use_cpu_attention` on `models` for the block; their own kernels come back after it.

    For models that decoding borrows from its caller (`Translator.from_model`, validation BLEU
    during training): they decode as the models decoding loads do, and come back as they were.
    """
    attentions = [
        m for model in models for m in model.modules() if isinstance(m, MultiHeadAttention)
    ]
    kernels = [m.kernel for m in attentions]
    for m in attentions:
        m.kernel = cpu_attention
    try:
        yield
    finally:
        for m, kernel in zip(attentions, kernels, strict=True):
            m.kernel = kernel


def quantize_int8(model: nn.Module, *, in_place: bool = False) -> nn.Module:
    """A copy of `model` whose `nn.Linear` layers hold int8 weights (dynamic quantization);
    with `in_place`, `model` itself, for a caller that owns it (a translator's freshly loaded
    model), without cloning every weight first.

    Attention, layer norms and embeddings stay float32; the pre-softmax projection is quantized
    like every other linear layer (in the copy it no longer shares storage with the embedding).
    Each output row of a weight has a scale of its own (per channel, as CTranslate2's int8
    weights): one scale per weight, PyTorch's default, lets the largest row coarsen every
    other. With the recipe's model on the Bible dev books per-row scales score within 0.1 BLEU
    of float32, one scale per weight 0.5 under it (bench/results/translate.jsonl).
    """
    import warnings

    per_row = torch.ao.quantization.per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its successor
        return torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear: per_row}, dtype=torch.qint8, inplace=in_place
        )


def onednn_linear_missing() -> str | None:
    """Why oneDNN's linear products cannot run here (`OneDNNLinearProducts`, and the packed
    weights of `aiayn.decode.packing`), or None if they can.

    Only on x86-64 CPUs: elsewhere (Apple silicon, ARM servers) PyTorch's default BLAS is the
    fast one, and oneDNN's packed products were not measured.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "PyTorch was built without oneDNN (mkldnn) or it is disabled"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this PyTorch has no oneDNN linear weight packing"
    return None


MIN_PACKED_FEATURES = 256
"""`aiayn.decode.packing.pack_linear_layers` packs a layer only when both its sides have at least
this many features (and `OneDNNLinearProducts` sends only such products to oneDNN).

Below it the call's fixed cost outweighs the faster product. Measured with beam 4 over 20
batches of 1–32 sentences of varying length on 1 thread: the
`tiny` preset's 64-wide layers ran slower packed, `small` (256 wide) and `base` faster (when
measured on an AMD EPYC; the beam-4 rows are to be re-measured at the current search)."""


class _OneDNNLinear(torch.autograd.Function):
    """y = x Wᵀ + b with oneDNN's products for y and dL/dx, MKL's for dL/dW.

    Measured at the batch shapes of the Bible recipe (2,500–4,096 rows,
    `small`'s layers, AMD EPYC): oneDNN is faster than MKL's sgemm for the forward product and
    for dL/dx = dL/dy · W, and slower for dL/dW = dL/dyᵀ · x (whose inner dimension is the
    rows), which stays with `torch.mm`. Row counts are not
    padded as in `aiayn.decode.packing.PackedLinear`: at these sizes a new one costs oneDNN
    about a millisecond, and padding to 8 sizes per octave cost more than it saved when tried.
    The weight is used as stored (its transpose a view), so a weight updated by the optimizer
    is always the current one: nothing is packed or cached.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """rows (N, in) → (N, out); the caller reshapes, so that the output is no view."""
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad_y.contiguous()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.mkldnn._linear_pointwise(grad_rows, weight.t(), None, "none", [], "")
        if ctx.needs_input_grad[1]:
            grad_weight = grad_rows.t() @ rows
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


ONEDNN_CHECK_ROWS = (1, 37, 1029)
"""Row counts `onednn_products_wrong` tries: one row, a count no block size divides, and a
count past a thousand rows (full blocks and a tail)."""


def onednn_products_wrong(
    model: nn.Module, rows: tuple[int, ...] = ONEDNN_CHECK_ROWS
) -> str | None:
    """What is wrong with `_OneDNNLinear` on this CPU at `model`'s layer shapes, or None.

    `--onednn` trains with oneDNN's products for y = x Wᵀ + b and dL/dx = dL/dy · W, and their
    kernels differ by instruction set and cache sizes. (On an AMD EPYC with AVX2 a gradient from
    them once differed from `nn.Linear`'s by far more than float32 rounding; a later look found
    float32 rounding at ReLU's kink, one pre-activation's sign flipped, not a wrong product:
    tests/test_acceleration.py.) So that a wrong kernel cannot train a model, before a run uses
    them each distinct weight shape that `OneDNNLinearProducts` would send to oneDNN is tried at
    a few row counts against the same products in float64, and a relative error above 1e-4 of
    the largest entry is reported (float32 rounding at these sizes is below 1e-5).
    """
    shapes = {
        tuple(m.weight.shape)
        for m in model.modules()
        if isinstance(m, nn.Linear) and min(m.weight.shape) >= MIN_PACKED_FEATURES
    }
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in sorted(shapes):
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        for n in rows:
            x = torch.randn(n, in_features, generator=generator, requires_grad=True)
            grad_y = torch.randn(n, out_features, generator=generator)
            y = _OneDNNLinear.apply(x, weight, bias)
            y.backward(grad_y)
            exact_y = x.detach().double() @ weight.double().t() + bias.double()
            exact_grad_x = grad_y.double() @ weight.double()
            for what, got, exact in (("y", y.detach(), exact_y), ("dL/dx", x.grad, exact_grad_x)):
                error = (got.double() - exact).abs().max().item()
                scale = exact.abs().max().item()
                if not error <= 1e-4 * scale:  # also catches NaN
                    return (
                        f"oneDNN's product for {what} of a {out_features}x{in_features} layer at "
                        f"{n} rows is off by {error:.3g} (largest entry {scale:.3g})"
                    )
    return None


class OneDNNLinearProducts(torch.overrides.TorchFunctionMode):
    """While active, float32 CPU `F.linear` (every `nn.Linear`, and the products of the chunked
    loss) runs on oneDNN (`_OneDNNLinear`; without gradients the forward product alone).

    For training on x86-64 CPUs, where PyTorch's float32 linear layers call MKL's sgemm. Only
    products at least `MIN_PACKED_FEATURES` wide on both sides; others, and anything under
    autocast (bf16 products already run on oneDNN), pass through. The same function up to
    float32 rounding: tests/test_acceleration.py compares losses and gradients with the plain
    path. The trainer enters it around each update's forward and backward with `--onednn`
    (`TrainConfig.onednn`), opt-in: on the Bible corpus with ≤ 2048-token batches it gave 0.97x
    the tokens/s at 2.8x the peak resident memory on a 2-core AMD EPYC with AVX512-BF16
    (BENCHMARKS.md), because a real run's new batch shape at nearly every step makes oneDNN
    allocate per shape and the heap fragments (docs/settings.md).
    `onednn_linear_missing` says where it cannot run.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, bias = _linear_arguments(*args, **kwargs)
        if not _onednn_product(x, weight, bias):
            return func(*args, **kwargs)
        rows = x.reshape(-1, x.size(-1))
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias)
        ):
            y = _OneDNNLinear.apply(rows, weight, bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.size(0))


def _linear_arguments(
    input: Tensor, weight: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    return input, weight, bias


def _onednn_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and weight.dim() == 2
        and x.dim() >= 1
        and x.size(-1) == weight.size(1)  # else F.linear's own error
        and min(weight.shape) >= MIN_PACKED_FEATURES
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
    )
