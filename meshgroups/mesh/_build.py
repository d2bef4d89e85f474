"""One collective build: a plan's groups checked against the world, the ranks met, the groups
created.

``init_mesh`` builds its plan once; ``MeshGroups.flatten`` and torch's ``_flatten``/``_unflatten``
on a meshgroups mesh build again, plans derived from the first (``mesh/_planning.py`` makes
both). Each runs inside a collective call (``meshgroups.mesh._collective``): the call number is
taken before anything is validated, a local error reaches every rank, and a failed call is
closed before the next one starts.
"""

from __future__ import annotations

import keyword
import os
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from meshgroups.errors import MeshConfigError, WorldSizeError, torch_says
from meshgroups.layout import Layout
from meshgroups.mesh._collective import Call
from meshgroups.mesh._groups import GroupCache, GroupHandle
from meshgroups.mesh._plan import BuildPlan
from meshgroups.mesh._strategies import Builder, CreationStrategy, build_families, make_strategy
from meshgroups.mesh._torch_seam import (
    advance_group_count,
    creation_store_prefix,
    default_backend_name,
    group_count,
    held_group_count,
)
from meshgroups.mesh._watched_store import WatchedStore, use_watched

_COUNTERS = ("group_count", "held")


@dataclass
class Built:
    """One build's result; later builds derive their plans from its ``plan`` (``BuildPlan.more``)."""

    handles: dict[Hashable, GroupHandle]
    builder: Builder
    plan: BuildPlan
    generation: int
    check: bool


def build(plan: BuildPlan, call: Call, *, cache: GroupCache | None) -> Built:
    """Create the groups of ``plan`` (made once, in ``call``: ``mesh/_planning.py``) as part of
    ``call``: check them against the world, meet the other ranks, create them through ``cache``
    (a new one for ``None``).

    Raises:
        WorldSizeError: a group uses a rank outside the world.
        MeshConfigError: the layout leaves ranks out without ``partial``, or the strategy
            cannot run here.
    """
    world_size = dist.get_world_size()
    for spec in plan.specs:
        check_in_world(spec.layout, world_size, spec.key)
    if not plan.partial:
        check_covers(plan.layout, call.members, world_size)
    creator = make_strategy(plan.strategy)
    creator.validate(plan.specs)
    fake = default_backend_name() == "fake"
    return run(plan, creator, cache if cache is not None else GroupCache(), call, not fake)


def cache_state(cache: GroupCache) -> str:
    """What every rank's cache must agree on: new, or in use since the same call."""
    return "new" if cache.since is None else f"in use since call #{cache.since} ({cache.strategy})"


def run(plan: BuildPlan, creator: CreationStrategy, cache: GroupCache, call: Call, check: bool) -> Built:
    """Meet, level torch's counters, create every family, report, clean the store."""
    counters = {"group_count": group_count(), "held": held_group_count()}
    digests = {**plan.digests(), "cache": cache_state(cache)}
    shown = {**plan.shown(), "cache": cache_state(cache)}
    agreed = call.agree(digests, shown, counters, plan.timeout)
    # After a failed call torch's counters can differ between ranks; sequential group names
    # stay unique when every rank jumps to the largest, so the next groups pair up again.
    advance_group_count(agreed["group_count"])
    builder = Builder(cache, backend=plan.backend, timeout=plan.timeout, gloo_twins=plan.gloo_twins)
    prefix = call.creation_prefix()
    # gloo connects while it creates (a dead member would hold the others until the timeout):
    # its waits watch liveness. Other backends connect later, outside this call.
    watched = WatchedStore.for_call(call) if eager_gloo(plan.backend) else None
    try:
        with use_watched(watched), creation_store_prefix(prefix, watched):
            if call.enabled and creator.name == "local":
                for _ in range(agreed["held"] - held_group_count()):
                    builder.pad()  # level the held-group counts that hashed names depend on
            handles = build_families(creator, builder, plan.specs, plan.layout, plan.gloo_twins)
    except BaseException as exc:
        cache.release(builder.keys, builder.pads)
        call.finish(exc)
        raise
    try:
        call.finish(None)
    except BaseException:
        cache.release(builder.keys, builder.pads)
        raise
    if cache.since is None and (builder.keys or builder.pads):
        cache.since = call.number
    if call.enabled and eager_gloo(plan.backend):
        call.sweep_prefixes.append(prefix + "/")
    return Built(handles, builder, plan, call.number, check)


def eager_gloo(backend: str | None) -> bool:
    """Whether every group of the call is gloo that connected during creation, so its
    connection keys in the store are no longer needed once every rank has built."""
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0"):
        return False
    spec = (backend or default_backend_name()).lower()
    return all(part.rsplit(":", 1)[-1].strip() == "gloo" for part in spec.split(","))


def check_in_world(layout: Layout, world_size: int, key: Any) -> None:
    """Refuse a group whose ranks leave the default group's world.

    Args:
        layout: the layout the group is built from.
        world_size: the default group's size.
        key: the group family, for the message.

    Raises:
        WorldSizeError: the layout's largest rank is ``world_size`` or more.
    """
    top = layout.max_rank
    if top >= world_size:
        message = (
            f"group {key!r} uses rank {top}, outside the default group's world (ranks 0..{world_size - 1}); "
            "a layout may cover part of the world but not more"
        )
        if layout.world_size > world_size:  # torch's words for a mesh with more ranks than the world
            message = torch_says(
                message,
                f"Mesh should not be bigger than default world size {world_size}, "
                f"but found {layout.world_size} ranks!",
            )
        raise WorldSizeError(message)


def check_covers(layout: Layout, members: Sequence[int] | None, world_size: int) -> None:
    """Refuse a layout over part of the world (or of a cohort's live ranks) unless the caller
    opted in (``partial=True``): ranks outside it would be in none of its groups.

    Args:
        layout: the main layout (already checked to lie inside the world).
        members: the cohort's ranks, ``None`` for the whole world.
        world_size: the default group's size.

    Raises:
        MeshConfigError: the layout leaves ranks out, naming them and the opt-in.
    """
    everyone = range(world_size) if members is None else members
    if members is None and layout.world_size == world_size:
        return  # ranks are distinct and inside the world: all of it (O(1))
    ranks = layout.grid.ravel()
    if members is not None and len(ranks) == len(members) and (np.sort(ranks) == np.asarray(members)).all():
        return
    left_out = np.setdiff1d(np.asarray(everyone), ranks)
    shown = ", ".join(map(str, left_out[:8].tolist())) + (", …" if len(left_out) > 8 else "")
    where = "world" if members is None else "cohort of live ranks"
    raise MeshConfigError(
        f"{layout!r} covers {layout.world_size} of the {len(everyone)} ranks of the {where}: rank(s) "
        f"{shown} would be in none of its groups (group() gives them torch's GroupMember.NON_GROUP_MEMBER, "
        "which torch's collectives skip). If that is meant, pass partial=True (init_mesh(..., partial=True) "
        f"or MeshOptions(partial=True)); else size the layout to the {len(everyone)} ranks"
    )


def check_new_name(name: object, taken: Iterable[str], what: str = "") -> None:
    """A new (flattened or unflattened) dim's name: an identifier naming no existing dim (torch
    refuses a flattened name that shadows a dim too)."""
    what = what or "the flattened dim's name"
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {name!r} ({type(name).__name__})")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise MeshConfigError(f"{what} {name!r} is not a Python identifier (or is a keyword)")
    if name in taken:
        raise MeshConfigError(
            torch_says(
                f"{what} {name!r} names an existing dim (or subset) of this mesh; pick another name",
                f"{name} already exists for submesh of the DeviceMesh. Please specify another valid mesh_dim_name.",
            )
        )
