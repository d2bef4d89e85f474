"""The state behind ``meshgroups.compat.parallel_state``: one explicit, resettable place (a leaf:
it imports none of the modules that serve megatron-core's surface).

``parallel_state`` is the front megatron-core code sees; it reads and writes everything here —
its module globals too (``ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = 2``, as Megatron writes
them, lands in ``SLOTS.overrides``). The helper modules (``parallel_state_ranks``,
``megatron_buffers``, ``megatron_helpers``) read the state here instead of importing the front
that re-exports them, so no import order matters::

    >>> SLOTS.state is None          # before initialize_model_parallel
    True
    >>> override("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE") is None
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from meshgroups.compat._errors import NotInitializedError
from meshgroups.compat._generated import make_function
from meshgroups.compat._megatron_api import API, FIELD_WHAT, OVERRIDES
from meshgroups.compat.megatron_layout import MegatronPlan

from meshgroups import MeshGroups


def legacy_group(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """``MeshGroups.group``'s answer as Megatron gives it: ``None`` on a rank outside the group
    (meshgroups answers torch's ``GroupMember.NON_GROUP_MEMBER`` there; Megatron keeps ``None``).

    >>> legacy_group(dist.GroupMember.NON_GROUP_MEMBER) is None
    True
    """
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


@dataclass
class MegatronState:
    """The groups of one ``initialize_model_parallel`` call: its plan, the mesh that holds the
    groups, the all-gather mesh (``create_all_gather_group``), and a lookup cache.

    Args:
        plan: the ``MegatronPlan`` (the layout and megatron-core's families on it).
        mesh_groups: the ``MeshGroups`` built from the plan.
        all_gather: the second dp×cp mesh, or ``None``.
    """

    plan: MegatronPlan
    mesh_groups: MeshGroups
    all_gather: MeshGroups | None = None
    cache: dict[tuple[str, Any], Any] = field(default_factory=dict)
    #: families without a gloo twin although gloo twins were asked for (megatron-core 0.19
    #: turns them off for the expert data-parallel groups under expert gtp_remat)
    no_gloo: frozenset[str] = frozenset()
    #: meshes made after initialisation (``create_all_gather_groups``), closed with the state
    extra: list[MeshGroups] = field(default_factory=list)

    def group(self, name: str, gloo: bool = False) -> dist.ProcessGroup | None:
        """This rank's group of family ``name`` (``None`` where megatron-core has none).

        Args:
            name: a family of the plan (``"tp"``, ``"dp_cp"``, ...).
            gloo: the gloo twin.

        Returns:
            The process group, or ``None``.
        """
        key = (name, gloo)
        if key not in self.cache:
            self.cache[key] = self._find(name, gloo)
        return self.cache[key]

    def _find(self, name: str, gloo: bool) -> dist.ProcessGroup | None:
        if name == "dp_cp_ag":
            return None if self.all_gather is None else legacy_group(self.all_gather.group("dp", "cp"))
        if name == "inter_dist_opt" and self.plan.sizes["n_opt"] == 1:
            return None  # megatron-core builds no inter-instance group for one instance
        if name not in self.plan.fields:
            return None
        if gloo and (not self.mesh_groups.gloo_twins or name in self.no_gloo):
            return None
        dims = self.plan.fields[name]
        return legacy_group(self.mesh_groups.group(*((dims,) if isinstance(dims, str) else dims), gloo=gloo))

    def ranks(self, name: str) -> list[int] | None:
        """This rank's global ranks in family ``name`` (``None``: no such group here).

        Args:
            name: a family of the plan.

        Returns:
            The ranks, in group order, or ``None``.
        """
        key = (name, "ranks")
        if key not in self.cache:
            dims = self.plan.fields[name]
            self.cache[key] = self.mesh_groups.ranks(*((dims,) if isinstance(dims, str) else dims))
        return self.cache[key]


class Slots:
    """Every piece of module state megatron-core keeps: the groups' state, the memory buffers,
    and the plain-value globals (``OVERRIDES``: sizes and ranks a user may force)."""

    def __init__(self) -> None:
        self.state: MegatronState | None = None
        self.memory_buffer: Any = None
        self.symmetric_memory_buffer: Any = None
        self.overrides: dict[str, Any] = dict.fromkeys(OVERRIDES)

    def reset(self) -> MegatronState | None:
        """Forget everything (``destroy_model_parallel``); returns the state that was held.

        Returns:
            The previous ``MegatronState`` (its groups still to be closed), or ``None``.
        """
        state = self.state
        self.state = self.memory_buffer = self.symmetric_memory_buffer = None
        self.overrides = dict.fromkeys(OVERRIDES)
        return state


SLOTS = Slots()


def override(name: str) -> Any:
    """The value of megatron-core's plain global ``name`` (``None``: not forced).

    Args:
        name: one of ``OVERRIDES``.

    Returns:
        Its value.
    """
    return SLOTS.overrides[name]


def set_override(name: str, value: Any) -> None:
    """Set megatron-core's plain global ``name`` (a setter such as
    ``set_tensor_model_parallel_world_size``, or Megatron code assigning the module global).

    Args:
        name: one of ``OVERRIDES``.
        value: its new value.
    """
    SLOTS.overrides[name] = value


def require(what: str) -> MegatronState:
    """The state, or ``NotInitializedError`` naming ``what`` before initialisation.

    Args:
        what: what the caller needs, for the message.

    Returns:
        The ``MegatronState``.

    Raises:
        NotInitializedError: before ``initialize_model_parallel``.
    """
    if SLOTS.state is None:
        raise NotInitializedError(f"{what} is not initialized: call initialize_model_parallel first")
    return SLOTS.state


def lookup(name: str, check_initialized: bool = True, gloo: bool = False, what: str = "") -> Any:
    """This rank's group of family ``name`` (``None`` where Megatron has ``None``).

    Args:
        name: a family of the plan.
        check_initialized: a missing group raises instead of answering ``None``.
        gloo: the gloo twin.
        what: the group's name in messages (default: megatron-core's).

    Returns:
        The process group, or ``None``.

    Raises:
        NotInitializedError: a missing group, with ``check_initialized``.
    """
    what = what or FIELD_WHAT.get(name, name) + (" (gloo)" if gloo else "")
    state = SLOTS.state
    if state is None:
        if check_initialized:
            require(what)
        return None
    group = state.group(name, gloo)
    if group is None and check_initialized:
        if gloo and not state.mesh_groups.gloo_twins:
            raise NotInitializedError(f"{what} is not initialized: pass create_gloo_process_groups=True")
        raise NotInitializedError(
            f"{what} is not initialized on rank {dist.get_rank()} (this rank is in no such group)"
        )
    return group


def ranks_of(name: str) -> list[int]:
    """This rank's global ranks in family ``name``.

    Args:
        name: a family of the plan.

    Returns:
        The ranks, in group order.

    Raises:
        NotInitializedError: before initialisation, or no such group on this rank.
    """
    what = FIELD_WHAT.get(name, name)
    ranks = require(what).ranks(name)
    if ranks is None:
        raise NotInitializedError(
            f"{what} is not initialized on rank {dist.get_rank()} (this rank is in no such group)"
        )
    return ranks


def local_rank_of(name: str) -> int:
    """This rank's index in its group of family ``name``.

    Args:
        name: a family of the plan.

    Returns:
        The index.
    """
    return ranks_of(name).index(dist.get_rank())


def held_groups() -> list[dist.ProcessGroup]:
    """Every distinct group the state holds on this rank (for ``update_pg_timeout``).

    Returns:
        The groups, each once.
    """
    state = SLOTS.state
    if state is None:
        return []
    names = [*FIELD_WHAT, *state.plan.fields]
    found = [state.group(n, gloo) for n in names for gloo in (False, True)]
    return list({id(g): g for g in found if g is not None}.values())


def hcp_groups() -> list[dist.ProcessGroup] | None:
    """The hierarchical context-parallel groups, one per level (``None`` without them).

    Returns:
        The groups, or ``None``.
    """
    state = SLOTS.state
    if state is None or not state.plan.hcp_levels:
        return None
    return [state.group(level[0]) for level in state.plan.hcp_levels]  # type: ignore[misc]


def hybrid_groups() -> dict[int, dist.ProcessGroup]:
    """The hybrid dp×cp groups by size (empty before initialisation or without them).

    Returns:
        ``{size: group}``.
    """
    state = SLOTS.state
    if state is None:
        return {}
    names = [n for n in state.plan.fields if n.startswith("hybrid_dp_cp_")]
    found = {int(n.rsplit("_", 1)[1]): state.group(n) for n in names}
    return {g: pg for g, pg in found.items() if pg is not None}


#: megatron-core's table-generated functions (getters, sizes, ranks, setters), bound to this
#: state and offered by ``parallel_state`` under its own module name.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    name: make_function(name, sys.modules[__name__], "meshgroups.compat.parallel_state")
    for name, api in API.items()
    if api.kind != "custom"
}


__all__ = [
    "FUNCTIONS",
    "SLOTS",
    "MegatronState",
    "Slots",
    "hcp_groups",
    "held_groups",
    "hybrid_groups",
    "local_rank_of",
    "lookup",
    "override",
    "ranks_of",
    "require",
    "set_override",
]
