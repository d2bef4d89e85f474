"""The one place that touches private ``torch.distributed`` internals (torch 2.13).

A torch upgrade that moves these names breaks this module only. Two helpers write torch state,
each for a reason the callers document: ``advance_group_count`` (re-align sequential group
names after a failed build) and ``creation_store_prefix`` (give each ``init_mesh`` call its own
store namespace, so rebuilt groups never read a previous incarnation's connection keys).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh


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


# ---------------------------------------------------------------------------------------------
# One root mesh. meshgroups hands out a single root DeviceMesh per layout; its slices, flattened
# dims and unflattened meshes must stay derived from it (TP + FSDP2 concatenate slices of one
# root) and must never get a group torch built itself: torch's _flatten/_unflatten create groups
# with sorted ranks, which on a placement whose ranks don't increase makes position != group
# rank and silently permutes DTensor data. ``RootedMesh`` is a DeviceMesh (isinstance, pickling,
# DTensor, FSDP2 and DCP see one) whose slices stay RootedMesh and whose _flatten/_unflatten ask
# meshgroups for the groups: ``builder(rows_per_dim, names)`` -> this rank's group per new dim,
# collective like torch's own calls, created in mesh order or reused.
# ---------------------------------------------------------------------------------------------

GroupBuilder = Callable[[Sequence[torch.Tensor], Sequence[str]], Sequence[dist.ProcessGroup]]
#: ``call(operation)``: the collective call (meshgroups.collective) that _flatten/_unflatten run in.
CallFactory = Callable[[str], AbstractContextManager[object]]


class RootedMesh(DeviceMesh):
    """A ``DeviceMesh`` built by meshgroups; see the comment above."""

    _mg_builder: GroupBuilder | None = None
    _mg_call: CallFactory | None = None

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        root = self._get_root_mesh()
        if self is root and len(names) == 1 and names[0] in root._flatten_mapping:
            return root._flatten_mapping[names[0]]  # a registered flattened dim, without torch's warning
        return _rooted(super().__getitem__(mesh_dim_names))

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_mg_builder", None)
        state.pop("_mg_call", None)
        return state

    def _collective(self, operation: str) -> AbstractContextManager[object]:
        call = getattr(self._get_root_mesh(), "_mg_call", None)
        return call(operation) if call is not None else nullcontext()

    def _builder(self) -> GroupBuilder:
        builder = getattr(self._get_root_mesh(), "_mg_builder", None)
        if builder is None:
            raise RuntimeError(
                "this mesh's MeshGroups was closed (or the mesh was unpickled in another process): "
                "new groups for it cannot be built"
            )
        return builder

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: object = None) -> DeviceMesh:
        with self._collective("_flatten"):  # numbered before anything is checked
            return self._flatten_in_call(mesh_dim_name, backend_override)

    def _flatten_in_call(self, mesh_dim_name: str | None, backend_override: object) -> DeviceMesh:
        if backend_override is not None:
            raise ValueError(
                "a meshgroups mesh builds its groups with the backend given to init_mesh; "
                "backend_override is not supported in _flatten"
            )
        names = tuple(self._mesh_dim_names or ())
        if not names:
            raise RuntimeError("Cannot flatten a DeviceMesh without mesh_dim_names!")
        name = mesh_dim_name or "_".join(names)
        if self.ndim == 1 and name in names:
            return self
        root = self._get_root_mesh()
        layout = _MeshLayout([self._layout.collapse()])
        existing = root._flatten_mapping.get(name)
        if existing is not None:
            if existing._layout == layout:
                return existing
            raise ValueError(
                f"flattened dim {name!r} already exists on this mesh over other dims; pick another name"
            )
        if name in (root._mesh_dim_names or ()):
            raise ValueError(f"{name!r} is already a dim of the root mesh; pick another name for _flatten")
        (group,) = self._builder()([layout.remap_to_tensor(root._rank_map)], (name,))
        return register_flattened(root, layout, name, group)

    def _init_process_groups(  # type: ignore[override]
        self,
        layout: _MeshLayout,
        rank_map: torch.Tensor,
        mesh_dim_names: tuple[str, ...] | None,
        backend_override: tuple[object, ...],
    ) -> list[str]:
        # torch's _unflatten calls this on the mesh being unflattened: build in mesh order.
        if any(b != (None, None) for b in backend_override):
            raise ValueError("backend_override is not supported on a meshgroups mesh")
        names = tuple(mesh_dim_names or (f"dim_{i}" for i in range(len(layout))))
        rows = [_MeshLayout([layout[i]]).remap_to_tensor(rank_map) for i in range(len(layout))]
        groups = self._builder()(rows, names)
        return [g.group_name for g in groups]

    def _unflatten(self, *args: object, **kwargs: object) -> DeviceMesh:
        with self._collective("_unflatten"):
            return _rooted(super()._unflatten(*args, **kwargs))  # type: ignore[arg-type]


def _rooted(mesh: DeviceMesh) -> DeviceMesh:
    # torch makes slices with its own class; keep them ours (same state, more behaviour).
    if type(mesh) is DeviceMesh:
        mesh.__class__ = RootedMesh
    return mesh


def make_root(
    groups: Sequence[dist.ProcessGroup],
    device_type: str,
    ranks: torch.Tensor,
    names: tuple[str, ...],
    builder: GroupBuilder,
    call: CallFactory | None = None,
) -> RootedMesh:
    """The root mesh over ``groups`` (one per dim, in mesh order), with meshgroups' builder."""
    mesh = _rooted(DeviceMesh.from_group(list(groups), device_type, mesh=ranks, mesh_dim_names=names))
    assert isinstance(mesh, RootedMesh)
    mesh._mg_builder = builder
    mesh._mg_call = call
    return mesh


def flattened_layout(root: DeviceMesh, names: tuple[str, ...]) -> _MeshLayout:
    return _MeshLayout([root[names]._layout.collapse()])


def register_flattened(
    root: DeviceMesh, layout: _MeshLayout, name: str, group: dist.ProcessGroup
) -> DeviceMesh:
    """A 1-D mesh over ``group`` registered on ``root`` as the flattened dim ``name``: torch's
    ``root[name]`` and ``root[dims]._flatten(name)`` then return it, and DTensor routes through it."""
    flat = RootedMesh(
        root.device_type,
        _layout=layout,
        _rank_map=root._rank_map,
        mesh_dim_names=(name,),
        _root_mesh=root,
        _init_backend=False,
    )
    flat._dim_group_names = [group.group_name]
    root._pg_registry[group.group_name] = group
    root._flatten_mapping[name] = flat
    return flat


def flattened_dim(root: DeviceMesh, name: str) -> DeviceMesh | None:
    """The flattened dim ``name`` registered on ``root``, if any."""
    return root._flatten_mapping.get(name)


def flatten_on_root(
    root: DeviceMesh, dims: tuple[str, ...], name: str, group: dist.ProcessGroup
) -> DeviceMesh:
    """``root[dims]`` flattened as ``name`` over ``group`` (registered once; an equal
    registration is returned, a different one under the same name refused)."""
    layout = flattened_layout(root, dims)
    existing = root._flatten_mapping.get(name)
    if existing is not None:
        if existing._layout != layout:
            raise ValueError(f"flattened dim {name!r} already exists over other dims; pick another name")
        return existing
    return register_flattened(root, layout, name, group)


def detach_builder(root: DeviceMesh | None) -> None:
    if root is not None:
        root._mg_builder = None  # type: ignore[attr-defined]
