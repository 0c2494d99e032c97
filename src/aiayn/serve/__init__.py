"""The HTTP translation service (``aiayn serve``): aiayn's JSON API, LibreTranslate's, a web page.

A leaf of the package with its own dependency stack (FastAPI, uvicorn, httptools,
python-multipart), so it lives apart from the model and the translator, which never import it,
and those dependencies are the optional extra ``aiayn[serve]``: using the application without
them (``from aiayn.serve import serve``, or importing :mod:`aiayn.serve.app`) raises a one-line
:class:`aiayn.extras.MissingExtra` that says how to install them. The settings
(:mod:`aiayn.serve.settings`) need neither them nor PyTorch, so that the CLI can build ``aiayn
serve``'s flags from them; this package's names are therefore imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Decoding": "settings",
    "ServerSettings": "settings",
    "create_app": "app",
    "serve": "app",
    "serve_in_background": "app",
}

__all__ = ["Decoding", "ServerSettings", "create_app", "serve", "serve_in_background"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'aiayn.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"aiayn.serve.{_WHERE[name]}"), name)
