"""A behavioural check of the seam, run once at first use: what a list of names cannot see.

meshgroups builds its meshes by writing torch's private fields (``rooted_mesh.new_mesh``). A new
torch may keep every name and still change what the fields mean, or read one more of them in
``__hash__``/``__eq__`` (torch 2.15's ``_preserve_rank_order`` did: every name check passed and
every DTensor failed). So, before the first mesh is built, a meshgroups mesh over a small
permuted layout is compared with a twin built by torch's own constructor over the same ranks:
equality and hash (what DTensor, ``fully_shard`` and redistribute key on), the rank map against
``Layout``'s grid, each dim sliced by torch's own ``__getitem__`` on the twin and by meshgroups'
on ours, and a flattened dim. No process group is created (``_init_backend=False``, group names
that are never resolved), so it costs about a millisecond; it needs an initialised default group
only for this process's rank, which torch's slicing reads (the fake backend serves in tests).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

from meshgroups.layout import Layout
from meshgroups.mesh._torch_seam.internals import refuse
from meshgroups.mesh._torch_seam.rooted_mesh import (
    flattened_layout,
    new_mesh,
    order_matters,
    register_flattened,
)

#: The layouts the self-test builds: 2 x 3 ranks, row-major and with the ``b`` dim permuted (its
#: ranks do not increase: torch >= 2.15's ``preserve_rank_order``), each shifted by a multiple of 6
#: to hold this process's rank.
GRIDS = (np.arange(6).reshape(2, 3), np.array([[2, 0, 1], [5, 3, 4]]))
NAMES = ("a", "b")

MeshMaker = Callable[..., DeviceMesh]


def _torch_mesh(
    layout: _MeshLayout, rank_map: torch.Tensor, names: tuple[str, ...], preserve: bool, **extra: Any
) -> DeviceMesh:
    """A mesh from torch's own constructor with no process group."""
    if "preserve_rank_order" in inspect.signature(DeviceMesh.__init__).parameters:
        extra["preserve_rank_order"] = preserve
    twin = DeviceMesh(
        "cpu",
        _layout=layout,
        _rank_map=rank_map,
        mesh_dim_names=names,
        _init_backend=False,
        **extra,
    )
    # names only: slicing copies them, nothing here resolves them
    twin._dim_group_names = [f"g_{n}" for n in names]  # type: ignore[misc]
    return twin


def _compare(label: str, ours: DeviceMesh, twin: DeviceMesh, expected: np.ndarray) -> list[str]:
    problems = []
    try:
        if ours != twin or twin != ours:
            problems.append(f"{label}: a meshgroups mesh is not equal to torch's mesh over the same ranks")
        if hash(ours) != hash(twin):
            problems.append(f"{label}: a meshgroups mesh hashes differently from torch's over the same ranks")
    except Exception as e:  # whatever torch's __eq__/__hash__ raise on a mesh missing a field
        problems.append(f"{label}: comparing with torch's mesh raised {type(e).__name__}: {e}")
    for name, mesh in (("meshgroups", ours), ("torch", twin)):
        try:
            got = mesh.mesh.numpy()
        except Exception as e:
            problems.append(f"{label}: the {name} mesh's ranks raised {type(e).__name__}: {e}")
            continue
        if got.shape != expected.shape or (got != expected).any():
            problems.append(
                f"{label}: the {name} mesh holds ranks {got.tolist()}, Layout says {expected.tolist()}"
            )
    return problems


def differences(make: MeshMaker = new_mesh) -> list[str]:
    """What differs between meshgroups' meshes (built by ``make``, with ``new_mesh``'s signature)
    and torch's over each of ``GRIDS``: empty when the seam fits this torch. Needs a default group.

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> dist.init_process_group("fake", store=FakeStore(), rank=4, world_size=8)
    >>> differences()
    []
    >>> dist.destroy_process_group()
    """
    rank = dist.get_rank()
    return [
        problem
        for grid in GRIDS
        for problem in _differences(make, grid + grid.size * (rank // grid.size), rank)
    ]


def _differences(make: MeshMaker, grid: np.ndarray, rank: int) -> list[str]:
    preserve = order_matters(grid)
    layout = Layout.from_grid(grid, NAMES)
    coords = layout.coords(rank)
    mesh_layout = _MeshLayout.from_sizes_strides(grid.shape)
    rank_map = torch.from_numpy(grid.astype(np.int32).reshape(-1))
    try:
        root = make(
            "cpu",
            mesh_layout,
            rank_map,
            NAMES,
            None,
            [f"g_{n}" for n in NAMES],
            tuple(coords[n] for n in NAMES),
            preserve=preserve,
            rank=rank,
        )
    except Exception as e:
        return [f"{grid.tolist()}: building a mesh raised {type(e).__name__}: {e}"]
    twin = _torch_mesh(mesh_layout, rank_map, NAMES, preserve)
    label = f"{grid.tolist()}: "
    problems = _compare(f"{label}the root", root, twin, grid)
    for name in NAMES:
        try:
            ours, theirs = root[name], twin[name]
        except Exception as e:
            problems.append(f"{label}slicing {name!r} raised {type(e).__name__}: {e}")
            continue
        problems += _compare(f"{label}the slice {name!r}", ours, theirs, layout.group_of(rank, name))
    try:
        flat = flattened_layout(root, NAMES)
        ours = register_flattened(root, flat, "ab", None, (int(np.flatnonzero(grid.reshape(-1) == rank)[0]),))
    except Exception as e:
        return [*problems, f"{label}registering a flattened dim raised {type(e).__name__}: {e}"]
    theirs = _torch_mesh(flat, rank_map, ("ab",), preserve, _root_mesh=twin)  # torch's _flatten
    problems += _compare(f"{label}the flattened dim 'ab'", ours, theirs, layout.group_of(rank, *NAMES))
    return problems


@functools.cache
def self_test() -> None:
    """Run ``differences()`` once per process; raise ``TorchInternalsError`` naming what differs.

    Raises:
        TorchInternalsError: this torch's DeviceMesh does not behave as the seam expects.
    """
    problems = differences()
    if problems:
        raise refuse("the seam's self-test failed: " + "; ".join(problems))


__all__ = ["differences", "self_test"]
