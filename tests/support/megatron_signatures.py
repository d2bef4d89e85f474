"""Signatures of megatron-core's public ``parallel_state`` / ``process_groups_config`` surface.

``collect(module)`` describes every public function and class a module defines (classes: the
constructor and each public method) as ``{name: [[param, kind, default], ...]}`` — names,
positional order, kinds and ``repr`` of defaults; annotations are left out. The committed tables
were made with each megatron-core installed (0.19.1: built from Megatron-LM's tag
``core_v0.19.0``, see docs/megatron-tests.md; it adds ``hyper_comm_grid``)::

    python -m tests.support.megatron_signatures > tests/data/megatron_core_0.16.1_signatures.json
    python -m tests.support.megatron_signatures > tests/data/megatron_core_0.19.1_signatures.json
"""

from __future__ import annotations

import inspect
import json
from types import ModuleType
from typing import Any

TABLE = "megatron_core_0.16.1_signatures.json"
#: The committed table of each served version (``meshgroups.compat._megatron_version.SERVED``).
TABLES = {"0.16": TABLE, "0.19": "megatron_core_0.19.1_signatures.json"}
#: The modules each table describes, by the version that has them.
MODULES = {
    "megatron.core.parallel_state": "0.16",
    "megatron.core.process_groups_config": "0.16",
    "megatron.core.hyper_comm_grid": "0.19",
}


def describe(obj: Any) -> list[list[str]]:
    params = inspect.signature(obj).parameters.values()
    return [
        [p.name, p.kind.name, "<required>" if p.default is inspect.Parameter.empty else repr(p.default)]
        for p in params
        if p.name != "self"
    ]


def collect(module: ModuleType, names: list[str] | None = None) -> dict[str, list[list[str]]]:
    """Signatures of ``names`` (``"Class.method"`` for a member, found through inheritance too;
    default: what ``module`` itself defines publicly, classes with their own members)."""
    if names is not None:
        out_named: dict[str, list[list[str]]] = {}
        for name in names:
            obj: Any = module
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is not None:
                out_named[name] = [["<class>", "CLASS", ""]] if inspect.isclass(obj) else describe(obj)
        return out_named
    if names is None:
        names = [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", None) == module.__name__
        ]
    out: dict[str, list[list[str]]] = {}
    for name in sorted(names):
        obj = getattr(module, name)
        if not inspect.isclass(obj):
            out[name] = describe(obj)
        else:
            out[name] = [["<class>", "CLASS", ""]]
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__setattr__"):
                    continue
                func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isfunction(func) and attr not in ("__repr__",):
                    out[f"{name}.{attr}"] = describe(getattr(obj, attr))
    return out


def live() -> dict[str, dict[str, list[list[str]]]]:
    """The installed megatron-core's table (the modules its version has)."""
    import importlib

    import megatron.core

    minor = ".".join(megatron.core.__version__.split(".")[:2])
    return {
        name: collect(importlib.import_module(name))
        for name, since in MODULES.items()
        if tuple(map(int, minor.split("."))) >= tuple(map(int, since.split(".")))
    }


def main() -> None:
    print(json.dumps(live(), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
