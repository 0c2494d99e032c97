"""The one way to load a backend from a directory: an aiayn model directory (or several, an
ensemble), an ONNX export or a CTranslate2 export, told apart by their files
(`aiayn.decode.backends.export_kind`); what ``Translator(directory)`` runs.

Each kind's backend module (and torch, for PyTorch and ONNX) is imported only when a directory
of that kind is loaded, so that a CTranslate2 export loads without torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.decode.backends import Backend, export_kind
from aiayn.errors import CheckpointError, UserValueError

if TYPE_CHECKING:
    import torch

    from aiayn.text.tokenizer import SplitTokenizer, Tokenizer

__all__ = ["LoadedBackend", "load_backend"]


@dataclass(frozen=True)
class LoadedBackend:
    """What `load_backend` loaded.

    Attributes:
        backend: Runs the model.
        tokenizer: The model's tokenizer.
        metadata: The model directory's ``metadata.json`` (the first of an ensemble), or the
            one an export carries.
        model_dirs: The directories loaded.
        worker_processes: How many forked processes decode batches at once
            (`aiayn.decode.workers`): the ``workers`` asked for where the backend runs in
            PyTorch, else 1 (CTranslate2 decodes its ``workers`` in threads of its own).
    """

    backend: Backend
    tokenizer: Tokenizer | SplitTokenizer
    metadata: dict[str, Any]
    model_dirs: list[Path]
    worker_processes: int = 1


def load_backend(
    model_dir: str | Path | Sequence[str | Path],
    *,
    device: str | torch.device = "cpu",
    threads: int = 0,
    int8: bool = False,
    bf16: bool = False,
    onednn: bool | None = None,
    workers: int = 1,
    compute_type: str | None = None,
) -> LoadedBackend:
    """The backend over an aiayn model directory (or several: an ensemble), an ONNX export or
    a CTranslate2 export, told apart by their files (`export_kind`); ``Translator``'s
    constructor says what each argument does.

    Raises:
        CheckpointError: A directory is missing, incomplete or corrupt, or an ensemble mixes
            exports with model directories.
        UserValueError: An option this kind of model does not take.
    """
    if threads < 0:
        raise UserValueError(f"threads ({threads}) must be >= 0 (0 = the runtime's default)")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserValueError(f"workers ({workers!r}) must be a positive integer")
    dirs = [model_dir] if isinstance(model_dir, (str, Path)) else list(model_dir)
    if not dirs:
        raise ValueError("no model directory given")
    kinds = [export_kind(d) for d in dirs]
    exported = [(d, kind) for d, kind in zip(dirs, kinds, strict=True) if kind is not None]
    if exported and len(dirs) > 1:
        directory, kind = exported[0]
        raise CheckpointError(
            f"{directory} is a {_KIND_NAMES[kind]} export: an ensemble takes aiayn model "
            "directories"
        )
    if kinds[0] != "ctranslate2" and compute_type is not None:
        raise UserValueError(
            "compute_type is CTranslate2's: give it with a CTranslate2 export "
            "(aiayn export --to ctranslate2)"
        )
    if kinds[0] == "onnx":
        return _load_onnx(Path(dirs[0]), device, threads, int8, bf16, workers)
    if kinds[0] == "ctranslate2":
        return _load_ctranslate2(
            Path(dirs[0]), str(device), threads, int8, bf16, onednn, workers, compute_type
        )
    return _load_pytorch(dirs, device, threads, int8, bf16, onednn, workers)


_KIND_NAMES = {"onnx": "ONNX", "ctranslate2": "CTranslate2"}


def _load_onnx(
    directory: Path, device: Any, threads: int, int8: bool, bf16: bool, workers: int
) -> LoadedBackend:
    import torch

    from aiayn.decode.backends.onnx import OnnxBackend, load_onnx_export

    if int8 or bf16 or torch.device(device).type != "cpu":
        raise UserValueError("an ONNX export runs in float32 on the CPU (onnxruntime)")
    if workers > 1:
        raise UserValueError("an ONNX export decodes in one process: workers must be 1")
    model, tokenizer = load_onnx_export(directory, threads=threads)
    return LoadedBackend(OnnxBackend(model), tokenizer, model.metadata, [directory])


def _load_ctranslate2(
    directory: Path,
    device: str,
    threads: int,
    int8: bool,
    bf16: bool,
    onednn: bool | None,
    workers: int,
    compute_type: str | None,
) -> LoadedBackend:
    from aiayn.decode.backends.ctranslate2 import CTranslate2Backend

    if int8 or bf16:
        kind = "int8" if int8 else "bfloat16"
        raise UserValueError(
            f"{'int8' if int8 else 'bf16'} is PyTorch's; with a CTranslate2 export give "
            f"compute_type={kind!r}"
        )
    if onednn is not None:
        raise UserValueError("onednn is PyTorch's: CTranslate2 picks its own CPU kernels")
    backend = CTranslate2Backend(
        directory,
        device=device,
        compute_type=compute_type or "default",
        threads=threads,
        workers=workers,
    )
    return LoadedBackend(backend, backend.tokenizer, backend.metadata, [directory])


def _load_pytorch(
    dirs: list[str | Path],
    device: Any,
    threads: int,
    int8: bool,
    bf16: bool,
    onednn: bool | None,
    workers: int,
) -> LoadedBackend:
    if threads > 0:
        warnings.warn(
            f"threads={threads} is not the translator's to set: PyTorch's threads belong "
            f"to the process; call aiayn.runtime.configure(threads={threads}) instead",
            stacklevel=4,  # the caller of Translator(...)
        )
    if workers > 1:
        from aiayn.decode.workers import fork_missing
        from aiayn.runtime import checked_device

        if checked_device(device).type != "cpu":
            raise UserValueError(f"workers decode on the CPU, not on {device}: use 1")
        if (reason := fork_missing()) is not None:
            raise UserValueError(f"workers={workers}: {reason}; use 1")
    from aiayn.decode.backends.pytorch import load_model_dirs

    backend, tokenizer, loaded = load_model_dirs(
        dirs, device=device, int8=int8, bf16=bf16, onednn=onednn
    )
    directories = [one.directory for one in loaded]
    return LoadedBackend(backend, tokenizer, loaded[0].metadata, directories, workers)
