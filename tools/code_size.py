"""Module and function sizes of the aiayn package (`make size`): what the ~600-line guideline flags.

    python tools/code_size.py            # a table of every module, then the longest functions
    python tools/code_size.py --markdown # the same as the README's Markdown

A function's size counts its lines without its docstring (what a reader has to read to follow
it); nested functions count in their parent too.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "aiayn"


@dataclass(frozen=True)
class Function:
    module: str
    name: str
    line: int
    lines: int


def module_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def functions(path: Path, module: str) -> list[Function]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        body = node.body
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
            lines -= first.end_lineno - first.lineno + 1  # the docstring
        found.append(Function(module, node.name, node.lineno, lines))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--top", type=int, default=8, help="how many longest functions to list")
    args = parser.parse_args()
    modules = sorted(PACKAGE.rglob("*.py"))
    sizes = {str(p.relative_to(PACKAGE)): module_lines(p) for p in modules}
    every = [f for p in modules for f in functions(p, str(p.relative_to(PACKAGE)))]
    longest = sorted(every, key=lambda f: -f.lines)[: args.top]
    total = sum(sizes.values())
    if args.markdown:
        print(f"{len(sizes)} modules, {total:,} lines; the largest:\n")
        print("| module | lines |\n| --- | ---: |")
        for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"| `{name}` | {n} |")
        print("\nThe longest functions (lines without the docstring):\n")
        print("| function | lines |\n| --- | ---: |")
        for f in longest:
            print(f"| `{f.module}:{f.line} {f.name}` | {f.lines} |")
        return
    for name, n in sorted(sizes.items()):
        print(f"{n:6d}  {name}")
    print(f"{total:6d}  total ({len(sizes)} modules)\n")
    for f in longest:
        print(f"{f.lines:6d}  {f.module}:{f.line} {f.name}")


if __name__ == "__main__":
    main()
