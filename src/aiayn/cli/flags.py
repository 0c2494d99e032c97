"""Command-line flags generated from dataclasses: one ``--field-name`` per field, its help the
field's description in the class's ``Attributes:`` docstring and its default read from the field
(so ``--help`` cannot restate a default that has changed), its type from the annotation.

`dataclass_values` inverts it: the fields the user gave, so that the dataclass keeps its own
defaults for the rest. `TrainConfig` (``aiayn train``), `DecodingOptions` (the search flags) and
`ServerSettings` (``aiayn serve``'s limits) are turned into flags this way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, TypeVar

import yaml

from aiayn.config import number_problem, shown
from aiayn.errors import UserValueError

T = TypeVar("T")

__all__ = [
    "add_dataclass_flags",
    "attribute_docs",
    "dataclass_from_args",
    "dataclass_values",
    "integer",
    "number",
    "parse_assignments",
]


def attribute_docs(cls: type) -> dict[str, str]:
    """Each attribute's description in the ``Attributes:`` section of ``cls``'s Google-style
    docstring, continuation lines joined and reST markup removed. An entry may describe several
    attributes at once (``src, tgt: Line-aligned training files.``)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    entry_indent = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the next section
            break
        entry_indent = entry_indent or indent
        entry = re.fullmatch(r"(\w+(?:, \w+)*):\s*(.*)", text)
        if indent == entry_indent and entry:
            names = entry.group(1).split(", ")
            for name in names:
                docs[name] = entry.group(2)
        else:
            for name in names:
                docs[name] = f"{docs[name]} {text}".strip()
    return {name: _plain(text) for name, text in docs.items()}


def _plain(text: str) -> str:
    """The text without reST markup: a role (:mod:), backquotes (single or double)."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", text)


def integer(text: str) -> int:
    """An integer flag's value, refused as argparse refuses a bad one (exit 2, naming the flag)
    if it is not an integer or is larger than `aiayn.config.MAX_NUMBER`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {shown(text)!r}") from None
    if problem := number_problem(value):
        raise argparse.ArgumentTypeError(f"{shown(text)} {problem}")
    return value


def number(text: str) -> float:
    """A float flag's value, refused as argparse refuses a bad one if it is not a number, is
    not finite (``inf``, ``nan``) or is larger than `aiayn.config.MAX_NUMBER`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {shown(text)!r}") from None
    if problem := number_problem(value):
        raise argparse.ArgumentTypeError(f"{shown(text)} {problem}")
    return value


def _flag_type(name: str, hint: Any) -> dict[str, Any]:
    """argparse keywords for a field annotated ``hint``: int or float (`integer`, `number`:
    finite, within `aiayn.config.MAX_NUMBER`), str, bool (--x/--no-x), a Literal (choices), or
    one of these ``| None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return {"type": type(choices[0]), "choices": choices}
    if hint in (int, float, str):
        return {"type": {int: integer, float: number, str: str}[hint]}
    raise TypeError(f"no command-line flag for field {name} of type {hint}")


def add_dataclass_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Sequence[str] | None = None,
    skip: Collection[str] = (),
    names: Mapping[str, str] | None = None,
) -> None:
    """Adds a ``--field-name`` flag for each field of the dataclass ``cls``: those in ``only``
    (in that order), or else all but ``skip``. ``names`` gives some fields another flag
    (``{"timeout_head_s": "--timeout-head"}``); the value still goes to the field's name.

    The type comes from the annotation (see :func:`_flag_type`). The help is the field's
    description in the class's ``Attributes:`` docstring (:func:`attribute_docs`) followed by
    "(default: X)" read from the field, so it cannot go stale (nothing for None: the description
    says what an unset field means); a field without a description
    is an error. A flag not given parses as None, so that :func:`dataclass_values` returns
    exactly what the user set and the dataclass keeps the defaults.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # The annotations are strings (PEP 563), resolved in the class's module, which a caller may
    # have dropped from sys.modules (tests that simulate a missing extra do): import it again.
    module = sys.modules.get(cls.__module__) or importlib.import_module(cls.__module__)
    hints = typing.get_type_hints(cls, globalns=vars(module))
    docs = attribute_docs(cls)
    for name in only if only is not None else [n for n in fields if n not in skip]:
        if name not in docs:
            raise TypeError(f"{cls.__name__}.{name} has no description in the class docstring")
        default = _default_text(fields[name])
        # A None default means "not set"; the description says what happens then.
        help_text = docs[name] if default == "None" else f"{docs[name]} (default: {default})"
        flag = (names or {}).get(name) or "--" + name.replace("_", "-")
        keywords = _flag_type(name, hints[name])
        if "type" in keywords and "choices" not in keywords:
            keywords["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        parser.add_argument(
            flag, dest=name, default=None, help=help_text.replace("%", "%%"), **keywords
        )


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return str(f.default)
    return str(f.default_factory())  # type: ignore[misc]


def dataclass_values(
    cls: type, args: argparse.Namespace, *, skip: Collection[str] = ()
) -> dict[str, Any]:
    """The fields of ``cls`` given as flags made by :func:`add_dataclass_flags`."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in skip:
            values[f.name] = value
    return values


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` built from the flags given; its own defaults for the rest."""
    return cls(**dataclass_values(cls, args))


def parse_assignments(items: Sequence[str], flag: str) -> dict[str, Any]:
    """['d_model=256', 'norm_first=true'] → {'d_model': 256, 'norm_first': True}."""
    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserValueError(f"{flag} expects FIELD=VALUE, got {item!r}")
        values[key.strip()] = yaml.safe_load(raw)
    return values
