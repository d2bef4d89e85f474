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

import hashlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._torch_seam import default_backend_name, default_store, group_count_for_hashed_names
from .consistency import check_same_plan
from .groups import GroupCache, GroupHandle, GroupSpec, Strategy, build_groups, check_strategy_inputs
from .layout import Layout

SubsetSpec = tuple[Layout, "str | Sequence[str]"]


class MeshGroups:
    """This rank's view of a built layout: the ``DeviceMesh`` and every declared group.

    Non-members get ``None``: a rank outside the layout (a rank offset, a subset) has
    ``mesh is None``, and ``group``/``ranks``/``local_rank``/``submesh`` return ``None`` for a
    family that has no group containing this rank. ``size`` always answers.
    """

    def __init__(
        self,
        layout: Layout,
        device_type: str,
        strategy: str,
        handles: dict[Hashable, GroupHandle],
        subsets: dict[str, GroupSpec],
        cache: GroupCache,
    ) -> None:
        self.layout = layout
        self.device_type = device_type
        self.strategy = strategy
        self.cache = cache
        self._handles = handles
        self._subsets = subsets
        self._submeshes: dict[tuple[Hashable, bool], DeviceMesh | None] = {}
        self._meshes: dict[str | None, DeviceMesh | None] = {}

    @property
    def mesh(self) -> DeviceMesh | None:
        """The ``DeviceMesh`` of the main layout (``mesh_dim_names == layout.names``), or ``None``
        on a rank outside the layout. Built on first use from the groups already created (no
        collective): torch's ``DeviceMesh`` costs O(world) to construct, the groups do not."""
        if None not in self._meshes:
            self._meshes[None] = self._build_mesh(self.layout)
        return self._meshes[None]

    def _build_mesh(self, layout: Layout) -> DeviceMesh | None:
        if dist.get_rank() not in layout:
            return None
        missing = [d for d in layout.names if (d,) not in self._handles]
        if missing:
            raise ValueError(
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
    def _key(self, dims: tuple[str, ...]) -> tuple[Hashable, GroupSpec | None]:
        if len(dims) == 1 and dims[0] in self._subsets:
            return dims[0], self._subsets[dims[0]]
        if not dims:
            raise ValueError("name at least one dim (or a subset), e.g. group('tp')")
        owner = self.layout.resolve(*dims)
        key = tuple(d for d in owner.names if d in dims)
        if key not in self._handles:
            raise ValueError(
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
                raise ValueError("no gloo twins were built; pass init_mesh(..., gloo_twins=True)")
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
        views = self.layout.views
        if name not in views:
            raise ValueError(f"unknown view {name!r}; views are {', '.join(views) or 'none'}")
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
        return (
            f"MeshGroups(rank={dist.get_rank()}, layout={self.layout!r}, strategy={self.strategy!r}, "
            f"families={len(self._handles)}, groups_held={len(self.cache)})"
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
    """Build ``layout`` on the initialised default process group. Call it on every rank.

    Args:
        layout: the main layout; its views (``Layout.with_views``) are built too.
        device_type: ``"cpu"`` or ``"cuda"`` (no index), as for ``DeviceMesh``.
        flatten: dim sets to build flattened groups for, e.g. ``[("dp", "cp")]``.
        subsets: named subset groups, ``{"embd": (layout.select("pp", [0, -1]), "pp")}``:
            the groups of that sub-layout varying those dims; other ranks get ``None``.
        only: build exactly these dim sets (and ``subsets``) instead of every dim plus
            ``flatten`` — e.g. ``only=[("tp",)]`` for just the tp groups. ``mesh`` and n-D
            ``submesh`` then need every single dim among them (``ValueError`` otherwise).
        backend: backend of the new groups; default: the default group's. Strings such as
            ``"cpu:gloo,cuda:nccl"`` pass through to ``new_group``.
        timeout: for every new group and for the cross-rank check (seconds or timedelta);
            default: torch's default process-group timeout.
        gloo_twins: also build a gloo twin of every group (``group(..., gloo=True)``), what
            Megatron calls ``create_gloo_process_groups``.
        strategy: ``"global"`` (default; every rank makes every creation call — safe
            everywhere, cost O(world) calls per rank), ``"local"`` (each rank creates only its
            own groups with ``use_local_synchronization=True`` — cost O(number of families);
            requires every rank to hold the same number of process groups on entry, which the
            cross-rank check verifies; not for MPI, and refused with a device-bound default
            group, where torch splits communicators collectively, pytorch#129965), or
            ``"split"`` (``dist.split_group`` per family; needs a device-bound default group,
            e.g. NCCL with ``device_id``; groups must have increasing ranks; untested in CI).
        cache: share groups across ``init_mesh`` calls (one strategy per cache).
        check: compare the plan across ranks through the default store before creating any
            group (default: on, except on the single-process ``"fake"`` backend).

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: bad arguments, a layout rank outside the world, or — on every rank — a rank
            that builds a different layout. ``TimeoutError`` if some rank never calls.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_mesh needs an initialised default process group: call dist.init_process_group first"
        )
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshgroups.Layout, got {type(layout).__name__}")
    if not isinstance(device_type, str) or ":" in device_type:
        raise ValueError(f"device_type={device_type!r}: give the device type only, e.g. 'cpu' or 'cuda'")
    timeout_td = _as_timedelta(timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if only is not None and tuple(flatten):
        raise ValueError("give either only= (exactly these groups) or flatten= (extra groups), not both")
    specs, subset_specs = _plan(layout, flatten, subsets or {}, only)
    for spec in specs:
        _check_in_world(spec.layout, world_size, spec.key)
    check_strategy_inputs(strategy, specs)
    fake = default_backend_name() == "fake"
    if check if check is not None else not fake:
        fingerprint, description = _plan_fingerprint(
            layout, specs, device_type, backend, strategy, gloo_twins
        )
        if strategy == "local":
            description += f" groups_held={group_count_for_hashed_names()}"
            fingerprint += f"/{group_count_for_hashed_names()}"
        check_same_plan(
            default_store(),
            rank,
            world_size,
            fingerprint,
            description,
            timeout_td or dist.default_pg_timeout,
        )
    cache = cache if cache is not None else GroupCache()
    handles = build_groups(
        specs,
        layout,
        strategy=strategy,
        backend=backend,
        timeout=timeout_td,
        gloo_twins=gloo_twins,
        cache=cache,
    )
    return MeshGroups(layout, device_type, strategy, handles, subset_specs, cache)


def _as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or a timedelta")


def _plan(
    layout: Layout,
    flatten: Iterable[Sequence[str]],
    subsets: Mapping[str, SubsetSpec],
    only: Iterable[Sequence[str]] | None,
) -> tuple[list[GroupSpec], dict[str, GroupSpec]]:
    specs: list[GroupSpec] = []
    if only is None:
        specs = [GroupSpec((d,), layout, (d,)) for d in layout.names]
        for view in layout.views.values():
            specs += [GroupSpec((d,), view, (d,)) for d in view.names if d not in layout.names]
    else:
        flatten = only
    keys = {spec.key for spec in specs}
    for dims in flatten:
        if isinstance(dims, str):
            raise TypeError(f"flatten/only take dim sets like [('dp', 'cp')], got the string {dims!r}")
        dims = tuple(dims)
        owner = layout.resolve(*dims)
        key = tuple(d for d in owner.names if d in dims)
        if key not in keys:
            keys.add(key)
            specs.append(GroupSpec(key, owner, key))
    subset_specs: dict[str, GroupSpec] = {}
    all_dims = set(layout.names).union(*(v.names for v in layout.views.values()))
    for name, value in subsets.items():
        if not isinstance(name, str) or not name.isidentifier() or name in all_dims:
            raise ValueError(f"subset name {name!r} must be an identifier that is not a dim name")
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Layout)):
            raise TypeError(
                f"subset {name!r} must be (Layout, dims), e.g. (layout.select('pp', [0, -1]), 'pp')"
            )
        sub, dims = value
        dims_t = (dims,) if isinstance(dims, str) else tuple(dims)
        sub.resolve(*dims_t)  # validates
        spec = GroupSpec(name, sub, tuple(d for d in sub.names if d in dims_t))
        subset_specs[name] = spec
        specs.append(spec)
    return specs, subset_specs


def _check_in_world(layout: Layout, world_size: int, key: Any) -> None:
    top = layout.max_rank
    if top >= world_size:
        raise ValueError(
            f"group {key!r} uses rank {top}, outside the default group's world (ranks 0..{world_size - 1}); "
            "a layout may cover part of the world but not more"
        )


def _plan_fingerprint(
    layout: Layout,
    specs: Sequence[GroupSpec],
    device_type: str,
    backend: str | None,
    strategy: str,
    gloo_twins: bool,
) -> tuple[str, str]:
    digest = hashlib.sha256()
    digest.update(f"{device_type}|{backend}|{strategy}|{gloo_twins}".encode())
    for spec in specs:
        digest.update(f"|{spec.key}:{spec.layout.fingerprint()}:{spec.dims}".encode())
    description = repr(layout)
    if len(description) > 160:
        description = description[:157] + "..."
    return f"{layout.fingerprint()}-{digest.hexdigest()[:12]}", description
