"""Run megatron-core itself on meshgroups: one call before ``import megatron.core``.

    import meshgroups.compat.megatron
    meshgroups.compat.megatron.install(strategy="local")   # before megatron-core is imported

    import megatron.core                                   # its parallel_state is meshgroups'
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(2, 2)         # checked, deduplicated groups

``install`` makes ``megatron.core.parallel_state``, ``megatron.core.process_groups_config`` and
(for megatron-core 0.19) ``megatron.core.hyper_comm_grid`` resolve to ``meshgroups.compat.parallel_state`` /
``process_groups_config`` / ``hyper_comm_grid``: a finder first on
``sys.meta_path`` answers those names with the compat modules, so Python still imports
``megatron`` and ``megatron.core`` first and binds the submodule attributes as usual, and every
``from megatron.core.parallel_state import ...`` in megatron-core's models, DDP, schedules and
megatron_fsdp binds compat's functions. It also sets the group-creation strategy
``initialize_model_parallel`` uses. ``uninstall`` removes the aliases and forgets every
megatron module imported since ``install``, so the next ``import megatron.core`` is
megatron-core's own again (objects already holding compat functions keep them).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

from meshgroups.compat import hyper_comm_grid, parallel_state, process_groups_config

from meshgroups import Strategy

__all__ = ["install", "installed", "uninstall"]

_ALIASES: dict[str, ModuleType] = {
    "megatron.core.parallel_state": parallel_state,
    "megatron.core.process_groups_config": process_groups_config,
    "megatron.core.hyper_comm_grid": hyper_comm_grid,
}
# megatron-core 0.16's HyperCommGrid has other private helpers its tests read: compat's (0.19's)
# stands in for it only for megatron-core 0.19 (``_active`` is chosen at install()).
_SINCE_019 = {"megatron.core.hyper_comm_grid"}
_active: set[str] = set()
# While installed: the sys.modules entries the aliases replaced, and the modules present before.
_saved: dict[str, ModuleType | None] | None = None
_before: set[str] = set()


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an aliased name with the compat module (the module object itself, unchanged)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in _active:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _ALIASES[spec.name]

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the module: give it its own back
        module.__spec__ = _SPECS[module.__name__]


_FINDER = _AliasFinder()
_SPECS = {m.__name__: m.__spec__ for m in _ALIASES.values()}


def installed() -> bool:
    """Whether ``install`` is in effect.

    Returns:
        True between ``install()`` and ``uninstall()``.
    """
    return _saved is not None


def install(strategy: Strategy = "global") -> None:
    """Make megatron-core use meshgroups' ``parallel_state`` and ``process_groups_config``.

    Call before ``import megatron.core`` (megatron-core binds parallel_state functions at
    import). ``strategy`` is the group-creation strategy of ``initialize_model_parallel``:
    ``"local"`` for a start-up cost flat in the world size (not with a default group bound to
    a device: use ``"split"`` there), ``"global"`` (default) to create groups as megatron-core
    does. Calling it again only changes the strategy.

    Raises:
        RuntimeError: megatron-core was already imported with its own ``parallel_state``.
    """
    global _saved, _before
    parallel_state.set_default_strategy(strategy)
    if _saved is not None:
        return
    current = sys.modules.get("megatron.core.parallel_state")
    if current is not None and current is not parallel_state:
        raise RuntimeError(
            "megatron.core was imported before meshgroups.compat.megatron.install(): call install() "
            "first (megatron-core binds its parallel_state functions when it is imported)"
        )
    from meshgroups.compat._megatron_version import megatron_version

    _active.clear()
    _active.update(n for n in _ALIASES if n not in _SINCE_019 or megatron_version() == "0.19")
    _before = set(sys.modules)
    _saved = {name: sys.modules.get(name) for name in _active}
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Undo ``install``: drop the aliases and the megatron modules imported since, and restore
    the default strategy ``"global"``. A no-op when not installed."""
    global _saved
    if _saved is None:
        return
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [
        n for n in sys.modules if (n == "megatron" or n.startswith("megatron.")) and n not in _before
    ]:
        del sys.modules[name]
    for name, previous in _saved.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _saved = None
    parallel_state.set_default_strategy("global")
