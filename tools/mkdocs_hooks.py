"""MkDocs hook: the API reference pages, generated from the code at every build.

``reference/meshgroups.md``, ``reference/transfer.md`` and ``reference/compat.md`` hold one
mkdocstrings section per public module (``tools/public_api.py``), listing exactly the public
names first met there, so a name exported later appears with no page edited.
"""

from __future__ import annotations

import importlib
import inspect
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

sys.path.insert(0, str(Path(__file__).resolve().parent))

from griffe_doctests import fence_doctests
from public_api import public_api

SOURCE_TREE = "build/docs-src"  # ignored by git (build/)
PAGES = {
    "meshgroups": ("reference/meshgroups.md", "meshgroups"),
    "meshgroups.transfer": ("reference/transfer.md", "meshgroups.transfer"),
    "meshgroups.compat": ("reference/compat.md", "meshgroups.compat"),
}
INTRO = (
    "Generated from the docstrings at every build of the site: the package's `__all__`, then "
    "each public module (no leading underscore) with its `__all__` (or the functions and "
    "classes it defines). A name is shown once, where it is first exported.\n"
)


def _page_of(module: str) -> str:
    for package in sorted(PAGES, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    raise ValueError(f"module {module!r} is in no reference page")


def _made_at_run_time(obj: object) -> bool:
    """Whether griffe, reading the source, would miss ``obj`` or its docstring: a function made
    when its module runs (``parallel_state``'s table-driven getters), or one whose docstring is
    completed then (``compat/_megatron_docs.py``)."""
    obj = inspect.unwrap(obj)  # type: ignore[arg-type]
    if not inspect.isfunction(obj):
        return False
    try:  # the source of the module that defines it (a package re-exports)
        source = inspect.getsource(inspect.getmodule(obj))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return True
    last = (obj.__doc__ or "").strip().splitlines()[-1:] or [""]
    return obj.__code__.co_name != obj.__name__ or last[0].strip() not in source


SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Attributes|Examples?):\s*$")


def _markdown_doc(doc: str) -> str:
    """A Google-style docstring as Markdown: section titles in bold, their entries as a list."""
    out: list[str] = []
    in_section = False
    for line in fence_doctests(inspect.cleandoc(doc)).split("\n"):
        if SECTION.match(line):
            out += ["", f"**{line.strip()}**", ""]
            in_section = True
        elif in_section and line.startswith("        "):
            out[-1] += " " + line.strip()
        elif in_section and line.startswith("    "):
            out.append("- " + line.strip())
        else:
            in_section = False
            out.append(line)
    return "\n".join(out)


def _function_section(module: str, name: str, obj: object) -> str:
    """The reference entry of a function griffe cannot read from the source."""
    try:
        signature = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        signature = "(...)"
    return (
        f"### `{name}` {{ #{module}.{name} }}\n\n```python\n{name}{signature}\n```\n\n"
        f"{_markdown_doc(getattr(obj, '__doc__', None) or '')}\n"
    )


def reference_pages() -> dict[str, str]:
    """``{path in docs: markdown}`` for the three reference pages."""
    text = {package: [f"# {title}\n", INTRO] for package, (_, title) in PAGES.items()}
    for module, names in public_api():
        mod = importlib.import_module(module)
        runtime = [n for n in names if _made_at_run_time(getattr(mod, n))]
        static = [n for n in names if n not in runtime]
        members = "[" + ", ".join(static) + "]" if static else "false"
        page = text[_page_of(module)]
        page.append(f"::: {module}\n    options:\n      members: {members}\n      show_root_heading: true\n")
        page += [_function_section(module, n, getattr(mod, n)) for n in runtime]
    return {PAGES[package][0]: "\n".join(parts) for package, parts in text.items()}


def _source_tree() -> str:
    """A folder where ``meshgroups/compat`` exists, for griffe to read the sources from: the
    repository maps the folder ``compat/`` to ``meshgroups.compat`` (pyproject's package-dir), a
    mapping griffe does not follow. A copy (symlinks would be resolved back to the repository)."""
    root = Path(__file__).resolve().parent.parent
    tree = root / SOURCE_TREE
    package = tree / "meshgroups"
    if package.exists():
        shutil.rmtree(package)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "meshgroups", package, ignore=skip)
    shutil.copytree(root / "compat", package / "compat", ignore=skip)
    return str(tree)


@event_priority(100)  # before mkdocstrings' own on_config reads its paths: a fresh clone has no tree yet
def on_config(config: Any) -> Any:
    _source_tree()  # mkdocs.yml points mkdocstrings' python handler there (paths)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, content in reference_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
