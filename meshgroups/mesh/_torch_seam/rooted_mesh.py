"""``RootedMesh``: the DeviceMesh meshgroups hands out, and the O(ndim) construction of the meshes
derived from a root (slices, flattened and unflattened dims)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh, _normalize_backend_override

from meshgroups.errors import UnknownDimError, torch_says
from meshgroups.mesh._torch_seam.builders import CALL_FACTORIES, BackendConfig, GroupBuilder, lookup_builder
from meshgroups.mesh._torch_seam.internals import present_fields

# ---------------------------------------------------------------------------------------------
# One root mesh, on every rank. meshgroups hands out a single root DeviceMesh per layout; its
# slices, flattened dims and unflattened meshes stay derived from it (TP + FSDP2 concatenate
# slices of one root) and never get a group torch built itself: torch's _flatten/_unflatten
# create groups with sorted ranks, which on a placement whose ranks don't increase makes
# position != group rank and silently permutes DTensor data. ``RootedMesh`` is a DeviceMesh
# (isinstance, pickling, DTensor, FSDP2 and DCP see one) whose slices stay RootedMesh and whose
# _flatten/_unflatten ask meshgroups for the groups: ``builder(rows_per_dim, names, backends)``
# -> this rank's group per new dim (None off it), collective like torch's own calls. A rank
# outside the mesh holds one too (coordinate None, no groups), as torch gives every rank a mesh,
# and takes part in every collective call. Derived meshes are made here in O(ndim) from the
# root's rank map (torch's constructor is O(world) per mesh), mirroring torch 2.13's
# _create_sub_mesh / _create_flatten_mesh / _create_unflatten_mesh.
# ---------------------------------------------------------------------------------------------


class RootedMesh(DeviceMesh):
    """A ``DeviceMesh`` built by meshgroups; see the comment above."""

    _mg_builder: GroupBuilder | None = None
    _mg_token: tuple[int, int] | None = None

    @property
    def _flatten_rank_map(self) -> tuple[int, ...]:
        # torch builds this O(world) tuple (for hashing and equality) in its constructor, for
        # every mesh; here it is made on first use, once per rank map, and shared by the root's
        # meshes. Pickles and copies make their own.
        root = self._root_mesh or self
        memo = root.__dict__.get("_mg_rank_tuple")
        if memo is None or memo[0] is not self._rank_map:
            memo = (self._rank_map, tuple(self._rank_map.tolist()))
            if self._rank_map is root._rank_map:
                root.__dict__["_mg_rank_tuple"] = memo
        return memo[1]

    @_flatten_rank_map.setter
    def _flatten_rank_map(self, value: tuple[int, ...]) -> None:
        pass  # always derived from _rank_map (torch's constructor sets it from there too)

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...] | list[str]) -> DeviceMesh:
        if not self._mesh_dim_names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names!")
        if isinstance(mesh_dim_names, str):
            names: tuple[str, ...] = (mesh_dim_names,)
        elif isinstance(mesh_dim_names, (tuple, list)) and all(isinstance(n, str) for n in mesh_dim_names):
            names = tuple(mesh_dim_names)  # a list of names slices like the tuple, as in torch
        else:
            # torch would iterate b"2" into (50,) and raise KeyError: a KeyError that also says why
            raise UnknownDimError(
                f"mesh dim names must be a str or a tuple (or list) of str, got {mesh_dim_names!r}; "
                f"dims of this mesh are {', '.join(self._mesh_dim_names)}"
            )
        if names == self._mesh_dim_names:
            return self
        root = self._get_root_mesh()
        if self is root and len(names) == 1 and names[0] in root._flatten_mapping:
            return root._flatten_mapping[names[0]]  # a registered flattened dim, without torch's warning
        layout = self._get_slice_mesh_layout(names)  # torch's checks, torch's exception classes
        groups: list[str] = []
        coordinate: list[int] = []
        member = self._coordinate_on_dim is not None
        for name in names:
            source: DeviceMesh = self
            index = self._mesh_dim_names.index(name) if name in self._mesh_dim_names else 0
            if name not in self._mesh_dim_names:
                source = root._flatten_mapping[name]
            if member and source._coordinate_on_dim is not None:
                groups.append(source._dim_group_names[index])
                coordinate.append(source._coordinate_on_dim[index])
        return _derived(self, layout, names, groups, tuple(coordinate) if member else None)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_mg_builder", None)
        state.pop("_mg_rank_tuple", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self._root_mesh is None:  # a copy in the building process keeps its builder
            self._mg_builder = lookup_builder(self._mg_token)

    def _builder(self) -> GroupBuilder:
        root = self._get_root_mesh()
        builder = getattr(root, "_mg_builder", None)
        if builder is not None:
            return builder
        token = getattr(root, "_mg_token", None)
        if token is not None and token[0] != os.getpid():
            raise RuntimeError(
                f"this mesh was built by meshgroups in process {token[0]} and unpickled in process "
                f"{os.getpid()}: new groups for it (_flatten, _unflatten) can only be built in the process "
                "that built it, while its MeshGroups is open. Here, slice it or use its existing dims, or "
                "build the mesh in this process with init_mesh"
            )
        raise RuntimeError(
            "this mesh's MeshGroups was closed (or garbage-collected): new groups for it cannot be built; "
            "keep the MeshGroups open (or a reference to its mesh) while you _flatten/_unflatten"
        )

    def _collective(self, operation: str) -> AbstractContextManager[object]:
        return CALL_FACTORIES[0](operation) if CALL_FACTORIES else nullcontext()

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: object = None) -> DeviceMesh:
        try:
            self._builder()
        except RuntimeError:  # it can build nothing here (unpickled elsewhere, closed): answer locally
            registered = self._registered(mesh_dim_name)
            if registered is not None:  # a registered dim needs no build, as in torch
                return registered
            raise
        with self._collective("_flatten"):  # numbered before anything else is checked
            return self._flatten_in_call(mesh_dim_name, backend_override)

    def _registered(self, mesh_dim_name: object) -> DeviceMesh | None:
        """The mesh ``_flatten(mesh_dim_name)`` returns without building anything, if any."""
        names = tuple(self._mesh_dim_names or ())
        if not names or not isinstance(mesh_dim_name, (str, type(None))):
            return None
        name = mesh_dim_name or "_".join(names)
        if self.ndim == 1 and name in names:
            return self
        existing = self._get_root_mesh()._flatten_mapping.get(name)
        if existing is not None and existing._layout == _MeshLayout([self._layout.collapse()]):
            return existing
        return None

    def _flatten_in_call(self, mesh_dim_name: str | None, backend_override: object) -> DeviceMesh:
        names = tuple(self._mesh_dim_names or ())
        if not names:
            raise RuntimeError("Cannot flatten a DeviceMesh without mesh_dim_names!")
        name = mesh_dim_name or "_".join(names)
        if self.ndim == 1 and name in names:
            return self
        override: BackendConfig = (None, None)
        if backend_override is not None:
            (override,) = _normalize_backend_override({0: backend_override}, 1)  # type: ignore[dict-item]
        root = self._get_root_mesh()
        if name in (root._mesh_dim_names or ()):
            raise ValueError(
                torch_says(
                    f"{name!r} is already a dim of the root mesh {root._mesh_dim_names}; "
                    "pick another name for the flattened dim",
                    f"{name} already exists for submesh of the {root!r}. The mesh_dim_names of submesh and "
                    f"flattened mesh are {root._mesh_dim_names}. Please specify another valid mesh_dim_name.",
                )
            )
        layout = _MeshLayout([self._layout.collapse()])
        existing = root._flatten_mapping.get(name)
        if existing is not None:
            if existing._layout == layout:
                return existing
            raise ValueError(
                torch_says(
                    f"the flattened dim {name!r} exists already, over other dims; pick another name for this one",
                    f"Flatten mesh with mesh_dim_name {name} has been created before, "
                    "Please specify another valid mesh_dim_name.",
                )
            )
        (group_name,) = self._init_process_groups(layout, root._rank_map, (name,), (override,)) or (None,)
        group = None if group_name is None else root._pg_registry[group_name]
        return register_flattened(root, layout, name, group, _position(layout, root._rank_map, self._rank))

    def _unflatten(  # type: ignore[override]
        self,
        dim: int | str,
        mesh_sizes: tuple[int, ...],
        mesh_dim_names: tuple[str, ...],
        backend_override: dict[str, object] | None = None,
    ) -> DeviceMesh:
        self._builder()  # a mesh that can build nothing here (unpickled elsewhere, closed) says so, locally
        with self._collective("_unflatten"):  # numbered before anything else is checked
            return self._unflatten_in_call(dim, mesh_sizes, mesh_dim_names, backend_override)

    def _unflatten_in_call(
        self,
        dim: int | str,
        mesh_sizes: tuple[int, ...],
        mesh_dim_names: tuple[str, ...],
        backend_override: dict[str, object] | None,
    ) -> DeviceMesh:
        names = tuple(self._mesh_dim_names or ())
        if isinstance(dim, int) and dim >= self.ndim:
            raise ValueError(f"dim {dim} specified in `_unflatten` is out of range {self.ndim}")
        if isinstance(dim, str) and dim not in names:
            raise ValueError(f"dim {dim} specified in `_unflatten` is not in {self._mesh_dim_names}")
        if len(mesh_sizes) != len(mesh_dim_names):
            raise RuntimeError("mesh_dim_names must have same length as mesh_sizes in _unflatten!")
        index = names.index(dim) if isinstance(dim, str) else dim
        overrides = tuple(
            _normalize_backend_override(dict(backend_override or {}), len(mesh_sizes), tuple(mesh_dim_names))  # type: ignore[arg-type]
        )
        inner = _MeshLayout.from_sizes_strides(tuple(mesh_sizes))
        if inner.numel() != self._layout[index].numel():
            raise ValueError(
                torch_says(
                    f"dim {dim!r} has size {self._layout[index].numel()} but mesh_sizes={tuple(mesh_sizes)} "
                    f"multiply to {inner.numel()}: unflatten splits a dim into sizes that multiply to its size",
                    f"The product of mesh_sizes={mesh_sizes} is {inner.numel()}, but the original dimension at "
                    f"dim={index} has size {self._layout[index].numel()}. "
                    "These must be equal for unflatten to work correctly.",
                )
            )
        partial = self._layout[index].composition(inner)
        root = self._get_root_mesh()
        new = self._init_process_groups(partial, root._rank_map, tuple(mesh_dim_names), overrides)
        coordinate = None
        if self._coordinate_on_dim is not None:
            inside = [int(c) for c in np.unravel_index(self._coordinate_on_dim[index], tuple(mesh_sizes))]
            coordinate = (*self._coordinate_on_dim[:index], *inside, *self._coordinate_on_dim[index + 1 :])
        groups = [*self._dim_group_names[:index], *new, *self._dim_group_names[index + 1 :]]
        out_names = (*names[:index], *mesh_dim_names, *names[index + 1 :])
        return _derived(self, self._layout.splice(index, index + 1, partial), out_names, groups, coordinate)

    def _init_process_groups(  # type: ignore[override]
        self,
        layout: _MeshLayout,
        rank_map: torch.Tensor,
        mesh_dim_names: tuple[str, ...] | None,
        backend_override: tuple[BackendConfig, ...],
        preserve_rank_order: bool = False,
    ) -> list[str]:
        # The groups of new dims, built in mesh order through meshgroups (never torch's sorted ones):
        # meshgroups always preserves rank order, so torch 2.15's preserve_rank_order changes nothing.
        names = tuple(mesh_dim_names or (f"dim_{i}" for i in range(len(layout))))
        rows = [_MeshLayout([layout[i]]).remap_to_tensor(rank_map) for i in range(len(layout))]
        groups = self._builder()(rows, names, backend_override)
        root = self._get_root_mesh()
        for group in groups:
            if group is not None:
                root._pg_registry[group.group_name] = group
        return [g.group_name for g in groups if g is not None]  # torch: all or none


def _position(layout: _MeshLayout, rank_map: torch.Tensor, rank: int) -> tuple[int, ...] | None:
    hit = (layout.remap_to_tensor(rank_map) == rank).nonzero()
    return (int(hit[0, 1]),) if hit.numel() else None


def _derived(
    parent: DeviceMesh,
    layout: _MeshLayout,
    names: tuple[str, ...],
    group_names: Sequence[str],
    coordinate: tuple[int, ...] | None,
) -> RootedMesh:
    """A mesh over ``parent``'s root rank map, made in O(ndim)."""
    root = parent._get_root_mesh()
    preserve = bool(root.__dict__.get("_preserve_rank_order", False))
    return new_mesh(
        root._device_type,
        layout,
        root._rank_map,
        names,
        root,
        group_names,
        coordinate,
        preserve=preserve,
        rank=root._rank,
    )


def order_matters(grid: np.ndarray, axes: Sequence[int] | None = None) -> bool:
    """Whether along some axis of the rank grid ``grid`` (all, or ``axes``: the mesh dims) ranks
    do not increase: where torch's default (sorted) groups would differ from the mesh-order
    groups meshgroups builds."""
    axes = range(grid.ndim) if axes is None else axes
    return any(bool((np.diff(grid, axis=d) <= 0).any()) for d in axes if grid.shape[d] > 1)


def new_mesh(
    device_type: str,
    layout: _MeshLayout,
    rank_map: torch.Tensor,
    names: tuple[str, ...],
    root: DeviceMesh | None,
    group_names: Sequence[str],
    coordinate: tuple[int, ...] | None,
    *,
    preserve: bool = False,
    rank: int | None = None,
) -> RootedMesh:
    """The state torch's constructor gives a mesh (``_init_backend=False``), without its
    O(world) searches: the coordinate is given (layout arithmetic), the rank-map tuple is made
    on first use (``RootedMesh._flatten_rank_map``). Every field of
    ``internals.CONSTRUCTOR_FIELDS`` that this torch's constructor sets is written here.

    ``preserve`` is torch >= 2.15's ``preserve_rank_order`` (ignored before): ``True`` exactly
    where a dim's ranks do not increase (``order_matters``), so a meshgroups mesh equals, and
    hashes as, the torch mesh whose groups are the same — ``DeviceMesh(...)`` over a row-major
    layout, ``DeviceMesh(..., preserve_rank_order=True)`` over a permuted one. Slices and
    flattened dims inherit the root's value, as in torch. ``rank`` defaults to ``dist.get_rank()``.
    """
    mesh = RootedMesh.__new__(RootedMesh)
    threaded = dist.is_initialized() and dist.get_backend() == "threaded"
    fields: dict[str, object] = dict(
        _device_type=device_type,
        _layout=layout,
        _rank_map=rank_map,
        _mesh_dim_names=names,
        _root_mesh=root,
        _thread_id=threading.get_ident() if threaded else None,
        _flatten_mapping={},
        _pg_registry={},
        _dim_group_names=list(group_names),
        _rank=dist.get_rank() if rank is None else rank,
        _coordinate_on_dim=coordinate,
        _hash=None,
    )
    if "_preserve_rank_order" in present_fields():
        fields["_preserve_rank_order"] = preserve
    mesh.__dict__.update(fields)
    return mesh


def flattened_layout(root: DeviceMesh, names: tuple[str, ...]) -> _MeshLayout:
    """The layout of ``root[names]._flatten()``, computed without slicing (O(ndim))."""
    dims = root._mesh_dim_names or ()
    return _MeshLayout([_MeshLayout([root._layout[dims.index(n)] for n in names]).collapse()])


def register_flattened(
    root: DeviceMesh,
    layout: _MeshLayout,
    name: str,
    group: dist.ProcessGroup | None,
    coordinate: tuple[int, ...] | None,
) -> DeviceMesh:
    """A 1-D mesh over ``group`` (``None`` off it) registered on ``root`` as the flattened dim
    ``name``: torch's ``root[name]`` and ``root[dims]._flatten(name)`` then return it, and
    DTensor routes through it. O(ndim)."""
    flat = _derived(root, layout, (name,), [group.group_name] if group is not None else [], coordinate)
    if group is not None:
        root._pg_registry[group.group_name] = group
    root._flatten_mapping[name] = flat
    return flat
