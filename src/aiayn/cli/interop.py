"""``aiayn export`` and ``aiayn import``: model directories to and from CTranslate2, Hugging Face
(Marian) and ONNX (:mod:`aiayn.interop`, docs/interop.md).

What ``-o`` may replace is :mod:`aiayn.cli.output_dir`'s rule, the one of ``aiayn average``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.flags import integer
from aiayn.cli.output_dir import check_output_dir, write_replacing
from aiayn.errors import UserFileNotFoundError, UserValueError

# aiayn.interop.ctranslate2.QUANTIZATIONS, restated so that building the parser imports no torch
# (a test checks that they agree).
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")
_LABELS = {"ctranslate2": "CTranslate2", "hf": "Hugging Face (Marian)", "onnx": "ONNX"}


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
        "--opset", type=integer, help="onnx only: the ONNX opset of the graphs (default: 18)"
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
        raise UserValueError(f"--quantization is for --to ctranslate2, not --to {args.to}")
    if args.opset is not None and args.to != "onnx":
        raise UserValueError(f"--opset is for --to onnx, not --to {args.to}")
    from aiayn.model_dir import resolve_model_dir

    model_dir = resolve_model_dir(args.model_dir)
    output = check_output_dir(Path(args.output), args.to)
    if args.to == "ctranslate2":
        from aiayn.interop.ctranslate2 import export_ctranslate2

        write_replacing(output, lambda tmp: export_ctranslate2(model_dir, tmp, args.quantization))
    elif args.to == "hf":
        from aiayn.interop.marian import export_hf

        write_replacing(output, lambda tmp: export_hf(model_dir, tmp))
    else:
        from aiayn.interop.onnx import OPSET, export_onnx

        opset = OPSET if args.opset is None else args.opset
        write_replacing(output, lambda tmp: export_onnx(model_dir, tmp, opset=opset))
    print(f"exported {model_dir} to {_LABELS[args.to]}: {output}")
    return 0


def _run_import(args: argparse.Namespace) -> int:
    hf_dir = Path(args.hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise UserFileNotFoundError(
            f"{hf_dir} is not a Hugging Face model directory (no config.json)"
        )
    output = check_output_dir(Path(args.output), "aiayn")
    from aiayn.interop.marian import import_marian

    write_replacing(output, lambda tmp: import_marian(hf_dir, tmp))
    print(f"imported {hf_dir} into {output}")
    return 0
