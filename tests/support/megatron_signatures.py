"""Signatures of megatron-core's public ``parallel_state`` / ``process_groups_config`` surface.

``collect(module)`` describes every public function and class a module defines (classes: the
constructor and each public method) as ``{name: [[param, kind, default], ...]}`` — names,
positional order, kinds and ``repr`` of defaults; annotations are left out. The committed table
``tests/data/megatron_core_0.16.1_signatures.json`` was made with megatron-core 0.16.1 installed:

    python -m tests.support.megatron_signatures > tests/data/megatron_core_0.16.1_signatures.json
"""

from __future__ import annotations

import inspect
import json
from types import ModuleType
from typing import Any

TABLE = "megatron_core_0.16.1_signatures.json"


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


def main() -> None:
    from megatron.core import parallel_state, process_groups_config

    table = {
        "megatron.core.parallel_state": collect(parallel_state),
        "megatron.core.process_groups_config": collect(process_groups_config),
    }
    print(json.dumps(table, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
