"""One optimizer update (§5.3, §5.4): the batches of an update, forward with the label-smoothed
loss, backward, Adam with the learning rate of Eq. 3 (or another schedule, aiayn.optim).

The update is normalised by the true number of target tokens it holds across every process, so
that one process accumulating k batches and k data-parallel processes compute the same update.
The loss comes from the model's own `forward` (`Transformer.forward` with a `target`), the one
call that DDP synchronises gradients for; it projects to the vocabulary and scores a chunk of
positions at a time, never holding the (B·T, V) logits (`loss.projected_label_smoothed_loss`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from aiayn.acceleration import OneDNNLinearProducts, native_bf16_cpu, onednn_linear_missing
from aiayn.optim import scheduled_rate, set_learning_rate
from aiayn.text.batching import BatchShapes, collate
from aiayn.text.bpe_dropout import EpochPairs
from aiayn.text.corpus import ParallelDataset
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.train.distributed import Distributed


def uses_bf16(device: torch.device, precision: str) -> bool:
    """bf16 autocast for `TrainConfig.precision` on `device`: "bf16" everywhere, "fp32"
    nowhere, "auto" where the device computes in bf16 natively: a CUDA GPU of compute
    capability 8.0 or newer (`cuda_computes_bf16`), a CPU with AVX512-BF16 or AMX
    (`native_bf16_cpu`). Elsewhere bf16 is emulated, slower than float32."""
    if precision == "bf16":
        return True
    if precision == "fp32":
        return False
    if precision != "auto":
        raise ValueError(f"precision ({precision!r}) must be auto, fp32 or bf16")
    if device.type == "cuda":
        return cuda_computes_bf16(device)
    return device.type == "cpu" and native_bf16_cpu()


def cuda_computes_bf16(device: torch.device) -> bool:
    """Whether the GPU `device` computes in bf16 natively (compute capability 8.0, Ampere, or
    newer); older GPUs only emulate it, slower than float32, and "auto" leaves them in float32."""
    try:
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a PyTorch without the argument: no emulation counted
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported()


def uses_onednn(device: torch.device, onednn: bool, *, bf16: bool, compile: bool) -> bool:
    """oneDNN's float32 linear products (`acceleration.OneDNNLinearProducts`): when `onednn` is
    asked for (`--onednn`), for eager float32 training on an x86-64 CPU (under bf16 autocast the
    products run on oneDNN anyway; a compiled model has its own kernels)."""
    return (
        onednn
        and device.type == "cpu"
        and not bf16
        and not compile
        and onednn_linear_missing() is None
    )


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """Mixed precision: matrix products in bf16, weights, optimizer and loss in float32."""
    if bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class UpdateStats:
    """What one update measured, summed over its batches and every process.

    The loss sums stay on the device: reading them waits until the device has finished the
    update, so the trainer adds them up there (`sums`) and reads them once per metrics record;
    `loss` and `nll` read them now, for callers that want the numbers of one update.
    """

    sums: Tensor  # (2,) float64 on the device: label-smoothed loss, NLL, over target tokens
    tokens: int  # target tokens of every process (counted on the host, from the batches)
    lr: float  # the learning rate the update used (its schedule's)

    @property
    def loss(self) -> float:
        """The label-smoothed loss summed over target tokens (waits for the device)."""
        return self.sums[0].item()

    @property
    def nll(self) -> float:
        """The NLL summed over target tokens (waits for the device)."""
        return self.sums[1].item()


class IntervalLossSums:
    """The loss sums of the updates since the last metrics record, added up on the device.

    Reading an update's sums makes the host wait until the device has finished that update;
    the trainer adds them up here and reads them once per record or save (`settle`). The
    additions are those the host made of Python floats, in the same order and precision
    (float64), so the records are the same.
    """

    def __init__(self) -> None:
        self._sums: Tensor | None = None  # (2,): loss, NLL

    def add(self, sums: Tensor, interval: dict[str, float]) -> None:
        """One update's `UpdateStats.sums`, onto the open metrics `interval`."""
        if self._sums is not None:
            self._sums = self._sums + sums
            return
        self._sums = sums.clone()
        for i, key in enumerate(("loss", "nll")):
            if interval[key]:  # sums carried over from a resumed checkpoint or a save
                self._sums[i] += interval[key]

    def settle(self, interval: dict[str, float]) -> None:
        """Write the sums into `interval` as numbers: one copy from the device."""
        if self._sums is not None:
            interval["loss"], interval["nll"] = self._sums.tolist()
            self._sums = None


def optimizer_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: ParallelDataset | EpochPairs,
    group: list[np.ndarray],
    *,
    step: int,
    d_model: int,
    warmup_steps: int,
    lr_scale: float,
    label_smoothing: float,
    clip_norm: float,
    bf16: bool,
    device: torch.device,
    distributed: Distributed,
    onednn: bool = False,
    schedule: str = "inverse_sqrt",
    end_step: int | None = None,
    shapes: BatchShapes | None = None,
) -> UpdateStats:
    """One optimizer update over the batches in `group` (gradient accumulation).

    The loss of every batch is divided by the number of target tokens in the whole update
    across all ranks, and multiplied by the world size because DDP averages gradients: the
    update is the same however the tokens are split over batches and processes.

    Args:
        model: A `Transformer`, or one wrapped by torch.compile and/or DDP.
        group: The update's batches, each an array of dataset indices.
        step: The number of this update (1 for the first), for the schedule.
        onednn: Forward and backward with `OneDNNLinearProducts` (`uses_onednn`).
        schedule: The learning-rate schedule (`aiayn.optim.scheduled_rate`): Eq. 3 by default.
        end_step: The run's last update, where a decaying schedule reaches 0.
        shapes: Pad every batch to these fixed shapes (`BatchShapes`; `group` cut for them).
            Then the gradients are tensors of their own, allocated before the first backward
            pass and zeroed, not freed, after each update: autograd adds a backward pass's
            gradients into them, never adopting its output, which with CUDA graphs
            (``torch.compile(mode="reduce-overhead")``) is memory that the next replay
            overwrites; and on a GPU each batch begins a new step of CUDA graph trees.
    """
    model.train()
    if shapes is not None:
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    examples = [[dataset[int(i)] for i in indices] for indices in group]
    batches = [
        collate(pairs, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, shapes=shapes)
        for pairs in examples
    ]
    # Counted on the host, from the batches: normalising by them waits for nothing on one
    # process (several add theirs up in a collective, as `Trainer.should_stop` does its flags).
    local_tokens = sum(b.n_tgt_tokens for b in batches)
    (n_tokens,) = distributed.sum([float(local_tokens)], device)
    sums_per_batch = []
    for i, batch in enumerate(batches):
        batch = batch.to(device, non_blocking=True)  # a CUDA copy waits for nothing
        last = i == len(batches) - 1
        sync = contextlib.nullcontext() if last or not distributed.enabled else model.no_sync()
        products = OneDNNLinearProducts() if onednn else contextlib.nullcontext()
        if shapes is not None and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with sync, products:
            with autocast(device, bf16):
                sums = model(
                    batch.src,
                    batch.tgt_in,
                    batch.tgt_out,
                    label_smoothing=label_smoothing,
                    src_padded=batch.src_padded,  # from the host: no wait for the device
                )
            (sums.loss * (distributed.world_size / n_tokens)).backward()
        sums_per_batch.append(torch.stack([sums.loss.detach(), sums.nll]))
    lr = scheduled_rate(
        schedule, step, d_model=d_model, warmup_steps=warmup_steps, scale=lr_scale, end=end_step
    )
    set_learning_rate(optimizer, lr)
    if clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=shapes is None)
    # Summed in float64, on the device: nothing here waits for it to finish the update.
    update_sums = distributed.sum_on_device(torch.stack(sums_per_batch).double().sum(dim=0))
    return UpdateStats(sums=update_sums, tokens=int(n_tokens), lr=lr)
