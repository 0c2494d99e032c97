"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The names most users need are importable from the package itself::

    from aiayn import Translator

    translator = Translator("runs/en-es/model")
    print(translator.translate(["In the beginning God created the heavens."])[0].text)

``Transformer`` (the model), ``ModelConfig`` (its hyperparameters), ``Translator`` (a trained
model directory, ready to translate) and ``DecodingOptions`` (beam size, length penalty and the
other §6.1 search settings ``Translator.translate`` takes) are imported on first use (PEP 562),
so ``import aiayn`` does not import PyTorch: a tool that only needs ``aiayn.__version__`` or one
light module stays fast. Everything else lives in the module named after its concept
(``aiayn.decode.search``, ``aiayn.train.trainer``, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name → the module that defines it.
_LAZY = {
    "DecodingOptions": "aiayn.decode.options",
    "ModelConfig": "aiayn.config",
    "Transformer": "aiayn.model",
    "Translator": "aiayn.decode.translator",
    "UserError": "aiayn.errors",
}

__all__ = [
    "DecodingOptions",
    "ModelConfig",
    "Transformer",
    "Translator",
    "UserError",
    "__version__",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ below
    from aiayn.config import ModelConfig
    from aiayn.decode.options import DecodingOptions
    from aiayn.decode.translator import Translator
    from aiayn.errors import UserError
    from aiayn.model import Transformer


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
