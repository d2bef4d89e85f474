"""The ``DeviceMesh``es of one ``MeshGroups``: the root mesh of its layout and of each view (built
on first use from the groups already created), subset meshes, flattened dims registered on a
root, and the builder torch's own ``_flatten``/``_unflatten`` call on them — so every group they
need comes from meshgroups' families, in mesh order. The private torch calls are in
``_torch_seam``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh._build import check_new_name
from meshgroups.mesh._families import Families
from meshgroups.mesh._torch_seam import (
    BackendConfig,
    detach_builder,
    flatten_on_root,
    make_group_mesh,
    make_root,
    register_builder,
    unregister_builder,
)


class RootMeshes:
    """The roots (main layout, views, subsets) of one layout's families; see the module
    docstring. Registered as the builder of its meshes until :meth:`close`."""

    def __init__(self, layout: Layout, device_type: str, families: Families) -> None:
        self.layout, self.device_type, self.families = layout, device_type, families
        self._roots: dict[str | None, DeviceMesh] = {}  # None: the main layout; else a view
        self._subsets: dict[str, DeviceMesh] = {}
        self._closed = False
        # How copies and unpickled meshes of this process find these families (weakly).
        self.token = register_builder(self.build_for_torch)

    def root(self, owner: Layout) -> DeviceMesh:
        """The root mesh of ``owner``: the main layout or one of its views (by identity)."""
        name = None if owner is self.layout else next(n for n, v in self.layout.views.items() if v is owner)
        if name not in self._roots:
            self._roots[name] = self._build_root(owner)
        return self._roots[name]

    def _build_root(self, layout: Layout) -> DeviceMesh:
        handles = self.families.handles
        missing = [d for d in layout.names if (d,) not in handles]
        if missing:
            raise MeshConfigError(
                f"a DeviceMesh needs the groups of every dim, but {', '.join(missing)} were not built "
                "(init_mesh was called with only=...)"
            )
        rank = dist.get_rank()
        coords = layout.coords(rank) if rank in layout else None
        groups = None if coords is None else [handles[(d,)].group for d in layout.names]
        root = make_root(
            cast("list[dist.ProcessGroup] | None", groups),
            self.device_type,
            # int32, what torch keeps as its rank map: built once, taken without a copy
            torch.from_numpy(layout.grid_as(np.int32)),
            layout.names,
            None if coords is None else tuple(coords[d] for d in layout.names),
            self.build_for_torch,
            self.token,
        )
        for key, handle in handles.items():
            if isinstance(key, tuple) and len(key) > 1 and all(d in layout.names for d in key):
                if self.layout.resolve(*key) is layout:
                    flatten_on_root(
                        root, key, "_".join(key), handle.group, flat_position(layout, key, coords)
                    )
        return root

    def flattened(self, owner: Layout, key: tuple[str, ...], label: str) -> DeviceMesh:
        """Register the built family ``key`` of ``owner`` on its root as ``label``; the 1-D mesh."""
        rank = dist.get_rank()
        coords = owner.coords(rank) if rank in owner else None
        group = self.families.handles[key].group
        return flatten_on_root(self.root(owner), key, label, group, flat_position(owner, key, coords))

    def subset(self, name: str) -> DeviceMesh:
        """The 1-D mesh over the subset ``name``'s groups (a root of its own)."""
        if name not in self._subsets:
            handle, spec = self.families.handles[name], self.families.subsets[name]
            self._subsets[name] = make_group_mesh(
                handle.group,
                self.device_type,
                torch.from_numpy(np.ascontiguousarray(spec.layout.groups(*spec.dims), dtype=np.int32)),
                name,
                None if handle.ranks is None else handle.ranks.index(dist.get_rank()),
                self.build_for_torch,
                self.token,
            )
        return self._subsets[name]

    def build_for_torch(
        self,
        rows_per_dim: Sequence[torch.Tensor],
        names: Sequence[str],
        backends: Sequence[BackendConfig] = (),
    ) -> list[dist.ProcessGroup | None]:
        """torch's ``_flatten``/``_unflatten`` on one of our meshes: a collective build of each
        new dim's groups (rows in mesh order; ``backends``: torch's normalised
        ``backend_override``), reusing equal groups. ``None`` where this rank is in no row."""
        if self._closed:
            raise RuntimeError("this MeshGroups was closed; its process groups are destroyed")
        for name in names:
            check_new_name(name, ())
        groups = []
        for i, (rows, name) in enumerate(zip(rows_per_dim, names)):
            grid = np.asarray(rows.cpu().numpy(), dtype=np.int64)
            override = backends[i] if i < len(backends) else (None, None)
            handle = self.families.add(
                Layout.from_grid(grid, ("group", "member")), ("member",), name, override
            )
            groups.append(handle.group)
        return groups

    def close(self) -> None:
        """Stop building for these meshes and detach them (their groups are the families')."""
        self._closed = True
        unregister_builder(self.token)
        for root in [*self._roots.values(), *self._subsets.values()]:
            detach_builder(root)
        self._roots.clear()
        self._subsets.clear()


def flat_position(
    layout: Layout, key: tuple[str, ...], coords: Mapping[str, int] | None
) -> tuple[int, ...] | None:
    """This rank's coordinate on the flattened dim ``key`` (row-major over ``key``), O(ndim)."""
    if coords is None:
        return None
    position = 0
    for d in key:
        position = position * layout.size(d) + coords[d]
    return (position,)
