"""The package's floors (README, "Layout"): each module imports only from its own floor and the
floors below it, and no modules import each other in a cycle.

Read from the source with `ast`, not by importing: every ``import`` and ``from ... import`` of an
aiayn module counts, at the top of a module or inside a function (a lazy import is still a
dependency), except under ``if TYPE_CHECKING:``, which only type checkers run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aiayn

PACKAGE = Path(aiayn.__file__).parent

# Bottom to top. A module belongs to the first floor one of whose prefixes it starts with.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core: the paper's model and what runs it",
        (
            "aiayn.attention",
            "aiayn.cache",
            "aiayn.config",
            "aiayn.loss",
            "aiayn.model",
            "aiayn.optim",
            "aiayn.acceleration",
            "aiayn.extras",
            "aiayn.errors",
            "aiayn.runtime",
        ),
    ),
    ("text", ("aiayn.text",)),
    ("saved models", ("aiayn.model_dir",)),
    ("decode", ("aiayn.decode",)),
    ("train", ("aiayn.train",)),
    ("interop", ("aiayn.interop",)),
    ("apps", ("aiayn.cli", "aiayn.serve", "aiayn.viz", "aiayn.demo", "aiayn.__main__")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in {__file__}")


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path) -> set[str]:
    """The aiayn modules `path` imports (``from aiayn.x import y`` counts as aiayn.x.y when
    that is a module, else aiayn.x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("aiayn")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("aiayn"):
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m != "aiayn"}  # the root holds only the version and lazy names


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}
GRAPH = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES - {"aiayn"}:
        floor_of(module)


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    wrong = [
        f"{module} ({FLOORS[floor_of(module)][0]}) imports {used} ({FLOORS[floor_of(used)][0]})"
        for module, used_set in sorted(GRAPH.items())
        if module != "aiayn"
        for used in sorted(used_set)
        if floor_of(used) > floor_of(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components: every component is one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
