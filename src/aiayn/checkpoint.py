"""Model directories and training checkpoints, written atomically, loaded without pickled code.

A *model directory* is self-describing and is all inference needs:

    config.json          the `ModelConfig`
    model.safetensors    the weights (shared weights stored once)
    tokenizer.model      the SentencePiece model (or, for a model imported from Marian,
                         source.spm + target.spm + vocab.json: `tokenizer.SplitTokenizer`)
    metadata.json        languages, training step, aiayn version
    checksums.json       SHA-256 of every file above, checked on load

A *checkpoint* (`RUN_DIR/checkpoints/step_00001000/`) is a model directory plus
`training_state.pt`: optimizer state, step, RNG states and data position. It is read with
`torch.load(weights_only=True)`, which refuses to run pickled code. Every directory is written
under a temporary name and renamed into place, so a killed run never leaves a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from aiayn import __version__
from aiayn.config import ConfigError, ModelConfig
from aiayn.model import Transformer
from aiayn.tokenizer import SPLIT_TOKENIZER_FILES, VOCAB_FILE, tokenizer_files

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
METADATA_FILE = "metadata.json"
CHECKSUMS_FILE = "checksums.json"
TRAINING_STATE_FILE = "training_state.pt"
MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, METADATA_FILE)


class CheckpointError(RuntimeError):
    """A model directory or checkpoint is missing, incomplete, corrupt or incompatible."""


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer_file: Path
    metadata: dict[str, Any]
    directory: Path


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# -- writing ------------------------------------------------------------------------------


def save_model_dir(
    directory: str | Path,
    model: nn.Module,
    *,
    tokenizer_file: str | Path,
    metadata: dict[str, Any] | None = None,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """Write a model directory atomically (replacing an existing one).

    Args:
        directory: Target directory.
        model: A `Transformer` (possibly wrapped in DDP / torch.compile).
        tokenizer_file: The SentencePiece model to copy in (or a split tokenizer's
            vocab.json, copied with its source.spm and target.spm).
        metadata: JSON-serialisable facts (languages, step, ...).
        extra_files: name → object saved with `torch.save` (e.g. the training state).
    """
    directory = Path(directory)
    model = unwrap(model)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "aiayn": __version__})
    files = tokenizer_files(Path(tokenizer_file))
    for file in files:
        shutil.copyfile(file, tmp / (file.name if len(files) > 1 else TOKENIZER_FILE))
    meta = {"aiayn_version": __version__, **(metadata or {})}
    (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    for name, obj in (extra_files or {}).items():
        torch.save(obj, tmp / name)
    names = sorted(p.name for p in tmp.iterdir())
    checksums = {name: _sha256(tmp / name) for name in names}
    (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=2) + "\n")
    _fsync_dir(tmp)
    _replace_dir(tmp, directory)
    return directory


def save_checkpoint(
    run_dir: str | Path,
    model: nn.Module,
    *,
    step: int,
    training_state: dict[str, Any],
    tokenizer_file: str | Path,
    metadata: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write `checkpoints/step_XXXXXXXX` and delete all but the newest `keep_last`."""
    checkpoints = Path(run_dir) / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    path = checkpoints / f"step_{step:08d}"
    save_model_dir(
        path,
        model,
        tokenizer_file=tokenizer_file,
        metadata={**metadata, "step": step},
        extra_files={TRAINING_STATE_FILE: training_state},
    )
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete step checkpoints of a run, oldest first (temporary directories are ignored)."""
    checkpoints = Path(run_dir) / "checkpoints"
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.glob("step_*") if (p / CHECKSUMS_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


# -- reading ------------------------------------------------------------------------------


def resolve_model_dir(path: str | Path) -> Path:
    """Accept a model directory, or a run directory (→ its `model/` subdirectory)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model directory not found: {path}")
    if not (path / CONFIG_FILE).exists() and (path / "model" / CONFIG_FILE).exists():
        return path / "model"
    return path


def verify(directory: Path) -> None:
    """Check that every expected file is there and matches its recorded SHA-256."""
    if not directory.is_dir():
        raise CheckpointError(f"model directory not found: {directory}")
    missing = [name for name in (*MODEL_FILES, CHECKSUMS_FILE) if not (directory / name).is_file()]
    if TOKENIZER_FILE in missing and all((directory / n).is_file() for n in SPLIT_TOKENIZER_FILES):
        missing.remove(TOKENIZER_FILE)  # a split tokenizer instead
    if missing:
        raise CheckpointError(
            f"{directory} is not a complete aiayn model directory: missing {', '.join(missing)}"
        )
    try:
        checksums = json.loads((directory / CHECKSUMS_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{directory / CHECKSUMS_FILE} is corrupt: {error}") from None
    for name, expected in checksums.items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{directory}: missing {name}")
        if _sha256(file) != expected:
            raise CheckpointError(
                f"{file} is corrupt or truncated (SHA-256 does not match checksums.json)"
            )


def read_model_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ConfigError, TypeError) as error:
        raise CheckpointError(f"{path}: invalid model config: {error}") from None


def load_model_dir(directory: str | Path, *, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a model directory (or a run directory's `model/`), verified, in eval mode."""
    directory = resolve_model_dir(directory)
    verify(directory)
    config = read_model_config(directory)
    model = Transformer(config)
    load_weights(model, directory / WEIGHTS_FILE)
    metadata = json.loads((directory / METADATA_FILE).read_text())
    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        tokenizer_file = directory / VOCAB_FILE  # a split tokenizer (tokenizer.SplitTokenizer)
    return LoadedModel(
        model=model.to(device).eval(),
        config=config,
        tokenizer_file=tokenizer_file,
        metadata=metadata,
        directory=directory,
    )


def load_weights(model: nn.Module, weights_file: Path) -> None:
    """Load safetensors weights into `model`, with errors that name the file."""
    try:
        missing, unexpected = load_model(unwrap(model), str(weights_file), strict=False)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise CheckpointError(f"cannot load weights from {weights_file}: {error}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_file} does not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    """The training state of a verified checkpoint; never executes pickled code."""
    verify(checkpoint)
    path = checkpoint / TRAINING_STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated/corrupt files
        raise CheckpointError(f"cannot read {path}: {error}") from None


def check_same_architecture(checkpoint: Path, config: ModelConfig) -> None:
    """Refuse to resume a checkpoint whose `ModelConfig` differs from the run's."""
    saved = read_model_config(checkpoint)
    diffs = [
        f"{key}: checkpoint {value!r}, config {getattr(config, key)!r}"
        for key, value in saved.to_dict().items()
        if getattr(config, key) != value and key not in ("dropout", "attention_dropout")
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: it holds a different architecture ("
            + "; ".join(diffs)
            + ")"
        )


def average_checkpoints(paths: list[Path]) -> Transformer:
    """A model whose weights are the element-wise mean of several checkpoints' (§6.1).

    Sums are taken in float64, so the order of checkpoints does not matter.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    config = read_model_config(paths[0])
    model = Transformer(config)
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        if read_model_config(path) != config:
            raise CheckpointError(f"cannot average {path} with {paths[0]}: configs differ")
        verify(path)
        load_weights(model, path / WEIGHTS_FILE)
        for name, tensor in model.state_dict().items():
            total[name] = total.get(name, 0) + tensor.double()
    model.load_state_dict({name: (t / len(paths)).float() for name, t in total.items()})
    return model


# -- file system helpers --------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing `target` is moved aside first, then deleted."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
