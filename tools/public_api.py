"""The public surface of meshgroups, read from the code, never listed by hand: one source for the
API reference (``tools/mkdocs_hooks.py``) and for the docstring test (``tests/project/test_docstrings.py``).

Public means what each package front says in its ``__all__``: the package ``meshgroups``, its
subpackages without a leading underscore (``layout``, ``mesh``, ``elastic``, ``transfer``,
``engines``, ``cost``, ``render``, ``cli``), ``meshgroups.compat``, and the few modules users
are told to import by their path (``MODULES``: the typed errors and compat's drop-in modules,
whose paths are the legacy APIs' own). Implementation modules are private (a leading
underscore, or a private folder) and never listed. A public module without ``__all__`` is an
error. An object is listed once, where it is first met (a package before its modules), so
``meshgroups.Layout`` is not listed again under ``meshgroups.layout``.

    >>> ("meshgroups", "Layout") in [(m, n) for m, names in public_api() for n in names]
    True
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

ROOT = "meshgroups"
# Modules (not packages) whose path users import: their own ``__all__`` is public too.
MODULES = (
    "meshgroups.errors",
    "meshgroups.compat.group_initializer",
    "meshgroups.compat.megatron",
    "meshgroups.compat.megatron_layout",
    "meshgroups.compat.parallel_state",
    "meshgroups.compat.process_groups_config",
)
SKIP_MODULES = {"meshgroups.__main__"}
# Packages without a leading underscore that are still not offered to users.
INTERNAL_PACKAGES: set[str] = set()


def public_packages() -> list[str]:
    """``meshgroups`` and every subpackage whose dotted path has no part with a leading underscore."""
    names = [ROOT]
    root = importlib.import_module(ROOT)
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{ROOT}."):
        if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")):
            if not any(info.name == p or info.name.startswith(p + ".") for p in INTERNAL_PACKAGES):
                names.append(info.name)
    if "meshgroups.compat" not in names:  # installed from compat/ (package-dir), not found by walking
        names.append("meshgroups.compat")
    return names


def public_modules() -> list[str]:
    """Every public module: the packages, then ``MODULES``."""
    return public_packages() + [m for m in MODULES if m not in SKIP_MODULES]


def _names(module: ModuleType) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is None:
        raise ValueError(f"public module {module.__name__} has no __all__: say what it exports")
    return list(exported)


def public_api() -> list[tuple[str, list[str]]]:
    """``[(module, [name, ...]), ...]``: each public module with the public names first met there."""
    seen: set[int] = set()
    out: list[tuple[str, list[str]]] = []
    for name in public_modules():
        module = importlib.import_module(name)
        mine = []
        for attr in _names(module):
            try:
                obj = getattr(module, attr)
            except ImportError as exc:  # needs an optional dependency (vLLM): not listed here
                if exc.name and exc.name.split(".")[0] == ROOT:
                    raise
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)) and id(obj) in seen:
                continue
            seen.add(id(obj))
            mine.append(attr)
        out.append((name, mine))
    return out


# The modules whose docstrings must name every argument and the return value
# (tests/project/test_docstrings.py): the ones the README and the guides tell users to call.
USER_MODULES = (
    "meshgroups",
    "meshgroups.mesh",
    "meshgroups.errors",
    "meshgroups.render",
    "meshgroups.transfer",
    "meshgroups.compat.group_initializer",
    "meshgroups.compat.megatron",
    "meshgroups.compat.parallel_state",
    "meshgroups.compat.process_groups_config",
)
