"""`DecodingOptions` is the one home of the paper's decoding defaults (§6.1): no other module
of the package writes one of its fields with a literal default of its own."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import aiayn
from aiayn.decode.options import DecodingOptions
from aiayn.serve import Decoding

PACKAGE = Path(aiayn.__file__).parent
FIELDS = {f.name for f in dataclasses.fields(DecodingOptions)}
# Names of a field that mean something else there: the corpus's min_len filters training pairs.
OTHER_SETTINGS = {("text/corpus.py", "min_len")}


def _is_literal(node: ast.AST | None) -> bool:
    """A number, string or bool written out (None means "not given", not a default)."""
    return isinstance(node, ast.Constant) and node.value is not None


def literal_defaults(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of parameters and annotated class attributes named like a decoding option
    whose default is a literal number, string or bool."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            with_defaults = positional[len(positional) - len(args.defaults) :]
            pairs = list(zip(with_defaults, args.defaults, strict=True))
            pairs += [
                (a, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                if d is not None
            ]
            found += [(a.arg, d.lineno) for a, d in pairs if _is_literal(d)]
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and _is_literal(node.value)
        ):
            found.append((node.target.id, node.lineno))
    return [(name, line) for name, line in found if name in FIELDS]


def test_no_module_but_decoding_options_writes_a_decoding_default() -> None:
    copies = [
        f"{path.relative_to(PACKAGE)}:{line} {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() != "decode/options.py"
        for name, line in literal_defaults(ast.parse(path.read_text(encoding="utf-8")))
        if (path.relative_to(PACKAGE).as_posix(), name) not in OTHER_SETTINGS
    ]
    assert copies == []


def test_the_detector_finds_a_copy() -> None:
    tree = ast.parse("def f(x, *, beam_size=4): ...\nclass C:\n    length_penalty: float = 0.6\n")
    assert literal_defaults(tree) == [("beam_size", 1), ("length_penalty", 3)]


def test_the_server_decodes_with_the_same_defaults() -> None:
    assert Decoding() == Decoding(**dataclasses.asdict(DecodingOptions()))
    assert isinstance(Decoding(), DecodingOptions)
