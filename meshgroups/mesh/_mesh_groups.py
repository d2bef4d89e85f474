"""The torch bridge: a ``Layout`` becomes one root ``DeviceMesh`` and its process groups
(``init_mesh``, whose docstring shows it on a stand-in world; ``MeshGroups``, the result).

Each distinct group is created once (``dp_cp`` with ``cp=1`` *is* the ``dp`` group; an expert
view's ``pp`` *is* the dense ``pp``; size-1 dims share one one-rank group), always in mesh order,
and only after every rank has confirmed it builds the same thing. ``mg.mesh`` is the only root
mesh of the layout: submeshes are its slices, declared flattened dims are registered on it, and
torch's own ``_flatten``/``_unflatten`` on it build (or reuse) groups in mesh order through
meshgroups instead of torch's sorted ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshgroups._lifecycle import Closeable
from meshgroups.errors import DuplicateNameError, MeshConfigError, UnknownDimError, torch_says
from meshgroups.layout import Layout
from meshgroups.mesh._build import Built, build, check_new_name
from meshgroups.mesh._collective import collective_call
from meshgroups.mesh._families import Families
from meshgroups.mesh._groups import GroupCache, GroupKey
from meshgroups.mesh._options import (
    DEFAULT_HEARTBEAT,
    DEFAULT_LEASE,
    DEFAULT_REPORT_EVERY,
    MeshOptions,
    merge_options,
)
from meshgroups.mesh._plan import SubsetSpec
from meshgroups.mesh._planning import check_device_index, plan_build
from meshgroups.mesh._root_meshes import RootMeshes
from meshgroups.mesh._torch_seam import (
    flattened_dim,
    forget_dtensor_caches,
    set_group_timeout,
    use_collective_calls,
)

# Public here (compat uses it): changing a live group's timeout has no public torch API.
__all__ = ["GroupCache", "MeshGroups", "init_mesh", "layout_of", "set_group_timeout"]
from meshgroups.mesh._strategies import Strategy


class MeshGroups(Closeable):
    """This rank's view of a built layout: the root ``DeviceMesh`` and every declared group.

    **Ranks outside a layout, view or subset** (a layout over part of the world, a rank offset,
    a subset) are treated as torch treats ranks outside a ``DeviceMesh``: ``mesh``,
    ``view_mesh`` and ``submesh`` still give a ``DeviceMesh`` (every rank gets one), whose
    ``get_coordinate()`` is ``None``, on which DTensor ops are no-ops, and whose ``_flatten``,
    ``_unflatten`` and slicing take part in the collective calls like the members'. There,
    ``group`` (and ``group(gloo=True)``) gives torch's own ``GroupMember.NON_GROUP_MEMBER``, what
    ``dist.new_group`` gives a rank outside the group: torch's collectives skip it (with a
    warning), never ``None``, which torch reads as the whole world. ``ranks`` and
    ``local_rank`` answer ``None`` (there is no such group); ``size`` always answers. A layout
    over part of the world is built only with ``partial=True``.

    ``close()`` (or leaving a ``with init_mesh(...) as mg:`` block) destroys every process group
    this mesh created, except those another live ``MeshGroups`` still uses through a shared
    ``GroupCache``; the mesh is unusable afterwards. On rank 2 of a world of 4 (torch's
    single-process ``"fake"`` backend stands in for the 4 ranks)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import Layout, init_mesh
        >>> dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
        >>> mg = init_mesh(Layout(dp=2, tp=2))
        >>> mg.ranks("tp"), mg.local_rank("tp"), mg.size("dp"), mg.layout.coords(2)
        ([2, 3], 0, 2, {'dp': 1, 'tp': 0})
        >>> dist.get_process_group_ranks(mg.group("tp")), mg.submesh("tp")
        ([2, 3], DeviceMesh((tp=2), 'cpu', stride=(1,)))
        >>> mg.close()  # destroys the groups it created: dp's and tp's
        2
        >>> outside = init_mesh(Layout(tp=2), partial=True)  # ranks 0 and 1 only: opted in
        >>> outside.group("tp") is dist.GroupMember.NON_GROUP_MEMBER, outside.ranks("tp")
        (True, None)
        >>> outside.close()
        0
        >>> dist.destroy_process_group()
    """

    def __init__(self, layout: Layout, built: Built) -> None:
        self.layout = layout
        self.device_type = built.plan.device_type
        self.strategy = built.plan.strategy
        self.cache: GroupCache = built.builder.cache
        self.generation = built.generation
        # The groups (lookups, lifetime) and the DeviceMeshes built from them.
        self._families = Families(built)
        self._roots = RootMeshes(layout, self.device_type, self._families)

    # ----------------------------------------------------------------------- lifetime
    @property
    def gloo_twins(self) -> bool:
        """Whether every group has a gloo twin (``init_mesh(gloo_twins=True)``)."""
        return self._families.plan.gloo_twins

    @property
    def options(self) -> MeshOptions:
        """The options this mesh was built with, to build another layout alike."""
        plan = self._families.plan
        return MeshOptions(
            device_type=plan.device_type,
            backend=plan.backend,
            timeout=plan.timeout,
            gloo_twins=plan.gloo_twins,
            strategy=plan.strategy,
            check=self._families.check,
            backend_override={k: v for k, v in plan.backend_override.items()} or None,
            partial=plan.partial,
            heartbeat=plan.liveness[0],
            lease=plan.liveness[1],
            report_every=plan.liveness[2],
        )

    @property
    def declared_flatten(self) -> tuple[tuple[str, ...], ...]:
        """The ``flatten=`` dim sets this mesh was built with."""
        return tuple(self._families.plan.flatten)

    @property
    def declared_only(self) -> tuple[tuple[str, ...], ...] | None:
        """The ``only=`` dim sets this mesh was built with (``None``: every dim)."""
        only = self._families.plan.only
        return None if only is None else tuple(only)

    def forget_group(self, key: GroupKey) -> None:
        """Stop holding the cache entry ``key`` (after ``GroupCache.evict(key)`` destroyed its
        group), so ``close()`` does not release it a second time."""
        self._families.keys[:] = [k for k in self._families.keys if k != key]

    def _release(self) -> int:
        # close(): the process groups this mesh created (not WORLD, not groups another live
        # mesh shares through the cache), and its DeviceMeshes detached
        self._roots.close()
        destroyed = self._families.release()
        forget_dtensor_caches()
        return destroyed

    def __enter__(self) -> MeshGroups:
        return self

    # ----------------------------------------------------------------------- meshes
    @property
    def mesh(self) -> DeviceMesh:
        """The root ``DeviceMesh`` of the main layout (``mesh_dim_names == layout.names``), on
        every rank (``get_coordinate()`` is ``None`` outside the layout). Built on first use
        from the groups already created (no collective; one O(world) torch constructor, every
        declared flattened dim then registered in O(ndim)): ``mesh["dp_cp"]`` and
        ``mesh["dp", "cp"]._flatten()`` return meshgroups' group."""
        self._check_open("mesh")
        return self._roots.root(self.layout)

    def view_mesh(self, name: str) -> DeviceMesh:
        """The root ``DeviceMesh`` of a view declared with ``Layout.with_views`` (coordinate
        ``None`` off it).
        A view is another factorisation, so its mesh is a root of its own: combine TP and FSDP2
        on slices of one root (the main mesh *or* one view mesh), never across them."""
        self._check_open("view_mesh()")
        views = self.layout.views
        if name not in views:
            raise MeshConfigError(f"unknown view {name!r}; views are {', '.join(views) or 'none'}")
        return self._roots.root(views[name])

    def flatten(self, *dims: str, name: str | None = None) -> DeviceMesh:
        """Add the flattened group of ``dims`` after ``init_mesh`` — collective: every rank calls
        it, like torch's ``_flatten`` — and register it on the root as ``name`` (default: the
        dims joined by ``_``). Returns the flattened 1-D mesh (coordinate ``None`` off the
        layout); an already built set is reused."""
        with collective_call("flatten") as call:  # numbered before anything is checked
            self._check_open("flatten()")
            if not dims:
                raise MeshConfigError("flatten needs at least one dim, e.g. mg.flatten('dp', 'cp')")
            owner = self.layout.resolve(*dims)
            key = tuple(d for d in owner.names if d in dims)
            label = name if name is not None else "_".join(key)
            if len(key) > 1:
                check_new_name(label, self._dim_names(), "flatten(name=)" if name is not None else "")
            call.compare(dims=key, name=label)
            handles = self._families.handles
            if key not in handles:
                handles[key] = self._families.add(owner, key, label)
            if len(key) == 1:
                return self._roots.root(owner)[key[0]]
            return self._roots.flattened(owner, key, label)

    def _dim_names(self) -> set[str]:
        """Every name a flattened dim must not take: dims of the layout and its views, subsets."""
        names = set(self.layout.names).union(*(v.names for v in self.layout.views.values()))
        return names | set(self._families.subsets)

    def submesh(self, *dims: str, flatten: bool = False) -> DeviceMesh:
        """A slice of the root: ``mg.mesh[dims]`` (any dims, n-D, no declaration needed), or
        with ``flatten=True`` the registered flattened dim (``mg.mesh["dp_cp"]``; declare it with
        ``init_mesh(flatten=...)`` or add it with ``flatten()``). A subset name gives a 1-D mesh
        over the subset's group, a root of its own (it is no dim of the layout). Off the group:
        the same mesh with coordinate ``None`` (as torch's slices on a rank outside the mesh)."""
        self._check_open("submesh()")
        if len(dims) == 1 and dims[0] in self._families.subsets:
            return self._roots.subset(dims[0])
        if not dims:
            raise MeshConfigError("name at least one dim (or a subset), e.g. submesh('tp')")
        try:
            owner = self.layout.resolve(*dims)
        except (UnknownDimError, DuplicateNameError) as exc:  # torch's words for mesh[dims] too
            said = (
                f"Invalid mesh_dim_names {dims} specified. Valid mesh_dim_names are {list(self.layout.names)}."
                if isinstance(exc, UnknownDimError)
                else f"Slicing overlapping dim_names {dims} is not allowed."
            )
            raise type(exc)(torch_says(str(exc), said)) from None
        key = tuple(d for d in owner.names if d in dims)
        root = self._roots.root(owner)
        if flatten and len(key) > 1:
            self._families.key_of(self.layout, key)  # a clear error if it was not built
            return flattened_dim(root, "_".join(key)) or self.flatten(*key)
        return root[key]

    # ----------------------------------------------------------------------- lookups
    def has(self, *dims: str) -> bool:
        """Whether the group family of ``dims`` (or the subset ``dims[0]``) was built, so
        ``group`` answers for it. Unknown dims are simply ``False``."""
        if len(dims) == 1 and dims[0] in self._families.subsets:
            return True
        if not dims or not all(isinstance(d, str) for d in dims):
            return False
        try:
            owner = self.layout.resolve(*dims)
        except ValueError:
            return False
        return tuple(d for d in owner.names if d in dims) in self._families.handles

    def group(self, *dims: str, gloo: bool = False) -> dist.ProcessGroup:
        """This rank's group varying ``dims`` (or the subset named ``dims[0]``). On a rank in
        none of them: torch's ``GroupMember.NON_GROUP_MEMBER`` (as ``dist.new_group`` gives a
        non-member), which torch's collectives skip with a warning — never ``None``, which
        torch reads as the whole world. ``gloo=True`` gives the gloo twin
        (``init_mesh(gloo_twins=True)``)."""
        self._check_open("group()")
        handle = self._families.handles[self._families.key_of(self.layout, dims)]
        if gloo and handle.ranks is not None and handle.gloo is None:
            raise MeshConfigError("no gloo twins were built; pass init_mesh(..., gloo_twins=True)")
        group = handle.gloo if gloo else handle.group
        return dist.GroupMember.NON_GROUP_MEMBER if group is None else group  # type: ignore[return-value]

    def _ranks(self, dims: tuple[str, ...]) -> tuple[int, ...] | None:
        self._check_open("_ranks()")
        if len(dims) == 1 and dims[0] in self._families.subsets:
            return self._families.handles[dims[0]].ranks
        if not dims:
            raise MeshConfigError("name at least one dim (or a subset), e.g. ranks('tp')")
        owner = self.layout.resolve(*dims)
        rank = dist.get_rank()
        return tuple(owner.group_of(rank, *dims).tolist()) if rank in owner else None

    def ranks(self, *dims: str) -> list[int] | None:
        """Global ranks of this rank's group varying ``dims``, in mesh order (= group rank order),
        or ``None``. Layout arithmetic: any dim set, built or not."""
        ranks = self._ranks(dims)
        return None if ranks is None else list(ranks)

    def local_rank(self, *dims: str) -> int | None:
        """This rank's index in its group varying ``dims`` (== ``dist.get_rank(group)`` where the
        group was built), or ``None``. Any dim set."""
        ranks = self._ranks(dims)
        return None if ranks is None else ranks.index(dist.get_rank())

    def size(self, *dims: str) -> int:
        """Size of the groups varying ``dims`` (or of the subset's groups); any dims, built or not;
        with no dims the layout's world size, as torch's ``DeviceMesh.size()``."""
        if len(dims) == 1 and dims[0] in self._families.subsets:
            return self._families.subsets[dims[0]].size
        return self.layout.size(*dims)

    @property
    def families(self) -> list[Hashable]:
        """Keys of every group family built: dim tuples (layout order) and subset names."""
        return list(self._families.handles)

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"MeshGroups(rank={dist.get_rank()}, layout={self.layout!r}, strategy={self.strategy!r}, "
            f"families={len(self._families.handles)}, groups_held={len(self.cache)}{state})"
        )

    def _repr_html_(self) -> str:
        from meshgroups.render import html

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
    strategy: Strategy = "auto",
    cache: GroupCache | None = None,
    check: bool | None = None,
    backend_override: Mapping[int | str, object] | None = None,
    partial: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    lease: float = DEFAULT_LEASE,
    report_every: float = DEFAULT_REPORT_EVERY,
    options: MeshOptions | None = None,
) -> MeshGroups:
    """Build ``layout`` on the initialised default process group. Call it on every rank, the
    same number of times, from one thread. Here on rank 5 of a job of 8 (torch's single-process
    ``"fake"`` backend stands in for the 8 ranks; under torchrun: ``init_process_group("nccl")``,
    ``device_type="cuda"``)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import Layout, init_mesh
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        >>> with init_mesh(Layout(pp=2, dp=2, tp=2), flatten=[("dp", "tp")]) as mg:
        ...     mg.ranks("tp"), mg.ranks("dp", "tp"), mg.mesh["dp_tp"]  # dp_tp: for fully_shard
        ([4, 5], [4, 5, 6, 7], DeviceMesh((dp_tp=4), 'cpu', stride=(1,)))
        >>> dist.destroy_process_group()

    Args:
        layout: the main layout; its views (``Layout.with_views``) are built too.
        device_type: ``"cpu"``, ``"cuda"``, ... (a device type, no index), as for ``DeviceMesh``.
        flatten: dim sets to build flattened groups for, e.g. ``[("dp", "cp")]``; each is also
            registered on the root mesh (``mg.mesh["dp_cp"]``).
        subsets: named subset groups, ``{"embd": (layout.select("pp", [0, -1]), "pp")}``:
            the groups of that sub-layout varying those dims; other ranks get ``None``.
        only: build exactly these dim sets (and ``subsets``) instead of every dim plus
            ``flatten`` — e.g. ``only=[("tp",)]`` for just the tp groups. ``mesh`` then needs
            every single dim among them.
        backend: backend of the new groups; default: the default group's. Strings such as
            ``"cpu:gloo,cuda:nccl"`` pass through to ``new_group``.
        timeout: bounds every wait of this call — the cross-rank check and each group's
            creation (seconds or timedelta, positive, at most 7 days); default: the default
            group's timeout (``init_process_group(timeout=...)``).
        gloo_twins: also build a gloo twin of every group (``group(..., gloo=True)``), what
            Megatron calls ``create_gloo_process_groups``.
        strategy: ``"auto"`` (default: ``"split"`` where the default group is bound to a
            device and torch >= 2.14, as torch 2.15's nccl2 backend splits subgroups from the
            parent itself; else ``"global"``), ``"global"`` (every rank makes every creation
            call — safe everywhere, O(world) calls per rank), ``"local"`` (each rank creates
            only its own groups with ``use_local_synchronization=True`` — O(number of
            families); torch's held-group counts are levelled across ranks first; not for MPI,
            refused with a device-bound default group, pytorch#129965), or ``"split"``
            (``dist.split_group`` per family; needs a device-bound default group; on torch 2.13
            groups must have increasing ranks; NCCL is untested here: no multi-GPU machine).
        cache: share groups across ``init_mesh`` calls (one strategy per cache); a group stays
            alive while any ``MeshGroups`` built through the cache uses it.
        check: ``None``/``True``: the cross-rank rendezvous runs (always, on a real backend:
            it is what keeps calls in step); ``False`` is accepted only on torch's
            single-process ``"fake"`` backend, where there is no store to meet through.
        backend_override: torch's per-dim backend choice (``init_device_mesh``'s argument):
            ``{dim name or index: backend name | backend options | (name, options)}``, e.g.
            ``{"tp": "gloo", 0: ("gloo", opts)}``; keys may also be a view's dim, a declared
            flattened dim (``"dp_cp"``) or a subset name. Part of the cross-rank check.
        partial: allow a layout over part of the world (a rank offset, fewer ranks, or part
            of a cohort's live ranks). Refused by default, naming the ranks left out: on them
            ``group()`` is torch's ``GroupMember.NON_GROUP_MEMBER``. Subsets need no opt-in.
        heartbeat, lease, report_every: how liveness is watched (``MeshOptions``' fields, which
            say why the defaults are 1 s, 5 s and 10 s): seconds between this rank's
            heartbeats, without a heartbeat before a rank *stopped responding*, between two
            "still waiting" lines.
        options: all of the above but ``flatten``, ``subsets``, ``only`` and ``cache`` as one
            ``MeshOptions`` value (then leave those keywords at their defaults).

    Every wait of the call watches liveness: a rank that has exited or stopped responding
    (no heartbeat for ``lease`` seconds) ends it on every rank with ``RanksGoneError`` within
    seconds; a rank alive but late is logged ("still waiting for ranks ...", with the call's
    number and site) every ``report_every`` seconds; the timeout stays the last bound.

    Raises:
        RuntimeError: the default process group is not initialised.
        ConcurrentInitError: another thread of this process is inside a collective call.
        TypeError / MeshConfigError / LayoutError: bad arguments on this rank — raised before
            any group is created, and raised on every other rank too, same class, naming it.
            Where torch raises ``RuntimeError`` for the same misuse the error is also one
            (``DeviceTypeError`` for ``"cpu:0"``, ``DuplicateNameError``, ``WorldSizeError``,
            ``BackendOverrideError``; see ``meshgroups.errors``).
        MismatchError: ranks passed different arguments, or made different calls at this call
            number (``argument`` is then ``"operation"`` or ``"call_site"``), named with the ranks.
        RendezvousTimeoutError: a rank never arrived, or arrived after the others gave up.
        RanksGoneError: a rank the call waits for exited or stopped responding (named, with how).
        StoreConnectionError: the connection to the store was lost (e.g. rank 0 died).
        MeshBuildError: a rank failed while creating groups; every rank destroyed what the call
            created, and retrying the same call on every rank is safe.

    Returns:
        The ``MeshGroups`` of this rank: ``mesh`` (the root ``DeviceMesh``), ``group(*dims)``,
        ``ranks``, ``local_rank``, ``size``, ``submesh``, ``view_mesh``; ``close()`` (or ``with``)
        destroys the groups it created.
    """
    if not dist.is_available() or not dist.is_initialized():
        check_device_index(device_type)  # torch tells this first, with or without a default group
        raise RuntimeError(
            "init_mesh needs an initialised default process group: call dist.init_process_group first"
        )
    keywords = MeshOptions(  # (in the order of its fields)
        *(device_type, backend, timeout, gloo_twins, strategy, check, backend_override),
        *(partial, heartbeat, lease, report_every),
    )
    opts, refusal = merge_options(options, keywords)
    with collective_call("init_mesh") as call:  # numbered first: every check below is every rank's
        if refusal is not None:
            raise TypeError(refusal)
        plan = plan_build(call, layout, opts, flatten=flatten, subsets=subsets, only=only, cache=cache)
        built = build(plan, call, cache=cache)
    return MeshGroups(layout, built)


# torch's _flatten/_unflatten on a meshgroups mesh run inside the same protocol as init_mesh.
use_collective_calls(collective_call)


def layout_of(device_mesh: DeviceMesh) -> Layout:
    """Any torch ``DeviceMesh`` read back as a ``Layout`` with the mesh's dim names (``dim_0``,
    ... when it has none): a root from ``init_device_mesh``, a slice (this rank's sub-grid) or a
    flattened mesh (this rank's flattened group), so a torchtitan user can draw and check the
    mesh they already have. Public DeviceMesh API only (``mesh``, ``mesh_dim_names``)::

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import layout_of
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)  # 1 of 8
        >>> layout_of(init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))
        Layout(dp=2, tp=4)
        >>> dist.destroy_process_group()

    Args:
        device_mesh: any ``DeviceMesh`` (a root, a slice, a flattened mesh).

    Returns:
        The ``Layout`` of the ranks it holds, with its dim names.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"layout_of takes a torch DeviceMesh, got {type(device_mesh).__name__}")
    grid = device_mesh.mesh.detach().cpu().numpy()
    names = device_mesh.mesh_dim_names or tuple(f"dim_{i}" for i in range(grid.ndim))
    return Layout.from_grid(grid, tuple(names))
