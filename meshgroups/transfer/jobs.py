"""Several layouts in one job: a trainer and a rollout side in one world, and the groups between.

``init_job`` builds every layout of a job in one collective call — each its own root mesh
through ``meshgroups.init_mesh`` (checked across ranks, each distinct group created once via one
shared ``GroupCache``) — after refusing layouts that overlap when they were declared disjoint::

    >>> dist.init_process_group("gloo")  # 8 ranks                       # doctest: +SKIP
    >>> job = init_job({"trainer": Layout(dp=2, tp=2), "rollout": Layout(tp=4, rank_offset=4)})  # doctest: +SKIP
    >>> job.roles(5), job["trainer"].mesh.get_coordinate() is None        # doctest: +SKIP
    (('rollout',), True)
    >>> job.close()  # or leave a ``with job:`` block                      # doctest: +SKIP

Layouts may sit anywhere in the world (any offset, ``Layout.from_grid`` with permuted ranks);
``sharing="colocated"`` requires both to cover the same ranks, ``"any"`` checks nothing.
``TransferGroups`` are the only extra groups a transfer needs: one per fan-out (one slice from
one rank to several receivers), over exactly that sender and those receivers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch.distributed as dist

from ..errors import LayoutError, MeshConfigError
from ..groups import GroupCache
from ..layout import Layout
from ..mesh import MeshGroups, init_mesh
from ..strategies import Strategy

if TYPE_CHECKING:
    from .plan import Plan

Sharing = Literal["disjoint", "colocated", "any"]
SHARINGS = ("disjoint", "colocated", "any")


def check_sharing(layouts: Mapping[str, Layout], sharing: str) -> None:
    """Raise ``LayoutError`` naming a rank when the layouts break ``sharing``; torch-free.

    >>> check_sharing({"a": Layout(tp=4), "b": Layout(tp=4, rank_offset=3)}, "disjoint")
    Traceback (most recent call last):
    ...
    meshgroups.errors.LayoutError: layouts 'a' and 'b' were declared disjoint but share rank 3 ...
    """
    if sharing not in SHARINGS:
        raise MeshConfigError(f"sharing={sharing!r} must be one of {', '.join(map(repr, SHARINGS))}")
    names = list(layouts)
    ranks = {name: np.unique(layouts[name].grid) for name in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if sharing == "disjoint":
                shared = np.intersect1d(ranks[a], ranks[b], assume_unique=True)
                if shared.size:
                    raise LayoutError(
                        f"layouts {a!r} and {b!r} were declared disjoint but share rank {int(shared[0])} "
                        f"({shared.size} shared ranks); move one (rank_offset, from_grid) or pass "
                        "sharing='colocated' or 'any'"
                    )
            elif sharing == "colocated":
                only = np.setxor1d(ranks[a], ranks[b], assume_unique=True)
                if only.size:
                    r = int(only[0])
                    inside, outside = (a, b) if r in layouts[a] else (b, a)
                    raise LayoutError(
                        f"layouts {a!r} and {b!r} were declared colocated (the same ranks) but rank {r} is in "
                        f"{inside!r} and not in {outside!r}; pass sharing='any' for a partial overlap"
                    )


class Job:
    """Every layout of a job built on this rank: ``job[name]`` is that layout's ``MeshGroups``
    (a mesh whose ``get_coordinate()`` is ``None``, and ``None`` groups, on ranks outside it). All share ``cache``, so a group
    two layouts both need (colocated ``tp`` groups of equal ranks) exists once. ``close()`` (or
    leaving ``with job:``) releases the meshes and every ``TransferGroups`` made from the job."""

    def __init__(
        self, meshes: Mapping[str, MeshGroups], cache: GroupCache, sharing: str, options: dict
    ) -> None:
        self.meshes = dict(meshes)
        self.cache = cache
        self.sharing = sharing
        self._options = options
        self._transfer: list[TransferGroups] = []
        self._closed = False

    @property
    def layouts(self) -> dict[str, Layout]:
        return {name: mg.layout for name, mg in self.meshes.items()}

    def __getitem__(self, name: str) -> MeshGroups:
        if name not in self.meshes:
            raise KeyError(f"no layout {name!r} in this job; layouts are {', '.join(self.meshes)}")
        return self.meshes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.meshes)

    def roles(self, rank: int | None = None) -> tuple[str, ...]:
        """The names of the layouts holding ``rank`` (default: this rank), in job order."""
        r = dist.get_rank() if rank is None else rank
        return tuple(name for name, mg in self.meshes.items() if r in mg.layout)

    def transfer_groups(self, plan: Plan) -> TransferGroups:
        """Collective: the fan-out groups of ``plan`` (see ``TransferGroups``), built with this
        job's options and cache and closed with the job."""
        if self._closed:
            raise RuntimeError("this Job was closed; its process groups are destroyed")
        groups = TransferGroups(plan, cache=self.cache, **self._options)
        self._transfer.append(groups)
        return groups

    def close(self) -> int:
        """Destroy what this job created (transfer groups, then each mesh's groups). Local,
        idempotent; call it on every rank. Returns the number of process groups destroyed."""
        if self._closed:
            return 0
        self._closed = True
        destroyed = sum(t.close() for t in self._transfer)
        return destroyed + sum(mg.close() for mg in self.meshes.values())

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={mg.layout!r}" for name, mg in self.meshes.items())
        return f"Job({parts}, sharing={self.sharing!r})"


def init_job(
    layouts: Mapping[str, Layout],
    *,
    sharing: Sharing = "disjoint",
    device_type: str = "cpu",
    flatten: Mapping[str, Iterable[Sequence[str]]] | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    strategy: Strategy = "global",
    check: bool | None = None,
) -> Job:
    """Build every layout of a job (collective: every rank of the world calls it alike).

    Args:
        layouts: ``{"trainer": Layout(...), "rollout": Layout(...)}``, built in this order, each
            its own root mesh; ranks outside a layout get its mesh with coordinate ``None``
            and ``None`` groups.
        sharing: ``"disjoint"`` (no rank in two layouts), ``"colocated"`` (every layout over the
            same ranks) or ``"any"``; checked before anything is built.
        flatten: per layout name, the flattened dim sets to build (``{"trainer": [("dp", "cp")]}``).
        device_type, backend, timeout, strategy, check: as for ``init_mesh``, for every layout.

    Raises:
        TypeError / MeshConfigError: bad arguments. LayoutError: the layouts break ``sharing``
        (naming a rank). Everything ``init_mesh`` raises; a failure in a later layout closes
        the earlier ones on this rank before it propagates.
    """
    if not isinstance(layouts, Mapping) or not layouts:
        raise TypeError(f"layouts must be a non-empty mapping name -> Layout, got {layouts!r}")
    for name, layout in layouts.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"layout names must be non-empty strings, got {name!r}")
        if not isinstance(layout, Layout):
            raise TypeError(f"layout {name!r} must be a meshgroups.Layout, got {type(layout).__name__}")
    flat = dict(flatten or {})
    unknown = sorted(set(flat) - set(layouts))
    if unknown:
        raise MeshConfigError(f"flatten names layout {unknown[0]!r}; layouts are {', '.join(layouts)}")
    check_sharing(layouts, sharing)
    cache = GroupCache()
    options: dict[str, Any] = {
        "device_type": device_type,
        "backend": backend,
        "timeout": timeout,
        "strategy": strategy,
    }
    meshes: dict[str, MeshGroups] = {}
    try:
        for name, layout in layouts.items():
            meshes[name] = init_mesh(layout, flatten=flat.get(name, ()), cache=cache, check=check, **options)
    except BaseException:
        for mg in meshes.values():
            mg.close()
        raise
    return Job(meshes, cache, sharing, {**options, "check": check})


RouteKey = tuple[str, int, tuple[tuple[int, int], ...], int]


def fanouts(plan: Plan, rank: int) -> dict[RouteKey, tuple[int, ...]]:
    """The fan-outs ``rank`` sends in ``plan``: one slice of one weight sent at one step to two
    or more other ranks, as ``{(weight, sender, box, step): (sender, *receivers sorted)}``.
    ``plan`` is the whole plan or ``rank``'s own (``plan_transfer(..., rank=rank)``)."""
    receivers: dict[RouteKey, list[int]] = {}
    for m in plan.for_rank(rank):
        if m.src == rank and m.dst != rank:
            receivers.setdefault((m.weight, m.src, m.box, m.step), []).append(m.dst)
    return {key: (key[1], *sorted(dsts)) for key, dsts in receivers.items() if len(dsts) > 1}


def _layers(sets: Sequence[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Pack equal-sized rank sets into layers of pairwise disjoint sets: each layer is one
    ``Layout.from_grid`` (rows = groups), one ``init_mesh`` call."""
    layers: list[tuple[int, set[int], list[tuple[int, ...]]]] = []
    for ranks in sorted(sets, key=lambda s: (len(s), s)):
        for size, used, rows in layers:
            if size == len(ranks) and used.isdisjoint(ranks):
                used.update(ranks)
                rows.append(ranks)
                break
        else:
            layers.append((len(ranks), set(ranks), [ranks]))
    return [rows for _, _, rows in layers]


class TransferGroups:
    """Collective: one process group per fan-out of ``plan`` over exactly its sender and its
    receivers (sender first), built through ``init_mesh`` (checked, deduplicated through
    ``cache``, released by ``close()``); one-to-one slices need no group (point-to-point on
    the default group). Every rank passes its plan — whole or its own (``plan_transfer(...,
    rank=r)``); the senders' fan-outs are gathered (one ``all_gather_object``) so every rank
    makes the same calls and every receiver knows which of its slices arrive by broadcast.

    The legacy ``WeightTransferGroupInitializer`` (one group of trainer rank 0 and every
    rollout rank) is the special case of a plan where one rank sends everything to all.

        >>> groups = TransferGroups(plan)                                  # doctest: +SKIP
        >>> groups.sets                                                     # doctest: +SKIP
        [(0, 4, 5, 6, 7)]
        >>> groups.group((0, 4, 5, 6, 7))  # this rank's group, or None    # doctest: +SKIP
    """

    def __init__(
        self,
        plan: Plan,
        *,
        cache: GroupCache | None = None,
        device_type: str = "cpu",
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        strategy: Strategy = "global",
        check: bool | None = None,
    ) -> None:
        me = dist.get_rank()
        gathered: list[dict[RouteKey, tuple[int, ...]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, fanouts(plan, me))
        everything = {key: ranks for part in gathered for key, ranks in (part or {}).items()}
        #: every fan-out group's ranks (sender first), the same list on every rank
        self.sets: list[tuple[int, ...]] = sorted(set(everything.values()))
        #: the fan-outs this rank takes part in: ``{(weight, sender, box, step): ranks}``
        self.routes: dict[RouteKey, tuple[int, ...]] = {k: r for k, r in everything.items() if me in r}
        self.cache = cache if cache is not None else GroupCache()
        self._meshes: list[MeshGroups] = []
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        try:
            for rows in _layers(self.sets):
                layout = Layout.from_grid(np.array(rows, dtype=np.int64), ("group", "member"))
                mg = init_mesh(
                    layout,
                    device_type,
                    only=[("member",)],
                    backend=backend,
                    timeout=timeout,
                    strategy=strategy,
                    cache=self.cache,
                    check=check,
                )
                self._meshes.append(mg)
                ranks = mg.ranks("member")
                group = mg.group("member")
                if ranks is not None and group is not None:
                    self._groups[tuple(ranks)] = group
        except BaseException:
            self.close()
            raise

    def group(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """This rank's group over ``ranks`` (sender first, receivers sorted), or ``None``."""
        return self._groups.get(tuple(ranks))

    def __len__(self) -> int:
        return len(self.sets)

    def close(self) -> int:
        """Destroy the groups (those no other mesh of the cache uses). Local, idempotent."""
        destroyed = sum(mg.close() for mg in self._meshes)
        self._meshes.clear()
        self._groups.clear()
        return destroyed

    def __enter__(self) -> TransferGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferGroups({len(self.sets)} fan-out groups, {len(self._groups)} on this rank)"


__all__ = ["Job", "RouteKey", "Sharing", "TransferGroups", "check_sharing", "fanouts", "init_job"]
