"""The public surface of meshgroups, computed, never listed by hand: one source for the API
reference (``tools/mkdocs_hooks.py``) and for the docstring test (``tests/test_docstrings.py``).

Public means what Python's conventions say: the packages ``meshgroups``, ``meshgroups.transfer``
and ``meshgroups.compat``, and every module of theirs whose name has no leading underscore; in
each, the names of its ``__all__``, or, without one, the classes and functions it defines whose
names have no leading underscore. An object is listed once, where it is first met (a package's
``__all__`` before its modules), so ``meshgroups.Layout`` is not listed again under
``meshgroups.layout``. A module added later is picked up by itself.

    >>> ("meshgroups", "Layout") in [(m, n) for m, names in public_api() for n in names]
    True
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

PACKAGES = ("meshgroups", "meshgroups.transfer", "meshgroups.compat")
# The modules the docs tell users to import (besides the packages): their docstrings name every
# argument and the return value (tests/test_docstrings.py).
USER_MODULES = (
    "meshgroups",
    "meshgroups.collective",
    "meshgroups.errors",
    "meshgroups.render",
    "meshgroups.transfer",
    "meshgroups.transfer.execute",
    "meshgroups.transfer.fanout_groups",
    "meshgroups.transfer.jobs",
    "meshgroups.transfer.presets",
    "meshgroups.transfer.torch_io",
    "meshgroups.compat.group_initializer",
    "meshgroups.compat.megatron",
    "meshgroups.compat.parallel_state",
    "meshgroups.compat.process_groups_config",
)
SKIP_MODULES = {"meshgroups.__main__"}


def public_modules() -> list[str]:
    """Every public module: each package, then its modules without a leading underscore."""
    names: list[str] = []
    for package in PACKAGES:
        names.append(package)
        module = importlib.import_module(package)
        subs = sorted(info.name for info in pkgutil.iter_modules(module.__path__))
        for sub in subs:
            full = f"{package}.{sub}"
            if sub.startswith("_") or full in PACKAGES or full in SKIP_MODULES:
                continue
            names.append(full)
    return names


def _names(module: ModuleType) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return list(exported)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    ]


def public_api() -> list[tuple[str, list[str]]]:
    """``[(module, [name, ...]), ...]``: each public module with the public names first met there."""
    seen: set[int] = set()
    out: list[tuple[str, list[str]]] = []
    for name in public_modules():
        module = importlib.import_module(name)
        mine = []
        for attr in _names(module):
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)) and id(obj) in seen:
                continue
            seen.add(id(obj))
            mine.append(attr)
        out.append((name, mine))
    return out
