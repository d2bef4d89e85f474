"""Creating process groups from layouts: each distinct group once, in mesh order.

Three strategies (see ``init_mesh`` for when to use which):

- ``"global"`` — every rank makes the creation call of every group, in one global order. The
  only mode ``torch.distributed.new_group`` promises to be safe everywhere; per-rank cost grows
  with the number of groups (O(world)).
- ``"local"`` — each rank creates only the groups that contain it, with
  ``new_group(..., use_local_synchronization=True)``. torch names such groups by hashing their
  ranks *and the number of groups the process already has*, so every member must arrive with
  the same count (pytorch#173608). We keep counts aligned by construction: every rank takes one
  step per group family, creating its own group or, where it has none to create (a cached group,
  a rank outside a subset), a trivial one-rank group in its place; ``init_mesh`` checks the
  counts agree across ranks before the first step. Not usable with NCCL ``ncclCommSplit``
  (pytorch#129965) or MPI.
- ``"split"`` — one ``dist.split_group`` per family (ncclCommSplit on a default group bound to
  a CUDA device). torch sorts split ranks, so every group must have increasing ranks.

Every group is created with ``sort_ranks=False`` from the layout's row, so a rank's position in
the mesh always equals its rank in the group.
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import numpy as np
import torch.distributed as dist

from ._torch_seam import bound_device_id
from .layout import Layout

Strategy = Literal["global", "local", "split"]
STRATEGIES: tuple[str, ...] = ("global", "local", "split")


@dataclass(frozen=True)
class GroupSpec:
    """One family of groups: the groups of ``layout`` varying ``dims`` (in layout order)."""

    key: Hashable
    layout: Layout
    dims: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.layout.size(*self.dims) if self.dims else 1


@dataclass
class GroupHandle:
    """This rank's group of one family: ``ranks`` in mesh order, or all ``None`` for a rank
    that is not a member."""

    ranks: tuple[int, ...] | None
    group: dist.ProcessGroup | None
    gloo: dist.ProcessGroup | None


@dataclass
class GroupCache:
    """Process groups by (ranks in mesh order, backend), shared by ``init_mesh`` calls that
    pass the same cache. Two groups over the same ranks in a different order are different
    groups: a rank's position must equal its group rank.

    Attributes:
        calls: ``new_group``/``split_group`` calls this rank made (members and non-members).
        created: groups this rank is a member of that were created through this cache.
        pads: one-rank groups the ``"local"`` strategy created to keep group counts aligned.
    """

    strategy: str | None = None
    calls: int = 0
    created: int = 0
    _groups: dict[tuple[tuple[int, ...], str], dist.ProcessGroup | None] = field(default_factory=dict)
    pads: list[dist.ProcessGroup] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(1 for g in self._groups.values() if g is not None)

    def groups(self) -> list[dist.ProcessGroup]:
        """Every distinct group this rank holds through the cache (WORLD excluded)."""
        return [g for g in self._groups.values() if g is not None and g is not dist.group.WORLD]

    def destroy(self) -> None:
        """Destroy every group the cache created (and the pads), then forget them."""
        for group in self.groups() + self.pads:
            dist.destroy_process_group(group)
        self._groups.clear()
        self.pads.clear()
        self.strategy = None


def _backend_key(backend: str | None) -> str:
    return backend or "<default>"


class _Builder:
    def __init__(
        self,
        *,
        strategy: str,
        backend: str | None,
        timeout: timedelta | None,
        gloo_twins: bool,
        cache: GroupCache,
    ) -> None:
        self.strategy = strategy
        self.backend = backend
        self.timeout = timeout
        self.cache = cache
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # A twin is only needed where the main backend is not gloo already.
        self.twin_backend: str | None = None
        if gloo_twins:
            main = (backend or str(dist.get_backend())).lower()
            self.twin_backend = None if main in ("gloo", "cpu:gloo") else "gloo"
        self.backends = [backend] + ([self.twin_backend] if self.twin_backend else [])

    # -- one group ------------------------------------------------------------------------
    def _new_group(self, ranks: list[int], backend: str | None, local: bool) -> dist.ProcessGroup | None:
        self.cache.calls += 1
        group = dist.new_group(
            ranks,
            timeout=self.timeout,
            backend=backend,
            use_local_synchronization=local,
            sort_ranks=False,
            group_desc="meshgroups",
        )
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        self.cache.created += 1
        return group

    def singleton(self, backend: str | None) -> dist.ProcessGroup:
        """This rank alone; every rank calls this at the same point of the sequence.

        Created with local synchronisation (no peers to wait for, and the global creation
        counter is left alone), except under ``"split"``, where a device-bound default group
        splits communicators collectively: there one ``split_group`` makes every rank's group."""
        key = ((self.rank,), _backend_key(backend))
        if key not in self.cache._groups:
            if self.strategy == "split" and backend == self.backend:
                self.cache.calls += 1
                alone = [[r] for r in range(self.world_size)]
                self.cache._groups[key] = dist.split_group(split_ranks=alone, timeout=self.timeout)
                self.cache.created += 1
            else:
                self.cache._groups[key] = self._new_group([self.rank], backend, local=True)
        return self.cache._groups[key]  # type: ignore[return-value]

    def _is_world(self, row: tuple[int, ...]) -> bool:
        return len(row) == self.world_size and row[0] == 0 and row == tuple(range(self.world_size))

    # -- strategies -----------------------------------------------------------------------
    def family_global(self, rows: np.ndarray, mine: tuple[int, ...] | None) -> list[dist.ProcessGroup | None]:
        out: list[dist.ProcessGroup | None] = []
        known = self.cache._groups
        # The hot loop at scale (one iteration per group in the world). Its many small tuples
        # would trigger the cyclic GC over and over; they hold no cycles, so pause it.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for backend in self.backends:
                bkey = _backend_key(backend)
                for row in rows.tolist():
                    key = (tuple(row), bkey)
                    if key in known:
                        continue
                    if backend == self.backend and self._is_world(key[0]):
                        known[key] = dist.group.WORLD
                    else:
                        known[key] = self._new_group(row, backend, local=False)
                out.append(known[(mine, bkey)] if mine is not None else None)
        finally:
            if gc_was_enabled:
                gc.enable()
        return out

    def family_local(self, mine: tuple[int, ...] | None) -> list[dist.ProcessGroup | None]:
        out: list[dist.ProcessGroup | None] = []
        for backend in self.backends:
            if mine is None:
                self._pad()
                out.append(None)
                continue
            key = (mine, _backend_key(backend))
            if key in self.cache._groups:
                self._pad()
            elif self._is_world(mine) and backend == self.backend:
                self.cache._groups[key] = dist.group.WORLD
                self._pad()  # WORLD needs no creation, but the step must still count
            else:
                self.cache._groups[key] = self._new_group(list(mine), backend, local=True)
            out.append(self.cache._groups[key])
        return out

    def _pad(self) -> None:
        self.cache.calls += 1
        self.cache.pads.append(dist.new_group([self.rank], use_local_synchronization=True))

    def family_split(self, rows: np.ndarray, mine: tuple[int, ...] | None) -> list[dist.ProcessGroup | None]:
        self.cache.calls += 1
        group = dist.split_group(split_ranks=rows.tolist(), timeout=self.timeout, group_desc="meshgroups")
        out: list[dist.ProcessGroup | None] = [None]
        if mine is not None:
            # Reuse an equal cached group; the fresh split (all ranks had to make it) is dropped.
            key = (mine, _backend_key(self.backend))
            self.cache._groups.setdefault(key, group)
            self.cache.created += 1
            out[0] = self.cache._groups[key]
        if self.twin_backend:
            out.append(self._twin_global(rows, mine))
        return out

    def _twin_global(self, rows: np.ndarray, mine: tuple[int, ...] | None) -> dist.ProcessGroup | None:
        saved = self.backends
        self.backends = [self.twin_backend]
        try:
            return self.family_global(rows, mine)[0]
        finally:
            self.backends = saved


def _mine(spec: GroupSpec, rank: int) -> tuple[int, ...] | None:
    if rank not in spec.layout:
        return None
    return tuple(spec.layout.group_of(rank, *spec.dims).tolist())


def _family_identity(spec: GroupSpec, main: Layout) -> tuple[object, ...]:
    """Families with equal identity have identical groups, so only the first is built. Dims of
    size 1 do not change a family; a view's dim that the main layout also has is the same dim
    (``Layout.with_views`` checked that)."""
    live = tuple(sorted(d for d in spec.dims if spec.layout.size(d) > 1))
    is_view = any(spec.layout is view for view in main.views.values())
    shared = spec.layout is main or (is_view and all(d in main.names for d in live))
    owner = id(main) if shared else id(spec.layout)
    return (owner, live)


def check_strategy_inputs(strategy: str, specs: Sequence[GroupSpec]) -> None:
    """Errors that must fire before any group is created."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(map(repr, STRATEGIES))}")
    if strategy == "local" and bound_device_id() is not None:
        raise ValueError(
            "strategy='local' cannot be used with a default process group bound to a device "
            "(init_process_group(device_id=...)): torch creates such groups by splitting the default "
            "communicator, which every rank must join (pytorch#129965); use strategy='split' there"
        )
    if strategy == "split":
        if bound_device_id() is None:
            raise ValueError(
                "strategy='split' needs a default process group bound to a device "
                "(init_process_group(..., device_id=torch.device('cuda', local_rank)))"
            )
        for spec in specs:
            rows = spec.layout.groups(*spec.dims)
            if rows.shape[1] > 1 and not (np.diff(rows, axis=1) > 0).all():
                raise ValueError(
                    f"strategy='split' cannot build group {spec.key!r}: split_group sorts ranks, but "
                    f"{rows[(np.diff(rows, axis=1) <= 0).any(axis=1)][0].tolist()} does not increase; "
                    "use strategy='global' or 'local' for this layout"
                )


def build_groups(
    specs: Sequence[GroupSpec],
    main: Layout,
    *,
    strategy: str = "global",
    backend: str | None = None,
    timeout: timedelta | None = None,
    gloo_twins: bool = False,
    cache: GroupCache | None = None,
) -> dict[Hashable, GroupHandle]:
    """Create the groups of every spec (in order) and return this rank's group of each.

    Every rank must call this with the same specs in the same order, after
    ``check_strategy_inputs`` (errors must fire before any collective); ``init_mesh`` does both.
    """
    cache = cache if cache is not None else GroupCache()
    if cache.strategy not in (None, strategy):
        raise ValueError(
            f"this GroupCache was filled with strategy={cache.strategy!r}; "
            f"it cannot be reused with strategy={strategy!r} (the ranks would disagree on what exists)"
        )
    cache.strategy = strategy
    builder = _Builder(
        strategy=strategy, backend=backend, timeout=timeout, gloo_twins=gloo_twins, cache=cache
    )
    if any(spec.size == 1 for spec in specs):  # same decision on every rank
        for b in builder.backends:
            builder.singleton(b)
    handles: dict[Hashable, GroupHandle] = {}
    built: dict[tuple[object, ...], Hashable] = {}
    for spec in specs:
        mine = _mine(spec, builder.rank)
        if spec.size == 1:
            groups = [builder.singleton(b) if mine is not None else None for b in builder.backends]
        elif _family_identity(spec, main) in built:
            earlier = handles[built[_family_identity(spec, main)]]
            handles[spec.key] = GroupHandle(mine, earlier.group, earlier.gloo)
            continue
        elif strategy == "global":
            groups = builder.family_global(spec.layout.groups(*spec.dims), mine)
        elif strategy == "local":
            groups = builder.family_local(mine)
        else:
            groups = builder.family_split(spec.layout.groups(*spec.dims), mine)
        built.setdefault(_family_identity(spec, main), spec.key)
        group = groups[0]
        gloo = groups[1] if builder.twin_backend else (group if gloo_twins else None)
        handles[spec.key] = GroupHandle(mine, group, gloo)
    return handles
