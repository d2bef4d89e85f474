"""Building meshgroups' DeviceMeshes: a layout's root, a subset's 1-D mesh, flattened dims on a
root, and forgetting torch's caches and builders when a mesh closes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

from meshgroups.errors import torch_says
from meshgroups.mesh._torch_seam.behaviour import self_test
from meshgroups.mesh._torch_seam.builders import GroupBuilder
from meshgroups.mesh._torch_seam.rooted_mesh import (
    RootedMesh,
    flattened_layout,
    new_mesh,
    order_matters,
    register_flattened,
)


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
    self_test()
    layout = _MeshLayout.from_sizes_strides(tuple(ranks.shape))
    group_names = [g.group_name for g in groups] if groups is not None else []
    preserve = order_matters(ranks.numpy())
    mesh = new_mesh(
        device_type, layout, ranks.reshape(-1), names, None, group_names, coordinate, preserve=preserve
    )
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
    self_test()
    layout = _MeshLayout.from_sizes_strides((rows.shape[1],), (1,))
    mesh = new_mesh(
        device_type,
        layout,
        rows.reshape(-1).contiguous(),
        (name,),
        None,
        [group.group_name] if group is not None else [],
        None if coordinate is None else (coordinate,),
        preserve=order_matters(rows.numpy(), axes=(1,)),  # one group per row
    )
    if group is not None:
        mesh._pg_registry[group.group_name] = group
    mesh._mg_builder, mesh._mg_token = builder, token
    return mesh


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
            raise ValueError(
                torch_says(
                    f"flattened dim {name!r} already exists over other dims; pick another name",
                    f"Flatten mesh with mesh_dim_name {name} has been created before, "
                    "Please specify another valid mesh_dim_name.",
                )
            )
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
