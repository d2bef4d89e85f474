"""Rebuild a mesh for a new layout over the live ranks, keeping every group that did not change.

``rebuild(old, new_layout)`` is one collective call over the current cohort (the live ranks,
``meshgroups.mesh.Cohort``; the default group's world when there is none):

1. **Out-of-step groups are retired.** Every group this rank holds whose members are all live
   is a candidate for reuse. Its members publish their torch sequence number for it (how many
   collectives each issued on it) and meet once; a group whose members disagree — one posted an
   operation the others never did when the step failed part-way — is destroyed on every member
   alike (they read the same numbers) and created anew below.
2. **The new layout is built through the old mesh's ``GroupCache``** (groups keyed by their
   ranks in mesh order) with the old mesh's options: every group whose rank set is unchanged is
   the *same* ``ProcessGroup`` object; only the others are created, over live ranks only.
3. **The old mesh is closed** locally: the groups only it used (those with a dead rank, or no
   longer in the layout) are destroyed — no collective; destroying a gloo group whose peer died
   returns at once.

Over a cohort smaller than the world (after a loss) the mesh must be built with
``strategy="local"`` (each rank creates only its own groups, with local synchronisation): the
ranks' caches differ (a survivor holds groups a spare never made; a retired group is gone on
its members only), and only the local strategy lets each rank skip the groups it already has.
Over the whole world (no loss, or torch's fake backend) ``"global"`` meshes rebuild too.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from meshgroups.elastic._unblock import holds_pair
from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh import (
    Call,
    GroupCache,
    GroupKey,
    MeshGroups,
    MeshOptions,
    SubsetSpec,
    collective_call,
    group_sequence,
    init_mesh,
    shrink_nccl_group,
)


def mesh_options(mg: MeshGroups) -> dict[str, Any]:
    """The ``init_mesh`` keywords ``mg`` was built with (subsets excepted: they belong to its
    layout), to build another layout alike: ``mg.options`` plus its ``flatten``/``only``.

    Args:
        mg: a built mesh.

    Returns:
        A new dict of ``init_mesh`` keywords.

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups import Layout, init_mesh
    >>> from meshgroups.elastic import mesh_options
    >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)  # 1 of 8
    >>> with init_mesh(Layout(dp=2, tp=4), flatten=[("dp", "tp")]) as mg:
    ...     opts = mesh_options(mg)
    >>> opts["flatten"], opts["device_type"], opts["only"]
    ((('dp', 'tp'),), 'cpu', None)
    >>> dist.destroy_process_group()
    """
    return {**mg.options.kwargs(), "flatten": mg.declared_flatten, "only": mg.declared_only}


def rebuild(
    old: MeshGroups | None,
    new_layout: Layout,
    *,
    subsets: Mapping[str, SubsetSpec] | None = None,
    options: MeshOptions | Mapping[str, Any] | None = None,
    flatten: Iterable[Sequence[str]] | None = None,
    cache: GroupCache | None = None,
    also_close: Sequence[MeshGroups] = (),
    site: str | None = None,
    broken: Collection[tuple[int, int]] = (),
) -> MeshGroups:
    """Build ``new_layout`` over the current cohort, reusing ``old``'s unchanged groups, then
    close ``old``. Collective over the cohort's members (``Elastic`` runs it over the
    survivors); here over the whole of a stand-in world (torch's ``"fake"`` backend, rank 5 of
    8), after ``plan_shrink`` dropped replica 0::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import Layout, init_mesh
        >>> from meshgroups.elastic import plan_shrink, rebuild
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        >>> old = init_mesh(Layout(dp=2, tp=4))
        >>> tp = old.group("tp")
        >>> new = rebuild(old, plan_shrink(old.layout, lost=[1]).new_layout)
        >>> new.layout, new.group("tp") is tp, old.closed  # the same tp group, kept
        (Layout(dp=1, tp=4, rank_offset=4), True, True)
        >>> closed = new.close()
        >>> dist.destroy_process_group()

    Args:
        old: the live mesh of the previous layout; ``None`` on a rank that holds none (a spare
            being admitted), which then needs ``options``.
        new_layout: the layout to build (every rank in it must be a live member).
        subsets: the new layout's subsets (``init_mesh``'s argument).
        options: the ``MeshOptions`` to build with (default: ``old.options``); a dict of
            ``init_mesh`` keywords (``mesh_options``) is still taken.
        flatten: the new layout's flattened dims (default: ``old``'s, or those of a dict
            ``options``).
        cache: the group cache to build through (default: ``old``'s, else a new one).
        also_close: other meshes built through the same cache to close with ``old`` (e.g. a
            world-wide group's); their out-of-step groups are forgotten too.
        site: compared instead of the caller's line (ranks that reach the same rebuild from
            different places on purpose, e.g. ``Elastic.grow`` and ``Elastic.standby``).
        broken: rank pairs whose connections were shut down (``Elastic`` wakes a blocked rank so):
            every group holding both ends of one is replaced (the same pairs on every rank).

    Returns:
        The new ``MeshGroups``.

    Raises:
        MeshConfigError: not ``strategy="local"`` over a cohort, no options, a rank of ``new_layout``
            is not a live member; and whatever ``init_mesh`` raises (on every member alike).
    """
    with collective_call("rebuild") as call:
        if site is not None:
            call.site_key = call.site = site
        if old is not None and old.closed:
            raise MeshConfigError(
                "rebuild needs the old MeshGroups open (it reuses its groups); it was closed"
            )
        opts = _keywords(options, old, flatten)
        if not opts:
            raise MeshConfigError("rebuild without an old mesh needs options= (init_mesh's arguments)")
        opts["partial"] = True  # a new layout after a loss leaves ranks out: those become spares
        shrunk = call.members is not None and len(call.members) < dist.get_world_size()
        if opts.get("strategy") != "local" and (shrunk or old is None):
            raise MeshConfigError(
                f"rebuild needs meshes built with strategy='local' (got {opts.get('strategy')!r}): after a loss "
                "the ranks hold different groups, and only local synchronisation lets each skip its own"
            )
        cache = cache if cache is not None else old.cache if old is not None else GroupCache()
        members = call.members if call.members is not None else range(dist.get_world_size())
        outside: list[int] = []
        if call.members is not None:  # (O(world) numpy, once per rebuild)
            grid = new_layout.grid.ravel()
            outside = grid[~np.isin(grid, np.asarray(call.members))].tolist()
        if outside:
            raise MeshConfigError(
                f"the new layout holds rank(s) {outside[:8]} that are not live members of this cohort "
                f"({list(members[:16])}); build only over survivors and admitted ranks"
            )
        call.compare(layout=new_layout.fingerprint())
        holders = [m for m in (old, *also_close) if m is not None]
        live = _Live(members)  # no set of the world: membership by range or bisection
        for gkey, _ in cache.items() if broken else ():
            if holds_pair(gkey[0], set(broken)):
                cache.evict(gkey)
                for holder in holders:
                    holder.forget_group(gkey)
        mine = _retire_out_of_step(call, cache, holders, live)
        _shrink_nccl_groups(cache, new_layout, opts, live)
        # Every rank's cache must look alike to the cross-rank check: it is in use, by design.
        cache.since, cache.strategy = -1, opts["strategy"]
        try:
            mg = init_mesh(new_layout, cache=cache, subsets=subsets, **opts)
        finally:
            for key in mine:
                try:
                    call.store.delete_key(key)  # type: ignore[union-attr]
                except Exception:
                    pass
    for m in holders:
        m.close()
    return mg


class _Live:
    """Membership in the cohort's members (sorted, distinct) or the whole world (a ``range``)
    without building a set of them: O(1) for a range, O(log n) otherwise, per rank asked.

        >>> _Live(range(8)).has_all([0, 7]), _Live((1, 4, 9)).has_any([2, 3])
        (True, False)
    """

    def __init__(self, members: Sequence[int]) -> None:
        self.members = members

    def __contains__(self, rank: int) -> bool:
        if isinstance(self.members, range):
            return rank in self.members
        i = bisect.bisect_left(self.members, rank)
        return i < len(self.members) and self.members[i] == rank

    def has_all(self, ranks: Iterable[int]) -> bool:
        """Every one of ``ranks`` is a member."""
        return all(r in self for r in ranks)

    def has_any(self, ranks: Iterable[int]) -> bool:
        """Some of ``ranks`` is a member."""
        return any(r in self for r in ranks)


def _retire_out_of_step(
    call: Call, cache: GroupCache, holders: Sequence[MeshGroups], live: _Live
) -> list[str]:
    """Step 1 of the module docstring; returns this rank's store keys (deleted after the build)."""
    if not call.enabled:
        return []
    rank, store = dist.get_rank(), call.store
    if store is None:  # an invariant of this module, not a check of user input
        raise RuntimeError("meshgroups internal error: store is None")
    candidates: list[tuple[GroupKey, dist.ProcessGroup]] = [
        (key, group)
        for key, group in cache.items()
        if group is not None and group is not dist.group.WORLD and len(key[0]) > 1 and live.has_all(key[0])
    ]
    # One round trip to publish and one to read, whatever the number of groups: every survivor
    # makes them at once, right after a loss, on a store every rank shares.
    mine = [f"{call.base}/seq/{group.group_name}/{rank}" for _, group in candidates]
    if mine:
        store.multi_set(mine, [str(group_sequence(group)) for _, group in candidates])  # type: ignore[attr-defined]
    call.agree({}, {})  # every member has published its numbers
    names = [[f"{call.base}/seq/{group.group_name}/{r}" for r in key[0]] for key, group in candidates]
    values = iter(store.multi_get([name for group_names in names for name in group_names]) if mine else [])
    for (key, _), group_names in zip(candidates, names):
        if len({next(values) for _ in group_names}) > 1:
            cache.evict(key)
            for holder in holders:
                holder.forget_group(key)
    return mine


def _keywords(
    options: MeshOptions | Mapping[str, Any] | None,
    old: MeshGroups | None,
    flatten: Iterable[Sequence[str]] | None,
) -> dict[str, Any]:
    """``init_mesh``'s keywords for the rebuild (empty: nothing to build with)."""
    if isinstance(options, MeshOptions):
        if flatten is not None or old is None:
            return {**options.kwargs(), "flatten": flatten or (), "only": None}
        return {**options.kwargs(), "flatten": old.declared_flatten, "only": old.declared_only}
    opts = dict(options if options is not None else mesh_options(old) if old is not None else {})
    if opts and flatten is not None:
        opts["flatten"] = flatten
    return opts


def _shrink_nccl_groups(cache: GroupCache, layout: Layout, opts: Mapping[str, Any], live: _Live) -> None:
    """NCCL only (untested in CI, see docs/elastic.md): each group of this rank in ``layout``
    that is a group it already holds without ranks that are no longer live members (its order
    kept) is made by ``dist.shrink_group`` of that group (ncclCommShrink, no new bootstrap) and
    put in the cache, so the build below finds it. Every member of the new group holds the same
    old group (it was a member too) and picks the same one (the smallest), and the excluded
    ranks are dead or out of the cohort, so none of them calls the shrink."""
    rank = dist.get_rank()
    backend = str(opts.get("backend") or dist.get_backend()).lower()
    if "nccl" not in backend or rank not in layout:
        return
    held = sorted(
        ((key, g) for key, g in cache.items() if g is not None and g is not dist.group.WORLD),
        key=lambda item: (len(item[0][0]), item[0][0]),
    )
    families = [(d,) for d in layout.names] + [tuple(f) for f in opts.get("flatten") or ()]
    for dims in families:
        row = tuple(layout.group_of(rank, *dims).tolist())
        if len(row) < 2 or any(cache.get((row, key[1]))[0] for key, _ in held):
            continue
        for (ranks, bkey), group in held:
            gone = [r for r in ranks if r not in row]
            if gone and tuple(r for r in ranks if r in row) == row and not live.has_any(gone):
                shrunk = shrink_nccl_group(group, gone)
                if shrunk is not None:
                    cache.put((row, bkey), shrunk, created=True)
                    break


__all__ = ["mesh_options", "rebuild"]
