"""docs/paper_map.md names real code and real tests.

The map is the index a reader uses to go from the paper to the code, so a stale row misleads
exactly the reader it was written for. Every backticked reference in it is resolved here by
name (importing the module, looking the symbol up, reading the test files), not compared with a
list kept in this file, so the test keeps working as modules move and fails only when the map no
longer says where things are.

What counts as a reference (any other backticked text, a formula or a field name, is prose):

- ``tests/test_x.py`` and ``tests/test_x.py::test_name``: the file, and the test in it;
- ``test_name`` (``test_prefix_*`` for a family): a test defined somewhere under ``tests/``;
- ``module.symbol[.attr]``, with or without ``aiayn.``: an importable module of aiayn and an
  attribute of it (``module.py`` names a module file);
- ``Class.attr``: a class defined in some aiayn module that has that attribute (a method, a
  dataclass field, or an attribute its methods set on ``self``);
- ``aiayn COMMAND --flag ...``: a command of the CLI that takes those flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import aiayn

ROOT = Path(__file__).resolve().parents[1]
PAPER_MAP = ROOT / "docs" / "paper_map.md"
TESTS = ROOT / "tests"
PACKAGE = Path(aiayn.__file__).parent

_TEST_FILE = re.compile(r"tests/[\w/]+\.py(::\w+)?")
_TEST_NAME = re.compile(r"test_\w+\*?")
_DOTTED = re.compile(r"(aiayn\.)?[a-z_]\w*(\.\w+)+")
_CLASS_ATTR = re.compile(r"[A-Z]\w*\.\w+")
_MODULE_FILE = re.compile(r"[a-z_]\w*\.py")
_COMMAND = re.compile(r"aiayn [a-z][\w-]*( .*)?")


def references() -> list[str]:
    """Every backticked span of the map that names code, a test or a command."""
    spans = re.findall(r"`([^`\n]+)`", PAPER_MAP.read_text(encoding="utf-8"))
    patterns = (_TEST_FILE, _TEST_NAME, _DOTTED, _CLASS_ATTR, _MODULE_FILE, _COMMAND)
    kept = [s for s in spans if any(p.fullmatch(s) for p in patterns)]
    return list(dict.fromkeys(kept))  # once each, in order


@functools.cache
def defined_tests() -> dict[Path, set[str]]:
    """The test functions (and methods) each file under tests/ defines."""
    names = {}
    for path in TESTS.rglob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names[path] = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name.startswith("test_")
        }
    return names


@functools.cache
def aiayn_modules() -> tuple[ModuleType, ...]:
    """Every module of the package that imports here (one needing a missing extra is skipped)."""
    modules = [aiayn]
    for info in pkgutil.walk_packages(aiayn.__path__, "aiayn."):
        if info.name == "aiayn.__main__":
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:
            continue
    return tuple(modules)


def has_attribute(cls: type, name: str) -> bool:
    """A method or class attribute, a dataclass field, or an attribute set on ``self``."""
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]", source) is not None


def resolve_dotted(reference: str) -> Any:
    """``[aiayn.]module[.sub].symbol[.attr]``: the longest importable module prefix, then
    attributes (the last one may be an instance attribute of a class).

    A name outside aiayn that the map cites as a reference (``torch.nn.Transformer``) resolves
    the same way from its own package.
    """
    parts = reference.removeprefix("aiayn.").split(".")
    package = "aiayn." if importlib.util.find_spec("aiayn." + parts[0]) else ""
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(package + ".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        break
    else:
        raise AssertionError(f"`{reference}`: no module {parts[0]!r} in aiayn or installed")
    rest = parts[split:]
    for i, name in enumerate(rest):
        if not hasattr(obj, name):
            last = i == len(rest) - 1
            if last and inspect.isclass(obj) and has_attribute(obj, name):
                return obj
            raise AssertionError(f"`{reference}`: {name!r} not found in {obj!r}")
        obj = getattr(obj, name)
    return obj


def check_class_attribute(reference: str) -> None:
    class_name, attribute = reference.split(".")
    classes = [
        getattr(module, class_name)
        for module in aiayn_modules()
        if inspect.isclass(getattr(module, class_name, None))
    ]
    assert classes, f"`{reference}`: no aiayn module defines a class {class_name}"
    assert any(has_attribute(cls, attribute) for cls in classes), (
        f"`{reference}`: {class_name} has no attribute {attribute!r}"
    )


def check_test(reference: str) -> None:
    if reference.startswith("tests/"):
        file, _, name = reference.partition("::")
        path = ROOT / file
        assert path.is_file(), f"`{reference}`: {file} does not exist"
        assert not name or name in defined_tests()[path], f"`{reference}`: no {name} in {file}"
        return
    defined = set().union(*defined_tests().values())
    assert fnmatch.filter(defined, reference), f"`{reference}`: no such test under tests/"


def check_command(reference: str) -> None:
    from aiayn.cli import build_parser

    words = reference.split()
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert words[1] in commands.choices, f"`{reference}`: aiayn has no command {words[1]!r}"
    options = commands.choices[words[1]]._option_string_actions
    for flag in (w for w in words[2:] if w.startswith("-")):
        assert flag in options, f"`{reference}`: aiayn {words[1]} has no option {flag}"


@pytest.mark.parametrize("reference", references())
def test_paper_map_reference_resolves(reference: str) -> None:
    if _TEST_FILE.fullmatch(reference) or _TEST_NAME.fullmatch(reference):
        check_test(reference)
    elif _COMMAND.fullmatch(reference):
        check_command(reference)
    elif _MODULE_FILE.fullmatch(reference):
        assert list(PACKAGE.rglob(reference)), f"`{reference}`: no such file in {PACKAGE}"
    elif _CLASS_ATTR.fullmatch(reference):
        check_class_attribute(reference)
    else:
        resolve_dotted(reference)


def test_the_map_is_checked_at_all() -> None:
    """Guards the patterns above: a change to the map's style must not silently check nothing."""
    found = references()
    assert len(found) > 40
    assert "aiayn.model.Transformer" in found and "test_decoder_is_causal" in found
