"""The group families one ``MeshGroups`` holds: a handle per family (a dim tuple in layout order,
or a subset name), the subsets' specs, the cache keys and one-rank pads it must release, and the
first build's plan, from which later builds — ``flatten``, torch's ``_flatten``/``_unflatten`` —
derive theirs. Shared by :class:`~meshgroups.MeshGroups` (lookups, lifetime) and
:class:`~meshgroups.mesh._root_meshes.RootMeshes` (DeviceMeshes).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch.distributed as dist

from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh._build import Built, build
from meshgroups.mesh._collective import collective_call
from meshgroups.mesh._groups import GroupCache, GroupHandle, GroupKey
from meshgroups.mesh._plan import BuildPlan, GroupSpec
from meshgroups.mesh._planning import plan_more
from meshgroups.mesh._torch_seam import BackendConfig


class Families:
    """Every group family built for one layout (see the module docstring)."""

    def __init__(self, built: Built) -> None:
        self.plan: BuildPlan = built.plan
        self.check: bool = built.check
        self.cache: GroupCache = built.builder.cache
        self.handles: dict[Hashable, GroupHandle] = dict(built.handles)
        self.subsets: dict[str, GroupSpec] = dict(built.plan.subsets)
        self.keys: list[GroupKey] = list(built.builder.keys)
        self.pads: list[dist.ProcessGroup] = list(built.builder.pads)

    def add(
        self,
        owner: Layout,
        key: tuple[str, ...],
        label: str | None = None,
        override: BackendConfig = (None, None),
    ) -> GroupHandle:
        """Build the family of ``key`` in ``owner`` (collective, like ``init_mesh``) with the
        first build's options (its plan's), reusing equal groups; ``label`` names it in torch."""
        label = label or "_".join(key)
        overrides = {label: override} if override != (None, None) else None
        with collective_call("init_mesh") as call:  # joins flatten's (or torch's _flatten's) call
            plan = plan_more(call, self.plan, owner, [key], {key: label}, overrides)
            built = build(plan, call, cache=self.cache)
        self.keys += built.builder.keys
        self.pads += built.builder.pads
        return built.handles[key]

    def key_of(self, layout: Layout, dims: tuple[str, ...]) -> Hashable:
        """The family key of ``dims`` (a subset name, or the dims in their layout's order);
        ``MeshConfigError`` naming how to build it if it was not built."""
        if len(dims) == 1 and dims[0] in self.subsets:
            return dims[0]
        if not dims:
            raise MeshConfigError("name at least one dim (or a subset), e.g. group('tp')")
        owner = layout.resolve(*dims)
        key = tuple(d for d in owner.names if d in dims)
        if key not in self.handles:
            raise MeshConfigError(
                f"group {key} was not built; declare it with init_mesh(..., flatten=[{key!r}]) or add it "
                f"with mg.flatten{key!r} on every rank (groups are created collectively)"
            )
        return key

    def release(self) -> int:
        """Release every group these families hold (those no other live user of the cache
        holds are destroyed); returns how many were destroyed on this rank."""
        destroyed = self.cache.release(self.keys, self.pads)
        self.keys.clear()
        self.pads.clear()
        return destroyed
