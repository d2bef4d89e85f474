"""MkDocs hook: the API reference pages, generated from the code at every build.

``reference/meshgroups.md``, ``reference/transfer.md`` and ``reference/compat.md`` hold one
mkdocstrings section per public module (``tools/public_api.py``), listing exactly the public
names first met there, so a name exported later appears with no page edited.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def reference_pages() -> dict[str, str]:
    """``{path in docs: markdown}`` for the three reference pages."""
    text = {package: [f"# {title}\n", INTRO] for package, (_, title) in PAGES.items()}
    for module, names in public_api():
        members = "[" + ", ".join(names) + "]" if names else "false"
        text[_page_of(module)].append(
            f"::: {module}\n    options:\n      members: {members}\n      show_root_heading: true\n"
        )
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


def on_config(config: Any) -> Any:
    _source_tree()  # mkdocs.yml points mkdocstrings' python handler there (paths)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, content in reference_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
