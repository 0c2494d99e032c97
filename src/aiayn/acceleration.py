"""What this machine can speed up: `torch.compile` where it can run (eager PyTorch where it
cannot), whether the CPU computes in bf16 natively, the attention kernels that run fastest on a
CPU (`use_cpu_attention`), weights pre-packed for the matrix products of CPU decoding, MKL's
or oneDNN's by layer (`pack_for_decoding`), oneDNN's products in float32 CPU training
(`OneDNNLinearProducts`), and int8 weights for decoding on a CPU (`quantize_int8`). (How many
threads decoding takes is `aiayn.runtime.decoding_threads`.)

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
import copy
import importlib.util
import logging
import os
import platform
import shutil
from collections.abc import Iterator, Sequence
from typing import NamedTuple

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


def maybe_compile(module: nn.Module, device: torch.device) -> nn.Module:
    """`torch.compile(module)`, or `module` itself (with a warning) where it cannot compile.

    A compilation that fails later, at the first call, raises, unless the program chose to fall
    back to eager execution there too: ``runtime.configure(compile_errors_fall_back=True)``
    (a process-wide TorchInductor setting), which ``aiayn train --compile`` does, so that a
    broken toolchain never stops a run; PyTorch then logs what failed.
    """
    reason = compiler_missing(device)
    if reason is not None:
        logger.warning("torch.compile is not available (%s): running eagerly", reason)
        return module
    return torch.compile(module)


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
    `bench/bench_train_kernels.py`), so training under `--cpu-bf16` runs it in float32, which
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


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of `model` whose `nn.Linear` layers hold int8 weights (dynamic quantization).

    Attention, layer norms and embeddings stay float32; the pre-softmax projection is quantized
    like every other linear layer (in the copy it no longer shares storage with the embedding).
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its successor
        return torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear}, dtype=torch.qint8, inplace=False
        )


def padded_rows(m: int) -> int:
    """`m` rounded up to one of 8 row counts per octave (at most 12.5% more; below 16, `m`).

    oneDNN builds a kernel for every new shape it sees (measured on 1 thread: 0.7 ms more than a
    call at a known row count for a 64→256 layer, 4.6 ms more for 512→2048;
    `bench/bench_gemm.py --new-shapes`), and keeps a cache of 1,024. Decoding meets many row
    counts (sentences × beams, batches of varying length), and a server meets new ones all day
    long; rounding them up bounds the kernels to 8 per octave per layer shape, which the cache
    holds, at the cost of a few padded rows.
    """
    if m < 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


KERNELS = ("onednn", "mkl")
"""The products `PackedLinear` can run on: oneDNN's on a weight in its blocked layout, or MKL's
sgemm on the weight stored transposed."""


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel ({kernel!r}) must be one of {', '.join(KERNELS)}")


class PackedLinear(nn.Module):
    """An `nn.Linear` for CPU inference whose weight is stored once in the layout its matrix
    product reads fastest.

    y = x Wᵀ + b, the same function as the layer it was made from, by one of two kernels:

    - ``"onednn"``: oneDNN's matrix product on a weight reordered once into its blocked layout
      (`torch.ops.mkldnn`, the kernels TorchInductor's frozen CPU graphs call). PyTorch's own
      float32 `nn.Linear` calls MKL's sgemm, which on AMD CPUs runs slower than oneDNN at 32
      to 4,096 rows (BENCHMARKS.md, bench/bench_gemm.py); CTranslate2 calls oneDNN on AMD
      CPUs for the same reason.
    - ``"mkl"``: MKL's sgemm on Wᵀ stored contiguous, (in, out). `nn.Linear` hands MKL a
      transposed view of W (its "NT" product); the same product on Wᵀ as stored ("NN") took
      0.6-0.9x the time at decoding shapes on an Intel Xeon, one thread (4 to 128 rows, the
      Bible recipe's layers: a microbenchmark, BENCHMARKS.md).

    Results differ from `nn.Linear` only by float32 rounding (another summation order, for
    some shapes).

    Two fusions save a little of a beam-4 step (`bench/bench_decode.py --fusions` measures it):
    several layers that read the same input are one product of their stacked weights (their
    outputs side by side: self-attention's W^Q, W^K, W^V), and with `relu=True` the product
    applies the ReLU of Eq. 2 itself (oneDNN's post-op; after MKL's product, in place),
    y = max(0, x Wᵀ + b).

    The stored weight is a copy: it never sees later updates of the original layer, so it
    belongs to a model that only decodes (`pack_linear_layers` makes one).
    """

    PACKED_FOR_ROWS = 128
    """Rows oneDNN's weight layout is chosen for; any number of rows runs (measured: 32 to
    1024 give the same speed from 4 to 768 rows, 1 is slower)."""

    def __init__(
        self, linear: nn.Linear | list[nn.Linear], relu: bool = False, kernel: str = "onednn"
    ) -> None:
        super().__init__()
        _check_kernel(kernel)
        linears = linear if isinstance(linear, list) else [linear]
        has_bias = [m.bias is not None for m in linears]
        if len({m.in_features for m in linears}) != 1 or len(set(has_bias)) != 1:
            raise ValueError("stacked layers need the same input size, all with a bias or none")
        self.in_features = linears[0].in_features
        self.out_features = sum(m.out_features for m in linears)
        self.relu = relu
        self.kernel = kernel
        weight = torch.cat([m.weight.detach().float() for m in linears]).contiguous()
        if kernel == "onednn":
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                weight, self.PACKED_FOR_ROWS
            )
        else:
            self.packed_weight = weight.t().contiguous()  # (in, out)
        self.bias = None
        if has_bias[0]:
            self.bias = torch.cat([m.bias.detach().float() for m in linears]).clone()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "mkl":
            if self.bias is None:
                y = rows @ self.packed_weight
            else:
                y = torch.addmm(self.bias, rows, self.packed_weight)
            if self.relu:
                y = y.relu_()
            return y.view(*x.shape[:-1], self.out_features)
        m = rows.size(0)
        padded = padded_rows(m)
        if padded != m:
            rows = F.pad(rows, (0, 0, 0, padded - m))
        post_op = "relu" if self.relu else "none"
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, post_op, [], "")
        return y[:m].view(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy that shares the packed weight: nothing writes to it, and oneDNN's opaque
        tensors cannot be copied."""
        clone = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(clone)
        clone.in_features, clone.out_features = self.in_features, self.out_features
        clone.relu, clone.kernel = self.relu, self.kernel
        clone.packed_weight = self.packed_weight
        clone.bias = None if self.bias is None else self.bias.clone()
        clone.train(self.training)
        return clone

    def extra_repr(self) -> str:
        bias = self.bias is not None
        relu = ", relu=True" if self.relu else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"
            f"{relu}, kernel={self.kernel!r}"
        )


class PackedSelfAttention(MultiHeadAttention):
    """Self-attention in a decoding copy (`pack_linear_layers`): [W^Q; W^K; W^V] as one
    packed product (`qkv_proj`, a `PackedLinear`), which `project_qkv` uses instead of the
    three.

    The same function as the layer it was made from, up to float32 rounding (the packed
    weights are a copy: `PackedLinear`). The three projections stay, for `project_query` and
    `project_key_value` (`pack_linear_layers` packs them apart too: a second copy of those
    weights, 3·d_model² floats per layer).
    """

    def __init__(self, attention: MultiHeadAttention, kernel: str = "onednn") -> None:
        """`attention` (its projections and kernel shared, not copied) with its stacked
        product packed for `kernel` (`PackedLinear`); its three projections must be
        `nn.Linear`."""
        nn.Module.__init__(self)  # not MultiHeadAttention's: the layers are `attention`'s
        self.n_heads, self.d_k, self.d_v = attention.n_heads, attention.d_k, attention.d_v
        self.attention_dropout = attention.attention_dropout
        self.q_proj, self.k_proj, self.v_proj = attention.q_proj, attention.k_proj, attention.v_proj
        self.out_proj = attention.out_proj
        self.kernel = attention.kernel
        self.qkv_proj = PackedLinear(
            [attention.q_proj, attention.k_proj, attention.v_proj], kernel=kernel
        )
        self.train(attention.training)

    def stacked_qkv_weights(self) -> None:
        """None: the stacked product is `qkv_proj`, packed, not weights for `F.linear`."""
        return None

    def project_qkv(
        self, x: Tensor, stacked: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) → q, k, v (B, H, T, d) in one packed product (`stacked` is None here:
        `stacked_qkv_weights`)."""
        return self.split_qkv(self.qkv_proj(x))


def onednn_linear_missing() -> str | None:
    """Why `pack_linear_layers` cannot pack here, or None if it can.

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


def cpu_vendor() -> str | None:
    """The CPU's vendor as Linux reports it ("GenuineIntel", "AuthenticAMD", ...), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def mkl_missing() -> str | None:
    """Why `PackedLinear`'s ``"mkl"`` kernel would not run on MKL here, or None if it would:
    PyTorch's float32 products are MKL's on x86-64 builds only."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if not torch.backends.mkl.is_available():
        return "PyTorch was built without MKL"
    return None


class DecodingKernels(NamedTuple):
    """The `PackedLinear` kernels of float32 CPU decoding (`decoding_kernels`)."""

    layers: str
    """Every linear layer's but the pre-softmax projection's."""
    output_projection: str
    """The pre-softmax projection's (d_model → the vocabulary)."""


def decoding_kernels(onednn: bool | None = None) -> DecodingKernels | None:
    """The kernels that float32 CPU decoding packs its linear layers for (`PackedLinear`), or
    None to leave them `nn.Linear`.

    - ``onednn=True``: oneDNN for every layer; ``onednn=False``: MKL for every layer (None
      where PyTorch's products are not MKL's, `mkl_missing`).
    - None (nobody says): where `packing_pays`, oneDNN for the pre-softmax projection and MKL
      for the rest, else MKL for all. On an AMD EPYC with AVX2 the products that keep or
      narrow the width (d_model → d_model, d_ff → d_model) ran faster on MKL's and the
      projection onto the vocabulary faster on oneDNN's (one thread, at decoding's row
      counts: a microbenchmark, BENCHMARKS.md). Decoding the 809 Bible dev sentences, beam 4,
      with the same outputs: whole `aiayn translate` commands on two cores took 0.83x (2+2
      layers) and 0.92x (3+3) the time of oneDNN for all; one thread, in one process
      (`bench/bench_kernels_ab.py`), 0.90-0.95x; for a random-weight `base`, within 2%.
    """
    mkl = mkl_missing() is None
    if onednn is True:
        return DecodingKernels("onednn", "onednn")
    if onednn is False or not packing_pays():
        return DecodingKernels("mkl", "mkl") if mkl else None
    if not mkl:
        return DecodingKernels("onednn", "onednn")
    return DecodingKernels("mkl", "onednn")


def packing_pays() -> bool:
    """Whether float32 decoding should run products on oneDNN-packed weights here when nobody
    says (`decoding_kernels`: then the pre-softmax projection's): on x86-64 CPUs other than
    Intel's.

    PyTorch's own float32 products are MKL's, and MKL runs its fastest kernels on Intel CPUs.
    Measured, the Bible recipe's 2+2 model decoding the 809-sentence Bible dev set with beam 4
    on one thread (what each decoding worker runs), batches alternated in one process: on the
    Intel Xeon (AMX) MKL for every layer took 0.94-0.95x the time of oneDNN for every layer,
    with the same outputs (BENCHMARKS.md); on an AMD EPYC with AVX2, MKL on weights stored
    transposed for every layer 0.97-1.02x, and oneDNN for the pre-softmax projection alone
    0.90-0.95x (`decoding_kernels`). Where the vendor is unknown, or packing cannot run
    (`onednn_linear_missing`), the answer follows that.
    """
    if onednn_linear_missing() is not None:
        return False
    return cpu_vendor() != "GenuineIntel"


MIN_PACKED_FEATURES = 256
"""`pack_linear_layers` packs a layer only when both its sides have at least this many features.

Below it the call's fixed cost outweighs the faster product. Measured with beam 4 over 20
batches of 1–32 sentences of varying length on 1 thread (`bench/bench_decode.py --varied`): the
`tiny` preset's 64-wide layers ran slower packed, `small` (256 wide) and `base` faster (when
measured on an AMD EPYC; the beam-4 rows are to be re-measured at the current search)."""


def pack_linear_layers(
    model: nn.Module,
    min_features: int | None = None,
    kernel: str = "onednn",
    output_kernel: str | None = None,
) -> nn.Module:
    """A copy of float32 CPU `model` whose `nn.Linear` layers are `PackedLinear`, for decoding
    with `kernel` ("onednn" or "mkl"), the pre-softmax projection (`model.output_projection`)
    with `output_kernel` (None: `kernel`); `decoding_kernels` says which a translator uses.

    The same function up to float32 rounding (tests/test_acceleration.py compares log-probs and
    translations); `model` is left as it is. Only layers with at least `min_features` (default
    `MIN_PACKED_FEATURES`) inputs and outputs are packed. Where either kernel is unavailable
    (`onednn_linear_missing`, `mkl_missing`), for a model not in float32 on the CPU, or when no
    layer is that large, returns `model` itself. The pre-softmax projection is packed like
    every other linear layer (in the copy it no longer shares storage with the embedding).
    In the copy, a ReLU feed-forward layer's first product applies the ReLU
    (`PackedLinear(relu=True)`), and each self-attention layer is a `PackedSelfAttention`,
    its [W^Q; W^K; W^V] one packed product (encoder-decoder attention projects the query and
    the memory apart and stays a `MultiHeadAttention`). Attention kernels are `model`'s
    (`use_cpu_attention`).
    """
    from aiayn.model import ACTIVATION_FUNCTIONS, PositionwiseFeedForward

    smallest = MIN_PACKED_FEATURES if min_features is None else min_features

    def packs(m: nn.Module) -> bool:
        return type(m) is nn.Linear and min(m.in_features, m.out_features) >= smallest

    output_kernel = output_kernel or kernel
    for k in (kernel, output_kernel):
        _check_kernel(k)
        missing = onednn_linear_missing() if k == "onednn" else mkl_missing()
        if missing is not None:
            return model
    if not any(packs(m) for m in model.modules()):
        return model
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return model
    packed = copy.deepcopy(model)
    output_projections = {  # a Transformer's, also inside a wrapper
        id(m.output_projection) for m in packed.modules() if hasattr(m, "output_projection")
    }
    for layer in list(packed.modules()):
        attention = getattr(layer, "self_attn", None)  # an encoder or decoder layer's
        if isinstance(attention, MultiHeadAttention) and all(
            packs(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj)
        ):
            layer.self_attn = PackedSelfAttention(attention, kernel)
    for module in list(packed.modules()):
        relu_first = (
            isinstance(module, PositionwiseFeedForward)
            and module.activation is ACTIVATION_FUNCTIONS["relu"]
            and packs(module.linear1)
        )
        if relu_first:
            module.linear1 = PackedLinear(module.linear1, relu=True, kernel=kernel)
            module.activation = _applied_by_the_first_product
        for name, child in list(module.named_children()):
            if packs(child):
                k = output_kernel if id(child) in output_projections else kernel
                setattr(module, name, PackedLinear(child, kernel=k))
    return packed


def pack_for_decoding(model: nn.Module, onednn: bool | None = None) -> nn.Module:
    """`model` as float32 CPU decoding runs it (`Translator`): a copy packed for
    `decoding_kernels(onednn)` by `pack_linear_layers`, or `model` itself where nothing is
    packed."""
    kernels = decoding_kernels(onednn)
    if kernels is None:
        return model
    return pack_linear_layers(model, kernel=kernels.layers, output_kernel=kernels.output_projection)


def _applied_by_the_first_product(x: Tensor) -> Tensor:
    """The feed-forward layer's ReLU in a packed copy: its first product already applied it."""
    return x


class _OneDNNLinear(torch.autograd.Function):
    """y = x Wᵀ + b with oneDNN's products for y and dL/dx, MKL's for dL/dW.

    Measured at the batch shapes of the Bible recipe as of commit 0529388 (2,500–4,096 rows,
    `small`'s layers, AMD EPYC): oneDNN is faster than MKL's sgemm for the forward product and
    for dL/dx = dL/dy · W, and slower for dL/dW = dL/dyᵀ · x (whose inner dimension is the
    rows), which stays with `torch.mm` (`bench/bench_train_kernels.py`). Row counts are not
    padded as in `PackedLinear`: at these sizes a new one costs oneDNN about a millisecond, and
    padding to 8 sizes per octave cost more than it saved when tried. The weight is used as
    stored (its transpose a view), so a weight updated by the optimizer is always the current
    one: nothing is packed or cached.
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

    For training on x86-64 CPUs, where PyTorch's float32 linear layers call MKL's sgemm, slower
    there than oneDNN (BENCHMARKS.md). Only products at least `MIN_PACKED_FEATURES` wide on both
    sides; others, and anything under autocast (bf16 products already run on oneDNN), pass
    through. The same function up to float32 rounding: tests/test_acceleration.py compares
    losses and gradients with the plain path. The trainer enters it around each update's forward
    and backward with `--onednn` (`TrainConfig.onednn`), opt-in: on the Bible recipe as of commit
    0529388 (≤ 4096-token batches) it gave ~5% more tokens/s but ~2.9x the peak resident
    memory, because a real run's new batch shape at nearly every step makes oneDNN allocate per
    shape and the heap fragments (BENCHMARKS.md).
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
