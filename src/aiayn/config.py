"""Typed, validated model configuration and the presets of Table 3.

Defaults are the paper's base model (§3, Table 3 row "base"). Every field is validated when the
config is built, and an error names the field and its value, e.g.
``d_model (500) must be divisible by n_heads (8)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

POSITIONAL_ENCODINGS = ("sinusoidal", "learned")
SHARE_EMBEDDINGS = ("all", "decoder", "none")


class ConfigError(ValueError):
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
        max_positions: Longest sequence the positional encoding covers.
        share_embeddings: "all" = source embedding, target embedding and pre-softmax projection
            are one matrix (§3.4, needs a joint vocabulary); "decoder" = target embedding and
            pre-softmax projection only; "none" = three separate matrices.
        layer_norm_eps: Epsilon of every LayerNorm (the paper does not give one; 1e-6 as in
            tensor2tensor, the paper's code).
        pad_id: Index of the padding token; its embedding row is zero and it is never attended.
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

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "d_ff", "n_heads"):
            _require(getattr(self, name) > 0, f"{name} ({getattr(self, name)}) must be positive")
        for name in ("n_encoder_layers", "n_decoder_layers", "max_positions"):
            _require(getattr(self, name) >= 1, f"{name} ({getattr(self, name)}) must be >= 1")
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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown model config key(s): {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
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
}  # fmt: skip


def preset(name: str, *, src_vocab_size: int, tgt_vocab_size: int | None = None, **overrides):
    """The named preset as a `ModelConfig`, with optional field overrides.

    Args:
        name: One of `PRESETS` ("base", "big" as in Table 3; "small", "tiny" for CPUs).
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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_types(config: Any) -> None:
    """Reject values of the wrong type (YAML and CLI input is untyped), naming the field."""
    for f in fields(config):
        value = getattr(config, f.name)
        expected = f.type if isinstance(f.type, str) else f.type.__name__
        if expected.startswith("int"):
            ok = isinstance(value, int) and not isinstance(value, bool)
            ok = ok or (value is None and "None" in expected)
        elif expected == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                object.__setattr__(config, f.name, float(value))
        elif expected == "bool":
            ok = isinstance(value, bool)
        elif expected == "str":
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            raise ConfigError(f"{f.name} ({value!r}) must be of type {expected}")
