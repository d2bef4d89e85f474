"""One collective build: validate on this rank, meet the other ranks, create the groups.

``init_mesh`` runs it once; ``MeshGroups.flatten`` and torch's ``_flatten``/``_unflatten`` on a
meshgroups mesh run it again for the families they add. Each runs inside a collective call
(``meshgroups.mesh._collective``): the call number is taken before anything is validated, a local
error reaches every rank, and a failed call is closed before the next one starts.
"""

from __future__ import annotations

import keyword
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshgroups.errors import DeviceTypeError, MeshConfigError, WorldSizeError, torch_says
from meshgroups.layout import Layout
from meshgroups.mesh._collective import Call, collective_call
from meshgroups.mesh._groups import GroupCache, GroupHandle
from meshgroups.mesh._options import DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY, check_settings
from meshgroups.mesh._plan import BackendConfig, BuildPlan, SubsetSpec, as_timedelta, make_plan
from meshgroups.mesh._strategies import Builder, CreationStrategy, build_families, make_strategy
from meshgroups.mesh._torch_seam import (
    advance_group_count,
    creation_store_prefix,
    default_backend_name,
    default_timeout,
    group_count,
    held_group_count,
    is_backend_options,
)
from meshgroups.mesh._watched_store import WatchedStore, use_watched

_COUNTERS = ("group_count", "held")


@dataclass
class Built:
    """One build's result; its ``plan`` and ``check`` are the options later builds reuse."""

    handles: dict[Hashable, GroupHandle]
    builder: Builder
    plan: BuildPlan
    generation: int
    check: bool


def build(
    layout: Layout,
    *,
    device_type: str,
    flatten: Iterable[Sequence[str]],
    subsets: Mapping[str, SubsetSpec] | None,
    only: Iterable[Sequence[str]] | None,
    backend: str | None,
    timeout: timedelta | float | None,
    gloo_twins: bool,
    strategy: object,
    cache: GroupCache | None,
    check: bool | None,
    backend_override: Mapping[Any, Any] | None = None,
    labels: Mapping[Hashable, str] | None = None,
    operation: str = "init_mesh",
    refusal: str | None = None,
    partial: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    lease: float = DEFAULT_LEASE,
    report_every: float = DEFAULT_REPORT_EVERY,
) -> Built:
    """One collective call of ``operation`` (or a part of the call already running on this
    thread): validate, meet, create the groups. ``refusal``: a ``TypeError`` message the caller
    found before the call, raised inside it (so every rank hears of it)."""
    with collective_call(operation) as call:
        if refusal is not None:
            raise TypeError(refusal)
        liveness = check_settings(heartbeat, lease, report_every)
        call.use_liveness(*liveness)  # first: the call's waits below use them
        if not isinstance(partial, bool):
            raise TypeError(f"partial must be True or False, got {partial!r}")
        world_size = dist.get_world_size()
        fake = default_backend_name() == "fake"
        if check is not None and not isinstance(check, bool):
            raise TypeError(f"check must be True, False or None, got {check!r}")
        if check is False and not fake:
            # A rank that skipped the meeting would leave the others waiting (or pair with their
            # next call): every call meets, so the check cannot be turned off on a real backend.
            raise MeshConfigError(
                "check=False is only allowed on torch's 'fake' backend: on a real backend every call "
                "meets the other ranks (that is what keeps calls in step); leave check at None or True"
            )
        check_device_index(device_type)  # first, as torch (and before the default group, in init_mesh)
        timeout_td = as_timedelta(timeout, default_timeout())
        check_options(device_type, backend, gloo_twins, cache, fake)
        overrides = normalize_overrides(backend_override)
        creator = make_strategy(strategy)
        plan = make_plan(
            layout,
            device_type=device_type,
            flatten=flatten,
            subsets=subsets,
            only=only,
            backend=backend,
            strategy=creator.name,
            gloo_twins=gloo_twins,
            timeout=timeout_td,
            backend_override=overrides,
            labels=labels,
            partial=partial,
            liveness=liveness,
        )
        for key, (name, _) in overrides.items():  # after the keys, as torch: a bad key is told first
            if name is not None:
                check_backend_name(name, f"backend_override[{key!r}]")
        for spec in plan.specs:
            check_in_world(spec.layout, world_size, spec.key)
        if not partial:
            check_covers(layout, call.members, world_size)
        creator.validate(plan.specs)
        return run(plan, creator, cache if cache is not None else GroupCache(), call, not fake)


def build_more(
    layout: Layout,
    only: Sequence[tuple[str, ...]],
    plan: BuildPlan,
    check: bool,
    cache: GroupCache,
    labels: Mapping[Hashable, str] | None = None,
    backend_override: Mapping[str, BackendConfig] | None = None,
) -> Built:
    """A later collective build of families over ``layout`` with the options of an earlier
    ``plan`` (a mesh's ``init_mesh``) and its cache, as part of the call running on this thread;
    ``labels`` name the families (their group description, torch's ``mesh_<name>``),
    ``backend_override`` is keyed by those names. ``layout`` is one the mesh holds (its main
    layout, a view, a subset's), so its coverage was settled when the mesh was built."""
    return build(
        layout,
        device_type=plan.device_type,
        flatten=(),
        subsets=None,
        only=only,
        backend=plan.backend,
        timeout=plan.timeout,
        gloo_twins=plan.gloo_twins,
        strategy=plan.strategy,
        cache=cache,
        check=None,
        backend_override=backend_override,
        labels=labels,
        partial=True,
        heartbeat=plan.liveness[0],
        lease=plan.liveness[1],
        report_every=plan.liveness[2],
    )


def normalize_overrides(value: object) -> dict[int | str, BackendConfig]:
    """torch's ``backend_override`` forms as ``{dim: (backend, options)}``: a value is a backend
    name, backend options, or ``(name, options)`` (either part ``None``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"backend_override must map dim names or indices to a backend, e.g. {{'tp': 'gloo'}}; got {value!r}"
        )
    out: dict[int | str, BackendConfig] = {}
    for key, given in value.items():
        config: BackendConfig
        if isinstance(given, str):
            config = (given, None)
        elif is_backend_options(given):
            config = (None, given)
        elif (
            isinstance(given, tuple)
            and len(given) == 2
            and (given[0] is None or isinstance(given[0], str))
            and (given[1] is None or is_backend_options(given[1]))
        ):
            config = (given[0], given[1])
        else:
            raise TypeError(
                f"backend_override[{key!r}] must be a backend name, backend options or (name, options), "
                f"got {given!r}"
            )
        out[key] = config  # backend names are checked once the keys are (build)
    return out


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


def check_device_index(device_type: object) -> None:
    """A device type with an index (``"cuda:0"``) is refused before anything else, as torch's
    ``init_device_mesh`` refuses it (whether or not a default group exists).

    Raises:
        DeviceTypeError: ``device_type`` carries an index.
    """
    if isinstance(device_type, str) and ":" in device_type:
        raise DeviceTypeError(
            torch_says(
                f"device_type={device_type!r}: give the device type only, e.g. 'cpu' or 'cuda'",
                f"Device type with index is not supported but got {device_type}. "
                "If you maintained a 'torch.device' object, it's recommended to pass in 'device.type'.",
            )
        )


def check_options(
    device_type: object, backend: object, gloo_twins: object, cache: object, fake: bool = False
) -> None:
    """Refuse bad ``init_mesh`` options before any collective.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... (a device type this torch can run, no index).
        backend: a backend name or ``"cpu:gloo,cuda:nccl"``-style string, or None (the default group's).
        gloo_twins: whether to build a gloo twin of every group (a bool).
        cache: a ``GroupCache`` or None.
        fake: True on torch's ``fake`` backend (the device check is skipped there).

    Raises:
        TypeError: a value of the wrong type.
        DeviceTypeError: a device type with an index, or one this torch cannot run.
        MeshConfigError: an unknown backend name.
    """
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    check_device_index(device_type)
    try:
        torch.device(device_type)
    except RuntimeError:
        raise DeviceTypeError(
            f"device_type={device_type!r} is not a torch device type (e.g. 'cpu', 'cuda', 'xpu')"
        ) from None
    if device_type not in ("cpu", "meta") and not fake:
        available = getattr(getattr(torch, device_type, None), "is_available", None)
        if not callable(available) or not available():
            raise DeviceTypeError(
                f"device_type={device_type!r}: this torch ({torch.__version__}) cannot run on "
                f"{device_type!r} here (torch.{device_type}.is_available() is not True); use 'cpu'"
            )
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str such as 'gloo' or 'cpu:gloo,cuda:nccl', got {backend!r}")
        check_backend_name(backend, "backend")
    if not isinstance(gloo_twins, bool):
        raise TypeError(f"gloo_twins must be True or False, got {gloo_twins!r}")
    if cache is not None and not isinstance(cache, GroupCache):
        raise TypeError(f"cache must be a meshgroups.GroupCache or None, got {type(cache).__name__}")


def check_backend_name(backend: str, what: str) -> None:
    """Refuse a backend string naming a backend torch does not know.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or ``"cpu:gloo,cuda:nccl"``-style.
        what: how the error names the argument (``"backend"``, ``"backend_override['tp']"``).

    Raises:
        MeshConfigError: a part names no backend of ``torch.distributed``.
    """
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    for part in backend.split(","):
        name = part.rsplit(":", 1)[-1].strip().lower()
        if name not in known:
            raise MeshConfigError(
                f"{what}={backend!r}: {name!r} is not a registered backend ({', '.join(known)})"
            )


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
