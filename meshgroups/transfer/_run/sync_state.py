"""What ``WeightSync`` reads from a module each step: its local tensors, and what a plan depends
on (torch side; local, no collective)::

    >>> import torch
    >>> describe({"w": torch.zeros(2, 3)})
    (('w', (2, 3), torch.float32),)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from meshgroups.errors import LayoutError
from meshgroups.transfer._spec import Box, Weight

if TYPE_CHECKING:
    from meshgroups.transfer._plan.plan import TransferPlan

#: A module (its parameters and persistent buffers), a ``{name: tensor}`` mapping, or ``None`` (no part here).
Tensors = torch.nn.Module | Mapping[str, Any] | None


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's tensors a checkpoint holds: its parameters (``named_parameters``: a tied one
    once) and then its *persistent* buffers (a router's correction bias, a running statistic):
    coverage that read parameters only would miss them. Non-persistent buffers (a rotary cache)
    are derived, not state.

    >>> m = torch.nn.BatchNorm1d(2)
    >>> [n for n, _ in module_tensors(m)]
    ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    out: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    for owner, mod in module.named_modules():
        for leaf, buf in mod._buffers.items():
            if buf is not None and leaf not in mod._non_persistent_buffers_set:
                out.append((f"{owner}.{leaf}" if owner else leaf, buf))
    return out


def _items(obj: Tensors) -> list[tuple[str, Any]]:
    if obj is None:
        return []
    if isinstance(obj, torch.nn.Module):
        return module_tensors(obj)
    if isinstance(obj, Mapping):
        return list(obj.items())
    raise TypeError(f"expected an nn.Module, a mapping name -> tensor or None, got {type(obj).__name__}")


def read(obj: Tensors) -> tuple[tuple[object, ...], dict[str, torch.Tensor]]:
    """One pass over ``obj``: what a plan depends on (see :func:`describe`) and its local
    tensors (see :func:`local_tensors`)."""
    meshes: dict[int, tuple[object, ...]] = {}
    described: list[object] = []
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # to_local() without autograd bookkeeping; detach() keeps the storage
        for name, t in _items(obj):
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                if id(mesh) not in meshes:  # a mesh is shared by many parameters
                    meshes[id(mesh)] = (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()), mesh)
                local = t.to_local()
                key = meshes[id(mesh)][:2]
                described.append(
                    (name, tuple(t.shape), t.dtype, tuple(local.shape), tuple(t.placements), key)
                )
            elif isinstance(t, torch.Tensor):
                local = t
                described.append((name, tuple(t.shape), t.dtype))
            else:
                raise TypeError(f"{name!r} must be a tensor, got {type(t).__name__}")
            tensors[name] = local.detach()
    return tuple(described), tensors


def local_tensors(obj: Tensors) -> dict[str, torch.Tensor]:
    """``{name: local tensor}`` (a DTensor's local shard), detached: same storage, so writing
    it writes the parameter."""
    return read(obj)[1]


def describe(obj: Tensors) -> tuple[object, ...]:
    """What a plan depends on, per tensor: name, shape, dtype, and for a DTensor its local
    shape, placements and mesh (dim names and ranks). Local: compared with this rank's earlier
    value only (no data is read)."""
    return read(obj)[0]


def slices(box: Box) -> tuple[slice, ...]:
    """``box`` (``(start, stop)`` per axis) as the index that cuts it out of a tensor."""
    return tuple(slice(a, b) for a, b in box)


def merge(parts: Sequence[Sequence[Weight]], side: str = "") -> list[Weight]:
    """Every rank's weights of one side, first seen in rank order; two ranks describing one
    weight differently is an error (``side``, e.g. ``"trainer"``, names the side in it)."""
    merged: dict[str, Weight] = {}
    for part in parts:
        for w in part:
            seen = merged.setdefault(w.name, w)
            if seen != w:
                which = f"{side} weight" if side else "weight"
                raise LayoutError(f"ranks describe {which} {w.name!r} differently: {seen} and {w}")
    return list(merged.values())


def check_buffers(plan: TransferPlan, me: int, have: Mapping[str, torch.Tensor]) -> None:
    """Each rollout tensor this rank holds has the local shape the plan writes (for a fused
    weight: its parts' local extents one after another), and every one is there."""
    if plan.mapping is None:  # an invariant of WeightSync, not a check of user input
        raise RuntimeError("meshgroups internal error: plan.mapping is None")
    for name in dict.fromkeys(link.rollout for link in plan.mapping.links.values()):
        want = plan.mapping.buffer_shape(name, me)
        if want is None:
            continue
        if name not in have:
            raise LayoutError(f"rank {me}: the rollout has no tensor {name!r}; the plan writes {want} of it")
        if tuple(have[name].shape) != want:
            raise LayoutError(
                f"rank {me}: rollout tensor {name!r} has local shape {tuple(have[name].shape)}, but its "
                f"layout gives this rank {want}; check rollout_weights / the rollout's placements"
            )


__all__ = [
    "Tensors",
    "check_buffers",
    "describe",
    "local_tensors",
    "merge",
    "module_tensors",
    "read",
    "slices",
]
