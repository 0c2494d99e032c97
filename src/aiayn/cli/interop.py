"""``aiayn export`` and ``aiayn import``: model directories to and from CTranslate2, Hugging Face
(Marian) and ONNX (:mod:`aiayn.interop`, docs/interop.md).

``-o`` never destroys what aiayn did not write: it may name a new or empty directory, or a
previous output of the same kind holding only the files that kind writes; anything else is
refused before the (slow) conversion. The output is written next to it under a temporary name
and then swapped in, so a failed conversion leaves an earlier output as it was.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# aiayn.interop.ctranslate2.QUANTIZATIONS, restated so that building the parser imports no torch
# (a test checks that they agree).
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")
_LABELS = {"ctranslate2": "CTranslate2", "hf": "Hugging Face (Marian)", "onnx": "ONNX"}


@dataclass(frozen=True)
class _Kind:
    """What one kind of output directory looks like."""

    name: str  # for messages
    markers: tuple[str, ...]  # files every such directory holds
    files: frozenset[str]  # every file the writer may put there

    def holds(self, directory: Path) -> bool:
        return all((directory / m).is_file() for m in self.markers)


_TOKENIZER_FILES = ("tokenizer.model", "source.spm", "target.spm", "vocab.json")
KINDS = {
    "ctranslate2": _Kind(
        "a CTranslate2 export",
        ("model.bin", "aiayn.json"),
        frozenset(
            {
                "model.bin",
                "config.json",
                "aiayn.json",
                "shared_vocabulary.json",
                "source_vocabulary.json",
                "target_vocabulary.json",
                *_TOKENIZER_FILES,
            }
        ),
    ),
    "hf": _Kind(
        "a Hugging Face export",
        ("config.json", "model.safetensors", "generation_config.json"),
        frozenset(
            {
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "added_tokens.json",
                *_TOKENIZER_FILES,
            }
        ),
    ),
    "onnx": _Kind(
        "an ONNX export",
        ("encoder.onnx", "decoder_step.onnx", "aiayn.json"),
        frozenset({"encoder.onnx", "decoder_step.onnx", "aiayn.json", *_TOKENIZER_FILES}),
    ),
    "aiayn": _Kind(
        "an aiayn model directory",
        ("config.json", "model.safetensors", "metadata.json"),
        frozenset(
            {
                "config.json",
                "model.safetensors",
                "metadata.json",
                "checksums.json",
                *_TOKENIZER_FILES,
            }
        ),
    ),
}


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a model directory for CTranslate2, Hugging Face (Marian) or ONNX Runtime",
        description="Convert an aiayn model directory for another runtime (docs/interop.md). "
        "'aiayn translate/evaluate/serve -m DIR' run a CTranslate2 or ONNX export directly. "
        "Needs the optional runtimes: pip install -e '.[export]'.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (or run directory)")
    p.add_argument(
        "--to",
        required=True,
        choices=("ctranslate2", "hf", "onnx"),
        help="ctranslate2: CTranslate2's model.bin with the tokenizer; hf: a MarianMTModel "
        "directory for transformers; onnx: encoder.onnx and decoder_step.onnx",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output directory: new, empty, or an earlier export of the same kind (replaced)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="ctranslate2 only: how the weights are stored (default: float32)",
    )
    p.add_argument(
        "--opset", type=int, help="onnx only: the ONNX opset of the graphs (default: 18)"
    )
    p.set_defaults(run=_run_export)

    p = sub.add_parser(
        "import",
        help="convert a Hugging Face Marian directory (e.g. OPUS-MT) to an aiayn model directory",
        description="Convert a local Hugging Face MarianMTModel directory (config.json, "
        "weights, source.spm, target.spm, vocab.json; nothing is downloaded) into an aiayn "
        "model directory that translate, evaluate and serve load. Models aiayn cannot "
        "represent are refused with the field that differs. Needs pip install -e '.[export]'.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="the Hugging Face Marian directory")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="output model directory: new, empty, or an earlier aiayn model directory",
    )
    p.set_defaults(run=_run_import)


def _run_export(args: argparse.Namespace) -> int:
    if args.quantization is not None and args.to != "ctranslate2":
        raise ValueError(f"--quantization is for --to ctranslate2, not --to {args.to}")
    if args.opset is not None and args.to != "onnx":
        raise ValueError(f"--opset is for --to onnx, not --to {args.to}")
    from aiayn.checkpoint import resolve_model_dir

    model_dir = resolve_model_dir(args.model_dir)
    output = Path(args.output)
    check_output_dir(output, args.to)
    if args.to == "ctranslate2":
        from aiayn.interop.ctranslate2 import export_ctranslate2

        _write_replacing(output, lambda tmp: export_ctranslate2(model_dir, tmp, args.quantization))
    elif args.to == "hf":
        from aiayn.interop.marian import export_hf

        _write_replacing(output, lambda tmp: export_hf(model_dir, tmp))
    else:
        from aiayn.interop.onnx import OPSET, export_onnx

        opset = OPSET if args.opset is None else args.opset
        _write_replacing(output, lambda tmp: export_onnx(model_dir, tmp, opset=opset))
    print(f"exported {model_dir} to {_LABELS[args.to]}: {output}")
    return 0


def _run_import(args: argparse.Namespace) -> int:
    hf_dir = Path(args.hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    output = Path(args.output)
    check_output_dir(output, "aiayn")
    from aiayn.interop.marian import import_marian

    _write_replacing(output, lambda tmp: import_marian(hf_dir, tmp))
    print(f"imported {hf_dir} into {output}")
    return 0


def check_output_dir(directory: Path, kind: str) -> None:
    """Refuse an output directory that writing a `kind` output would destroy (see the module
    docstring); a missing or empty one, or an earlier output of that kind, passes."""
    from aiayn.checkpoint import CheckpointError, is_run_dir

    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(f"{directory} exists and is not a directory (nothing was changed)")
    if is_run_dir(directory) or is_run_dir(directory.resolve().parent):
        raise CheckpointError(
            f"{directory} is a training run directory or inside one; choose another output "
            "directory (nothing was changed)"
        )
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return
    wanted = KINDS[kind]
    if not wanted.holds(directory):
        other = next((k.name for k in KINDS.values() if k.holds(directory)), None)
        if other:
            raise CheckpointError(
                f"{directory} holds {other}, not {wanted.name}; choose another output directory "
                "(nothing was changed)"
            )
        foreign = names
    else:
        foreign = [name for name in names if name not in wanted.files]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise CheckpointError(
            f"{directory} already holds files that are not {wanted.name}'s ({shown}); choose "
            "another output directory (nothing was changed)"
        )


def _write_replacing(output: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a fresh sibling of ``output``, then put it in ``output``'s place
    (the earlier output, already checked by `check_output_dir`, is removed only then)."""
    output = output.absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if output.exists():
            output.rename(old)
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
