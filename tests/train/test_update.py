"""Tests for aiayn.train.update: one optimizer update, normalised by the target tokens of the whole
update, with the loss computed in chunks through the model's forward."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aiayn.config import TrainConfig
from aiayn.loss import label_smoothed_loss
from aiayn.model import Transformer
from aiayn.optim import build_optimizer, learning_rate, set_learning_rate
from aiayn.text.batching import BatchShapes, collate
from aiayn.text.corpus import ParallelDataset, load_or_build
from aiayn.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.train import update
from aiayn.train.distributed import Distributed
from aiayn.train.update import UpdateStats, optimizer_update, uses_bf16
from model_dirs import tiny_model

LETTERS = "abcdefgh"
WARMUP = 4


class _LetterEncoder:
    """One id per letter (a stand-in tokenizer for building a data cache)."""

    vocab_size = 4 + len(LETTERS)
    sha256 = "letters"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[4 + LETTERS.index(c) for c in text.split()] for text in texts]

    encode_target_batch = encode_batch


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> ParallelDataset:
    return letter_dataset(tmp_path_factory.mktemp("corpus"))


def letter_dataset(directory: Path) -> ParallelDataset:
    """48 pairs of 3-6 random letters, the target a copy of the source."""
    rng = random.Random(0)
    lines = [" ".join(rng.choices(LETTERS, k=rng.randint(3, 6))) for _ in range(48)]
    src, tgt = directory / "train.src", directory / "train.tgt"
    for path in (src, tgt):
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    data, _ = load_or_build(src, tgt, None, _LetterEncoder(), directory / "data", max_len=16)
    return data


def letter_model(**overrides: Any) -> Transformer:
    """`tiny_model` over the letters (d_model 16, one layer a stack), in training mode."""
    sizes = dict(d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1)
    model = tiny_model(_LetterEncoder.vocab_size, preset="tiny", **sizes | overrides)
    return model.train()


def run_update(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    dataset: Any,
    group: list[Any],
    shapes: BatchShapes | None = None,
) -> UpdateStats:
    return optimizer_update(
        model,
        optimizer,
        dataset,
        [torch.as_tensor(g).numpy() for g in group],
        step=3,
        d_model=16,
        warmup_steps=WARMUP,
        lr_scale=1.0,
        label_smoothing=0.1,
        clip_norm=0.0,
        bf16=False,
        device=torch.device("cpu"),
        distributed=Distributed(),
        shapes=shapes,
    )


class _GradientRecorder(torch.optim.SGD):
    """An optimizer that records the gradients it is given and leaves the weights alone."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.0)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure: Callable | None = None) -> None:
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


def test_update_normalises_by_the_target_tokens_of_the_whole_update(
    dataset: ParallelDataset,
) -> None:
    """Accumulating batches A and B gives the gradient of (loss(A) + loss(B)) / tokens(A ∪ B):
    the same as one batch holding both, not the mean of two per-batch means."""
    torch.manual_seed(0)
    model = letter_model(dropout=0.0)
    by_length = sorted(range(len(dataset)), key=lambda i: len(dataset[i][1]))
    a, b = torch.tensor(by_length[:3]), torch.tensor(by_length[-7:])  # 3 short, 7 long pairs
    batches = [collate([dataset[int(i)] for i in idx]) for idx in (a, b)]
    assert batches[0].n_tgt_tokens != batches[1].n_tgt_tokens

    def run(group: list[torch.Tensor]) -> tuple[UpdateStats, list[torch.Tensor]]:
        optimizer = _GradientRecorder(model.parameters())
        result = run_update(model, optimizer, dataset, group)
        assert all(p.grad is None for p in model.parameters())  # cleared for the next update
        return result, optimizer.grads[0]

    stats, accumulated = run([a, b])
    _, joint = run([torch.cat([a, b])])

    n_tokens = sum(batch.n_tgt_tokens for batch in batches)
    total_loss = total_nll = 0.0
    for batch in batches:
        sums = label_smoothed_loss(
            model(batch.src, batch.tgt_in), batch.tgt_out, epsilon=0.1, pad_id=PAD_ID
        )
        (sums.loss / n_tokens).backward()
        total_loss += sums.loss.item()
        total_nll += sums.nll.item()
    expected = [p.grad for p in model.parameters()]

    assert stats.tokens == n_tokens
    assert stats.lr == learning_rate(3, d_model=16, warmup_steps=WARMUP)
    assert stats.loss == pytest.approx(total_loss, rel=1e-6)
    assert stats.nll == pytest.approx(total_nll, rel=1e-6)
    for got, want, one_batch in zip(accumulated, expected, joint, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(one_batch, want, rtol=1e-4, atol=1e-6)


def test_an_update_through_the_chunked_loss_equals_one_through_the_logits(
    dataset: ParallelDataset,
) -> None:
    """One Adam update of `optimizer_update` (projection and loss in chunks, inside `forward`)
    leaves the same weights as the plain path: the (B, T, V) logits, `label_smoothed_loss`,
    backward. fp32 on a CPU, dropout on (the same masks: both draw them in the same order),
    two batches accumulated, the output projection shared with both embeddings."""
    torch.manual_seed(0)
    chunked = letter_model()
    plain = copy.deepcopy(chunked)
    group = [torch.arange(0, 20), torch.arange(20, 48)]
    chunked_adam, plain_adam = build_optimizer(chunked), build_optimizer(plain)
    # Step 3 of the schedule: earlier steps give Adam moments, so that the update is not the
    # sign of each gradient (a first Adam step hides differences in gradient size).
    for optimizer, model in ((chunked_adam, chunked), (plain_adam, plain)):
        for p in model.parameters():
            state = optimizer.state[p]
            state["step"] = torch.tensor(2.0)
            state["exp_avg"] = torch.full_like(p, 1e-3)
            state["exp_avg_sq"] = torch.full_like(p, 1e-4)

    torch.manual_seed(1)
    stats = run_update(chunked, chunked_adam, dataset, group)

    torch.manual_seed(1)
    plain.train()
    batches = [collate([dataset[int(i)] for i in g], bos_id=BOS_ID, eos_id=EOS_ID) for g in group]
    n_tokens = sum(batch.n_tgt_tokens for batch in batches)
    loss = 0.0
    for batch in batches:
        sums = label_smoothed_loss(
            plain(batch.src, batch.tgt_in), batch.tgt_out, epsilon=0.1, pad_id=PAD_ID
        )
        (sums.loss / n_tokens).backward()
        loss += sums.loss.item()
    set_learning_rate(plain_adam, learning_rate(3, d_model=16, warmup_steps=WARMUP))
    plain_adam.step()

    assert stats.loss == pytest.approx(loss, rel=1e-6)
    assert chunked.output_projection.weight is chunked.src_embed.embedding.weight
    for (name, got), want in zip(chunked.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_an_update_of_fixed_shapes_equals_one_of_the_batches_as_they_are(
    dataset: ParallelDataset,
) -> None:
    """Padding the batches to `BatchShapes` (wider, and empty rows) changes neither the loss,
    nor the tokens counted, nor the gradients; the gradients stay allocated, zeroed, for the
    next update."""
    torch.manual_seed(0)
    model = letter_model(dropout=0.0)
    group = [torch.arange(0, 5), torch.arange(5, 12)]
    shapes = BatchShapes(max_tokens=96, widths=(8, 16))
    assert collate([dataset[i] for i in range(5)], shapes=shapes).src.shape == (12, 8)

    results = []
    for fixed in (None, shapes):
        optimizer = _GradientRecorder(model.parameters())
        stats = run_update(model, optimizer, dataset, group, shapes=fixed)
        results.append((stats, optimizer.grads[0]))
        if fixed is None:
            assert all(p.grad is None for p in model.parameters())
        else:
            assert all(not p.grad.any() for p in model.parameters())
    (plain, plain_grads), (padded, padded_grads) = results
    assert padded.tokens == plain.tokens
    assert padded.loss == pytest.approx(plain.loss, rel=1e-6)
    assert padded.nll == pytest.approx(plain.nll, rel=1e-6)
    for got, want in zip(padded_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_loss_path_of_forward_is_float32_under_bf16_autocast() -> None:
    model = letter_model()
    src, tgt = torch.randint(4, 12, (2, 5)), torch.randint(4, 12, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums = model(src, tgt[:, :-1], tgt[:, 1:], label_smoothing=0.1)
    assert sums.loss.dtype == torch.float32
    sums.loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_bf16_autocast_is_auto_where_the_device_computes_it_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """precision auto (the default): bf16 on a CUDA GPU that computes in bf16 (Ampere or
    newer) and on a CPU with AVX512-BF16 or AMX; float32 on an older GPU or CPU (which only
    emulate it); bf16 and fp32 as asked, anywhere."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    default = TrainConfig(src="a", tgt="b").precision
    assert default == "auto"
    native = {"cuda": True, "cpu": True}
    monkeypatch.setattr(update, "cuda_computes_bf16", lambda device: native["cuda"])
    monkeypatch.setattr(update, "native_bf16_cpu", lambda: native["cpu"])
    assert uses_bf16(cuda, default) and uses_bf16(cpu, default)
    native["cuda"] = native["cpu"] = False  # a pre-Ampere GPU, a CPU with AVX2 only
    assert not uses_bf16(cuda, default) and not uses_bf16(cpu, default)
    assert uses_bf16(cuda, "bf16") and uses_bf16(cpu, "bf16")
    assert not uses_bf16(cuda, "fp32") and not uses_bf16(cpu, "fp32")


def test_cuda_computes_bf16_asks_without_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.cuda.is_bf16_supported()` counts emulation by default (True on a pre-Ampere GPU
    that only emulates bf16, slowly); "auto" asks for native support only."""
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    assert not update.cuda_computes_bf16(torch.device("cuda"))
    assert asked == [False]


def test_an_update_with_onednn_products_is_the_plain_update(dataset: ParallelDataset) -> None:
    """`optimizer_update(onednn=True)`, what `aiayn train` runs in float32 on x86-64 CPUs: the
    same losses and the same gradients handed to the optimizer as with `nn.Linear` (float32
    rounding apart), over two updates with dropout on (the same masks for the same seed)."""
    from aiayn.acceleration import onednn_linear_missing

    if onednn_linear_missing():
        pytest.skip(onednn_linear_missing())
    torch.manual_seed(0)
    wide = letter_model(d_model=256, d_ff=256, dropout=0.1)
    runs = []
    for onednn in (True, False):
        model = copy.deepcopy(wide)
        recorder = _GradientRecorder(model.parameters())
        torch.manual_seed(1)
        with torch.profiler.profile() as prof:
            stats = [
                optimizer_update(
                    model,
                    recorder,
                    dataset,
                    [torch.arange(i, i + 8).numpy()],
                    step=3,
                    d_model=256,
                    warmup_steps=WARMUP,
                    lr_scale=1.0,
                    label_smoothing=0.1,
                    clip_norm=0.0,
                    bf16=False,
                    device=torch.device("cpu"),
                    distributed=Distributed(),
                    onednn=onednn,
                )
                for i in (0, 8)
            ]
        calls = {e.key: e.count for e in prof.key_averages()}
        assert (calls.get("mkldnn::_linear_pointwise", 0) > 0) == onednn
        runs.append((stats, recorder.grads))
    (fast, fast_grads), (plain, plain_grads) = runs
    for a, b in zip(fast, plain, strict=True):
        assert a.tokens == b.tokens
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
    for got, expected in zip(fast_grads, plain_grads, strict=True):
        largest = max(g.abs().max() for g in expected)
        for g, e in zip(got, expected, strict=True):  # k_proj.bias: 0 but for rounding
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6 * largest)


def _plain_updates(
    model: Transformer, dataset: ParallelDataset, groups: list[list[Any]]
) -> tuple[float, float]:
    """Adam updates as a plain loop runs them: each batch's loss sums read back as Python
    floats and added up on the host. Returns the loss and NLL sums over the updates."""
    optimizer = build_optimizer(model)
    loss_sum = nll_sum = 0.0
    model.train()
    for step, group in enumerate(groups, start=3):
        batches = [
            collate([dataset[int(i)] for i in g], bos_id=BOS_ID, eos_id=EOS_ID) for g in group
        ]
        n_tokens = float(sum(batch.n_tgt_tokens for batch in batches))
        sums = []
        for batch in batches:
            out = model(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=0.1)
            (out.loss * (1 / n_tokens)).backward()
            sums.append(torch.stack([out.loss.detach(), out.nll]))
        set_learning_rate(optimizer, learning_rate(step, d_model=16, warmup_steps=WARMUP))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss, nll = torch.stack(sums).double().sum(dim=0).tolist()
        loss_sum, nll_sum = loss_sum + loss, nll_sum + nll
    return loss_sum, nll_sum


def test_updates_with_their_sums_on_the_device_equal_a_plain_loop_bit_for_bit(
    dataset: ParallelDataset,
) -> None:
    """Three Adam updates of `optimizer_update`, their loss sums added up on the device
    (`IntervalLossSums`), leave the very weights of a plain loop that reads every update's
    sums back to the host, and the same sums to the last bit: dropout on (the same masks for
    the same seed), two batches accumulated per update."""
    torch.manual_seed(0)
    model = letter_model()
    plain = copy.deepcopy(model)
    groups = [[torch.arange(i, i + 5), torch.arange(i + 5, i + 16)] for i in (0, 16, 32)]

    torch.manual_seed(1)
    optimizer, interval = build_optimizer(model), {"loss": 0.0, "nll": 0.0}
    sums = update.IntervalLossSums()
    for step, group in enumerate(groups, start=3):
        stats = optimizer_update(
            model, optimizer, dataset, [g.numpy() for g in group], step=step, d_model=16,
            warmup_steps=WARMUP, lr_scale=1.0, label_smoothing=0.1, clip_norm=0.0, bf16=False,
            device=torch.device("cpu"), distributed=Distributed(),
        )  # fmt: skip
        sums.add(stats.sums, interval)
    sums.settle(interval)

    torch.manual_seed(1)
    assert (interval["loss"], interval["nll"]) == _plain_updates(plain, dataset, groups)
    for (name, got), want in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(got, want), name


def test_interval_sums_carry_on_from_a_resumed_interval_as_host_floats_do() -> None:
    """An interval restored from a checkpoint holds sums already: the device adds onto them
    in the order the host did, float64 for float64."""
    values = [0.1, 1e16, 0.3, -1e16, 0.7]
    interval = {"loss": 2.5e-3, "nll": 1.0}
    sums = update.IntervalLossSums()
    for v in values:
        sums.add(torch.tensor([v, v / 3], dtype=torch.float64), interval)
    sums.settle(interval)
    loss, nll = 2.5e-3, 1.0
    for v in values:
        loss, nll = loss + v, nll + v / 3
    assert (interval["loss"], interval["nll"]) == (loss, nll)


class _HostReads:
    """Counts what aiayn's own code reads back from tensors (`item`, `tolist`, `int`,
    `float`, `bool`): on a GPU each is a wait for the device to catch up."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import sys

        self.calls: list[str] = []
        self.counting = False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(tensor: torch.Tensor, *args: Any, _name=name, _original=original) -> Any:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if self.counting and caller.startswith("aiayn"):
                    self.calls.append(f"{caller}: {_name}")
                return _original(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_updates_read_nothing_back_from_the_device(
    dataset: ParallelDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between metrics records the update path reads no tensor back to the host: the token
    counts come from the batches, the loss sums are added up on the device; the one read is
    the record's (`IntervalLossSums.settle`). Whether a batch's sources are padded is the
    batch's token count (`Batch.src_padded`), not a read of the source mask."""
    torch.manual_seed(0)
    model = letter_model()
    optimizer, interval = build_optimizer(model), {"loss": 0.0, "nll": 0.0}
    sums = update.IntervalLossSums()
    reads = _HostReads(monkeypatch)
    reads.counting = True
    for step, start in enumerate((0, 16, 32), start=1):
        group = [np.arange(start, start + 8), np.arange(start + 8, start + 16)]
        stats = optimizer_update(
            model, optimizer, dataset, group, step=step, d_model=16, warmup_steps=WARMUP,
            lr_scale=1.0, label_smoothing=0.1, clip_norm=1.0, bf16=False,
            device=torch.device("cpu"), distributed=Distributed(),
        )  # fmt: skip
        sums.add(stats.sums, interval)
    assert reads.calls == []
    sums.settle(interval)
    assert reads.calls == ["aiayn.train.update: tolist"]
    assert interval["loss"] > interval["nll"] > 0
