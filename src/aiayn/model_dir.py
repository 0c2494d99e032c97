"""Model directories: what a trained model is on disk, written atomically, loaded without
pickled code.

A *model directory* is self-describing and is all inference needs:

    config.json          the `ModelConfig`
    model.safetensors    the weights (shared weights stored once)
    tokenizer.model      the SentencePiece model (or, for a model imported from Marian,
                         source.spm + target.spm + vocab.json: `text.tokenizer.SplitTokenizer`)
    metadata.json        languages, training step, aiayn version
    checksums.json       SHA-256 of every file above, checked on load

Training writes them (its checkpoints, `aiayn.train.checkpoint`, are model directories with a
training state beside), decoding and the exporters read them. Every directory is written under a
temporary name and renamed into place, so a killed save never leaves a half-written one; what a
kill does leave (the parts of `aiayn.parts`: temporary names, a directory moved aside while being
replaced) is removed by the next save to the same place, found by `stranded_copy`, read from
where it lies by `resolve_model_dir`, and put back by `aiayn.train.rundir.remove_debris` when
the run starts again. A full disk is reported as such
(`DiskFullError`: where, what the save needs, what is free), with the partial directory removed.
The same weights saved twice are the same bytes, and a config.json is checked against its
weights' shapes before a model is built from it (`read_model_config`). PyTorch is imported by
the functions that build, save or load a model, not by this module: reading a directory's
config and shapes (``aiayn info -m``) takes no torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from aiayn import __version__, parts
from aiayn.config import ConfigError, ModelConfig
from aiayn.errors import CheckpointError, CorruptCheckpointError
from aiayn.text.tokenizer import SPLIT_TOKENIZER_FILES, VOCAB_FILE, tokenizer_files

if TYPE_CHECKING:
    import torch
    from torch import nn

    from aiayn.model import Transformer

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
METADATA_FILE = "metadata.json"
CHECKSUMS_FILE = "checksums.json"
MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, METADATA_FILE)


class DiskFullError(CheckpointError):
    """A save ran out of disk space, quota or file size limit; what it had written was
    removed."""


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer_file: Path
    metadata: dict[str, Any]
    directory: Path


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DistributedDataParallel and/or torch.compile wrappers."""
    from torch import nn

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
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write a model directory atomically (replacing an existing one).

    Args:
        directory: Target directory.
        model: A `Transformer` (possibly wrapped in DDP / torch.compile).
        tokenizer_file: The SentencePiece model to copy in (or a split tokenizer's
            vocab.json, copied with its source.spm and target.spm).
        metadata: JSON-serialisable facts (languages, step, ...).
        extra_files: name → object saved with `torch.save` (e.g. the training state).
        files: name → bytes written as they are (a lexical shortlist).

    Raises:
        DiskFullError: The disk or quota filled up; the partial directory was removed and an
            existing `directory` is untouched.
    """
    directory = Path(directory)
    model = unwrap(model)
    tmp = parts.part(directory)
    parts.remove_dead(directory)
    try:
        tmp.mkdir(parents=True)
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        _write_model_files(tmp, model, tokenizer_file, metadata, extra_files)
    except BaseException as error:
        # A partial directory would only fill the disk further (and a full disk is the
        # usual cause): nothing reads it, so remove it before saying what happened.
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(error, Exception):
            raise
        needed = _bytes_needed(model, tokenizer_file, extra_files)
        free = _free_bytes(tmp)
        code = _disk_full_errno(error)
        if code is None and isinstance(error, _WRITE_ERRORS) and free < needed:
            code = errno.ENOSPC  # a writer that hides the cause (see _write_model_files)
        if code is None:
            raise
        what = "checkpoint" if extra_files else "model directory"
        raise DiskFullError(
            f"{os.strerror(code)} writing {tmp}: the {what} needs about {_size(needed)}, "
            f"{_size(free)} free; partial {what} removed"
        ) from None
    parts.swap_in(tmp, directory)
    return directory


def _write_model_files(
    tmp: Path,
    model: nn.Module,
    tokenizer_file: str | Path,
    metadata: dict[str, Any] | None,
    extra_files: dict[str, Any] | None,
) -> None:
    import torch
    from safetensors.torch import save_model

    (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    weights = tmp / WEIGHTS_FILE
    save_model(model, str(weights), metadata={"format": "pt", "aiayn": __version__})
    _sort_header_metadata(weights)
    # safetensors writes through a private temporary file (mode 0600): give the weights the
    # mode every other file here got from the umask, so whoever may read the config may load.
    os.chmod(weights, (tmp / CONFIG_FILE).stat().st_mode & 0o777)
    files = tokenizer_files(Path(tokenizer_file))
    for file in files:
        shutil.copyfile(file, tmp / (file.name if len(files) > 1 else TOKENIZER_FILE))
    meta = {"aiayn_version": __version__, **(metadata or {})}
    (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    for name, obj in (extra_files or {}).items():
        # On a full disk torch's zip writer swallows the file's OSError(ENOSPC) and raises
        # "RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos": the file
        # it writes through keeps that OSError, raised in its place (a quota's EDQUOT, which
        # the free space does not show, included). `save_model_dir` also compares the free
        # space with what the save needs, for a writer that hides the cause otherwise.
        with open(tmp / name, "wb") as f:
            kept = _KeptWriteError(f)
            try:
                torch.save(obj, kept)
            except RuntimeError as error:
                if kept.error is not None:
                    raise kept.error from error
                raise
    names = sorted(p.name for p in tmp.iterdir())
    checksums = {name: sha256_of(tmp / name) for name in names}
    (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=2) + "\n")
    _fsync_dir(tmp)


def add_files(directory: Path, files: dict[str, bytes]) -> None:
    """Add small files to a complete model directory (replacing those of the same names), and
    their SHA-256 to its checksums.json, atomically: a copy of the directory is made beside it,
    its files hard-linked where the file system allows (the weights are not copied), the new
    files and checksums.json written into it, and the copy swapped in (`parts.swap_in`, as
    `save_model_dir` does). A kill leaves the directory as it was, and a part that the next
    writer removes.

    Raises:
        CheckpointError: `directory` is no complete model directory.
    """
    checksums = _expected_checksums(directory)
    tmp = parts.part(directory)
    parts.remove_dead(directory)
    try:
        tmp.mkdir()
        for entry in sorted(directory.iterdir()):
            if entry.name in files or entry.name == CHECKSUMS_FILE:
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry, tmp / entry.name)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
            checksums[name] = sha256_of(tmp / name)
        checksums = dict(sorted(checksums.items()))
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=2) + "\n")
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    parts.swap_in(tmp, directory)


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    """A hard link of `source` at `target`, or a copy where the file system has none."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


class _KeptWriteError:
    """A binary file whose ``write`` keeps the OSError it raises, for a writer (torch's) that
    reports only that the write failed."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def stranded_copy(target: Path) -> Path | None:
    """The newest complete, verified copy of `target` that a killed replacement left."""
    complete = []
    for path, name in parts.dead_parts(target.parent):
        if name == target.name:
            try:
                verify(path)
            except CheckpointError:
                continue
            complete.append(path)
    return max(complete, key=lambda p: (p / CHECKSUMS_FILE).stat().st_mtime_ns, default=None)


# -- reading ------------------------------------------------------------------------------


def resolve_model_dir(path: str | Path) -> Path:
    """Accept a model directory, or a run directory (→ its `model/` subdirectory).

    A directory that a killed save left moved aside (see `aiayn.train.rundir.remove_debris`) is read
    from where it lies, without moving it back: a reader must not rearrange a run another
    process owns.
    """
    path = Path(path)
    if not path.exists():
        if (copy := stranded_copy(path)) is not None:
            return _read_stranded(path, copy)
        raise CheckpointError(f"model directory not found: {path}")
    if not (path / CONFIG_FILE).exists():
        if (path / "model" / CONFIG_FILE).exists():
            return path / "model"
        if not (path / "model").exists() and (copy := stranded_copy(path / "model")) is not None:
            return _read_stranded(path / "model", copy)
    return path


def _read_stranded(target: Path, copy: Path) -> Path:
    logger.warning(
        "%s is missing (a save was killed while replacing it): reading %s; "
        "`aiayn train --resume` puts it back",
        target,
        copy,
    )
    return copy


def verify(directory: Path) -> None:
    """Check that every expected file is there and matches its recorded SHA-256."""
    _verify_checksums(directory, _expected_checksums(directory))


def _expected_checksums(directory: Path) -> dict[str, str]:
    """The checksums.json of a model directory, once every file it must have is there.

    `verify`'s quick half: it reads no file but checksums.json.

    Raises:
        CheckpointError: No such directory.
        CorruptCheckpointError: A file is missing, or checksums.json is not JSON.
    """
    if not directory.is_dir():
        raise CheckpointError(f"model directory not found: {directory}")
    missing = [name for name in (*MODEL_FILES, CHECKSUMS_FILE) if not (directory / name).is_file()]
    if TOKENIZER_FILE in missing and all((directory / n).is_file() for n in SPLIT_TOKENIZER_FILES):
        missing.remove(TOKENIZER_FILE)  # a split tokenizer instead
    if missing:
        raise CorruptCheckpointError(
            f"{directory} is not a complete aiayn model directory: missing {', '.join(missing)}"
        )
    try:
        checksums = json.loads((directory / CHECKSUMS_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(f"{directory / CHECKSUMS_FILE} is corrupt: {error}") from None
    if not isinstance(checksums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
    ):
        raise CorruptCheckpointError(
            f"{directory / CHECKSUMS_FILE} is corrupt: not an object of file names and SHA-256 "
            "digests"
        )
    return checksums


def _verify_checksums(
    directory: Path, checksums: dict[str, str], stop: threading.Event | None = None
) -> None:
    """Check that every file of `checksums` matches its SHA-256 (`verify`'s slow half: it reads
    them). With `stop`, returns early, unchecked, once it is set (its caller gave up)."""
    for name, expected in checksums.items():
        file = directory / name
        if not file.is_file():
            raise CorruptCheckpointError(f"{directory}: missing {name}")
        digest = sha256_of(file, stop)
        if stop is not None and stop.is_set():
            return
        if digest != expected:
            raise CorruptCheckpointError(
                f"{file} is corrupt or truncated (SHA-256 does not match checksums.json)"
            )


def read_model_config(directory: str | Path) -> ModelConfig:
    """A model directory's `ModelConfig`, checked against its weights' shapes if it has them.

    Everything that builds a model reads its config here, so that a config.json whose sizes
    are not the weights' (edited by hand, or copied from another model) is refused by name
    before the model is built: d_model 2^40 would otherwise ask the allocator for petabytes.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        config = ModelConfig.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ConfigError, TypeError) as error:
        raise CheckpointError(f"{path}: invalid model config: {error}") from None
    if (Path(directory) / WEIGHTS_FILE).is_file():
        check_sizes(config, path, Path(directory) / WEIGHTS_FILE)
    return config


# Where the weights file records each size of a `ModelConfig`: (tensor, dimension), by the
# model's parameter names. The layer counts are counted from the names.
_SIZES_IN_WEIGHTS = {
    "src_vocab_size": ("src_embed.embedding.weight", 0),
    "d_model": ("src_embed.embedding.weight", 1),
    "tgt_vocab_size": ("tgt_embed.embedding.weight", 0),
    "d_ff": ("encoder.layers.0.feed_forward.linear1.weight", 0),
    "n_heads × d_k": ("encoder.layers.0.self_attn.q_proj.weight", 0),
    "n_heads × d_v": ("encoder.layers.0.self_attn.v_proj.weight", 0),
    "max_positions": ("positions.embedding.weight", 0),  # learned positions only
}
_LAYER = re.compile(r"(?P<stack>encoder|decoder)\.layers\.(?P<index>\d+)\.")


def check_sizes(config: ModelConfig, config_file: Path, weights_file: Path) -> None:
    """Refuse a config whose sizes differ from the shapes in `weights_file`, naming the field.

    Reads the safetensors header only (no tensor). Which tensors exist (another architecture)
    is `load_weights`'s to check; this check is what must come before building the model.
    """
    shapes = _weight_shapes(weights_file)
    given = config.to_dict() | {
        "n_heads × d_k": config.n_heads * config.d_k,
        "n_heads × d_v": config.n_heads * config.d_v,
    }
    found: list[tuple[str, int, str]] = []  # (field, size in the weights, where it is seen)
    for name, (tensor, dim) in _SIZES_IN_WEIGHTS.items():
        if (shape := shapes.get(tensor)) is not None and len(shape) > dim:
            found.append((name, shape[dim], f"{tensor} has shape {list(shape)}"))
    for stack in ("encoder", "decoder"):
        layers = {int(m["index"]) for n in shapes if (m := _LAYER.match(n)) and m["stack"] == stack}
        if layers:
            found.append(
                (f"n_{stack}_layers", len(layers), f"{stack}.layers.* counts {len(layers)}")
            )
    for name, size, seen in found:
        if given[name] != size:
            raise CheckpointError(
                f"{config_file}: {name} ({given[name]}) does not match the weights in "
                f"{weights_file}, where {seen}; the config was edited or belongs to other weights"
            )


def _weight_shapes(weights_file: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file, also under the names of the shared weights
    that `save_model` stored once (its metadata maps each to the name stored)."""
    try:
        with safe_open(str(weights_file), framework="numpy") as f:  # numpy's: no torch
            names = f.keys()  # a safe_open is not iterable
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise CorruptCheckpointError(
            f"{weights_file} is corrupt or truncated (its header cannot be read: {error})"
        ) from None
    aliases = {name: shapes[kept] for name, kept in metadata.items() if kept in shapes}
    return aliases | shapes


def load_model_dir(directory: str | Path, *, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a model directory (or a run directory's `model/`), verified, in eval mode.

    Every file is checked against its recorded SHA-256 (`verify`). The weights' checksum is
    computed on a thread of its own while the model is built and the weights are read: hashlib
    and the reads release the interpreter lock, so on two cores a `base` model loads in 0.32 s,
    not 0.37 (medians of 6 in one process; the hashing alone takes 0.15 s). The small files
    are checked before anything is built from them. Nothing is returned before the weights
    match; where they do not, that is the error raised, also when loading failed first (a
    truncated file, say). Ctrl-C stops the hashing at once.
    """
    from aiayn.model import Transformer

    directory = resolve_model_dir(directory)
    checksums = _expected_checksums(directory)
    weights = {name: digest for name, digest in checksums.items() if name == WEIGHTS_FILE}
    # The small files first: a config.json changed by a byte could ask for any model size.
    _verify_checksums(directory, {n: d for n, d in checksums.items() if n not in weights})
    stop = threading.Event()
    # The pool's thread ends with this block: nothing of it outlives the load (a decoding
    # worker forked next forks a process with no thread of ours).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiayn-verify") as pool:
        verified = pool.submit(_verify_checksums, directory, weights, stop)
        try:
            config = read_model_config(directory)
            model = Transformer(config, initialize=False)  # every weight is loaded next
            load_weights(model, directory / WEIGHTS_FILE)
        except Exception:
            verified.result()  # weights that do not match their checksum are the error raised
            raise
        except BaseException:  # Ctrl-C: the hashing stops within a MiB, and the block ends
            stop.set()
            raise
        verified.result()
    metadata = read_metadata(directory)
    return LoadedModel(
        model=model.to(device).eval(),
        config=config,
        tokenizer_file=tokenizer_file_of(directory),
        metadata=metadata,
        directory=directory,
    )


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """A model directory's or checkpoint's metadata.json (languages, step, ...), or {} where it
    has none or it is not a JSON object."""
    try:
        metadata = json.loads((Path(directory) / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return metadata if isinstance(metadata, dict) else {}


def tokenizer_file_of(directory: str | Path) -> Path:
    """The tokenizer of a model directory or checkpoint, as `tokenizer.load_tokenizer` takes it:
    `tokenizer.model`, or a split tokenizer's `vocab.json` (tokenizer.SplitTokenizer)."""
    joint = Path(directory) / TOKENIZER_FILE
    return joint if joint.is_file() else Path(directory) / VOCAB_FILE


def load_weights(model: nn.Module, weights_file: Path) -> None:
    """Load safetensors weights into `model`, with errors that name the file."""
    from safetensors.torch import load_model

    try:
        missing, unexpected = load_model(unwrap(model), str(weights_file), strict=False)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise CheckpointError(f"cannot load weights from {weights_file}: {error}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_file} does not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


# -- file system helpers --------------------------------------------------------------------


def sha256_of(path: Path, stop: threading.Event | None = None) -> str:
    """The SHA-256 of a file, read in 1 MiB pieces (checksums.json records these); with
    `stop`, the digest of what was read before it was set (no file's: its caller gave up)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            if stop is not None and stop.is_set():
                break
    return digest.hexdigest()


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a size limit
_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)  # what the writers raise


def _disk_full_errno(error: BaseException) -> int | None:
    """ENOSPC, EDQUOT or EFBIG if `error` comes from a full disk, a quota or a file size
    limit, else None.

    safetensors (Rust) reports I/O errors as a SafetensorError whose text ends with
    "(os error N)" rather than as an OSError.
    """
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        return error.errno
    return next((code for code in _DISK_FULL if f"(os error {code})" in str(error)), None)


def _sort_header_metadata(weights_file: Path) -> None:
    """Put the metadata in a safetensors file's header in sorted order, in place.

    safetensors writes it in the order of a Rust HashMap, random per save (safetensors#584),
    so the same weights saved twice differed byte for byte, checksums.json with them. The
    header (8 bytes of length, then JSON padded with spaces) is rewritten as the same JSON in
    the same compact form, so its length, and every tensor's offset, stay as they were.
    """
    with open(weights_file, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= length:  # always: the same JSON; never move the tensors
            f.seek(8)
            f.write(text.ljust(length))


def _bytes_needed(
    model: nn.Module, tokenizer_file: str | Path, extra_files: dict[str, Any] | None
) -> int:
    """About what a save writes: every tensor's storage once (shared weights are stored
    once), the tokenizer, and a margin for the formats' headers and the small JSON files."""
    tensors = [*model.state_dict().values(), *_tensors_in(extra_files)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    files = [file for file in tokenizer_files(Path(tokenizer_file)) if file.is_file()]
    tokenizer = sum(file.stat().st_size for file in files)
    return sum(storages.values()) + tokenizer + 512 * len(tensors) + 64 * 1024


def _tensors_in(values: Any) -> list[torch.Tensor]:
    """The tensors in nested dicts, lists and tuples (a training state)."""
    import torch

    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (list, tuple)):
        return [tensor for value in values for tensor in _tensors_in(value)]
    return []


def _free_bytes(path: Path) -> int:
    """Free space (for this user) on the file system that holds `path` or its nearest parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _size(n: float) -> str:
    """A byte count for people: 1536 → "1.5 KiB"."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while n >= 1024 and unit < len(units) - 1:
        n /= 1024
        unit += 1
    return f"{n:.0f} bytes" if unit == 0 else f"{n:.1f} {units[unit]}"


def _fsync_dir(directory: Path) -> None:
    for path in directory.iterdir():
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
