"""How process groups get created: one strategy object per strategy, behind one interface.

- ``GlobalStrategy`` (``"global"``) — every rank makes the creation call of every group, in one
  global order. The only mode ``torch.distributed.new_group`` promises to be safe everywhere;
  per-rank cost grows with the number of groups (O(world)).
- ``LocalStrategy`` (``"local"``) — each rank creates only the groups that contain it, with
  ``new_group(..., use_local_synchronization=True)``. torch names such groups by hashing their
  ranks *and the number of groups the process already has*, so every member must arrive with
  the same count (pytorch#173608). Counts stay aligned by construction: every rank takes one
  step per family, creating its own group or, where it has none to create (a cached group, a
  rank outside a subset), a trivial one-rank group in its place; the cross-rank check of
  ``init_mesh`` levels the counts on entry. Refused with a device-bound default group, where
  torch splits communicators collectively (pytorch#129965); not for MPI.
- ``SplitStrategy`` (``"split"``) — one ``dist.split_group`` per family (ncclCommSplit on a
  default group bound to a CUDA device). torch 2.13 sorts split ranks, so there every group must
  increase; from 2.14 a rank's position in the list is its group rank, and any order is split.
- ``"auto"`` (the default) picks one of these per call, the same on every rank: ``"split"`` where
  the default group is bound to a device, torch keeps split order (>= 2.14) and the whole world
  is live — what NCCL wants, and what torch 2.15's ``"nccl"`` (the nccl2 backend: eager
  communicators, subgroups split from the parent) does itself —, else ``"global"``.

Every group is created with ``sort_ranks=False`` from the layout's row, so a rank's position in
the mesh always equals its rank in the group. A ``Builder`` runs one strategy over a plan's
families and records what it created, so a failed or closed build can release exactly that.
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import Literal

import numpy as np
import torch.distributed as dist

from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh._cohort import current_cohort
from meshgroups.mesh._groups import GroupCache, GroupHandle, GroupKey, backend_key
from meshgroups.mesh._plan import GroupSpec, options_tag
from meshgroups.mesh._torch_seam import SPLIT_GROUP_SORTS, bound_device_id
from meshgroups.mesh._watched_store import keep, watching

Groups = list["dist.ProcessGroup | None"]
Strategy = Literal["auto", "global", "local", "split"]


class Builder:
    """One build: creation calls against one cache, with everything this build took recorded."""

    def __init__(
        self, cache: GroupCache, *, backend: str | None, timeout: timedelta, gloo_twins: bool
    ) -> None:
        self.cache = cache
        self.backend = backend
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.gloo_twins = gloo_twins
        self.default = backend
        self.desc = "meshgroups"
        self.options: object | None = None
        self.overridden = False
        self.twin_backend: str | None = None
        self.backends: list[str | None] = []
        self._use(backend)
        self.keys: list[GroupKey] = []  # entries this build holds a reference to
        self.pads: list[dist.ProcessGroup] = []  # one-rank groups this build created

    def _use(self, backend: str | None) -> None:
        self.backend = backend
        # A twin is only needed where the main backend is not gloo already.
        self.twin_backend = None
        if self.gloo_twins:
            main = (real_backend(backend) or str(dist.get_backend())).lower()
            self.twin_backend = None if main in ("gloo", "cpu:gloo") else "gloo"
        self.backends = [backend] + ([self.twin_backend] if self.twin_backend else [])

    def configure(self, spec: GroupSpec) -> None:
        """Use ``spec``'s backend override (if any) and group description for what follows.
        With options the backend key carries ``#<options tag>``, so the group cache never
        hands a family a group made with other options."""
        self.desc = spec.desc or "meshgroups"
        self.overridden = spec.backend is not None
        if spec.backend is None:
            self.options = None
            self._use(self.default)
            return
        name, self.options = spec.backend
        tag = "" if self.options is None else f"#{options_tag(self.options)}"
        self._use(f"{name or self.default or ''}{tag}" if tag else (name or self.default))

    def take(self, key: GroupKey) -> dist.ProcessGroup | None:
        self.keys.append(key)
        self.cache.acquire([key])
        return self.cache.get(key)[1]

    def new_group(self, ranks: list[int], backend: str | None, local: bool) -> dist.ProcessGroup | None:
        self.cache.calls += 1
        options = self.options if backend == self.backend else None
        # torch lets an explicit timeout win over the options' own (device_mesh passes it too)
        timeout = getattr(options, "_timeout", None) or self.timeout
        with watching(ranks):  # its creation stops waiting for a member that is gone
            group = dist.new_group(
                ranks,
                timeout=timeout,
                backend=real_backend(backend),
                pg_options=options,
                use_local_synchronization=local,
                sort_ranks=False,
                group_desc=self.desc,
            )
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        keep(group)
        self.cache.created += 1
        return group

    def pad(self) -> None:
        """A one-rank group that only advances this rank's held-group count."""
        self.cache.calls += 1
        group = dist.new_group([self.rank], use_local_synchronization=True, timeout=self.timeout)
        self.cache.pads.append(group)
        self.pads.append(group)

    def is_world(self, row: tuple[int, ...]) -> bool:
        # An overridden backend gets a group of its own even over the whole world (as in torch).
        if self.overridden:
            return False
        # After a loss WORLD holds a dead rank, and after an elastic job admitted a new process
        # in a lost one's place (epoch > 0) the default groups never connected to it: never
        # hand WORLD out then.
        cohort = current_cohort()
        if cohort is not None and (len(cohort) != self.world_size or cohort.epoch > 0):
            return False
        return len(row) == self.world_size and row[0] == 0 and row == tuple(range(self.world_size))


def real_backend(backend: str | None) -> str | None:
    """The backend name ``new_group`` gets from a builder's backend key (``"gloo#<options>"``)."""
    return (backend.partition("#")[0] or None) if backend else None


class CreationStrategy:
    """The interface: check inputs before any collective, then build families one by one."""

    name = ""

    def validate(self, specs: Sequence[GroupSpec]) -> None:
        """Errors that must fire before any group is created (identical on every rank)."""

    def singleton(self, b: Builder, backend: str | None) -> dist.ProcessGroup | None:
        """This rank alone; every rank calls this at the same point of the sequence. Created with
        local synchronisation: no peers to wait for, the global creation counter left alone."""
        key = ((b.rank,), backend_key(backend))
        if not b.cache.get(key)[0]:
            b.cache.put(key, b.new_group([b.rank], backend, local=True))
        return b.take(key)

    def family(self, b: Builder, rows: np.ndarray | None, mine: tuple[int, ...] | None) -> Groups:
        """This rank's group of one family, per backend (``None`` where not a member)."""
        raise NotImplementedError

    #: Whether ``family`` needs every group of the family (O(world)) or only this rank's.
    needs_all_rows = True


class GlobalStrategy(CreationStrategy):
    """``strategy="global"``: every rank makes every group-creation call, in one global order
    (what torch requires of ``new_group``; O(world) calls per rank).
    """

    name = "global"

    def family(self, b: Builder, rows: np.ndarray | None, mine: tuple[int, ...] | None) -> Groups:
        if rows is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: rows is None")
        out: Groups = []
        # The hot loop at scale (one iteration per group in the world). Its many small tuples
        # would trigger the cyclic GC over and over; they hold no cycles, so pause it.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for backend in b.backends:
                bkey = backend_key(backend)
                for row in rows.tolist():
                    key = (tuple(row), bkey)
                    if not b.cache.get(key)[0]:
                        if backend == b.backend and b.is_world(key[0]):
                            b.cache.put(key, dist.group.WORLD)
                        else:
                            b.cache.put(key, b.new_group(row, backend, local=False))
                    # Every rank references every row, member or not, so releases stay
                    # symmetric: an entry disappears on all ranks at the same close.
                    b.take(key)
                out.append(b.cache.get((mine, bkey))[1] if mine is not None else None)
        finally:
            if gc_was_enabled:
                gc.enable()
        return out


class LocalStrategy(CreationStrategy):
    """``strategy="local"``: each rank creates only its own groups with
    ``use_local_synchronization=True``, one step per family (O(families) per rank); refused for a
    device-bound default group.
    """

    name = "local"
    needs_all_rows = False

    def validate(self, specs: Sequence[GroupSpec]) -> None:
        if bound_device_id() is not None:
            raise MeshConfigError(
                "strategy='local' cannot be used with a default process group bound to a device "
                "(init_process_group(device_id=...)): torch creates such groups by splitting the default "
                "communicator, which every rank must join (pytorch#129965); use strategy='split' there"
            )

    def family(self, b: Builder, rows: np.ndarray | None, mine: tuple[int, ...] | None) -> Groups:
        out: Groups = []
        for backend in b.backends:
            if mine is None:
                b.pad()
                out.append(None)
                continue
            key = (mine, backend_key(backend))
            if b.cache.get(key)[0]:
                b.pad()
            elif b.is_world(mine) and backend == b.backend:
                b.cache.put(key, dist.group.WORLD)
                b.pad()  # WORLD needs no creation, but the step must still count
            else:
                b.cache.put(key, b.new_group(list(mine), backend, local=True))
            out.append(b.take(key))
        return out


class SplitStrategy(CreationStrategy):
    """``strategy="split"``: one ``dist.split_group`` per family, for a default group bound to a
    device; on torch 2.13 (whose split sorts ranks) refused where groups' ranks do not increase.
    """

    name = "split"

    def validate(self, specs: Sequence[GroupSpec]) -> None:
        if bound_device_id() is None:
            raise MeshConfigError(
                "strategy='split' needs a default process group bound to a device "
                "(init_process_group(..., device_id=torch.device('cuda', local_rank)))"
            )
        refuse_unsorted(specs)

    def singleton(self, b: Builder, backend: str | None) -> dist.ProcessGroup | None:
        if backend != b.backend:
            return super().singleton(b, backend)
        key = ((b.rank,), backend_key(backend))
        if not b.cache.get(key)[0]:
            # A device-bound default group splits communicators collectively: one split_group
            # makes every rank's one-rank group.
            b.cache.calls += 1
            alone = [[r] for r in range(b.world_size)]
            b.cache.put(key, dist.split_group(split_ranks=alone, timeout=b.timeout))
            b.cache.created += 1
        return b.take(key)

    def family(self, b: Builder, rows: np.ndarray | None, mine: tuple[int, ...] | None) -> Groups:
        if rows is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: rows is None")
        b.cache.calls += 1
        group = dist.split_group(
            split_ranks=rows.tolist(), timeout=b.timeout, pg_options=b.options, group_desc=b.desc
        )
        out: Groups = [None]
        if mine is not None:
            # Reuse an equal cached group; the fresh split (all ranks had to make it) is dropped.
            key = (mine, backend_key(b.backend))
            if not b.cache.get(key)[0]:
                b.cache.put(key, group)
                b.cache.created += 1
            out[0] = b.take(key)
        if b.twin_backend:
            saved = b.backends
            b.backends = [b.twin_backend]
            try:
                out.append(GlobalStrategy().family(b, rows, mine)[0])
            finally:
                b.backends = saved
        return out


def refuse_unsorted(specs: Sequence[GroupSpec], sorts: bool = SPLIT_GROUP_SORTS) -> None:
    """Where ``split_group`` sorts ranks (``sorts``: torch 2.13), a group whose ranks do not
    increase would get group ranks in another order than the mesh's: refused by name."""
    if not sorts:
        return
    for spec in specs:
        rows = spec.layout.groups(*spec.dims)
        if rows.shape[1] > 1 and not (np.diff(rows, axis=1) > 0).all():
            raise MeshConfigError(
                f"strategy='split' cannot build group {spec.key!r}: this torch's split_group sorts ranks, "
                f"but {rows[(np.diff(rows, axis=1) <= 0).any(axis=1)][0].tolist()} does not increase; "
                "use strategy='global' or 'local' for this layout, or torch >= 2.14"
            )


STRATEGIES: dict[str, type[CreationStrategy]] = {
    s.name: s for s in (GlobalStrategy, LocalStrategy, SplitStrategy)
}


def resolve_auto() -> str:
    """What ``strategy="auto"`` means here: ``"split"`` for a device-bound default group on a torch
    whose ``split_group`` keeps rank order, over the whole live world; else ``"global"``."""
    cohort = current_cohort()  # split_group is collective over the default group: no dead rank in it
    whole = cohort is None or len(cohort) == dist.get_world_size()
    return "split" if bound_device_id() is not None and not SPLIT_GROUP_SORTS and whole else "global"


def make_strategy(name: object) -> CreationStrategy:
    """The strategy object for a name (``"auto"`` resolved by ``resolve_auto``).

    Args:
        name: ``"auto"``, ``"global"``, ``"local"`` or ``"split"``.

    Returns:
        A new ``CreationStrategy``.

    Raises:
        MeshConfigError: any other value.
    """
    if name == "auto":
        name = resolve_auto()
    if not isinstance(name, str) or name not in STRATEGIES:
        names = ", ".join(map(repr, ("auto", *STRATEGIES)))
        raise MeshConfigError(f"strategy={name!r} is not one of {names}")
    return STRATEGIES[name]()


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


def build_families(
    strategy: CreationStrategy, b: Builder, specs: Sequence[GroupSpec], main: Layout, gloo_twins: bool
) -> dict[Hashable, GroupHandle]:
    """Create the groups of every spec (in order) and return this rank's group of each.

    Every rank must call this with the same specs in the same order, after the strategy's
    ``validate`` and the cross-rank check; ``init_mesh`` does all three.
    """
    if b.cache.strategy not in (None, strategy.name):
        raise MeshConfigError(
            f"this GroupCache was filled with strategy={b.cache.strategy!r}; "
            f"it cannot be reused with strategy={strategy.name!r} (the ranks would disagree on what exists)"
        )
    b.cache.strategy = strategy.name
    # One shared one-rank group per backend for every size-1 family, made at the first such
    # family: the same step on every rank, whether or not it is a member.
    singles: dict[str | None, Groups] = {}
    handles: dict[Hashable, GroupHandle] = {}
    built: dict[tuple[object, ...], Hashable] = {}
    for spec in specs:
        b.configure(spec)
        mine = _mine(spec, b.rank)
        identity = (*_family_identity(spec, main), b.backend)
        if spec.size == 1:
            if b.backend not in singles:
                singles[b.backend] = [strategy.singleton(b, backend) for backend in b.backends]
            groups = singles[b.backend] if mine is not None else [None] * len(b.backends)
        elif identity in built:
            earlier = handles[built[identity]]
            handles[spec.key] = GroupHandle(mine, earlier.group, earlier.gloo)
            continue
        else:
            rows = spec.layout.groups(*spec.dims) if strategy.needs_all_rows else None
            groups = strategy.family(b, rows, mine)
        built.setdefault(identity, spec.key)
        group = groups[0]
        gloo = groups[1] if b.twin_backend else (group if gloo_twins else None)
        handles[spec.key] = GroupHandle(mine, group, gloo)
    return handles
