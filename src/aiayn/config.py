"""Typed, validated model configuration and the presets of Table 3.

Defaults are the paper's base model (§3, Table 3 row "base"). Every field is validated when the
config is built, and an error names the field and its value, e.g.
``d_model (500) must be divisible by n_heads (8)``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from aiayn.errors import UserValueError

POSITIONAL_ENCODINGS = ("sinusoidal", "learned")
SHARE_EMBEDDINGS = ("all", "decoder", "none")
ACTIVATIONS = ("relu", "gelu", "swish")
INITS = ("xavier", "fairseq")
# The most positions a model may cover: a sinusoidal table is built from max_positions alone
# (no weight holds it), so an absurd value would reach the allocator; 65536 positions is far
# beyond what attention's S × S maps allow one sequence, and 256 MiB of table at d_model 1024.
MAX_POSITIONS = 2**16
PATIENCE_METRICS = ("loss", "bleu")
# TrainConfig.schedule: "auto" and aiayn.optim.SCHEDULES (checked against each other in a test).
Schedule = Literal["auto", "inverse_sqrt", "linear", "cosine", "inverse_sqrt_cooldown"]
Precision = Literal["auto", "fp32", "bf16"]
# Keys of earlier releases that TrainConfig.from_dict still reads (`upgrade_train_values`).
LEGACY_PRECISION_KEYS = ("bf16", "cpu_bf16")

logger = logging.getLogger(__name__)


class ConfigError(UserValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the encoder-decoder Transformer (§3, Table 3).

    Attributes:
        src_vocab_size: Source vocabulary size.
        tgt_vocab_size: Target vocabulary size.
        d_model: Width of every sub-layer output and embedding (§3.1).
        d_ff: Inner width of the position-wise feed-forward network (Eq. 2).
        n_heads: Number of attention heads h (§3.2.2).
        d_k: Per-head query/key size; defaults to d_model / n_heads (Table 3 rows A, B vary it).
        d_v: Per-head value size; defaults to d_model / n_heads.
        n_encoder_layers: N for the encoder stack (§3.1).
        n_decoder_layers: N for the decoder stack (§3.1).
        dropout: P_drop of §5.4, on each sub-layer output and on embedding + position sums.
        attention_dropout: Dropout on attention probabilities. 0 in the paper (a deviation if set).
        norm_first: Pre-norm (x + Sublayer(LayerNorm(x))). False = the paper's post-norm.
        positional_encoding: "sinusoidal" (§3.5) or "learned" (Table 3 row E).
        max_positions: Longest sequence the positional encoding covers (at most
            `MAX_POSITIONS`).
        share_embeddings: "all" = source embedding, target embedding and pre-softmax projection
            are one matrix (§3.4, needs a joint vocabulary); "decoder" = target embedding and
            pre-softmax projection only; "none" = three separate matrices.
        layer_norm_eps: Epsilon of every LayerNorm (the paper does not give one; 1e-6 as in
            tensor2tensor, the paper's code).
        pad_id: Index of the padding token; its embedding row is zero and it is never attended.
        activation: Non-linearity of the feed-forward network: "relu" (Eq. 2), or "gelu" /
            "swish" (x·sigmoid(x), what OPUS-MT's Marian models use) for imported models.
        init: How a new model's weights are drawn (the paper gives no scheme):
            "xavier", as tensor2tensor (the paper's code): every projection Xavier-uniform,
            biases 0; "fairseq", as fairseq's Transformer: W^Q, W^K, W^V Xavier-uniform with
            gain 1/√2 and the feed-forward layers U(±1/√fan_in) (`nn.Linear`'s default),
            biases included, so each sub-layer starts with smaller outputs. Embeddings are
            N(0, d_model^-½) in both. Only new models read it (docs/small-data.md measured
            it: lower dev perplexity after the warm-up on the Bible recipe).
        target_side_output: The pre-softmax projection scores only the pieces of the target
            side (not in the paper; docs/deviations.md): a joint vocabulary's other pieces,
            the source language's alone, get a fixed bias of `aiayn.model.OUTSIDE_TARGET_SIDE`
            (probability 0), and training's loss and softmax run over the target side's pieces
            alone, a smaller product for each update. A new run counts the pieces of its
            training and validation targets into that bias (`output_projection.bias`, kept
            with the weights); False scores the whole vocabulary.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    d_k: int | None = None
    d_v: int | None = None
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    norm_first: bool = False
    positional_encoding: str = "sinusoidal"
    max_positions: int = 1024
    share_embeddings: str = "all"
    layer_norm_eps: float = 1e-6
    pad_id: int = 0
    activation: str = "relu"
    init: str = "xavier"
    target_side_output: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "d_ff", "n_heads"):
            _require(getattr(self, name) > 0, f"{name} ({getattr(self, name)}) must be positive")
        for name in ("n_encoder_layers", "n_decoder_layers", "max_positions"):
            _require(getattr(self, name) >= 1, f"{name} ({getattr(self, name)}) must be >= 1")
        _require(
            self.max_positions <= MAX_POSITIONS,
            f"max_positions ({self.max_positions}) must be at most {MAX_POSITIONS}",
        )
        if self.d_k is None or self.d_v is None:
            _require(
                self.d_model % self.n_heads == 0,
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless d_k and d_v are given",
            )
        if self.d_k is None:
            object.__setattr__(self, "d_k", self.d_model // self.n_heads)
        if self.d_v is None:
            object.__setattr__(self, "d_v", self.d_model // self.n_heads)
        _require(self.d_k > 0, f"d_k ({self.d_k}) must be positive")
        _require(self.d_v > 0, f"d_v ({self.d_v}) must be positive")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{name} ({value}) must be in [0, 1)")
        _require(
            self.positional_encoding in POSITIONAL_ENCODINGS,
            f"positional_encoding ({self.positional_encoding!r}) must be one of "
            f"{', '.join(POSITIONAL_ENCODINGS)}",
        )
        _require(
            self.share_embeddings in SHARE_EMBEDDINGS,
            f"share_embeddings ({self.share_embeddings!r}) must be one of "
            f"{', '.join(SHARE_EMBEDDINGS)}",
        )
        if self.share_embeddings == "all":
            _require(
                self.src_vocab_size == self.tgt_vocab_size,
                f"share_embeddings ('all') needs a joint vocabulary, but src_vocab_size "
                f"({self.src_vocab_size}) != tgt_vocab_size ({self.tgt_vocab_size})",
            )
        _require(
            self.activation in ACTIVATIONS,
            f"activation ({self.activation!r}) must be one of {', '.join(ACTIVATIONS)}",
        )
        _require(self.init in INITS, f"init ({self.init!r}) must be one of {', '.join(INITS)}")
        _require(self.layer_norm_eps > 0, f"layer_norm_eps ({self.layer_norm_eps}) must be > 0")
        _require(
            0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size),
            f"pad_id ({self.pad_id}) must be a valid token index",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, suitable for JSON/YAML (the form saved next to the weights)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from a dict; unknown keys are an error that lists the valid ones."""
        unknown, valid = _unknown_keys(cls, values)
        if unknown:
            raise ConfigError(f"unknown model config key(s): {unknown}; valid keys: {valid}")
        return cls(**values)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (d_k/d_v are re-derived unless given)."""
        values = self.to_dict()
        if "d_model" in changes or "n_heads" in changes:
            values["d_k"] = values["d_v"] = None
        values.update(changes)
        return ModelConfig.from_dict(values)


# Table 3 of the paper, plus CPU-sized presets for tests, the demo and small corpora.
PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                 dropout=0.1),
    "big": dict(d_model=1024, d_ff=4096, n_heads=16, n_encoder_layers=6, n_decoder_layers=6,
                dropout=0.3),
    "small": dict(d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                  dropout=0.1),
    "tiny": dict(d_model=64, d_ff=256, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                 dropout=0.1),
    # `aiayn demo`'s model (1.4M parameters with its 400-piece vocabulary): `small`'s depth at
    # half its width, which learns the numbers task in the demo's 1,200 updates on 2 CPU cores.
    "demo": dict(d_model=128, d_ff=512, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                 dropout=0.1),
}  # fmt: skip


def preset(name: str, *, src_vocab_size: int, tgt_vocab_size: int | None = None, **overrides):
    """The named preset as a `ModelConfig`, with optional field overrides.

    Args:
        name: One of `PRESETS` ("base", "big" as in Table 3; "small", "tiny" for CPUs; "demo",
            the model of `aiayn demo`).
        src_vocab_size: Source vocabulary size (also the target's unless given).
        tgt_vocab_size: Target vocabulary size.
        **overrides: Any other `ModelConfig` field.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = dict(PRESETS[name])
    values.update(overrides)
    return ModelConfig.from_dict(
        dict(
            src_vocab_size=src_vocab_size,
            tgt_vocab_size=tgt_vocab_size if tgt_vocab_size is not None else src_vocab_size,
            **values,
        )
    )


def _unknown_keys(cls: type, values: dict[str, Any]) -> tuple[str, str]:
    """(the keys of `values` that are not fields of `cls`, all valid keys), comma-separated."""
    known = {f.name for f in fields(cls)}
    return ", ".join(sorted(set(values) - known)), ", ".join(sorted(known))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


MAX_NUMBER = 2**53
"""The largest magnitude a number in a config or a flag takes: no count, size, rate or
duration aiayn takes comes near it, and past it the arithmetic in floats that schedules and
budgets do loses the number (a 400-digit ``max_steps`` is an OverflowError there, after the run
directory is written)."""


def number_problem(value: float) -> str | None:
    """What makes ``value`` no number aiayn takes: not finite (``inf``, ``nan``) or larger than
    `MAX_NUMBER`, as the end of a message ("is not a finite number"); None if nothing does."""
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    if abs(value) > MAX_NUMBER:
        return "is too large (at most 2^53)"
    return None


def shown(text: object) -> str:
    """``text`` for a one-line message: its ends only, if it is long (a 400-digit number)."""
    text = str(text)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"


def _accepts(kind: Any, value: Any) -> bool:
    """Whether `value` (read from YAML or a flag, so untyped) is of the annotated type `kind`."""
    if typing.get_origin(kind) in (types.UnionType, typing.Union):
        return any(_accepts(option, value) for option in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is Literal:
        return value in typing.get_args(kind)
    if kind is float:  # an int is a float here (YAML writes 0, not 0.0); bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(kind) or kind)


def _check_types(config: Any) -> None:
    """Reject values of the wrong type (YAML and CLI input is untyped), naming the field.

    The annotations are resolved to real types (`typing.get_type_hints`), so `int | None` means
    an int or None, and a type this function does not know is checked with `isinstance`.
    """
    for name, kind in typing.get_type_hints(type(config)).items():
        value = getattr(config, name)
        if typing.get_origin(kind) is Literal and not _accepts(kind, value):
            choices = ", ".join(typing.get_args(kind))
            raise ConfigError(f"{name} ({value!r}) must be one of {choices}")
        if not _accepts(kind, value):
            kind_name = getattr(kind, "__name__", None) or str(kind).replace("NoneType", "None")
            raise ConfigError(f"{name} ({shown(repr(value))}) must be of type {kind_name}")
        if isinstance(value, (int, float)) and (problem := number_problem(value)):
            raise ConfigError(f"{name} ({shown(value)}) {problem}")
        if kind is float:
            object.__setattr__(config, name, float(value))


@dataclass(frozen=True)
class TrainConfig:
    """Everything `aiayn train` needs; defaults are the paper's (§5) where it gives one.

    Read from a YAML file and/or command-line flags (flags win). Unknown keys are errors. The
    resolved config is written into the run directory as `train_config.yaml`.

    Attributes:
        out_dir: Run directory: tokenizer, data cache, metrics, checkpoints, model.
        src, tgt: Line-aligned training files (or `tsv`).
        tsv: Tab-separated training pairs (instead of src/tgt).
        valid_src, valid_tgt, valid_tsv: Validation set, likewise (optional).
        src_lang, tgt_lang: Language codes recorded in the model directory (informational).
        tokenizer: An existing SentencePiece model to reuse; else one is trained.
        vocab_size: Size of the joint BPE vocabulary to train (§5.1: ~37000 for EN-DE).
        preset: Model preset (`PRESETS`); `model` overrides individual `ModelConfig` fields.
        init_from: Fine-tune: start from the weights of this model directory (e.g. one `aiayn
            import` made; a run directory means its model/) instead of a random initialisation.
            Its config.json is the architecture and its tokenizer the vocabulary: a preset, model
            field, tokenizer or vocab_size that disagrees is refused, but model.dropout and
            model.attention_dropout (regularisation, not architecture) may be set. Adam and the
            learning-rate schedule start afresh at step 0 (aiayn.train.finetune).
        max_len: Longest sentence kept, in subword tokens (longer pairs are filtered out).
        max_ratio: Drop pairs whose length ratio exceeds this (0 = no ratio filter).
        max_tokens: Token budget of one batch on one device, per side, padding included (§5.1).
            `aiayn train` on a CUDA GPU: 12500 unless set (`CUDA_BATCHES`).
        accumulate: Batches accumulated per update (per device).
        tokens_per_update: If > 0, sets `accumulate` so an update holds about this many target
            tokens across devices (the paper: ~25000). `aiayn train` on a CUDA GPU: 25000
            unless it or `accumulate` is set (`CUDA_BATCHES`).
        max_steps: Number of optimizer updates (§5.2: 100k for base). With `time_budget`,
            whichever comes first ends the run.
        max_epochs: Stop after this many epochs as well (0 = no limit).
        time_budget: Wall time the run may take, e.g. 90s, 30m, 8h, 1d or 1h30m; none (or not
            set) = no budget (--time-budget none drops a recipe's). The run ends by itself
            inside it, start-up, validations and the final save included, and saves its
            model/. `aiayn train` counts from the start of its process as the OS records it
            (/proc; under torchrun, the launcher's start; where there is no /proc, from when
            the command began); `train()` from when it is called. The budget is the run's, not
            the process's: a resumed run has what is left of it, its processes' wall time up
            to the checkpoint it resumes from being saved with that checkpoint (time after the
            last checkpoint of a killed process is not counted). Under torchrun, rank 0's
            clock decides, and every rank stops after the same update. docs/training.md says
            how the end is foreseen.
        warmup_steps: Eq. 3 warm-up (4000 in the paper); every schedule warms up the same way.
        lr_scale: Factor on Eq. 3's learning rate (1.0 = the paper).
        schedule: The learning-rate schedule (aiayn.optim.scheduled_rate): "inverse_sqrt" is
            Eq. 3, which never anneals; "linear" and "cosine" warm up as Eq. 3 to its peak and
            then decay to 0 at the run's last update; "inverse_sqrt_cooldown" is Eq. 3 with a
            linear decay to 0 over the last 20% of the updates. The last update is max_steps
            (or max_epochs' last), or, with time_budget, the one that the measured speed
            foresees, re-estimated after every update. "auto" is inverse_sqrt without a
            time_budget (the paper, whose recipes are unchanged) and linear with one; a run
            records the schedule "auto" chose in its train_config.yaml.
        adam_beta1, adam_beta2, adam_eps: §5.3.
        label_smoothing: ε_ls of §5.4.
        bpe_dropout: BPE-dropout (not in the paper; Provilkov et al., 2020): each epoch the
            training pairs are segmented anew, every merge of the vocabulary skipped with this
            probability, so that words come in smaller pieces now and then; validation and
            translation keep the plain segmentation (aiayn.text.bpe_dropout). 0 = off. Needs
            a BPE vocabulary: aiayn's own, not an imported Marian model's.
        clip_norm: Gradient-norm clipping (0 = off, as in the paper).
        ema_decay: Keep an exponential moving average of the weights (not in the paper; as
            Marian's --exponential-smoothing, whose 1e-4 is 0.9999 here): after update t,
            average = d·average + (1 - d)·weights with d = min(ema_decay, (1 + t) / (10 + t)),
            so that early on it follows the weights closely. 0 = off. Kept in float32 on the
            training device and saved with every checkpoint. Every validation measures both
            weights; model/ (and best/) holds whichever validates better by patience_metric,
            and metrics.jsonl records which (docs/training.md).
        seed: Seeds model init, dropout and batch order.
        device: "auto", "cpu", "cuda" or "cuda:N".
        precision: "auto": bf16 autocast where the device computes in bf16 natively: a CUDA
            GPU of the Ampere generation or newer (torch.cuda.is_bf16_supported), a CPU with
            AVX512-BF16 or AMX (`acceleration.native_bf16_cpu`); float32 elsewhere, where bf16
            is only emulated and slower. "fp32": float32 everywhere; "bf16": bf16 autocast on
            any device (a warning where it is emulated). Weights, Adam and the loss stay
            float32. On a 2-core AMD EPYC with AVX512-BF16 the Bible recipe trains 1.37x
            float32's target tokens/s in bf16, at about 2x the peak memory (BENCHMARKS.md's
            training table; docs/settings.md).
            With bf16 on a CPU `aiayn train` also has oneDNN keep few compiled kernels (peak
            memory: `acceleration.ONEDNN_KERNELS_FOR_BF16_TRAINING`), a setting of the process
            that it makes through `aiayn.runtime.configure`. The deprecated fields bf16 and
            cpu_bf16 (and --no-bf16, --cpu-bf16) are read as precision: bf16 false is fp32,
            cpu_bf16 true is bf16.
        onednn: On an x86-64 CPU in float32, run the linear layers' products (and the chunked
            loss's) on oneDNN instead of MKL's sgemm (`aiayn.acceleration.OneDNNLinearProducts`):
            the same function up to float32 rounding, 0.97x the tokens/s with the Bible
            recipe on a 2-core AMD EPYC with AVX512-BF16, at 2.8x the peak memory (new batch
            shapes every step fragment the heap), hence opt-in. Ignored under
            bf16 and with `compile`.
        compile: Wrap the model in `torch.compile` (eager, with a warning, where it cannot
            compile: aiayn.acceleration). For GPUs: on a 2-core AMD EPYC (AVX2, float32) it
            trained the Bible recipe at 0.80x eager's tokens/s, and compiles first
            (BENCHMARKS.md). Compiled, the loss over the whole logits is part of the graph.
            Where compilation fails at the first update, `aiayn train` goes on eagerly
            (``runtime.configure(compile_errors_fall_back=True)``, process-wide, which `train`
            itself leaves as it is).
        static_shapes: Pad every training batch to one of about 16 fixed shapes (rows × width,
            each width about 19% wider than the last, a multiple of 8, the widest max_len + 1;
            `aiayn.text.batching.BatchShapes`), filling the rows a width allows under
            max_tokens with empty ones. With `compile` on a CUDA GPU the update then runs as
            CUDA graphs, captured once per shape (``torch.compile(mode="reduce-overhead")``):
            a few launches an update instead of thousands. The loss and its gradients are the
            unpadded batches'; which sentences share a batch changes.
        log_every: Updates between metric lines in metrics.jsonl.
        tensorboard: Also write the records of metrics.jsonl as TensorBoard scalars into
            RUN/tensorboard/ (needs the tensorboard extra: pip install -e '.[tensorboard]').
        valid_every: Updates between validations (0 = only at the end).
        valid_bleu: Also decode the validation set and report sacreBLEU.
        patience: Stop early once `patience_metric` has not improved for this many validations
            in a row (0 = never); needs a validation set and valid_every.
        patience_metric: What early stopping watches and what chooses `best/`: "loss" (the
            validation NLL per token, i.e. perplexity) or "bleu" (needs valid_bleu).
        save_every: Updates between checkpoints (0 = only at the end).
        save_every_minutes: Also checkpoint every this many minutes (0 = off; the paper: 10).
        keep_last: Number of step checkpoints kept (the best is kept separately).
        threads: CPU threads for PyTorch (0 = PyTorch's default). The thread count belongs to
            the process, so `train` leaves it as it is: `aiayn train` applies this through
            `aiayn.runtime.configure` before training; a program that calls `train` does so
            itself (`aiayn.train.trainer.runtime_settings`).
        progress: Show a live progress bar (only on a terminal).
    """

    out_dir: str = "runs/default"
    src: str | None = None
    tgt: str | None = None
    tsv: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    valid_tsv: str | None = None
    src_lang: str = "src"
    tgt_lang: str = "tgt"
    tokenizer: str | None = None
    vocab_size: int = 8000
    preset: str = "base"
    model: dict = dataclasses.field(default_factory=dict)
    init_from: str | None = None
    max_len: int = 256
    max_ratio: float = 0.0
    max_tokens: int = 4096
    accumulate: int = 1
    tokens_per_update: int = 0
    max_steps: int = 100_000
    max_epochs: int = 0
    time_budget: str | None = None
    warmup_steps: int = 4000
    lr_scale: float = 1.0
    schedule: Schedule = "auto"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    bpe_dropout: float = 0.0
    clip_norm: float = 0.0
    ema_decay: float = 0.0
    seed: int = 1
    device: str = "auto"
    precision: Precision = "auto"
    onednn: bool = False
    compile: bool = False
    static_shapes: bool = False
    log_every: int = 100
    tensorboard: bool = False
    valid_every: int = 1000
    valid_bleu: bool = False
    patience: int = 0
    patience_metric: str = "loss"
    save_every: int = 1000
    save_every_minutes: float = 0.0
    keep_last: int = 5
    threads: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        # "none" is how a flag (or YAML, where `none` is a string) says "no budget": stored as
        # None, as an unset budget is, so that nothing downstream needs to know the spelling.
        if isinstance(self.time_budget, str) and self.time_budget.strip().lower() == "none":
            object.__setattr__(self, "time_budget", None)
        if isinstance(self.time_budget, (int, float)) and not isinstance(self.time_budget, bool):
            raise ConfigError(
                f"time_budget ({self.time_budget!r}) needs a unit: {self.time_budget}s, or "
                "minutes (30m), hours (8h), days (1d)"
            )
        _check_types(self)
        if self.tsv is None:
            _require(
                self.src is not None and self.tgt is not None,
                "training data missing: give src and tgt (line-aligned files) or tsv",
            )
        else:
            _require(self.src is None and self.tgt is None, "give either tsv or src/tgt, not both")
        if self.valid_tsv is not None:
            _require(
                self.valid_src is None and self.valid_tgt is None,
                "give either valid_tsv or valid_src/valid_tgt, not both",
            )
        else:
            _require(
                (self.valid_src is None) == (self.valid_tgt is None),
                "valid_src and valid_tgt must be given together",
            )
        _require(
            self.preset in PRESETS, f"preset ({self.preset!r}) must be one of {', '.join(PRESETS)}"
        )
        _require(self.init_from != "", "init_from ('') must name a model directory")
        for name in ("vocab_size", "max_len", "max_tokens", "accumulate", "max_steps"):
            _require(getattr(self, name) >= 1, f"{name} ({getattr(self, name)}) must be >= 1")
        for name in ("tokens_per_update", "max_epochs", "warmup_steps", "valid_every",
                     "save_every", "threads", "patience", "seed"):  # fmt: skip
            _require(getattr(self, name) >= 0, f"{name} ({getattr(self, name)}) must be >= 0")
        _require(self.warmup_steps >= 1, f"warmup_steps ({self.warmup_steps}) must be >= 1")
        _require(self.log_every >= 1, f"log_every ({self.log_every}) must be >= 1")
        _require(self.keep_last >= 1, f"keep_last ({self.keep_last}) must be >= 1")
        _require(self.vocab_size >= 8, f"vocab_size ({self.vocab_size}) must be >= 8")
        _require(
            self.max_tokens >= self.max_len + 2,
            f"max_tokens ({self.max_tokens}) must be >= max_len + 2 ({self.max_len + 2}) so "
            "that the longest sentence fits in a batch",
        )
        for name in ("adam_beta1", "adam_beta2", "label_smoothing", "bpe_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{name} ({value}) must be in [0, 1)")
        _require(
            not (self.bpe_dropout and self.model.get("target_side_output")),
            "model.target_side_output needs bpe_dropout 0: BPE-dropout's segmentations use "
            "pieces the counted, plain one never does",
        )
        for name in ("lr_scale", "adam_eps"):
            _require(getattr(self, name) > 0, f"{name} ({getattr(self, name)}) must be > 0")
        for name in ("max_ratio", "clip_norm", "save_every_minutes"):
            _require(getattr(self, name) >= 0, f"{name} ({getattr(self, name)}) must be >= 0")
        _require(0.0 <= self.ema_decay < 1.0, f"ema_decay ({self.ema_decay}) must be in [0, 1)")
        if self.time_budget is not None:
            parse_duration(self.time_budget, name="time_budget")
        self._check_early_stopping()
        _require(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            f"device ({self.device!r}) must be auto, cpu, cuda or cuda:N",
        )
        # The model overrides are checked now, with the vocabulary size as a stand-in for the
        # tokenizer's: a typo must fail before a vocabulary is trained and data binarised.
        try:
            self.model_config(self.vocab_size)
        except (ConfigError, TypeError) as error:
            message = str(error)
            prefix = "" if message.startswith("model.") else "model: "
            raise ConfigError(prefix + message) from None

    def _check_early_stopping(self) -> None:
        _require(
            self.patience_metric in PATIENCE_METRICS,
            f"patience_metric ({self.patience_metric!r}) must be one of "
            f"{', '.join(PATIENCE_METRICS)}",
        )
        _require(
            self.patience_metric != "bleu" or self.valid_bleu,
            "patience_metric ('bleu') needs valid_bleu: BLEU is measured only with it",
        )
        if self.patience > 0:
            _require(
                self.valid_tsv is not None or self.valid_src is not None,
                f"patience ({self.patience}) needs a validation set: give valid_src and "
                "valid_tgt, or valid_tsv",
            )
            _require(
                self.valid_every > 0,
                f"patience ({self.patience}) needs valid_every > 0: with valid_every 0 the "
                "run validates only at its end",
            )

    @property
    def budget_seconds(self) -> float | None:
        """`time_budget` in seconds (None: no budget)."""
        if self.time_budget is None:
            return None
        return parse_duration(self.time_budget, name="time_budget")

    @property
    def resolved_schedule(self) -> str:
        """The schedule the run uses: `schedule`, with "auto" resolved (inverse_sqrt, Eq. 3,
        without a time budget; linear with one)."""
        if self.schedule != "auto":
            return self.schedule
        return "inverse_sqrt" if self.time_budget is None else "linear"

    def model_config(self, vocab_size: int, pad_id: int = 0) -> ModelConfig:
        """The `ModelConfig` for a joint vocabulary of `vocab_size` (preset + overrides)."""
        overrides = dict(self.model)
        overrides.setdefault("pad_id", pad_id)
        for key in ("src_vocab_size", "tgt_vocab_size"):
            if key in overrides:
                raise ConfigError(
                    f"model.{key} is set from the tokenizer; remove it from the config"
                )
        return preset(self.preset, src_vocab_size=vocab_size, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> TrainConfig:
        """Build from a dict; unknown keys are an error naming `source` and the valid keys.
        Keys of earlier releases are read as their replacements (`upgrade_train_values`)."""
        values = upgrade_train_values(values, source=source)
        unknown, valid = _unknown_keys(cls, values)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}; valid keys: {valid}")
        try:
            return cls(**values)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None


CUDA_BATCHES = {"max_tokens": 12_500, "tokens_per_update": 25_000}
"""`aiayn train`'s batches on a CUDA GPU where neither the config file nor the flags size them:
the paper's ~25,000 target tokens an update (§5.1) in two batches of 12,500 tokens a side on
one GPU (one each on two). On one H200, `base` peaked at 4.3 GiB in bf16 and 5.7 GiB in float32
at this size (docs/gpu.md), so smaller cards hold it too; a single batch of 25,000 would launch
half the kernels but is unmeasured. On a CPU the defaults stay `TrainConfig`'s (4096, no
accumulation): an update of the paper's size takes minutes there."""


def device_train_defaults(device_type: str, given: Collection[str]) -> dict[str, int]:
    """The `TrainConfig` values a run on `device_type` ("cpu", "cuda", ...) takes where the
    config file and flags (`given`, their keys) leave them out: `CUDA_BATCHES` on CUDA, but no
    `tokens_per_update` where `accumulate` is given (it would override it); none on a CPU."""
    if device_type != "cuda":
        return {}
    sized = {"accumulate", "tokens_per_update"} & set(given)
    return {
        key: value
        for key, value in CUDA_BATCHES.items()
        if key not in given and not (key == "tokens_per_update" and sized)
    }


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_DAYS = 366
"""The longest duration `parse_duration` takes: a year. Longer is a slip of the keyboard, and
past a float's range (a 400-digit number of hours) it is infinite, which no schedule can use."""


def parse_duration(text: str, *, name: str = "duration") -> float:
    """Seconds in a duration such as ``90s``, ``30m``, ``8h``, ``1d`` or ``1h30m``.

    Raises:
        ConfigError: Not a duration, not positive, or longer than `MAX_DURATION_DAYS`; the
            message names `name`.
    """
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION_PART.findall(compact)
    if not compact or "".join(number + unit for number, unit in parts) != compact:
        raise ConfigError(
            f"{name} ({text!r}) must be a duration: a number and a unit, s, m, h or d "
            "(90s, 30m, 8h, 1d, 1h30m)"
        )
    seconds = sum(float(number) * _SECONDS[unit] for number, unit in parts)
    _require(seconds > 0, f"{name} ({text!r}) must be longer than 0 s")
    _require(
        seconds <= MAX_DURATION_DAYS * _SECONDS["d"],
        f"{name} ({shown(text)!r}) must be at most {MAX_DURATION_DAYS}d",
    )
    return seconds


def upgrade_train_values(
    values: dict[str, Any], *, source: str = "config", warn: bool = True
) -> dict[str, Any]:
    """`TrainConfig` values with the keys of earlier releases replaced by today's:
    `bf16` and `cpu_bf16` (two booleans) by `precision`. A warning names the new
    key; giving both the old and the new key is an error that names them.

    bf16 true (the old default) is precision auto, which also checks that a GPU computes in
    bf16 before using it; bf16 false is fp32; cpu_bf16 true is bf16. bf16 false with
    cpu_bf16 true (bf16 on a CPU, float32 on CUDA) is bf16 or fp32 as the device is.
    `warn` False reads them silently (a run directory's own train_config.yaml, which the run
    rewrites with precision when it resumes).
    """
    old = [key for key in LEGACY_PRECISION_KEYS if key in values]
    if not old:
        return values
    values = dict(values)
    given = {key: values.pop(key) for key in old}
    shown = ", ".join(f"{key}: {value!r}" for key, value in given.items())
    if "precision" in values:
        raise ConfigError(
            f"{source}: {shown} and precision ({values['precision']!r}) both given: "
            f"{' and '.join(old)} {'are' if len(old) > 1 else 'is'} replaced by precision; "
            "give precision alone"
        )
    for key, value in given.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} ({value!r}) must be true or false")
    bf16, cpu_bf16 = given.get("bf16", True), given.get("cpu_bf16", False)
    if cpu_bf16:
        from aiayn.runtime import device_type  # torch only for "auto": reading a config needs none

        on_cpu = device_type(values.get("device", "auto")) == "cpu"
        precision = "bf16" if bf16 or on_cpu else "fp32"
    else:
        precision = "auto" if bf16 else "fp32"
    if warn:
        logger.warning(
            "%s: %s is read as precision: %s (%s replaced by precision)",
            source,
            shown,
            precision,
            " and ".join(old) + (" are" if len(old) > 1 else " is"),
        )
    values["precision"] = precision
    return values


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as error:
        raise ConfigError(_yaml_error(path, error)) from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    return values


def _yaml_error(path: Path, error: yaml.MarkedYAMLError) -> str:
    """One line, `FILE:LINE:COLUMN: not valid YAML: PROBLEM`, for the parser's several (the
    problem, where it was found, the construct it was in, a quote of the line, a caret).

    The construct is named only where it began elsewhere (an unclosed quote, a bracket).
    """
    mark = error.problem_mark or error.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    message = error.problem or error.context or "syntax error"
    if error.problem and error.context and (start := error.context_mark) is not None:
        message += f" ({error.context} at {start.line + 1}:{start.column + 1})"
    return f"{where}: not valid YAML: {message}"
