"""Models that travel: aiayn model directories to and from other runtimes and formats.

- `export_ctranslate2` / `CTranslate2Translator` (`aiayn.interop.ctranslate2`): a directory
  CTranslate2 runs, which `Translator` loads like a model directory
- `export_hf`, `import_marian` (`aiayn.interop.marian`): Hugging Face `MarianMTModel`
- `export_onnx` / `OnnxModel` (`aiayn.interop.onnx`): encoder and decoder step as ONNX graphs,
  which `Translator` loads like a model directory

Exporters and importers only: decoding an export is decoding's business
(`aiayn.decode.backends`): `CTranslate2Translator` is ``Translator(export_dir)``, and
`OnnxModel` is the ONNX backend's, named here too.

The peer runtimes are optional: `pip install -e '.[export]'`. Names are imported lazily, so
that `import aiayn.interop` needs none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

# Defined with the backends that run the exports (which check outputs against it); here too.
from aiayn.decode.backends import EXTRA_POSITIONS as EXTRA_POSITIONS

_WHERE = {
    "export_ctranslate2": "ctranslate2",
    "CTranslate2Translator": "ctranslate2",
    "export_hf": "marian",
    "import_marian": "marian",
    "export_onnx": "onnx",
    "OnnxModel": "onnx",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'aiayn.interop' has no attribute {name!r}")
    return getattr(importlib.import_module(f"aiayn.interop.{_WHERE[name]}"), name)
