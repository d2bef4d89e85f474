"""Every old import path and old name of meshgroups, in one table, each served with one
``DeprecationWarning`` that names its replacement and the release it goes away in.

0.5.0 made implementation modules private (``meshgroups.mesh._collective``): a user imports from
a package's front (``from meshgroups.mesh import collective_call``). Code written against 0.4
keeps working until ``REMOVED_IN``:

- an old module path (``MODULES``: ``meshgroups.heal``, ``meshgroups.mesh.mesh_groups``,
  ``meshgroups.transfer.execute``, ...) is answered by an alias module whose names are the very
  objects of its new home; importing it warns once;
- an old name (``NAMES``: ``meshgroups.RanksLost``, ``meshgroups.transfer.Plan``, ...) is
  answered by the module's ``__getattr__`` through ``old_name``, warning on each use;
- an old attribute of a class (``RENAMED_ATTRIBUTES``) through ``renamed_property``.

Nothing else in the package keeps an old path or name alive::

    >>> import warnings
    >>> import meshgroups
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     old = meshgroups.RanksLost
    >>> old is meshgroups.RanksLostError, caught[0].category.__name__
    (True, 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

#: The release that deprecated what this table serves, and the one that removes it.
SINCE = "0.5.0"
REMOVED_IN = "0.7.0"


def _private(package: str, names: Sequence[str], folder: str = "") -> dict[str, str]:
    return {f"{package}.{n}": f"{package}.{folder}{'' if folder else '_'}{n}" for n in names}


#: Old module path -> the module that holds its names now (the same objects).
MODULES: dict[str, str] = {
    # 0.4's nine aliases at the package root
    "meshgroups.heal": "meshgroups.elastic._heal",
    "meshgroups.recover": "meshgroups.elastic._recover",
    "meshgroups.verdict": "meshgroups.elastic._verdict",
    "meshgroups.cohort": "meshgroups.mesh._cohort",
    "meshgroups.collective": "meshgroups.mesh._collective",
    "meshgroups.checks": "meshgroups._checks",
    "meshgroups.placement": "meshgroups.layout._placement",
    "meshgroups.widgets": "meshgroups.render._widgets",
    "meshgroups.demo": "meshgroups.cli._demo",
    # 0.4's implementation modules, private since 0.5
    **_private(
        "meshgroups.layout",
        [
            "algebra",
            "core",
            "grid",
            "layout_topology",
            "order",
            "placement",
            "serialize",
            "topology",
            "views",
        ],
    ),
    "meshgroups.layout.checks": "meshgroups._checks",
    **_private(
        "meshgroups.mesh",
        [
            "build",
            "cohort",
            "collective",
            "failure_records",
            "families",
            "groups",
            "mesh_groups",
            "options",
            "plan",
            "rendezvous",
            "root_meshes",
            "strategies",
        ],
    ),
    "meshgroups.mesh.torch_seam": "meshgroups.mesh._torch_seam",
    **{
        f"meshgroups.mesh.torch_seam.{n}": f"meshgroups.mesh._torch_seam.{n}"
        for n in ("builders", "c10d", "internals", "meshes", "placements", "rooted_mesh", "worlds")
    },
    **_private(
        "meshgroups.elastic",
        ["elastic_mesh", "heal", "owners", "plans", "recover", "recovery_plan", "verdict"],
    ),
    **_private("meshgroups.render", ["figure", "formats", "spans", "widgets", "window"]),
    **_private(
        "meshgroups.cost",
        ["model", "roles", "rules", "memory", "calls", "traffic", "enumerate", "report"],
    ),
    "meshgroups.engines.worlds": "meshgroups.engines._worlds",
    **_private(
        "meshgroups.compat",
        [
            "megatron_api",
            "megatron_buffers",
            "megatron_helpers",
            "megatron_state",
            "parallel_state_ranks",
            "pg_setup",
        ],
    ),
    **_private(
        "meshgroups.engines.vllm",
        [
            "api",
            "clients",
            "destination",
            "plugin",
            "protocol",
            "read",
            "trainer",
            "trainer_engine",
            "worker",
        ],
    ),
    **_private("meshgroups.cli", ["app", "args", "cost", "demo", "elastic", "transfer"]),
    "meshgroups.transfer.spec": "meshgroups.transfer._spec",
    **_private(
        "meshgroups.transfer",
        [
            "names",
            "conventions",
            "families",
            "families_megatron",
            "stacking",
            "mapped",
            "linking",
            "expand",
            "quant",
            "presets",
        ],
        folder="_names.",
    ),
    **_private(
        "meshgroups.transfer",
        ["shards", "assign", "routes", "plan", "stats"],
        folder="_plan.",
    ),
    # 0.4's choose and stream, one module since (who sends)
    "meshgroups.transfer.choose": "meshgroups.transfer._plan.senders",
    "meshgroups.transfer.stream": "meshgroups.transfer._plan.senders",
    **_private(
        "meshgroups.transfer",
        [
            "buckets",
            "execute",
            "steps",
            "status",
            "fanout_groups",
            "jobs",
            "sync",
            "torch_io",
            "fp8",
        ],
        folder="_run.",
    ),
    # merged since into the module that took their job in
    "meshgroups.transfer.pairing": "meshgroups.transfer._run.status",
    "meshgroups.transfer.packing": "meshgroups.transfer._run.steps",
    "meshgroups.transfer.sync_state": "meshgroups.transfer._run.torch_io",
}

#: (module, old name) -> (module, new name): names renamed (the ``Error`` suffix, the plans'
#: own names) or taken out of a package's public surface.
NAMES: dict[tuple[str, str], tuple[str, str]] = {
    **{
        (module, old): (module, f"{old}Error")
        for module in ("meshgroups", "meshgroups.errors")
        for old in ("Excluded", "RanksLost", "StepFailed", "RendezvousTimeout")
    },
    ("meshgroups", "GroupSpec"): ("meshgroups.mesh._plan", "GroupSpec"),
    ("meshgroups.mesh", "GroupSpec"): ("meshgroups.mesh._plan", "GroupSpec"),
    ("meshgroups.mesh.plan", "Plan"): ("meshgroups.mesh._plan", "BuildPlan"),
    ("meshgroups.transfer", "Plan"): ("meshgroups.transfer", "TransferPlan"),
    ("meshgroups.transfer.plan", "Plan"): ("meshgroups.transfer", "TransferPlan"),
    ("meshgroups.elastic.recovery_plan", "Status"): ("meshgroups.elastic._recovery_plan", "FamilyStatus"),
    ("meshgroups.elastic.verdict", "StepAborted"): ("meshgroups.elastic._verdict", "StepAbortedError"),
    # the cost model's entry points 0.4.1 also answered from its memory module
    **{
        ("meshgroups.cost.memory", n): ("meshgroups.cost", n)
        for n in ("RankMemory", "peak_memory", "rank_memory", "activation_bytes_per_layer")
    },
    # the planner's internals 0.3/0.4 exported from meshgroups.transfer
    ("meshgroups.transfer", "Link"): ("meshgroups.transfer._names.mapped", "Link"),
    ("meshgroups.transfer", "Mapped"): ("meshgroups.transfer._names.mapped", "Mapped"),
    ("meshgroups.transfer", "Move"): ("meshgroups.transfer._names.mapped", "Move"),
    ("meshgroups.transfer", "SegmentWeight"): ("meshgroups.transfer._names.mapped", "SegmentWeight"),
}

#: ``Class.old`` -> the attribute's new name (served by ``renamed_property``).
RENAMED_ATTRIBUTES: dict[str, str] = {"Elastic.group": "live_group"}


def front(module: str) -> str:
    """The public module a private one's names are imported from: its path up to the first
    private part (``meshgroups.mesh._collective`` -> ``meshgroups.mesh``)."""
    parts = module.split(".")
    public = [p for p in parts[: next((i for i, p in enumerate(parts) if p.startswith("_")), len(parts))]]
    return ".".join(public)


def _warn(message: str, stacklevel: int) -> None:
    warnings.warn(
        f"{message} (deprecated in meshgroups {SINCE}, removed in {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def _asked_by_import_system(depth: int) -> bool:
    """Whether the frame ``depth`` levels up is Python's import system: ``from m import name``
    first asks ``hasattr(m, name)`` there (is it a submodule?), then takes the attribute."""
    return sys._getframe(depth + 1).f_code.co_filename.startswith("<frozen importlib")


def old_name(module: str, name: str) -> Any:
    """The object an old ``name`` of ``module`` stands for, with a ``DeprecationWarning``; a
    module's ``__getattr__`` ends with this.

    Raises:
        AttributeError: ``name`` is no old name of ``module`` either.
    """
    if (module, name) not in NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, new_name = NAMES[(module, name)]
    if not _asked_by_import_system(2):  # one warning for ``from m import name``, not two
        home = front(new_module)
        where = f"{home}.{new_name}" if home == new_module else f"internal (meshgroups' own {new_name})"
        _warn(f"{module}.{name} is now {where}", stacklevel=3)
    return getattr(importlib.import_module(new_module), new_name)


def renamed_property(qualname: str) -> property:
    """A read-only property answering ``qualname`` (``"Elastic.group"``) with its new name's
    value and a ``DeprecationWarning``."""
    new = RENAMED_ATTRIBUTES[qualname]

    def get(self: object) -> Any:
        _warn(f"{qualname} is now {qualname.split('.')[0]}.{new}", stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: ``{new}``.")


def _package_warning(old: str) -> None:
    new = MODULES[old]
    _warn(
        f"{old} is private now ({new}): import from {front(new)} the names it exports "
        "(the same objects); the others are meshgroups' internals",
        3,
    )


class _Alias(types.ModuleType):
    """An old module path: its names are the objects of ``MODULES[path]``. An old *package*
    (one with old submodules) warns at its first attribute, not when imported: importing one of
    its submodules imports it too, and that import should warn once, for the submodule."""

    def __getattr__(self, name: str) -> Any:
        old = self.__name__
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__dict__.get("_mg_warn_on_use") and not _asked_by_import_system(1):
            self.__dict__["_mg_warn_on_use"] = False
            _package_warning(old)
        if (old, name) in NAMES:
            return old_name(old, name)
        return getattr(importlib.import_module(MODULES[old]), name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(importlib.import_module(MODULES[self.__name__]))))


class _Guarded(types.ModuleType):
    """A package whose public name is also an old submodule's name (``meshgroups.transfer``'s
    ``execute``): importing the old path must not replace the package's attribute with the
    alias module, as Python's import system otherwise does after every submodule import."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, _Alias) and name in getattr(self, "__all__", ()):
            return
        super().__setattr__(name, value)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        package = any(old.startswith(fullname + ".") for old in MODULES)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Alias(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        parent_name, _, child = module.__name__.rpartition(".")
        parent = sys.modules.get(parent_name)
        if (
            parent is not None
            and type(parent) is types.ModuleType
            and child in getattr(parent, "__all__", ())
        ):
            parent.__class__ = _Guarded
        if module.__spec__ is not None and module.__spec__.submodule_search_locations is not None:
            module.__dict__["_mg_warn_on_use"] = True
        else:
            _package_warning(module.__name__)


_FINDER = _Finder()


def install() -> None:
    """Serve ``MODULES`` (idempotent; ``import meshgroups`` calls it)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


__all__ = [
    "MODULES",
    "NAMES",
    "REMOVED_IN",
    "RENAMED_ATTRIBUTES",
    "SINCE",
    "front",
    "install",
    "old_name",
    "renamed_property",
]
