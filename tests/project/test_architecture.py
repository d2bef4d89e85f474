"""The package's shape, checked: one folder per subsystem, imports only down the layers and
across packages only through a package's front, no import cycle, no module importing another's
underscore names, compat on meshgroups' public API, no ``assert`` nor ``AssertionError``, and the
file map of ``docs/design.md`` naming every module there is (AST only, no import)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The leaves every package may import: the typed errors, the shared input checks, the deprecation
# table, the closeable base of every object holding groups, and the version (each imports nothing
# of meshgroups but errors).
LEAVES = {
    "meshgroups.errors",
    "meshgroups._checks",
    "meshgroups._deprecated",
    "meshgroups._lifecycle",
    "meshgroups._version",
}

# What each subsystem may import at module level (besides itself and the ``LEAVES``). Imports inside functions or ``if TYPE_CHECKING:`` are not layering:
# they are how the numpy side reaches an optional renderer or the torch side lazily.
ALLOWED = {
    "meshgroups.layout": set(),
    "meshgroups.models": set(),  # the one model description: a leaf beside the layout core
    "meshgroups.render": {"meshgroups.layout"},
    "meshgroups.cost": {"meshgroups.layout", "meshgroups.models"},
    "meshgroups.mesh": {"meshgroups.layout"},
    "meshgroups.transfer": {"meshgroups.layout", "meshgroups.mesh", "meshgroups.models"},
    "meshgroups.elastic": {"meshgroups.layout", "meshgroups.mesh", "meshgroups.transfer"},
    "meshgroups.engines": {
        "meshgroups.layout",
        "meshgroups.mesh",
        "meshgroups.transfer",
        "meshgroups.models",
    },
    "meshgroups.cli": {
        "meshgroups.layout",
        "meshgroups.models",
        "meshgroups.render",
        "meshgroups.mesh",
        "meshgroups.elastic",
        "meshgroups.transfer",
        "meshgroups.cost",
    },
}
SUBSYSTEMS = sorted(ALLOWED, key=len, reverse=True)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "compat":
        parts = ["meshgroups", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> list[tuple[str, Path, ast.Module]]:
    paths = sorted((ROOT / "meshgroups").rglob("*.py")) + sorted((ROOT / "compat").rglob("*.py"))
    return [(_module_name(p), p, ast.parse(p.read_text(), str(p))) for p in paths]


SOURCES = _sources()


def _top_level_imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of the imports a module runs when it loads (not those inside a
    function, nor under ``if TYPE_CHECKING:``)."""
    out: list[tuple[int, str, list[str]]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((node.lineno, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out.extend((node.lineno, a.name, []) for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return out


def _subsystem(module: str) -> str | None:
    return next((s for s in SUBSYSTEMS if module == s or module.startswith(s + ".")), None)


def test_imports_only_go_down_the_layers():
    offenders = []
    for name, path, tree in SOURCES:
        mine = _subsystem(name)
        if mine is None:
            continue  # the top-level package, its aliases, compat: checked below
        for line, module, names in _top_level_imports(tree):
            if module == "meshgroups" and all(f"meshgroups.{n}" in LEAVES for n in names):
                continue  # from meshgroups import _deprecated: a leaf
            theirs = _subsystem(module)
            if module.startswith("meshgroups") and theirs is None and module not in LEAVES:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module} (not a subsystem)")
            elif theirs not in (None, mine) and theirs not in ALLOWED[mine]:
                offenders.append(
                    f"{path.relative_to(ROOT)}:{line} imports {module}: {mine} may not use {theirs}"
                )
    assert not offenders, "\n".join(offenders)


def test_the_layout_core_and_the_renderer_import_no_torch_when_they_load():
    offenders = []
    for name, path, tree in SOURCES:
        if _subsystem(name) not in (
            "meshgroups.layout",
            "meshgroups.models",
            "meshgroups.render",
            "meshgroups.cost",
        ):
            if name not in LEAVES:
                continue
        offenders += [
            f"{path.relative_to(ROOT)}:{line} imports {module}"
            for line, module, _ in _top_level_imports(tree)
            if module.split(".")[0] == "torch"
        ]
    assert not offenders, "\n".join(offenders)


def _all_imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    return [
        (node.lineno, node.module, [a.name for a in node.names])
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    ]


# megatron-core's own underscore names, which compat's drop-in must offer under the same names.
MEGATRON_NAMES = {"_set_global_memory_buffer", "_set_global_symmetric_memory_buffer"}


MODULE_NAMES = {name for name, _, _ in SOURCES}


def _own_private_module(importer: str, target: str) -> bool:
    """``target`` is a private module of the importer's own package, or a root leaf."""
    if target in LEAVES:
        return True
    package = target.rsplit(".", 1)[0]
    return target in MODULE_NAMES and (importer == package or importer.startswith(package + "."))


def test_no_module_imports_another_modules_underscore_names():
    offenders = []
    for importer, path, tree in SOURCES:
        for line, module, names in _all_imports(tree):
            if not module.startswith("meshgroups"):
                continue
            private = [
                n
                for n in names
                if n.startswith("_")
                and not (n.startswith("__") and n.endswith("__"))
                and n not in MEGATRON_NAMES
                and not _own_private_module(importer, f"{module}.{n}")
            ]
            if private:
                offenders.append(f"{path.relative_to(ROOT)}:{line} from {module} import {', '.join(private)}")
    assert not offenders, "\n".join(offenders)


def test_no_module_imports_a_module_whose_path_has_an_underscore_part_from_outside_it():
    """A module or package named ``_x`` is private to the package holding it."""
    offenders = []
    for name, path, tree in SOURCES:
        for line, module, _ in _all_imports(tree):
            if not module.startswith("meshgroups"):
                continue  # torch's private modules: tests/mesh/test_mesh_torch_seam.py
            parts = module.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not name.startswith(".".join(parts[:i])):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, "\n".join(offenders)


def _front(module: str) -> str | None:
    """The package front a module belongs to (``meshgroups.engines.vllm`` counts as its own)."""
    sub = _subsystem(module)
    if sub == "meshgroups.engines" and (
        module == "meshgroups.engines.vllm" or module.startswith("meshgroups.engines.vllm.")
    ):
        return "meshgroups.engines.vllm"
    return sub


def test_imports_across_packages_go_through_the_packages_front():
    """``from meshgroups.mesh import init_mesh``, never ``from meshgroups.mesh._mesh_groups
    import init_mesh`` from another package: a package's modules are its own business."""
    offenders = []
    for name, path, tree in SOURCES:
        mine = _front(name) or name
        for line, module, _ in _all_imports(tree):
            if not module.startswith("meshgroups.") or module in LEAVES:
                continue
            theirs = _front(module)
            if theirs is not None and theirs != mine and module != theirs:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module} (import from {theirs})")
    assert not offenders, "\n".join(offenders)


def _import_graph() -> dict[str, set[str]]:
    """module -> the meshgroups modules it imports when it loads (packages resolved to the
    module a name comes from where the name is a submodule)."""
    modules = {name for name, _, _ in SOURCES}
    graph: dict[str, set[str]] = {}
    for name, _, tree in SOURCES:
        edges = set()
        for _, module, names in _top_level_imports(tree):
            if module not in modules:
                continue
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            edges.update(subs or [module])
        graph[name] = edges - {name}
    return graph


def test_no_import_cycles_between_modules():
    """Modules import each other as a tree, never in a circle (a package front importing its own
    modules, and a module importing its package's front for a sibling's name, excepted: the
    front is the package itself)."""
    graph = _import_graph()
    fronts = {name for name, path, _ in SOURCES if path.name == "__init__.py"}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in fronts:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state and node not in fronts:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_no_module_raises_assertion_error():
    """An internal invariant is a ``RuntimeError`` naming it; ``AssertionError`` is what a test
    raises (compat's Megatron drop-in raises its ``AssertionError`` subclasses, as Megatron does)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for name, path, tree in SOURCES
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise)
        and node.exc is not None
        and ast.unparse(node.exc).split("(")[0] in ("AssertionError", "builtins.AssertionError")
    ]
    assert not offenders, "\n".join(offenders)


def test_no_object_reaches_into_another_classs_private_state():
    # The reach-ins issue 36 removed: a holder's group keys, a cache's counters, a mesh's families.
    pattern = re.compile(r"(?<![.\w])(?!self\b)\w+\._(families|roots|groups|refs)\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for _, path, _ in SOURCES
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def test_compat_uses_meshgroups_public_names_only():
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from public_api import public_api

    public = {(m, n) for m, names in public_api() for n in names}
    public_modules = {m for m, _ in public}
    offenders = []
    for name, path, tree in SOURCES:
        if not name.startswith("meshgroups.compat"):
            continue
        for line, module, names in _all_imports(tree):
            if not module.startswith("meshgroups") or module.startswith("meshgroups.compat"):
                continue
            if module not in public_modules:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module} (not a public module)")
                continue
            offenders += [
                f"{path.relative_to(ROOT)}:{line} imports {module}.{n} (not in its __all__)"
                for n in names
                if (module, n) not in public and not _exported_earlier(public, n)
            ]
    assert not offenders, "\n".join(offenders)


def _exported_earlier(public: set[tuple[str, str]], name: str) -> bool:
    """A name the public API lists where it was first met (``meshgroups.Layout``), re-exported
    by a later public module."""
    return any(n == name for _, n in public)


def _design_file_map() -> set[str]:
    """The files ``docs/design.md``'s map names: one bullet per folder (its first backticked
    name); the ``x.py`` names after it are in that folder, those after a ``sub/`` in ``sub``."""
    text = (ROOT / "docs" / "design.md").read_text().split("## Layout of the repository", 1)[1]
    listed: set[str] = set()
    for bullet in re.split(r"\n- ", text)[1:]:
        names = re.findall(r"`([\w/.]+)`", bullet)
        if not names or not names[0].endswith("/"):
            continue
        folder = names[0]
        listed.add(folder)
        here = folder
        for name in names[1:]:
            if name.endswith("/") and "/" not in name[:-1]:
                here = folder + name
                listed.add(here)
            elif name.endswith(".py"):
                listed.add(here + name)
    return listed


@pytest.mark.parametrize("folder", ["meshgroups", "compat"])
def test_the_design_file_map_names_every_module(folder):
    listed = _design_file_map()
    missing = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            rel = path.parent.relative_to(ROOT).as_posix() + "/"
        if rel not in listed:
            missing.append(rel)
    assert not missing, "docs/design.md's file map does not name:\n" + "\n".join(missing)


def test_the_design_file_map_names_no_module_that_is_gone():
    gone = sorted(p for p in _design_file_map() if p.endswith(".py") and not (ROOT / p).exists())
    assert not gone, f"docs/design.md's file map names files that do not exist: {gone}"


def test_no_assert_statements_in_the_package():
    """``python -O`` strips asserts: a rule checked by one is no rule (a typed error instead)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for _, path, tree in SOURCES
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_design_pages_picture_of_the_packages_is_what_the_imports_say():
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import package_graph

    text = (ROOT / "docs" / "design.md").read_text()
    assert package_graph.shown(text) == package_graph.block(), "run: python tools/package_graph.py --write"


def test_no_module_is_over_450_lines():
    long = [
        f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines"
        for _, path, _ in SOURCES
        if len(path.read_text().splitlines()) > 450
    ]
    assert not long, long
