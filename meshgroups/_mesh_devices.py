"""The ``DeviceMesh``es of a ``MeshGroups``: the root mesh of the layout and of each view (built
on first use from the groups already created), their slices, flattened dims registered on the
root, subset meshes, and the builder torch's own ``_flatten``/``_unflatten`` call on them — so
every group they need comes from meshgroups' cache, in mesh order.

A mixin of :class:`~meshgroups.mesh.MeshGroups` (its lifetime and group lookups live in
``mesh.py``); the private torch calls are in ``_torch_seam``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._torch_seam import BackendConfig, flatten_on_root, flattened_dim, make_group_mesh, make_root
from .build import build_more, check_new_name
from .collective import collective_call
from .errors import MeshConfigError
from .layout import Layout

if TYPE_CHECKING:
    from .groups import GroupCache, GroupHandle, GroupKey
    from .plan import GroupSpec, Plan


class MeshDevices:
    """DeviceMesh methods of ``MeshGroups`` (see the module docstring)."""

    if TYPE_CHECKING:
        layout: Layout
        device_type: str
        cache: GroupCache
        _plan: Plan
        _check: bool
        _handles: dict[Hashable, GroupHandle]
        _subsets: dict[str, GroupSpec]
        _keys: list[GroupKey]
        _pads: list[dist.ProcessGroup]
        _meshes: dict[str | None, DeviceMesh]
        _subset_meshes: dict[str, DeviceMesh]
        _token: tuple[int, int]

        def _check_open(self) -> None: ...

        def _key(self, dims: tuple[str, ...]) -> Hashable: ...

    # ----------------------------------------------------------------------- meshes
    @property
    def mesh(self) -> DeviceMesh:
        """The root ``DeviceMesh`` of the main layout (``mesh_dim_names == layout.names``), on
        every rank (``get_coordinate()`` is ``None`` outside the layout). Built on first use
        from the groups already created (no collective; one O(world) torch constructor, every
        declared flattened dim then registered in O(ndim)): ``mesh["dp_cp"]`` and
        ``mesh["dp", "cp"]._flatten()`` return meshgroups' group."""
        self._check_open()
        if None not in self._meshes:
            self._meshes[None] = self._build_root(self.layout)
        return self._meshes[None]

    def view_mesh(self, name: str) -> DeviceMesh:
        """The root ``DeviceMesh`` of a view declared with ``Layout.with_views`` (coordinate
        ``None`` off it).
        A view is another factorisation, so its mesh is a root of its own: combine TP and FSDP2
        on slices of one root (the main mesh *or* one view mesh), never across them."""
        self._check_open()
        views = self.layout.views
        if name not in views:
            raise MeshConfigError(f"unknown view {name!r}; views are {', '.join(views) or 'none'}")
        if name not in self._meshes:
            self._meshes[name] = self._build_root(views[name])
        return self._meshes[name]

    def _build_root(self, layout: Layout) -> DeviceMesh:
        missing = [d for d in layout.names if (d,) not in self._handles]
        if missing:
            raise MeshConfigError(
                f"a DeviceMesh needs the groups of every dim, but {', '.join(missing)} were not built "
                "(init_mesh was called with only=...)"
            )
        rank = dist.get_rank()
        coords = layout.coords(rank) if rank in layout else None
        groups = None if coords is None else [self._handles[(d,)].group for d in layout.names]
        root = make_root(
            cast("list[dist.ProcessGroup] | None", groups),
            self.device_type,
            # int32, what torch keeps as its rank map: built once, taken without a copy
            torch.from_numpy(layout.grid_as(np.int32)),
            layout.names,
            None if coords is None else tuple(coords[d] for d in layout.names),
            self._build_for_torch,
            self._token,
        )
        for key, handle in self._handles.items():
            if isinstance(key, tuple) and len(key) > 1 and all(d in layout.names for d in key):
                if self.layout.resolve(*key) is layout:
                    flatten_on_root(
                        root, key, "_".join(key), handle.group, _flat_position(layout, key, coords)
                    )
        return root

    def _root_of(self, owner: Layout) -> DeviceMesh:
        if owner is self.layout:
            return self.mesh
        return self.view_mesh(next(n for n, v in self.layout.views.items() if v is owner))

    def _build_for_torch(
        self,
        rows_per_dim: Sequence[torch.Tensor],
        names: Sequence[str],
        backends: Sequence[BackendConfig] = (),
    ) -> list[dist.ProcessGroup | None]:
        """torch's ``_flatten``/``_unflatten`` on one of our meshes: a collective build of each
        new dim's groups (rows in mesh order; ``backends``: torch's normalised
        ``backend_override``), reusing equal groups. ``None`` where this rank is in no row."""
        self._check_open()
        for name in names:
            check_new_name(name, ())
        groups = []
        for i, (rows, name) in enumerate(zip(rows_per_dim, names)):
            grid = np.asarray(rows.cpu().numpy(), dtype=np.int64)
            override = backends[i] if i < len(backends) else (None, None)
            handle = self._build_family(
                Layout.from_grid(grid, ("group", "member")), ("member",), name, override
            )
            groups.append(handle.group)
        return groups

    def _build_family(
        self,
        owner: Layout,
        key: tuple[str, ...],
        label: str | None = None,
        override: BackendConfig = (None, None),
    ) -> GroupHandle:
        label = label or "_".join(key)
        overrides = {label: override} if override != (None, None) else None
        built = build_more(owner, [key], self._plan, self._check, self.cache, {key: label}, overrides)
        self._keys += built.builder.keys
        self._pads += built.builder.pads
        return built.handles[key]

    def flatten(self, *dims: str, name: str | None = None) -> DeviceMesh:
        """Add the flattened group of ``dims`` after ``init_mesh`` — collective: every rank calls
        it, like torch's ``_flatten`` — and register it on the root as ``name`` (default: the
        dims joined by ``_``). Returns the flattened 1-D mesh (coordinate ``None`` off the
        layout); an already built set is reused."""
        with collective_call("flatten") as call:  # numbered before anything is checked
            self._check_open()
            if not dims:
                raise MeshConfigError("flatten needs at least one dim, e.g. mg.flatten('dp', 'cp')")
            owner = self.layout.resolve(*dims)
            key = tuple(d for d in owner.names if d in dims)
            label = name if name is not None else "_".join(key)
            if len(key) > 1:
                check_new_name(label, self._dim_names(), "flatten(name=)" if name is not None else "")
            call.compare(dims=key, name=label)
            if key not in self._handles:
                self._handles[key] = self._build_family(owner, key, label)
            root = self._root_of(owner)
            if len(key) == 1:
                return root[key[0]]
            rank = dist.get_rank()
            coords = owner.coords(rank) if rank in owner else None
            return flatten_on_root(
                root, key, label, self._handles[key].group, _flat_position(owner, key, coords)
            )

    def _dim_names(self) -> set[str]:
        """Every name a flattened dim must not take: dims of the layout and its views, subsets."""
        names = set(self.layout.names).union(*(v.names for v in self.layout.views.values()))
        return names | set(self._subsets)

    def submesh(self, *dims: str, flatten: bool = False) -> DeviceMesh:
        """A slice of the root: ``mg.mesh[dims]`` (any dims, n-D, no declaration needed), or
        with ``flatten=True`` the registered flattened dim (``mg.mesh["dp_cp"]``; declare it with
        ``init_mesh(flatten=...)`` or add it with ``flatten()``). A subset name gives a 1-D mesh
        over the subset's group, a root of its own (it is no dim of the layout). Off the group:
        the same mesh with coordinate ``None`` (as torch's slices on a rank outside the mesh)."""
        self._check_open()
        if len(dims) == 1 and dims[0] in self._subsets:
            return self._subset_mesh(dims[0])
        if not dims:
            raise MeshConfigError("name at least one dim (or a subset), e.g. submesh('tp')")
        owner = self.layout.resolve(*dims)
        key = tuple(d for d in owner.names if d in dims)
        root = self._root_of(owner)
        if flatten and len(key) > 1:
            self._key(key)  # raises a clear error if the flattened group was not built
            return flattened_dim(root, "_".join(key)) or self.flatten(*key)
        return root[key]

    def _subset_mesh(self, name: str) -> DeviceMesh:
        if name not in self._subset_meshes:
            handle, spec = self._handles[name], self._subsets[name]
            self._subset_meshes[name] = make_group_mesh(
                handle.group,
                self.device_type,
                torch.from_numpy(np.ascontiguousarray(spec.layout.groups(*spec.dims), dtype=np.int32)),
                name,
                None if handle.ranks is None else handle.ranks.index(dist.get_rank()),
                self._build_for_torch,
                self._token,
            )
        return self._subset_meshes[name]


def _flat_position(
    layout: Layout, key: tuple[str, ...], coords: Mapping[str, int] | None
) -> tuple[int, ...] | None:
    """This rank's coordinate on the flattened dim ``key`` (row-major over ``key``), O(ndim)."""
    if coords is None:
        return None
    position = 0
    for d in key:
        position = position * layout.size(d) + coords[d]
    return (position,)
