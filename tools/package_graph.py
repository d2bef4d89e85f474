"""The picture of meshgroups' packages and their arrows, read from the code's imports.

Each line is one package (its front and its private modules together) and the packages its
modules import when they load (imports inside functions and under ``TYPE_CHECKING`` are not
arrows: they are how a numpy package reaches an optional renderer, or torch, lazily). The leaves
every package may use (``errors``, ``_checks``, ``_deprecated``, ``_lifecycle``, ``_version``)
are left out. ``docs/design.md`` shows this text between its ``package-graph`` markers, and
``tests/project/test_architecture.py`` checks that it is what the code says::

    python tools/package_graph.py          # print it
    python tools/package_graph.py --write  # write it into docs/design.md

AST only: nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("layout", "render", "cost", "mesh", "transfer", "engines", "elastic", "cli", "compat")
NUMPY_ONLY = {"layout", "render", "cost"}
MARK_BEGIN, MARK_END = "<!-- package-graph -->", "<!-- /package-graph -->"


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "meshgroups" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in PACKAGES else None


def _loads(tree: ast.Module) -> list[str]:
    out: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append(node.module)
            elif isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return out


def arrows() -> dict[str, set[str]]:
    """package -> the packages its modules import when they load."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for name in PACKAGES:
        folder = ROOT / ("compat" if name == "compat" else f"meshgroups/{name}")
        for path in folder.rglob("*.py"):
            for module in _loads(ast.parse(path.read_text())):
                other = _package(module)
                if other is not None and other != name:
                    graph[name].add(other)
                elif name == "compat" and module == "meshgroups":
                    graph[name].add("meshgroups")
    return graph


def picture() -> str:
    """The text block: one line per package, in layer order."""
    graph = arrows()
    width = max(len(p) for p in PACKAGES)
    lines = []
    for name in PACKAGES:
        kind = "numpy only" if name in NUMPY_ONLY else "torch side"
        order = sorted(graph[name], key=lambda p: PACKAGES.index(p) if p in PACKAGES else -1)
        targets = ", ".join(order)
        lines.append(f"{name:<{width}}  ({kind})  -> {targets or '(nothing of meshgroups)'}")
    return "\n".join(lines)


def block() -> str:
    return f"{MARK_BEGIN}\n```text\n{picture()}\n```\n{MARK_END}"


def shown(text: str) -> str:
    """The block ``docs/design.md`` shows now."""
    begin, end = text.index(MARK_BEGIN), text.index(MARK_END) + len(MARK_END)
    return text[begin:end]


if __name__ == "__main__":
    if "--write" in sys.argv:
        design = ROOT / "docs" / "design.md"
        text = design.read_text()
        design.write_text(text.replace(shown(text), block()))
    else:
        print(picture())
