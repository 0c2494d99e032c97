"""The model on CUDA computes what it computes on the CPU: the forward pass against a float64
CPU reference (float32, TF32 and bf16 autocast, each within its stated tolerance), every fused
attention kernel against the explicit Eq. 1, and one bf16-autocast update against a float32 one.

Errors are relative, ‖out − ref‖ / ‖ref‖ over the whole output. What each precision may reach,
measured on these models with the CPU as stand-in (bf16 autocast there rounds as on a GPU):
float32 ~5e-7, bf16 autocast ~7e-3; TF32 keeps 10 mantissa bits where bf16 keeps 7, so ~1e-3.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import matmul_precision, relative_error
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.optim import build_optimizer
from aiayn.text.batching import collate
from aiayn.train.distributed import Distributed
from aiayn.train.update import autocast, optimizer_update

pytestmark = pytest.mark.cuda

VOCAB = 300
SRC_LENGTHS = (9, 5, 7, 3)  # a padded source batch: the masked kernels run
T = 8

# Relative error allowed against the float64 reference, per precision (see the module doc).
TOLERANCE = {"float32": 1e-5, "tf32": 5e-3, "bf16-autocast": 3e-2}


def config(**overrides: object) -> ModelConfig:
    values: dict[str, object] = dict(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        d_model=128,
        d_ff=512,
        n_heads=4,
        n_encoder_layers=3,
        n_decoder_layers=3,
        max_positions=64,
    )
    return ModelConfig(**{**values, **overrides})


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Source (B, S) right-padded to its longest sentence, shifted target (B, T), on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (len(SRC_LENGTHS), max(SRC_LENGTHS)), generator=generator)
    for row, n in enumerate(SRC_LENGTHS):
        src[row, n:] = 0
    return src, torch.randint(4, VOCAB, (len(SRC_LENGTHS), T), generator=generator)


def perturbed_model(**overrides: object) -> Transformer:
    """A CPU model in eval mode with biases and LayerNorm gains moved off 0/1, so that a
    misplaced bias or norm on either device would show."""
    torch.manual_seed(0)
    model = Transformer(config(**overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


# -- the forward pass against float64 ----------------------------------------------------------


@pytest.mark.parametrize("precision", list(TOLERANCE))
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_forward_on_cuda_equals_the_cpu_float64_reference(
    device: torch.device, precision: str, norm_first: bool
) -> None:
    model = perturbed_model(norm_first=norm_first)
    src, tgt = padded_batch()
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(src, tgt)
        on_device = model.to(device)
        matmuls = "high" if precision == "tf32" else "highest"
        with matmul_precision(matmuls), autocast(device, precision == "bf16-autocast"):
            logits = on_device(src.to(device), tgt.to(device))
    assert logits.device.type == device.type
    error = relative_error(logits, reference)
    assert error < TOLERANCE[precision], f"{precision}: relative error {error:.2e}"


def test_teacher_forced_loss_on_cuda_equals_the_cpu(device: torch.device) -> None:
    """The chunked projection + label-smoothed loss (`Transformer.forward` with a target),
    its sums and its gradients, in float32 on both devices."""
    model = perturbed_model()
    src, tgt = padded_batch()
    target = torch.roll(tgt, -1, dims=1)
    results = []
    for where, m in (("cpu", model), (device, copy.deepcopy(model).to(device))):
        m.zero_grad()
        args = (src.to(where), tgt.to(where), target.to(where))
        with matmul_precision("highest"):
            sums = m(*args, label_smoothing=0.1)
            sums.loss.backward()
        grads = torch.cat([p.grad.flatten().cpu() for p in m.parameters()])
        results.append((sums.loss.item(), sums.nll.item(), sums.n_tokens, grads))
    (cpu_loss, cpu_nll, cpu_n, cpu_grads), (loss, nll, n, grads) = results
    assert n == cpu_n
    assert loss == pytest.approx(cpu_loss, rel=1e-5)
    assert nll == pytest.approx(cpu_nll, rel=1e-5)
    assert relative_error(grads, cpu_grads) < 1e-4


# -- fused attention kernels against the explicit path ----------------------------------------


def test_fused_and_explicit_attention_agree_in_the_model_on_cuda(device: torch.device) -> None:
    """`forward` (SDPA, fused) and `forward_with_attention` (explicit Eq. 1): float32 to
    rounding, and under bf16 autocast within bf16's tolerance."""
    model = perturbed_model().to(device)
    src, tgt = (t.to(device) for t in padded_batch())
    with torch.no_grad(), matmul_precision("highest"):
        fused = model(src, tgt)
        explicit, maps = model.forward_with_attention(src, tgt)
        with autocast(device, True):
            fused_bf16 = model(src, tgt)
            explicit_bf16, _ = model.forward_with_attention(src, tgt)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
    assert relative_error(fused_bf16, explicit_bf16) < TOLERANCE["bf16-autocast"]
    padded_key = (src == 0)[None, :, None, None, :]  # (1, B, 1, 1, S)
    assert (maps.cross.masked_select(padded_key) == 0).all()


def _attention_inputs(
    device: torch.device, dtype: torch.dtype, *, queries: int, keys: int, masked: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(queries * 100 + keys)
    b, h, d = 3, 4, 64

    def draw(length: int) -> torch.Tensor:
        return torch.randn(b, h, length, d, generator=generator).to(device, dtype)

    q, k, v = draw(queries), draw(keys), draw(keys)
    mask = None
    if masked:
        lengths = torch.tensor([keys, keys - 3, 2])
        mask = (torch.arange(keys)[None, :] < lengths[:, None])[:, None, None, :]  # (B,1,1,S)
        mask = mask.to(device)
    return q, k, v, mask


# (backend, dtype, queries, keys, masked, causal): the calls the model makes. Flash attention
# takes no mask: it runs the unpadded and the causal cases; the memory-efficient kernel also
# runs the padded ones, decoding's few queries over a padded memory among them. cuDNN's kernel,
# which PyTorch may prefer on Hopper GPUs, is checked where it runs.
FLASH, EFFICIENT, MATH = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
BF16, FP32 = torch.bfloat16, torch.float32
KERNEL_CASES = [
    pytest.param(FLASH, BF16, 12, 12, False, True, id="flash-causal"),
    pytest.param(FLASH, BF16, 12, 17, False, False, id="flash-cross"),
    pytest.param(EFFICIENT, BF16, 12, 17, True, False, id="efficient-bf16-padded"),
    pytest.param(EFFICIENT, FP32, 12, 17, True, False, id="efficient-fp32-padded"),
    pytest.param(EFFICIENT, FP32, 12, 12, False, True, id="efficient-fp32-causal"),
    pytest.param(EFFICIENT, FP32, 4, 17, True, False, id="efficient-decoding-step"),
    pytest.param(MATH, FP32, 12, 17, True, False, id="math-fp32-padded"),
]


@pytest.mark.parametrize(("backend", "dtype", "queries", "keys", "masked", "causal"), KERNEL_CASES)
def test_each_fused_kernel_equals_explicit_eq1(
    device: torch.device,
    backend: SDPBackend,
    dtype: torch.dtype,
    queries: int,
    keys: int,
    masked: bool,
    causal: bool,
) -> None:
    """`MultiHeadAttention`'s default kernel, forced onto one SDPA backend at a time, against
    Eq. 1 as written in float64: the kernel computes Eq. 1 with aiayn's mask convention
    (True = may attend)."""
    if device.type != "cuda":
        pytest.skip("SDPA kernels are chosen per backend on CUDA only")
    q, k, v, mask = _attention_inputs(device, dtype, queries=queries, keys=keys, masked=masked)
    with sdpa_kernel(backend):
        fused = MultiHeadAttention(8, 1, 8, 8).kernel(q, k, v, attn_mask=mask, is_causal=causal)
    explicit, probs = scaled_dot_product_attention(
        q.double(), k.double(), v.double(), mask, is_causal=causal, need_weights=True
    )
    assert probs is not None
    assert fused.dtype == dtype
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert relative_error(fused, explicit) < tolerance


def test_the_default_kernel_never_runs_cudnn_attention(device: torch.device) -> None:
    """cuDNN's attention builds a graph for every new shape (~10 ms each on an H100), which
    made bf16 decoding and training several times slower than float32: `fused_attention` turns
    it off for its call, and leaves PyTorch's setting as it found it."""
    if device.type != "cuda":
        pytest.skip("SDPA kernels are chosen per backend on CUDA only")
    q, k, v, _ = _attention_inputs(device, BF16, queries=12, keys=12, masked=False)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError as error:  # then the refusal below would prove nothing
        pytest.skip(f"cuDNN attention does not run here: {error}")
    kernel = MultiHeadAttention(8, 1, 8, 8).kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # the caller allows cuDNN's kernel alone
        with pytest.raises(RuntimeError):  # "No available kernel": the kernel refused it
            kernel(q, k, v, is_causal=True)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # and left the setting as it was
    explicit, _ = scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert relative_error(kernel(q, k, v, is_causal=True), explicit) < 1e-2


# -- one training update: bf16 autocast against float32 ---------------------------------------


def copy_task(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` pairs of 5-15 random tokens whose target is the source: the dataset protocol of
    `optimizer_update` (dataset[i] → (source ids, target ids))."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        ids = rng.integers(4, VOCAB, rng.integers(5, 16)).astype(np.int64)
        pairs.append((ids, ids.copy()))
    return pairs


def update_once(
    model: Transformer, data: list, group: list[np.ndarray], device: torch.device, bf16: bool
) -> float:
    """One `optimizer_update`, as `aiayn train` runs it (fused Adam, Eq. 3 at step 1 with a
    one-step warm-up, scaled to a learning rate of 1e-3); returns its label-smoothed loss per
    target token."""
    stats = optimizer_update(
        model,
        build_optimizer(model),
        data,
        group,
        step=1,
        d_model=model.config.d_model,
        warmup_steps=1,
        lr_scale=1e-3 * model.config.d_model**0.5,
        label_smoothing=0.1,
        clip_norm=0.0,
        bf16=bf16,
        device=device,
        distributed=Distributed(),
    )
    return stats.loss / stats.tokens


def float32_loss(model: Transformer, data: list, group: list[np.ndarray]) -> float:
    """The label-smoothed loss per target token of `group`, float32, no dropout."""
    model.eval()
    loss = tokens = 0.0
    with torch.no_grad(), matmul_precision("highest"):
        for indices in group:
            batch = collate([data[int(i)] for i in indices]).to(next(model.parameters()).device)
            sums = model(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=0.1)
            loss, tokens = loss + sums.loss.item(), tokens + sums.n_tokens
    return loss / tokens


def gradients(model: Transformer, data: list, group: list[np.ndarray], bf16: bool) -> torch.Tensor:
    model.train()
    model.zero_grad()
    device = next(model.parameters()).device
    for indices in group:
        batch = collate([data[int(i)] for i in indices]).to(device)
        with matmul_precision("highest"), autocast(device, bf16):
            sums = model(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=0.1)
        sums.loss.backward()
    return torch.cat([p.grad.flatten().float().cpu() for p in model.parameters()])


def test_one_bf16_update_moves_the_loss_as_float32_does(device: torch.device) -> None:
    """Two batches accumulated into one update, from the same weights: with bf16 autocast
    (aiayn's default on CUDA) and in float32.

    Tolerances: the update's own loss within 1% of float32's; the gradient within 10% of
    float32's (relative error; cosine ≥ 0.995) and its norm within 3%; the loss the update
    leaves (measured in float32) moved by the float32 move ± 5%. bf16 keeps 8 significant
    bits (0.4% per rounding); Adam's first step is nearly lr·sign(gradient), so its move
    differs only where a gradient element is small enough for rounding to flip its sign.
    With the CPU's bf16 autocast standing in for CUDA's, this model gave a gradient error of
    2.6% (cosine 0.9997, norm +0.02%) and moves of −0.3747 (float32) and −0.3734 (bf16); the
    CPU computes attention in float32 there, where CUDA's flash kernel computes it in bf16,
    hence the margins. A wrong scale or a broken kernel misses them by far.
    """
    data = copy_task(48, seed=1)
    group = [np.arange(0, 24), np.arange(24, 48)]
    torch.manual_seed(0)
    start = Transformer(config(dropout=0.0, d_model=64, d_ff=256)).to(device)
    before = float32_loss(start, data, group)

    fp32_grad = gradients(copy.deepcopy(start), data, group, bf16=False)
    bf16_grad = gradients(copy.deepcopy(start), data, group, bf16=True)
    assert relative_error(bf16_grad, fp32_grad) < 0.1
    cosine = torch.nn.functional.cosine_similarity(bf16_grad.double(), fp32_grad.double(), dim=0)
    assert cosine > 0.995
    assert float(bf16_grad.norm()) == pytest.approx(float(fp32_grad.norm()), rel=0.03)

    moved: dict[bool, float] = {}
    for bf16 in (False, True):
        model = copy.deepcopy(start)
        with matmul_precision("highest"):
            update_loss = update_once(model, data, group, device, bf16)
        assert update_loss == pytest.approx(before, rel=1e-2), "the update saw another loss"
        moved[bf16] = float32_loss(model, data, group) - before
    assert moved[False] < -0.01, f"the float32 update did not lower the loss ({moved[False]})"
    assert moved[True] == pytest.approx(moved[False], rel=0.05)
