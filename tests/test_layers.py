"""The package's floors (STYLE.md, "Layout"): each module imports only from its own floor and the
floors below it, and no modules import each other in a cycle. The paper's modules sit below the
platform code (speed-ups, process settings, optional dependencies), which reaches into them only
through hooks (`MultiHeadAttention.kernel`, `aiayn.acceleration.use_cpu_attention`).

Read from the source with `ast`, not by importing. Every way a module can load another counts, at
the top of a module or inside a function (a lazy import is still a dependency), except under
``if TYPE_CHECKING:``, which only type checkers run:

- ``import aiayn.x`` and ``from aiayn.x import y`` (aiayn.x.y where that is a module);
- relative imports (``from . import x``, ``from ..x import y``);
- ``import aiayn`` and ``from aiayn import Name``: a name a package loads on first use (PEP 562,
  its table of names and modules) is a dependency on the module that defines it, a submodule
  on the submodule, and a name the package defines itself (``__version__``) on nothing more;
- ``importlib.import_module("aiayn.x")``; and where the argument is computed (a package's
  lazy names), every module that a string of the module names, in full or after the f-string's
  literal prefix (``f"aiayn.serve.{where}"``).

The tests at the end plant imports into copies of the sources, as strings, to show that each
form is read.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import aiayn

PACKAGE = Path(aiayn.__file__).parent

# Bottom to top. A module belongs to the first floor one of whose prefixes it starts with.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("aiayn.errors",)),
    (
        "paper: the model of the paper and what trains it",
        (
            "aiayn.attention",
            "aiayn.cache",
            "aiayn.config",
            "aiayn.loss",
            "aiayn.model",
            "aiayn.optim",
        ),
    ),
    (
        "platform: speed-ups, process settings, optional dependencies, writers' parts",
        ("aiayn.acceleration", "aiayn.extras", "aiayn.runtime", "aiayn.parts"),
    ),
    ("text", ("aiayn.text",)),
    ("saved models", ("aiayn.model_dir",)),
    ("decode", ("aiayn.decode",)),
    ("train", ("aiayn.train",)),
    ("interop", ("aiayn.interop",)),
    ("apps", ("aiayn.cli", "aiayn.serve", "aiayn.viz", "aiayn.demo", "aiayn.__main__")),
    ("the package's front door (its names loaded on first use)", ("aiayn",)),
]

EXCEPTIONS: dict[tuple[str, str], str] = {
    ("aiayn.config", "aiayn.runtime"): (
        "reading a train_config.yaml of an earlier release (its cpu_bf16 key) resolves "
        '--device "auto", a rule aiayn.runtime owns; imported in that function alone'
    ),
}
"""Imports from a floor above, each with the reason it is allowed."""

PLATFORM_CODE_IN_THE_PAPER: dict[str, str] = {
    "aiayn.model.Dropout.forward": (
        "on a CPU the keep-mask is drawn as U[0, 1) ≥ p, 1.5-1.9x faster than F.dropout: which "
        "mask a seed gives is the model's numerics, the same with or without a hook installed"
    ),
    "aiayn.attention.fused_attention": (
        "the default kernel turns cuDNN's attention off around each CUDA call (its per-shape "
        "graphs made bf16 5-9x slower): PyTorch's switch is process-wide, and "
        "torch.nn.attention.sdpa_kernel writes the same switch, so no per-call choice exists to "
        "move behind a hook; the switch is back as it was after every call"
    ),
    "aiayn.cache.DecoderCache._rows_to_move_in_place": (
        "a CPU copies a beam's few moved rows in place, a GPU gathers them all: one data "
        "movement or the other, the same values"
    ),
}
"""Where the paper's modules branch on the device or touch PyTorch's process-wide switches, and
why that stays there rather than behind a hook in the platform code."""

PAPER_MODULES = FLOORS[1][1]
PROCESS_SWITCHES = (
    "torch.backends.",
    "torch.cuda.",
    "torch._C.",
    "torch._dynamo.config",
    "os.environ",
    "torch.set_",
    "torch.manual_seed",
    "torch.use_deterministic_algorithms",
)
DEVICE_BRANCHES = (".is_cuda", ".is_cpu", ".device.type")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_sources(package: Path = PACKAGE) -> dict[str, str]:
    """Every module of `package` → its source."""
    return {module_name(p, package): p.read_text(encoding="utf-8") for p in package.rglob("*.py")}


def floor_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in {__file__}")


def _is_package(module: str, sources: dict[str, str]) -> bool:
    return any(other.startswith(module + ".") for other in sources)


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


@functools.cache
def _parsed(source: str) -> tuple[ast.Module, frozenset[ast.AST]]:
    """`source`'s tree and the nodes under ``if TYPE_CHECKING:`` (read once per source)."""
    tree = ast.parse(source)
    skipped = {
        inner
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    return tree, frozenset(skipped)


def _is_import_module(call: ast.Call) -> bool:
    name = ast.unparse(call.func)
    return name in ("importlib.import_module", "import_module", "__import__")


def _dynamic_targets(tree: ast.AST, arg: ast.expr, modules: set[str]) -> set[str]:
    """The modules a computed ``import_module(arg)`` may load: the strings of the module that
    name one, whole or after the f-string's literal prefix."""
    prefix = ""
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
    strings = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    return {prefix + s for s in strings if prefix + s in modules and prefix + s != prefix}


def _lazy_names(tree: ast.AST, modules: set[str]) -> dict[str, str]:
    """A package's names loaded on first use → the module that defines each: a dict of
    name → module (or submodule name) in a module that calls import_module."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_import_module(n)]
    dynamic = [c.args[0] for c in calls if c.args and not isinstance(c.args[0], ast.Constant)]
    names: dict[str, str] = {}
    for arg in dynamic:
        prefix = ""
        if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
            prefix = str(arg.values[0].value)
        for table in (n for n in ast.walk(tree) if isinstance(n, ast.Dict)):
            for key, value in zip(table.keys, table.values, strict=True):
                constants = isinstance(key, ast.Constant) and isinstance(value, ast.Constant)
                if constants and f"{prefix}{value.value}" in modules:
                    names[str(key.value)] = f"{prefix}{value.value}"
    return names


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Each module → the aiayn modules it may load, read from `sources` (module → source)."""
    modules = set(sources)
    parsed = {m: _parsed(source) for m, source in sources.items()}
    lazy = {m: _lazy_names(tree, modules) for m, (tree, _) in parsed.items()}

    def resolve(package: str, name: str) -> str | None:
        """What ``from package import name`` loads (None: nothing beyond `package`)."""
        if f"{package}.{name}" in modules:
            return f"{package}.{name}"
        if name in lazy.get(package, {}):
            return lazy[package][name]
        return None if package == "aiayn" else package

    graph: dict[str, set[str]] = {}
    for module, (tree, skipped) in parsed.items():
        found: set[str] = set()
        imports_root = False
        here = module if _is_package(module, sources) else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if node in skipped:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "aiayn":
                        imports_root = alias.asname is None
                    elif alias.name.startswith("aiayn."):
                        found.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package `level` steps up
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    package = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    package = node.module or ""
                if package != "aiayn" and not package.startswith("aiayn."):
                    continue
                for alias in node.names:
                    target = resolve(package, alias.name)
                    if target is not None:
                        found.add(target)
            elif isinstance(node, ast.Call) and _is_import_module(node) and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("aiayn"):
                    found.add(str(arg.value))
                else:
                    found |= _dynamic_targets(tree, arg, modules)
        if imports_root:  # aiayn.Name, aiayn.sub.module
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node not in skipped:
                    chain = ast.unparse(node)
                    if chain.startswith("aiayn.") and chain in modules:
                        found.add(chain)
                    elif isinstance(node.value, ast.Name) and node.value.id == "aiayn":
                        target = resolve("aiayn", node.attr)
                        if target is not None:
                            found.add(target)
        graph[module] = {m for m in found if m != module}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a floor above the importer's, bar the `EXCEPTIONS`."""
    return [
        f"{module} ({FLOORS[floor_of(module)][0]}) imports {used} ({FLOORS[floor_of(used)][0]})"
        for module, used_set in sorted(graph.items())
        for used in sorted(used_set)
        if floor_of(used) > floor_of(module) and (module, used) not in EXCEPTIONS
    ]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def platform_code(module: str, source: str) -> dict[str, list[str]]:
    """Where `source` (a module of the paper) touches a process-wide switch or branches on the
    device: the qualified name of the enclosing function or class → what it does there."""
    tree = ast.parse(source)
    parents = _parents(tree)
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(parents.get(node), ast.Attribute):
            continue
        text = ast.unparse(node)
        if not (text.startswith(PROCESS_SWITCHES) or text.endswith(DEVICE_BRANCHES)):
            continue
        names, owner = [], parents.get(node)
        while owner is not None:
            if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(owner.name)
            owner = parents.get(owner)
        found.setdefault(".".join([module, *reversed(names)]), []).append(text)
    return found


SOURCES = read_sources()
GRAPH = import_graph(SOURCES)


def test_every_module_is_on_a_floor() -> None:
    for module in SOURCES:
        floor_of(module)


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    wrong = upward_imports(GRAPH)
    assert not wrong, "\n".join(wrong)


def test_every_exception_is_still_taken() -> None:
    """An allowed upward import that no module makes any more is dropped from `EXCEPTIONS`."""
    stale = [f"{a} → {b}" for a, b in EXCEPTIONS if b not in GRAPH.get(a, set())]
    assert not stale, f"remove from EXCEPTIONS: {stale}"


def test_no_import_cycles() -> None:
    cycles = import_cycles(GRAPH)
    assert not cycles, f"import cycles: {cycles}"


def test_the_paper_leaves_devices_and_process_switches_to_the_platform_code() -> None:
    """The paper's modules touch no process-wide switch and choose nothing by device, but in
    the places `PLATFORM_CODE_IN_THE_PAPER` names and says why."""
    found = {
        where: uses
        for module in PAPER_MODULES
        for where, uses in platform_code(module, SOURCES[module]).items()
    }
    unlisted = {
        where: uses for where, uses in found.items() if where not in PLATFORM_CODE_IN_THE_PAPER
    }
    assert not unlisted, f"platform code in the paper's modules (move it behind a hook): {unlisted}"
    assert set(PLATFORM_CODE_IN_THE_PAPER) <= set(found), "an exception no code takes any more"


# -- the checker reads every import form: planted into copies of the sources -----------------


def planted(module: str, code: str) -> dict[str, set[str]]:
    """The import graph with `code` added, inside a function, to a copy of `module`."""
    sources = dict(SOURCES)
    body = "\n".join(f"    {line}" for line in code.splitlines())
    sources[module] += f"\n\ndef _planted() -> None:\n{body}\n"
    return import_graph(sources)


@pytest.mark.parametrize(
    ("code", "target"),
    [
        ("from aiayn.acceleration import use_cpu_attention", "aiayn.acceleration"),
        ("import aiayn.acceleration", "aiayn.acceleration"),
        ("from aiayn import acceleration", "aiayn.acceleration"),
        ("from . import acceleration", "aiayn.acceleration"),
        ("from .acceleration import use_cpu_attention", "aiayn.acceleration"),
        ("import importlib\nimportlib.import_module('aiayn.acceleration')", "aiayn.acceleration"),
        ("from aiayn import Translator", "aiayn.decode.translator"),
        ("import aiayn\naiayn.Translator", "aiayn.decode.translator"),
        ("import aiayn\naiayn.acceleration.use_cpu_attention", "aiayn.acceleration"),
    ],
)
def test_the_checker_refuses_a_planted_import_from_the_paper_upwards(
    code: str, target: str
) -> None:
    assert not upward_imports(GRAPH)
    graph = planted("aiayn.model", code)
    assert target in graph["aiayn.model"]
    assert f"aiayn.model (paper: the model of the paper and what trains it) imports {target} " in (
        "\n".join(upward_imports(graph)) + " "
    )


def test_a_name_the_root_defines_itself_loads_nothing_more() -> None:
    """``from aiayn import __version__`` (a model directory's metadata) is no dependency on the
    modules the package loads on first use."""
    graph = planted("aiayn.model", "from aiayn import __version__")
    assert graph["aiayn.model"] == GRAPH["aiayn.model"]


def test_the_checker_finds_a_planted_cycle_through_import_module() -> None:
    """aiayn.model imports aiayn.cache; a lazy ``import_module`` back from the cache closes a
    cycle, by a literal name or by a name computed from a table, as the packages' lazy names
    are."""
    assert not import_cycles(GRAPH)
    literal = planted("aiayn.cache", "import importlib\nimportlib.import_module('aiayn.model')")
    assert ["aiayn.cache", "aiayn.model"] in import_cycles(literal)
    computed = planted(
        "aiayn.cache",
        "import importlib\nwhere = {'Transformer': 'model'}\n"
        "importlib.import_module(f'aiayn.{where[\"Transformer\"]}')",
    )
    assert ["aiayn.cache", "aiayn.model"] in import_cycles(computed)


def test_the_checker_finds_platform_code_planted_in_the_paper() -> None:
    source = SOURCES["aiayn.loss"] + "\n\ndef _planted(x):\n    return x.is_cuda\n"
    assert platform_code("aiayn.loss", source) == {"aiayn.loss._planted": ["x.is_cuda"]}
