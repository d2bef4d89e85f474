"""The one place that touches private ``torch.distributed`` internals (torch 2.13).

A torch upgrade that moves these names breaks this module only. Two helpers write torch state,
each for a reason the callers document: ``advance_group_count`` (re-align sequential group
names after a failed build) and ``creation_store_prefix`` (give each ``init_mesh`` call its own
store namespace, so rebuilt groups never read a previous incarnation's connection keys).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.distributed import distributed_c10d as _c10d
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh, _normalize_backend_override

from .errors import UnknownDimError


def default_store() -> dist.Store:
    """The store the default process group was initialised with (TCPStore under torchrun)."""
    return _c10d._get_default_store()


def held_group_count() -> int:
    """How many groups this process belongs to. torch names groups created with
    ``use_local_synchronization=True`` by hashing their ranks *and this count*, so every member
    of such a group must have the same count when it is created (pytorch#173608)."""
    return len(_c10d._world.pg_names)


def group_count() -> int:
    """torch's counter behind sequential group names (``new_group`` without local sync):
    incremented by every such call, member or not, so it must agree on every rank."""
    return int(_c10d._world.group_count)


def advance_group_count(value: int) -> None:
    """Move the sequential-name counter forward to ``value`` (never back: names stay unique)."""
    if value > _c10d._world.group_count:
        _c10d._world.group_count = value


@contextmanager
def creation_store_prefix(prefix: str) -> Iterator[None]:
    """Groups created inside get their connection keys under ``prefix`` in the default store.

    torch derives a new group's store as ``PrefixStore(name, default store)``; hashed names
    repeat once a group is destroyed and rebuilt, and gloo would then read the old group's
    addresses. Swapping the default store's entry for a prefixed one while creating gives each
    call a namespace of its own; the groups keep a reference to their own store afterwards.

    Hashed group names (``use_local_synchronization``, ``split_group``) get the prefix mixed in
    too, so a group rebuilt after ``close()`` never takes the name of a destroyed one: an old
    DeviceMesh slice holding that name then fails to resolve instead of silently resolving to
    the new mesh's group. The prefix is the same on every rank of the call."""
    default_pg = _c10d._get_default_group()
    backend, store = _c10d._world.pg_map[default_pg]
    hash_ranks = _c10d._hash_ranks_to_str
    _c10d._world.pg_map[default_pg] = (backend, dist.PrefixStore(prefix, store))
    _c10d._hash_ranks_to_str = lambda ranks: hash_ranks([*ranks, prefix])  # type: ignore[list-item]
    try:
        yield
    finally:
        _c10d._world.pg_map[default_pg] = (backend, store)
        _c10d._hash_ranks_to_str = hash_ranks


def default_timeout() -> timedelta:
    """The default group's timeout (``init_process_group(timeout=...)``)."""
    group = _c10d._get_default_group()
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            timeout = group._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return timeout
    return dist.default_pg_timeout


def default_backend_name() -> str:
    return str(dist.get_backend())


def bound_device_id() -> object | None:
    """The device the default group is bound to (``init_process_group(device_id=...)``)."""
    return _c10d._get_default_group().bound_device_id


def is_backend_options(value: object) -> bool:
    """Whether ``value`` is a c10d backend options object (``ProcessGroupGloo._Options``, ...)."""
    return isinstance(value, _C10dBackend.Options)


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

BackendConfig = tuple["str | None", "object | None"]
GroupBuilder = Callable[
    [Sequence[torch.Tensor], Sequence[str], Sequence[BackendConfig]], Sequence["dist.ProcessGroup | None"]
]
# Live builders by serial, so a copy or an unpickled mesh *in the process that built it* finds
# its MeshGroups; weak, so a mesh nobody holds does not keep its MeshGroups alive.
_BUILDERS: dict[int, weakref.WeakMethod] = {}
_SERIALS = itertools.count(1)


def register_builder(builder: GroupBuilder) -> tuple[int, int]:
    """A token for ``builder`` (a bound method): ``(pid, serial)``, pickled with the meshes."""
    serial = next(_SERIALS)
    _BUILDERS[serial] = weakref.WeakMethod(builder)
    return (os.getpid(), serial)


def unregister_builder(token: tuple[int, int]) -> None:
    _BUILDERS.pop(token[1], None)


def _lookup(token: tuple[int, int] | None) -> GroupBuilder | None:
    if token is None or token[0] != os.getpid():
        return None
    ref = _BUILDERS.get(token[1])
    return None if ref is None else ref()


#: ``call(operation)``: the collective call (``meshgroups.collective``) that ``_flatten`` and
#: ``_unflatten`` run in, numbered before they check anything; set by ``use_collective_calls``.
CallFactory = Callable[[str], AbstractContextManager[object]]
_CALLS: list[CallFactory] = []


def use_collective_calls(factory: CallFactory) -> None:
    _CALLS[:] = [factory]


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

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        if not self._mesh_dim_names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names!")
        if isinstance(mesh_dim_names, str):
            names: tuple[str, ...] = (mesh_dim_names,)
        elif isinstance(mesh_dim_names, tuple) and all(isinstance(n, str) for n in mesh_dim_names):
            names = mesh_dim_names
        else:
            # torch would iterate b"2" into (50,) and raise KeyError: a KeyError that also says why
            raise UnknownDimError(
                f"mesh dim names must be a str or a tuple of str, got {mesh_dim_names!r}; "
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
            self._mg_builder = _lookup(self._mg_token)

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
        return _CALLS[0](operation) if _CALLS else nullcontext()

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
                f"{name!r} is already a dim of the root mesh {root._mesh_dim_names}; "
                "pick another name for the flattened dim"
            )
        layout = _MeshLayout([self._layout.collapse()])
        existing = root._flatten_mapping.get(name)
        if existing is not None:
            if existing._layout == layout:
                return existing
            raise ValueError(
                f"Flatten mesh with mesh_dim_name {name} has been created before over other dims; "
                "pick another name for the flattened dim"
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
                f"The product of mesh_sizes={tuple(mesh_sizes)} is {inner.numel()}, but dim {dim!r} has size "
                f"{self._layout[index].numel()}; they must be equal to unflatten"
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
    ) -> list[str]:
        # The groups of new dims, built in mesh order through meshgroups (never torch's sorted ones).
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
    return _new_mesh(root._device_type, layout, root._rank_map, names, root, group_names, coordinate)


def _new_mesh(
    device_type: str,
    layout: _MeshLayout,
    rank_map: torch.Tensor,
    names: tuple[str, ...],
    root: DeviceMesh | None,
    group_names: Sequence[str],
    coordinate: tuple[int, ...] | None,
) -> RootedMesh:
    """The state torch 2.13's constructor gives a mesh (``_init_backend=False``), without its
    O(world) searches: the coordinate is given (layout arithmetic), the rank-map tuple is made
    on first use (``RootedMesh._flatten_rank_map``)."""
    mesh = RootedMesh.__new__(RootedMesh)
    threaded = dist.is_initialized() and dist.get_backend() == "threaded"
    mesh.__dict__.update(
        _device_type=device_type,
        _layout=layout,
        _rank_map=rank_map,
        _mesh_dim_names=names,
        _root_mesh=root,
        _thread_id=threading.get_ident() if threaded else None,
        _flatten_mapping={},
        _pg_registry={},
        _dim_group_names=list(group_names),
        _rank=dist.get_rank(),
        _coordinate_on_dim=coordinate,
        _hash=None,
    )
    return mesh


def make_root(
    groups: Sequence[dist.ProcessGroup] | None,
    device_type: str,
    ranks: torch.Tensor,
    names: tuple[str, ...],
    coordinate: tuple[int, ...] | None,
    builder: GroupBuilder,
    token: tuple[int, int],
) -> RootedMesh:
    """The root mesh over ``ranks`` (C-contiguous) with ``groups`` (one per dim, in mesh order)
    at ``coordinate``; both ``None`` on a rank outside it. New groups come from ``builder``."""
    layout = _MeshLayout.from_sizes_strides(tuple(ranks.shape))
    group_names = [g.group_name for g in groups] if groups is not None else []
    mesh = _new_mesh(device_type, layout, ranks.reshape(-1), names, None, group_names, coordinate)
    for group in groups or ():
        mesh._pg_registry[group.group_name] = group
    mesh._mg_builder, mesh._mg_token = builder, token
    return mesh


def make_group_mesh(
    group: dist.ProcessGroup | None,
    device_type: str,
    rows: torch.Tensor,
    name: str,
    coordinate: int | None,
    builder: GroupBuilder,
    token: tuple[int, int],
) -> RootedMesh:
    """A 1-D root over one family of groups (``rows``: one group per row): this rank's group
    where it has one, else a mesh with coordinate ``None`` — what ``DeviceMesh("cpu", [0, 2])``
    is on ranks 1 and 3 when there is one row. Its rank map holds every row, so ``_flatten`` and
    ``_unflatten`` ask for the same groups on every rank."""
    layout = _MeshLayout.from_sizes_strides((rows.shape[1],), (1,))
    mesh = _new_mesh(
        device_type,
        layout,
        rows.reshape(-1).contiguous(),
        (name,),
        None,
        [group.group_name] if group is not None else [],
        None if coordinate is None else (coordinate,),
    )
    if group is not None:
        mesh._pg_registry[group.group_name] = group
    mesh._mg_builder, mesh._mg_token = builder, token
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


def flattened_dim(root: DeviceMesh, name: str) -> DeviceMesh | None:
    """The flattened dim ``name`` registered on ``root``, if any."""
    return root._flatten_mapping.get(name)


def flatten_on_root(
    root: DeviceMesh,
    dims: tuple[str, ...],
    name: str,
    group: dist.ProcessGroup | None,
    coordinate: tuple[int, ...] | None,
) -> DeviceMesh:
    """``root[dims]`` flattened as ``name`` over ``group`` (registered once; an equal
    registration is returned, a different one under the same name refused)."""
    layout = flattened_layout(root, dims)
    existing = root._flatten_mapping.get(name)
    if existing is not None:
        if existing._layout != layout:
            raise ValueError(f"flattened dim {name!r} already exists over other dims; pick another name")
        return existing
    return register_flattened(root, layout, name, group, coordinate)


def forget_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation caches (torch's debug helpers). They are keyed by mesh
    *equality*, which ignores process groups, so after a close an equal mesh built later would
    be handed cached specs naming the destroyed groups ("Could not resolve the process group")."""
    from torch.distributed.tensor import debug

    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()


def detach_builder(root: DeviceMesh | None) -> None:
    if root is not None:
        root._mg_builder = None  # type: ignore[attr-defined]


def set_group_timeout(group: dist.ProcessGroup | None, timeout: timedelta) -> None:
    """Change the timeout of ``group`` (None: the default group) after creation, what
    megatron-core's ``update_pg_timeout`` does (torch has no public API for it)."""
    _c10d._set_pg_timeout(timeout, group)
