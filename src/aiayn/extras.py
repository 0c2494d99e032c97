"""Optional dependencies ("extras"): what needs them says how to install them.

Training and translating need only torch, numpy and sentencepiece (and a few small libraries).
The HTTP server (``aiayn[serve]``: FastAPI, uvicorn with httptools, python-multipart) and the
pictures (``aiayn[viz]``: matplotlib) install on request, so a package that needs one imports
it through :func:`require`, which turns a missing module into a one-line :class:`MissingExtra`
naming the command to run. The CLI prints it as one line, not as a traceback: it is a
:class:`~aiayn.errors.UserError`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from aiayn.errors import UserError

__all__ = ["MissingExtra", "require"]


class MissingExtra(UserError, ImportError):
    """A module of an optional extra is not installed; the message says how to install it."""


def require(extra: str, *modules: str, needed_by: str) -> list[ModuleType]:
    """Imports ``modules`` (the first of ``"a|b"`` alternatives that imports), or raises
    :class:`MissingExtra` naming ``extra``.

    Args:
        extra: The extra of pyproject.toml that installs the modules ("serve", "viz").
        *modules: Import names; ``"python_multipart|multipart"`` accepts either.
        needed_by: What needs them, for the message ("aiayn serve").
    """
    imported = []
    for spec in modules:
        names = spec.split("|")
        for name in names:
            try:
                imported.append(importlib.import_module(name))
                break
            except ImportError:
                continue
        else:
            raise MissingExtra(
                f"{needed_by} needs {names[0]}, which is not installed: "
                f"pip install -e '.[{extra}]' in the aiayn checkout "
                f"(or pip install 'aiayn[{extra}]')"
            )
    return imported
