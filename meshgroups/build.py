"""One collective build: validate on this rank, meet the other ranks, create the groups.

``init_mesh`` runs it once; ``MeshGroups.flatten`` and torch's ``_flatten``/``_unflatten`` on a
meshgroups mesh run it again for the families they add. Each run takes the next generation
number the moment it starts (see ``rendezvous``), so every rank must make the same runs in the
same order, like any collective, from one thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._torch_seam import (
    advance_group_count,
    creation_store_prefix,
    default_backend_name,
    default_store,
    default_timeout,
    group_count,
    held_group_count,
    is_backend_options,
)
from .errors import ConcurrentInitError, DeviceTypeError, MeshConfigError, WorldSizeError
from .groups import GroupCache, GroupHandle
from .layout import Layout
from .plan import BackendConfig, Plan, SubsetSpec, as_timedelta, make_plan
from .rendezvous import Rendezvous, next_generation
from .strategies import Builder, CreationStrategy, build_families, make_strategy

_lock = threading.Lock()
_COUNTERS = ("group_count", "held")


@contextmanager
def one_at_a_time() -> Any:
    """Collective builds of this process, one thread at a time; a second is refused at once."""
    if not _lock.acquire(blocking=False):
        raise ConcurrentInitError(
            f"init_mesh (or a flatten of a meshgroups mesh) is already running in another thread of this "
            f"process (rank {dist.get_rank()}); these calls are collective: make them one at a time, from "
            "one thread"
        )
    try:
        yield
    finally:
        _lock.release()


@dataclass
class Built:
    """One build's result; its ``plan`` and ``check`` are the options later builds reuse."""

    handles: dict[Hashable, GroupHandle]
    builder: Builder
    plan: Plan
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
) -> Built:
    """Validate (every error before any collective, and told to the other ranks), then run the
    collective build. Call with ``one_at_a_time()`` held."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Taken first, so a call that fails below still uses up its number on this rank.
    generation = next_generation(dist.group.WORLD)
    if check is not None and not isinstance(check, bool):
        raise TypeError(f"check must be True, False or None, got {check!r}")
    do_check = check if check is not None else default_backend_name() != "fake"
    default = default_timeout()
    rdzv = Rendezvous(default_store(), rank, world_size, generation, default) if do_check else None
    try:
        timeout_td = as_timedelta(timeout, default)
        check_options(device_type, backend, gloo_twins, cache)
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
        )
        for spec in plan.specs:
            check_in_world(spec.layout, world_size, spec.key)
        creator.validate(plan.specs)
    except Exception as exc:
        if rdzv is not None:
            rdzv.publish_failure(exc)
        raise
    return run(plan, creator, cache if cache is not None else GroupCache(), rdzv, generation, do_check)


def build_more(
    layout: Layout,
    only: Sequence[tuple[str, ...]],
    plan: Plan,
    check: bool,
    cache: GroupCache,
    labels: Mapping[Hashable, str] | None = None,
    backend_override: Mapping[str, BackendConfig] | None = None,
) -> Built:
    """A later collective build of families over ``layout`` with the options of an earlier
    ``plan`` (a mesh's ``init_mesh``) and its cache; ``labels`` name the families (their group
    description, torch's ``mesh_<name>``), ``backend_override`` is keyed by those names."""
    with one_at_a_time():
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
            check=check,
            backend_override=backend_override,
            labels=labels,
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
        if config[0] is not None:
            check_backend_name(config[0], f"backend_override[{key!r}]")
        out[key] = config
    return out


def run(
    plan: Plan,
    creator: CreationStrategy,
    cache: GroupCache,
    rdzv: Rendezvous | None,
    generation: int,
    check: bool,
) -> Built:
    """Meet (if checking), level torch's counters, create every family, report, clean the store."""
    agreed = {"group_count": group_count(), "held": held_group_count()}
    if rdzv is not None:
        rdzv.timeout = plan.timeout
        agreed = rdzv.agree(plan.digests(), plan.shown(), agreed)
        # After a failed call torch's counters can differ between ranks; sequential group names
        # stay unique when every rank jumps to the largest, so the next groups pair up again.
        advance_group_count(agreed["group_count"])
    builder = Builder(cache, backend=plan.backend, timeout=plan.timeout, gloo_twins=plan.gloo_twins)
    prefix = f"meshgroups/g{generation}"
    try:
        with creation_store_prefix(prefix):
            if rdzv is not None and creator.name == "local":
                for _ in range(agreed["held"] - held_group_count()):
                    builder.pad()  # level the held-group counts that hashed names depend on
            handles = build_families(creator, builder, plan.specs, plan.layout, plan.gloo_twins)
    except BaseException as exc:
        cache.release(builder.keys, builder.pads)
        if rdzv is not None:
            rdzv.finish(exc)
        raise
    if rdzv is not None:
        try:
            rdzv.finish(None)
        except BaseException:
            cache.release(builder.keys, builder.pads)
            raise
        rdzv.leave(_COUNTERS, (prefix + "/",) if eager_gloo(plan.backend) else ())
    return Built(handles, builder, plan, generation, check)


def eager_gloo(backend: str | None) -> bool:
    """Whether every group of the call is gloo that connected during creation, so its
    connection keys in the store are no longer needed once every rank has built."""
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0"):
        return False
    spec = (backend or default_backend_name()).lower()
    return all(part.rsplit(":", 1)[-1].strip() == "gloo" for part in spec.split(","))


def check_options(device_type: object, backend: object, gloo_twins: object, cache: object) -> None:
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    if ":" in device_type:
        raise DeviceTypeError(f"device_type={device_type!r}: give the device type only, e.g. 'cpu' or 'cuda'")
    try:
        torch.device(device_type)
    except RuntimeError:
        raise DeviceTypeError(
            f"device_type={device_type!r} is not a torch device type (e.g. 'cpu', 'cuda', 'xpu')"
        ) from None
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str such as 'gloo' or 'cpu:gloo,cuda:nccl', got {backend!r}")
        check_backend_name(backend, "backend")
    if not isinstance(gloo_twins, bool):
        raise TypeError(f"gloo_twins must be True or False, got {gloo_twins!r}")
    if cache is not None and not isinstance(cache, GroupCache):
        raise TypeError(f"cache must be a meshgroups.GroupCache or None, got {type(cache).__name__}")


def check_backend_name(backend: str, what: str) -> None:
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    for part in backend.split(","):
        name = part.rsplit(":", 1)[-1].strip().lower()
        if name not in known:
            raise MeshConfigError(
                f"{what}={backend!r}: {name!r} is not a registered backend ({', '.join(known)})"
            )


def check_in_world(layout: Layout, world_size: int, key: Any) -> None:
    top = layout.max_rank
    if top >= world_size:
        raise WorldSizeError(
            f"group {key!r} uses rank {top}, outside the default group's world (ranks 0..{world_size - 1}); "
            "a layout may cover part of the world but not more"
        )
