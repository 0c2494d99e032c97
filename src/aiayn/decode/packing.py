"""The weights of a model laid out for the matrix products of float32 decoding on a CPU.

Every linear layer of §3.1–3.4 computes y = x Wᵀ + b: the attention projections W^Q, W^K, W^V
and W^O (§3.2.2), the two of the feed-forward network (Eq. 2, §3.3) and the pre-softmax
projection onto the vocabulary (§3.4). Decoding runs these products at every step on weights
that never change, so the model it runs can be a copy that stores each weight once in the layout
its product reads fastest (`PackedLinear`): oneDNN's blocked layout, or Wᵀ contiguous for MKL's
sgemm. In the copy, self-attention's W^Q, W^K, W^V are one product (`StackedSelfAttention`) and
the feed-forward network's first product applies its ReLU.

Which kernel runs which layer depends on the CPU (`decoding_kernels`); `pack_for_decoding`
makes the copy that `Translator` decodes with in float32 on a CPU
(`decode.backends.pytorch.load_model_dirs`), `pack_linear_layers` one for given kernels. The
copy computes the model's function up to float32 rounding (tests/decode/test_packing.py), and
the model is left as it is. Training never packs: its oneDNN products
(`acceleration.OneDNNLinearProducts`) read the weights as the optimizer updates them.

int8 decoding stacks self-attention's W^Q, W^K, W^V too (`stack_self_attention`), so that
dynamic quantization makes them one int8 product (`acceleration.quantize_int8`).
"""

from __future__ import annotations

import copy
import platform
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.acceleration import MIN_PACKED_FEATURES, onednn_linear_missing
from aiayn.attention import MultiHeadAttention
from aiayn.model import ACTIVATION_FUNCTIONS, PositionwiseFeedForward


def padded_rows(m: int) -> int:
    """`m` rounded up to one of 8 row counts per octave (at most 12.5% more; below 16, `m`).

    oneDNN builds a kernel for every new shape it sees (measured on 1 thread: 0.7 ms more than a
    call at a known row count for a 64→256 layer, 4.6 ms more for 512→2048;
    a microbenchmark), and keeps a cache of 1,024. Decoding meets many row
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
      to 4,096 rows (a microbenchmark); CTranslate2 calls oneDNN on AMD
      CPUs for the same reason.
    - ``"mkl"``: MKL's sgemm on Wᵀ stored contiguous, (in, out). `nn.Linear` hands MKL a
      transposed view of W (its "NT" product); the same product on Wᵀ as stored ("NN") took
      0.6-0.9x the time at decoding shapes on an Intel Xeon, one thread (4 to 128 rows, the
      Bible recipe's layers: a microbenchmark).

    Results differ from `nn.Linear` only by float32 rounding (another summation order, for
    some shapes).

    Two fusions save a little of a beam-4 step:
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
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a decoding step's: 2-D
        if self.kernel == "mkl":
            if self.bias is None:
                y = rows @ self.packed_weight
            else:
                y = torch.addmm(self.bias, rows, self.packed_weight)
            if self.relu:
                y = y.relu_()
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        m = rows.size(0)
        padded = padded_rows(m)
        if padded != m:
            rows = F.pad(rows, (0, 0, 0, padded - m))
        post_op = "relu" if self.relu else "none"
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, post_op, [], "")
        if padded != m:
            y = y[:m]
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

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


class StackedSelfAttention(MultiHeadAttention):
    """Self-attention in a decoding copy: [W^Q; W^K; W^V] as one product `qkv_proj`, in place
    of the three projections.

    `qkv_proj` is the caller's: a `PackedLinear` in a float32 copy (`pack_linear_layers`), an
    `nn.Linear` of the stacked weights that int8 quantization then turns into one int8 product
    (`stack_self_attention`), which quantizes its input once where three products quantized it
    thrice. The same function as the layer it was made from, up to rounding. The three
    projections are not kept: self-attention projects its input with `project_qkv`
    (`MultiHeadAttention.forward`, the decoder's step), and `project_query` and
    `project_key_value` take their part of the stacked product.
    """

    def __init__(self, attention: MultiHeadAttention, qkv_proj: nn.Module) -> None:
        """`attention`'s W^O and kernel (shared, not copied) with `qkv_proj`, which maps x
        (..., D) to its stacked projections (..., H·(2·d_k + d_v))."""
        nn.Module.__init__(self)  # not MultiHeadAttention's: the layers are `attention`'s
        self.n_heads, self.d_k, self.d_v = attention.n_heads, attention.d_k, attention.d_v
        self.attention_dropout = attention.attention_dropout
        self.out_proj = attention.out_proj
        self.kernel = attention.kernel
        self.qkv_proj = qkv_proj
        self.train(attention.training)

    def stacked_qkv_weights(self) -> None:
        """None: the stacked product is `qkv_proj`, not weights for `F.linear`."""
        return None

    def project_qkv(
        self, x: Tensor, stacked: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) → q, k, v (B, H, T, d), a step's rows (B, D) → (B, H, 1, d), in one
        product (`stacked` is None here: `stacked_qkv_weights`)."""
        return self.split_qkv(self.qkv_proj(x))

    def project_query(self, x: Tensor) -> Tensor:
        """(B, T, D) → queries (B, H, T, d_k); (B, D) → (B, H, 1, d_k); from the stacked
        product."""
        return self.project_qkv(x)[0]

    def project_key_value(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S, D) → keys (B, H, S, d_k) and values (B, H, S, d_v), from the stacked
        product."""
        _, k, v = self.project_qkv(x)
        return k, v


def stacked_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One `nn.Linear` computing `linears` side by side (their weights and biases stacked, a
    copy), for layers that read the same input, all with a bias or none."""
    has_bias = {m.bias is not None for m in linears}
    if len({m.in_features for m in linears}) != 1 or len(has_bias) != 1:
        raise ValueError("stacked layers need the same input size, all with a bias or none")
    weight = torch.cat([m.weight.detach() for m in linears])
    stacked = nn.Linear(
        weight.size(1), weight.size(0), bias=has_bias.pop(), device=weight.device,
        dtype=weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        stacked.weight.copy_(weight)
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([m.bias.detach() for m in linears]))
    return stacked


def _self_attentions(model: nn.Module) -> list[tuple[nn.Module, MultiHeadAttention]]:
    """Every (encoder or decoder layer, its `self_attn`) of `model` whose three projections are
    `nn.Linear`."""
    found = []
    for layer in model.modules():
        attention = getattr(layer, "self_attn", None)
        if type(attention) is MultiHeadAttention and all(
            type(m) is nn.Linear for m in (attention.q_proj, attention.k_proj, attention.v_proj)
        ):
            found.append((layer, attention))
    return found


def stack_self_attention(model: nn.Module) -> nn.Module:
    """`model`, in place, each self-attention layer a `StackedSelfAttention` whose `qkv_proj`
    is an `nn.Linear` of the stacked weights (`stacked_linear`): for int8 decoding, which
    quantizes it as one product (`acceleration.quantize_int8` after this). Encoder-decoder
    attention projects the query and the memory apart and stays as it is."""
    for layer, attention in _self_attentions(model):
        qkv = stacked_linear([attention.q_proj, attention.k_proj, attention.v_proj])
        layer.self_attn = StackedSelfAttention(attention, qkv)
    return model


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
    - None (nobody says): where `onednn_pays_for_output_projection`, oneDNN for the
      pre-softmax projection and MKL for the rest, else MKL for all. On an AMD EPYC with AVX2
      the products that keep or narrow the width (d_model → d_model, d_ff → d_model) ran
      faster on MKL's and the projection onto the vocabulary faster on oneDNN's (one thread,
      at decoding's row counts: a microbenchmark). Decoding the 809 Bible dev
      sentences, beam 4, with the same outputs: whole `aiayn translate` commands on two cores
      took 0.83x (2+2 layers) and 0.92x (3+3) the time of oneDNN for all; one thread, in one
      process, 0.90-0.95x; for a random-weight `base`, within
      2%.
    """
    mkl = mkl_missing() is None
    if onednn is True:
        return DecodingKernels("onednn", "onednn")
    if onednn is False or not onednn_pays_for_output_projection():
        return DecodingKernels("mkl", "mkl") if mkl else None
    if not mkl:
        return DecodingKernels("onednn", "onednn")
    return DecodingKernels("mkl", "onednn")


def onednn_pays_for_output_projection() -> bool:
    """Whether float32 decoding should run the pre-softmax projection (§3.4) on oneDNN-packed
    weights here when nobody says (`decoding_kernels`): on x86-64 CPUs other than Intel's.

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


def pack_linear_layers(
    model: nn.Module,
    min_features: int | None = None,
    kernel: str = "onednn",
    output_kernel: str | None = None,
    *,
    in_place: bool = False,
) -> nn.Module:
    """A copy of float32 CPU `model` whose `nn.Linear` layers are `PackedLinear`, for decoding
    with `kernel` ("onednn" or "mkl"), the pre-softmax projection (`model.output_projection`)
    with `output_kernel` (None: `kernel`); `decoding_kernels` says which a translator uses.

    The same function up to float32 rounding (tests/decode/test_packing.py compares log-probs and
    translations); `model` is left as it is, unless `in_place`: then `model` itself is packed
    and returned, for a caller that owns it and decodes with nothing else (a translator's
    freshly loaded model, whose copy would clone every weight only for the packed layers to
    copy theirs again). Only layers with at least `min_features` (default
    `MIN_PACKED_FEATURES`) inputs and outputs are packed. Where either kernel is unavailable
    (`onednn_linear_missing`, `mkl_missing`), for a model not in float32 on the CPU, or when no
    layer is that large, returns `model` itself. The pre-softmax projection is packed like
    every other linear layer (in the copy it no longer shares storage with the embedding).
    In the copy, a ReLU feed-forward layer's first product applies the ReLU
    (`PackedLinear(relu=True)`), and each self-attention layer is a `StackedSelfAttention`,
    its [W^Q; W^K; W^V] one packed product (encoder-decoder attention projects the query and
    the memory apart and stays a `MultiHeadAttention`). Attention kernels are `model`'s
    (`acceleration.use_cpu_attention`).
    """
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
    packed = model if in_place else copy.deepcopy(model)
    output_projections = {  # a Transformer's, also inside a wrapper
        id(m.output_projection) for m in packed.modules() if hasattr(m, "output_projection")
    }
    for layer, attention in _self_attentions(packed):
        linears = [attention.q_proj, attention.k_proj, attention.v_proj]
        if all(packs(m) for m in linears):
            layer.self_attn = StackedSelfAttention(attention, PackedLinear(linears, kernel=kernel))
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


def pack_for_decoding(
    model: nn.Module, onednn: bool | None = None, *, in_place: bool = False
) -> nn.Module:
    """`model` as float32 CPU decoding runs it (`Translator`): a copy packed for
    `decoding_kernels(onednn)` by `pack_linear_layers` (`model` itself, packed, with
    `in_place`), or `model` itself where nothing is packed."""
    kernels = decoding_kernels(onednn)
    if kernels is None:
        return model
    return pack_linear_layers(
        model,
        kernel=kernels.layers,
        output_kernel=kernels.output_projection,
        in_place=in_place,
    )


def _applied_by_the_first_product(x: Tensor) -> Tensor:
    """The feed-forward layer's ReLU in a packed copy: its first product already applied it."""
    return x
