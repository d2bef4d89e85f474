"""What meshgroups reads from torch modules (local, no collective but ``module_weights``'s gather).

**Their tensors** (:func:`read`): a module's parameters and persistent buffers
(:func:`module_tensors`), each rank's local tensors (a DTensor's local shard, detached: the same
storage) and what a plan depends on (:func:`describe`: names, shapes, dtypes, placements and
meshes, no data) — what ``WeightSync`` reads each step; :func:`check_buffers` holds a rollout's
local tensors against the shapes a plan writes::

    >>> describe({"w": torch.zeros(2, 3)})
    (('w', (2, 3), torch.float32),)

**Where their weights live** (:func:`module_weights`, :func:`local_weights`): ``Weight``
placements read from DTensor parameters. FSDP2 + TP parameters are DTensors on a slice of the
trainer's root mesh: ``param.device_mesh`` names the dims, ``param.placements`` says how each
shards the tensor. ``module_weights`` turns them into ``Weight`` objects on the trainer's
``Layout`` (mesh dim names mapped to layout dims), gathers every rank's (pipeline stages hold
different weights, :func:`merge`) and keeps this rank's local shards (``src =
module_weights(model, layout)``, then ``plan_transfer(src.layout, src.weights, ...)`` and
``execute(plan, src.tensors, ...)``).

torch's FSDP2 shards a tensor axis that TP already shards *after* TP (``_StridedShard`` on the
FSDP dim), the reverse of DTensor's mesh order; such a weight gets ``shard_order=("tp",
"dp_shard")``, and so does any weight whose mesh nests dims in another order than the layout.
Plain tensors (not DTensors) are replicated over the layout, or over their pipeline stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.mesh import StridedShard as _StridedShard
from meshgroups.transfer._spec import Box, Placement, Replicate, Shard, Weight, dtype_name

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


@dataclass
class ModuleWeights:
    """A module's weights on ``layout``: ``weights`` (every rank's, gathered, the same list on
    every rank) and ``tensors``, this rank's local shards by name."""

    layout: Layout
    weights: list[Weight]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _check_mesh(name: str, param: DTensor, layout: Layout, dims: tuple[str, ...], rank: int) -> None:
    """The DTensor's mesh must be this rank's group of ``dims`` in the layout (any dim order)."""
    got = param.device_mesh.mesh.detach().cpu().numpy()
    coords = layout.coords(rank)
    index = tuple(slice(None) if d in dims else coords[d] for d in layout.names)
    in_layout_order = [d for d in layout.names if d in dims]
    want = np.transpose(layout.grid[index], [in_layout_order.index(d) for d in dims])
    if got.shape != want.shape or not np.array_equal(got, want):
        raise LayoutError(
            f"parameter {name!r}: its DeviceMesh over {dims} holds ranks {got.tolist()}, but the layout's "
            f"{dims} group of rank {rank} is {want.tolist()}; pass the layout the mesh was built from"
        )


def _placements(
    name: str, param: DTensor, names: tuple[str, ...], sizes: tuple[int, ...], layout: Layout
) -> tuple[dict[str, Placement], tuple[str, ...] | None]:
    """Placements by layout dim, and the ``shard_order`` torch's nesting needs (``None`` when
    every axis splits in layout order)."""
    placements: dict[str, Placement] = {}
    per_axis: dict[int, list[tuple[int, int]]] = {}  # axis -> [(mesh index, split factor)]
    for i, p in enumerate(param.placements):
        if isinstance(p, _StridedShard):
            placements[names[i]] = Shard(p.dim)
            per_axis.setdefault(p.dim, []).append((i, int(p.split_factor)))
        elif isinstance(p, TorchShard):
            placements[names[i]] = Shard(p.dim)
            per_axis.setdefault(p.dim, []).append((i, 1))
        elif isinstance(p, TorchReplicate):
            placements[names[i]] = Replicate()
        else:
            raise LayoutError(
                f"parameter {name!r}: placement {p!r} on mesh dim {names[i]!r} holds no complete values "
                "(only Shard, _StridedShard and Replicate can be transferred); redistribute it first"
            )
    order: list[str] = []
    for axis, dims in per_axis.items():
        nested = [i for i, _ in dims]  # DTensor: mesh order
        for pos, (i, factor) in enumerate(dims):
            if factor == 1:
                continue
            # _StridedShard(sf): the next same-axis dims, whose sizes multiply to sf, split first
            prod, k = 1, pos + 1
            while k < len(dims) and prod < factor:
                prod *= sizes[dims[k][0]]
                k += 1
            if prod != factor:
                raise LayoutError(
                    f"parameter {name!r}: _StridedShard(dim={axis}, split_factor={factor}) on {names[i]!r} "
                    "does not match the sizes of the later dims sharding that axis; unsupported placement"
                )
            nested.remove(i)
            nested.insert(nested.index(dims[k - 1][0]) + 1, i)
        dims_in_order = [names[i] for i in nested]
        if dims_in_order != sorted(dims_in_order, key=layout.names.index):
            order += dims_in_order
    return placements, tuple(order) or None


def local_weights(
    module: torch.nn.Module | Mapping[str, Any] | None,
    layout: Layout,
    *,
    dims: Mapping[str, str] | None = None,
    stage_dim: str | None = "pp",
) -> tuple[list[Weight], dict[str, torch.Tensor]]:
    """This rank's weights and local shards (no collective).

    ``module``: an ``nn.Module`` (its parameters and persistent buffers) or a ``{name: tensor}`` mapping such
    as a state dict; ``None`` on a rank that holds none. ``dims`` renames mesh dims to layout dims
    (``{"dp_shard": "dp"}``). When ``stage_dim`` is a layout dim the DTensor meshes do not
    cover, each weight lives on this rank's stage only (``stage=("pp", k)``).

    Returns:
        ``(weights, tensors)``: this rank's ``Weight`` list and its local shards by name.

    Raises:
        ValueError: a DTensor whose mesh is not the layout's group of this rank, a
            ``Partial`` placement, a dim missing from ``layout`` (``TypeError`` for a wrong type).

    Plain tensors live whole on every rank (one-process world here)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import local_weights
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> weights, tensors = local_weights(torch.nn.Linear(3, 2), Layout(dp=1))
        >>> [(w.name, w.shape, dict(w.placements)) for w in weights], list(tensors)
        ([('weight', (2, 3), {}), ('bias', (2,), {})], ['weight', 'bias'])
        >>> dist.destroy_process_group()
    """
    if module is None:
        return [], {}
    rank = dist.get_rank()
    if rank not in layout:
        raise LayoutError(f"rank {rank} passed a module but is not in the layout {layout!r}; pass None there")
    items = module_tensors(module) if isinstance(module, torch.nn.Module) else module.items()
    rename = dict(dims or {})
    coords = layout.coords(rank)
    weights: list[Weight] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, t in items:
        if isinstance(t, DTensor):
            mesh_names = t.device_mesh.mesh_dim_names or ()
            mapped = tuple(rename.get(d, d) for d in mesh_names)
            unknown = [d for d in mapped if d not in layout.names]
            if not mesh_names or unknown:
                raise LayoutError(
                    f"parameter {name!r}: mesh dim {(unknown or ['(unnamed)'])[0]!r} is not a dim of the layout "
                    f"({', '.join(layout.names)}); map it with dims={{mesh dim: layout dim}}, or for a flattened "
                    "mesh dim (dp_cp) pass the layout flattened alike (layout.flatten('dp', 'cp'))"
                )
            _check_mesh(name, t, layout, mapped, rank)
            shape = tuple(t.device_mesh.mesh.shape)
            placements, order = _placements(name, t, mapped, shape, layout)
            local = t.to_local()
        else:
            mapped, placements, order, local = (), {}, None, t
        stage = None
        if stage_dim is not None and stage_dim in layout.names and stage_dim not in mapped:
            stage = (stage_dim, coords[stage_dim])
        weights.append(Weight(name, tuple(t.shape), dtype_name(local.dtype), placements, stage, order))
        tensors[name] = local.detach()
    return weights, tensors


def module_weights(
    module: torch.nn.Module | Mapping[str, Any] | None,
    layout: Layout,
    *,
    dims: Mapping[str, str] | None = None,
    stage_dim: str | None = "pp",
    group: dist.ProcessGroup | None = None,
) -> ModuleWeights:
    """Collective (``group``, default the world; ranks without a part pass ``module=None``):
    every rank's ``local_weights`` gathered into one list (first seen in rank order), checked
    to agree where two ranks describe the same weight.

    Args:
        module: as for ``local_weights``.
        layout: the layout the weights live on.
        dims: as for ``local_weights``.
        stage_dim: as for ``local_weights``.
        group: the ranks taking part (default: the world).

    Returns:
        A ``ModuleWeights`` with every rank's weights and this rank's tensors.

    On a one-process world (in a job, every rank of the world calls it)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import module_weights
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> src = module_weights(torch.nn.Linear(3, 2), Layout(dp=1))
        >>> [w.name for w in src.weights], list(src.tensors), src.layout
        (['weight', 'bias'], ['weight', 'bias'], Layout(dp=1))
        >>> dist.destroy_process_group()

    Raises:
        ValueError: two ranks describe one weight differently; what ``local_weights`` raises.
    """
    weights, tensors = local_weights(module, layout, dims=dims, stage_dim=stage_dim)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, weights, group=group)
    return ModuleWeights(layout, merge(gathered), tensors)


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
    "ModuleWeights",
    "Tensors",
    "check_buffers",
    "describe",
    "local_tensors",
    "local_weights",
    "merge",
    "module_tensors",
    "module_weights",
    "read",
    "slices",
]
