"""The torch bridge: a ``Layout`` becomes a real ``DeviceMesh`` and process groups.

    >>> import torch.distributed as dist                        # doctest: +SKIP
    >>> dist.init_process_group("gloo")                         # or torchrun's env
    >>> mg = init_mesh(Layout(pp=2, dp=2, cp=1, tp=2), flatten=[("dp", "cp")])
    >>> mg.group("tp"), mg.ranks("dp", "cp"), mg.local_rank("pp")
    >>> fully_shard(model, mesh=mg.submesh("dp", "cp", flatten=True))

Each distinct group is created once (``dp_cp`` with ``cp=1`` *is* the ``dp`` group; an expert
view's ``pp`` *is* the dense ``pp``; size-1 dims share one one-rank group), always in mesh order,
and only after every rank has confirmed it builds the same layout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._torch_seam import (
    advance_group_count,
    creation_store_prefix,
    default_backend_name,
    default_store,
    default_timeout,
    group_count,
    held_group_count,
)
from .errors import ConcurrentInitError, MeshConfigError
from .groups import GroupCache, GroupHandle, GroupKey
from .layout import Layout
from .plan import GroupSpec, SubsetSpec, as_timedelta, make_plan
from .rendezvous import Rendezvous, next_generation
from .strategies import Builder, Strategy, build_families, make_strategy

_init_lock = threading.Lock()
_COUNTERS = ("group_count", "held")


class MeshGroups:
    """This rank's view of a built layout: the ``DeviceMesh`` and every declared group.

    Non-members get ``None``: a rank outside the layout (a rank offset, a subset) has
    ``mesh is None``, and ``group``/``ranks``/``local_rank``/``submesh`` return ``None`` for a
    family that has no group containing this rank. ``size`` always answers.

    ``close()`` (or leaving a ``with init_mesh(...) as mg:`` block) destroys every process group
    this mesh created, except those another live ``MeshGroups`` still uses through a shared
    ``GroupCache``; the mesh is unusable afterwards.
    """

    def __init__(
        self,
        layout: Layout,
        device_type: str,
        strategy: str,
        handles: dict[Hashable, GroupHandle],
        subsets: Mapping[str, GroupSpec],
        cache: GroupCache,
        keys: Sequence[GroupKey] = (),
        pads: Sequence[dist.ProcessGroup] = (),
        generation: int = 0,
    ) -> None:
        self.layout = layout
        self.device_type = device_type
        self.strategy = strategy
        self.cache = cache
        self.generation = generation
        self._handles = handles
        self._subsets = dict(subsets)
        self._keys = list(keys)
        self._pads = list(pads)
        self._closed = False
        self._submeshes: dict[tuple[Hashable, bool], DeviceMesh | None] = {}
        self._meshes: dict[str | None, DeviceMesh | None] = {}

    # ----------------------------------------------------------------------- lifetime
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> int:
        """Destroy the process groups this mesh created (not WORLD, not groups another live
        mesh shares through the cache) and forget its DeviceMeshes. Local: no collective, but
        call it on every rank, like the ``init_mesh`` it undoes. Idempotent. Returns the number
        of process groups destroyed on this rank."""
        if self._closed:
            return 0
        self._closed = True
        self._meshes.clear()
        self._submeshes.clear()
        destroyed = self.cache.release(self._keys, self._pads)
        self._keys.clear()
        self._pads.clear()
        return destroyed

    def __enter__(self) -> MeshGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this MeshGroups was closed; its process groups are destroyed")

    # ----------------------------------------------------------------------- meshes
    @property
    def mesh(self) -> DeviceMesh | None:
        """The ``DeviceMesh`` of the main layout (``mesh_dim_names == layout.names``), or ``None``
        on a rank outside the layout. Built on first use from the groups already created (no
        collective): torch's ``DeviceMesh`` costs O(world) to construct, the groups do not."""
        self._check_open()
        if None not in self._meshes:
            self._meshes[None] = self._build_mesh(self.layout)
        return self._meshes[None]

    def _build_mesh(self, layout: Layout) -> DeviceMesh | None:
        if dist.get_rank() not in layout:
            return None
        missing = [d for d in layout.names if (d,) not in self._handles]
        if missing:
            raise MeshConfigError(
                f"a DeviceMesh needs the groups of every dim, but {', '.join(missing)} were not built "
                "(init_mesh was called with only=...)"
            )
        groups = [self._handles[(d,)].group for d in layout.names]
        return DeviceMesh.from_group(
            cast(list[dist.ProcessGroup], groups),
            self.device_type,
            mesh=torch.tensor(layout.grid, dtype=torch.int64),
            mesh_dim_names=layout.names,
        )

    # ----------------------------------------------------------------------- lookups
    def has(self, *dims: str) -> bool:
        """Whether the group family of ``dims`` (or the subset ``dims[0]``) was built, so
        ``group``/``ranks``/``local_rank`` answer for it. Unknown dims are simply ``False``."""
        if len(dims) == 1 and dims[0] in self._subsets:
            return True
        if not dims or not all(isinstance(d, str) for d in dims):
            return False
        try:
            owner = self.layout.resolve(*dims)
        except ValueError:
            return False
        return tuple(d for d in owner.names if d in dims) in self._handles

    def _key(self, dims: tuple[str, ...]) -> tuple[Hashable, GroupSpec | None]:
        self._check_open()
        if len(dims) == 1 and dims[0] in self._subsets:
            return dims[0], self._subsets[dims[0]]
        if not dims:
            raise MeshConfigError("name at least one dim (or a subset), e.g. group('tp')")
        owner = self.layout.resolve(*dims)
        key = tuple(d for d in owner.names if d in dims)
        if key not in self._handles:
            raise MeshConfigError(
                f"group {key} was not built; declare it with init_mesh(..., flatten=[{key!r}]) "
                "(groups are created collectively, so every rank must ask for them up front)"
            )
        return key, None

    def _handle(self, dims: tuple[str, ...]) -> GroupHandle:
        return self._handles[self._key(dims)[0]]

    def group(self, *dims: str, gloo: bool = False) -> dist.ProcessGroup | None:
        """This rank's group varying ``dims`` (or the subset named ``dims[0]``); ``None`` if this
        rank is in none. ``gloo=True`` gives the gloo twin (``init_mesh(gloo_twins=True)``)."""
        handle = self._handle(dims)
        if gloo:
            if handle.ranks is not None and handle.gloo is None:
                raise MeshConfigError("no gloo twins were built; pass init_mesh(..., gloo_twins=True)")
            return handle.gloo
        return handle.group

    def ranks(self, *dims: str) -> list[int] | None:
        """Global ranks of this rank's group, in mesh order (= group rank order), or ``None``."""
        ranks = self._handle(dims).ranks
        return None if ranks is None else list(ranks)

    def local_rank(self, *dims: str) -> int | None:
        """This rank's index in its group (== ``dist.get_rank(group)``), or ``None``."""
        ranks = self._handle(dims).ranks
        return None if ranks is None else ranks.index(dist.get_rank())

    def size(self, *dims: str) -> int:
        """Size of the groups varying ``dims`` (or of the subset's groups); any dims, built or not."""
        if len(dims) == 1 and dims[0] in self._subsets:
            return self._subsets[dims[0]].size
        return self.layout.size(*dims)

    def view_mesh(self, name: str) -> DeviceMesh | None:
        """The ``DeviceMesh`` of a view declared with ``Layout.with_views`` (``None`` off it)."""
        self._check_open()
        views = self.layout.views
        if name not in views:
            raise MeshConfigError(f"unknown view {name!r}; views are {', '.join(views) or 'none'}")
        if name not in self._meshes:
            self._meshes[name] = self._build_mesh(views[name])
        return self._meshes[name]

    def submesh(self, *dims: str, flatten: bool = False) -> DeviceMesh | None:
        """A ``DeviceMesh`` over ``dims``: the n-D slice of the (view) mesh, or with
        ``flatten=True`` (always for a subset name) a 1-D mesh over the flattened group, named
        like ``"dp_cp"`` — what ``fully_shard(mesh=...)`` takes. ``None`` off the group."""
        key, subset = self._key(dims)
        flat = flatten or subset is not None or len(key) == 1  # type: ignore[arg-type]
        cache_key = (key, flat)
        if cache_key not in self._submeshes:
            self._submeshes[cache_key] = self._make_submesh(key, flat)
        return self._submeshes[cache_key]

    def _make_submesh(self, key: Hashable, flat: bool) -> DeviceMesh | None:
        handle = self._handles[key]
        if handle.ranks is None:
            return None
        if flat:
            name = key if isinstance(key, str) else "_".join(key)  # type: ignore[arg-type]
            return DeviceMesh.from_group(
                handle.group,  # type: ignore[arg-type]
                self.device_type,
                mesh=torch.tensor(handle.ranks, dtype=torch.int64),
                mesh_dim_names=(name,),
            )
        owner = self.layout.resolve(*key)  # type: ignore[misc]
        base = self.mesh if owner is self.layout else self.view_mesh(self._view_name(owner))
        return base[key] if base is not None else None  # type: ignore[index]

    def _view_name(self, owner: Layout) -> str:
        return next(name for name, view in self.layout.views.items() if view is owner)

    @property
    def families(self) -> list[Hashable]:
        """Keys of every group family built: dim tuples (layout order) and subset names."""
        return list(self._handles)

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"MeshGroups(rank={dist.get_rank()}, layout={self.layout!r}, strategy={self.strategy!r}, "
            f"families={len(self._handles)}, groups_held={len(self.cache)}{state})"
        )

    def _repr_html_(self) -> str:
        from .render import html

        return html(self.layout, highlight_rank=dist.get_rank())


def init_mesh(
    layout: Layout,
    device_type: str = "cpu",
    *,
    flatten: Iterable[Sequence[str]] = (),
    subsets: Mapping[str, SubsetSpec] | None = None,
    only: Iterable[Sequence[str]] | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    gloo_twins: bool = False,
    strategy: Strategy = "global",
    cache: GroupCache | None = None,
    check: bool | None = None,
) -> MeshGroups:
    """Build ``layout`` on the initialised default process group. Call it on every rank, the
    same number of times, from one thread.

    Args:
        layout: the main layout; its views (``Layout.with_views``) are built too.
        device_type: ``"cpu"``, ``"cuda"``, ... (a device type, no index), as for ``DeviceMesh``.
        flatten: dim sets to build flattened groups for, e.g. ``[("dp", "cp")]``.
        subsets: named subset groups, ``{"embd": (layout.select("pp", [0, -1]), "pp")}``:
            the groups of that sub-layout varying those dims; other ranks get ``None``.
        only: build exactly these dim sets (and ``subsets``) instead of every dim plus
            ``flatten`` — e.g. ``only=[("tp",)]`` for just the tp groups. ``mesh`` and n-D
            ``submesh`` then need every single dim among them.
        backend: backend of the new groups; default: the default group's. Strings such as
            ``"cpu:gloo,cuda:nccl"`` pass through to ``new_group``.
        timeout: bounds every wait of this call — the cross-rank check and each group's
            creation (seconds or timedelta, positive, at most 7 days); default: the default
            group's timeout (``init_process_group(timeout=...)``).
        gloo_twins: also build a gloo twin of every group (``group(..., gloo=True)``), what
            Megatron calls ``create_gloo_process_groups``.
        strategy: ``"global"`` (default; every rank makes every creation call — safe
            everywhere, O(world) calls per rank), ``"local"`` (each rank creates only its own
            groups with ``use_local_synchronization=True`` — O(number of families); torch's
            held-group counts are levelled across ranks first; not for MPI, refused with a
            device-bound default group, pytorch#129965), or ``"split"`` (``dist.split_group``
            per family; needs a device-bound default group; groups must have increasing ranks;
            untested in CI).
        cache: share groups across ``init_mesh`` calls (one strategy per cache); a group stays
            alive while any ``MeshGroups`` built through the cache uses it.
        check: run the cross-rank rendezvous (default: on, except on the single-process
            ``"fake"`` backend). Off, nothing verifies that ranks agree.

    Raises:
        RuntimeError: the default process group is not initialised.
        ConcurrentInitError: another thread of this process is inside ``init_mesh``.
        TypeError / MeshConfigError / LayoutError: bad arguments on this rank — raised before
            any collective, and (with ``check``) raised on every other rank too, same class.
        MismatchError: ranks passed different arguments (names the argument and the ranks).
        RendezvousTimeout: a rank never arrived, or arrived after the others gave up.
        StoreConnectionError: the connection to the store was lost (e.g. rank 0 died).
        MeshBuildError: a rank failed while creating groups; every rank destroyed what the call
            created, and retrying the same call on every rank is safe.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_mesh needs an initialised default process group: call dist.init_process_group first"
        )
    if not _init_lock.acquire(blocking=False):
        raise ConcurrentInitError(
            f"init_mesh is already running in another thread of this process (rank {dist.get_rank()}); "
            "its calls are collective: make them one at a time, from one thread"
        )
    try:
        return _init_mesh(
            layout, device_type, flatten, subsets, only, backend, timeout, gloo_twins, strategy, cache, check
        )
    finally:
        _init_lock.release()


def _init_mesh(
    layout: Layout,
    device_type: str,
    flatten: Iterable[Sequence[str]],
    subsets: Mapping[str, SubsetSpec] | None,
    only: Iterable[Sequence[str]] | None,
    backend: str | None,
    timeout: timedelta | float | None,
    gloo_twins: bool,
    strategy: str,
    cache: GroupCache | None,
    check: bool | None,
) -> MeshGroups:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Taken first, so a call that fails below still uses up its number on this rank.
    generation = next_generation(dist.group.WORLD)
    if check is not None and not isinstance(check, bool):
        raise TypeError(f"check must be True, False or None, got {check!r}")
    do_check = check if check is not None else default_backend_name() != "fake"
    rdzv = Rendezvous(default_store(), rank, world_size, generation, default_timeout()) if do_check else None
    try:
        timeout_td = as_timedelta(timeout, default_timeout())
        _check_options(device_type, backend, gloo_twins, cache)
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
        )
        for spec in plan.specs:
            _check_in_world(spec.layout, world_size, spec.key)
        creator.validate(plan.specs)
    except Exception as exc:
        if rdzv is not None:
            rdzv.publish_failure(exc)
        raise
    cache = cache if cache is not None else GroupCache()
    counters = {"group_count": group_count(), "held": held_group_count()}
    if rdzv is not None:
        rdzv.timeout = timeout_td
        agreed = rdzv.agree(plan.digests(), plan.shown(), counters)
        # After a failed call torch's counters can differ between ranks; sequential group names
        # stay unique when every rank jumps to the largest, so the next groups pair up again.
        advance_group_count(agreed["group_count"])
    builder = Builder(cache, backend=backend, timeout=timeout_td, gloo_twins=gloo_twins)
    prefix = f"meshgroups/g{generation}"
    try:
        with creation_store_prefix(prefix):
            if rdzv is not None and creator.name == "local":
                for _ in range(agreed["held"] - held_group_count()):
                    builder.pad()  # level the held-group counts that hashed names depend on
            handles = build_families(creator, builder, plan.specs, layout, gloo_twins)
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
        rdzv.leave(_COUNTERS, (prefix + "/",) if _eager_gloo(backend, gloo_twins) else ())
    return MeshGroups(
        layout,
        device_type,
        creator.name,
        handles,
        plan.subsets,
        cache,
        builder.keys,
        builder.pads,
        generation,
    )


def _eager_gloo(backend: str | None, gloo_twins: bool) -> bool:
    """Whether every group of the call is gloo that connected during creation, so its
    connection keys in the store are no longer needed once every rank has built."""
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0"):
        return False
    spec = (backend or default_backend_name()).lower()
    return all(part.rsplit(":", 1)[-1].strip() == "gloo" for part in spec.split(","))


def _check_options(device_type: object, backend: object, gloo_twins: object, cache: object) -> None:
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    if ":" in device_type:
        raise MeshConfigError(f"device_type={device_type!r}: give the device type only, e.g. 'cpu' or 'cuda'")
    try:
        torch.device(device_type)
    except RuntimeError:
        raise MeshConfigError(
            f"device_type={device_type!r} is not a torch device type (e.g. 'cpu', 'cuda', 'xpu')"
        ) from None
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str such as 'gloo' or 'cpu:gloo,cuda:nccl', got {backend!r}")
        known = [b for b in dist.Backend.backend_list if b != "undefined"]
        for part in backend.split(","):
            name = part.rsplit(":", 1)[-1].strip().lower()
            if name not in known:
                raise MeshConfigError(
                    f"backend {backend!r}: {name!r} is not a registered backend ({', '.join(known)})"
                )
    if not isinstance(gloo_twins, bool):
        raise TypeError(f"gloo_twins must be True or False, got {gloo_twins!r}")
    if not isinstance(cache, (GroupCache, type(None))):
        raise TypeError(f"cache must be a meshgroups.GroupCache or None, got {type(cache).__name__}")


def _check_in_world(layout: Layout, world_size: int, key: Any) -> None:
    top = layout.max_rank
    if top >= world_size:
        raise MeshConfigError(
            f"group {key!r} uses rank {top}, outside the default group's world (ranks 0..{world_size - 1}); "
            "a layout may cover part of the world but not more"
        )
