"""Heal: fill new replicas' parameters and optimizer state from the surviving replicas.

A replica admitted by ``Elastic.grow`` has the model and optimizer built on the new mesh but
holds no values. ``fill_replicas`` moves them with the weight-transfer machinery of RL
(``plan_transfer`` + ``TransferGroups`` + ``execute``): the source layout is the grown layout's
old replicas, the destination its new ones, every tensor placed as its DTensor says. One code
path: the plan picks the senders (fewest cross-node bytes, even send load), the transfer
checks shapes, dtypes and pairing, and a failure is a ``TransferError`` on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout, Topology
from meshgroups.mesh import current_cohort
from meshgroups.transfer import (
    DEFAULT_BUCKET_BYTES,
    Report,
    TransferGroups,
    Weight,
    execute,
    local_weights,
    plan_transfer,
)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{name: tensor}``: the model's parameters (DTensors as they are) and, per parameter,
    each tensor of its optimizer state as ``<param>.<key>`` (a 0-dim tensor such as Adam's
    ``step`` as a 1-element view, so writing it writes the state). Every rank of one model
    gets the same names once the optimizer state exists (see ``init_optimizer_state``).

    After a step that failed inside ``forward()`` or ``backward()``, FSDP2 still holds the
    failed step's unsharded parameters: call ``reset_iter_state()`` on the root FSDP module
    first (torch's recovery call), or a model whose parameters are none of the optimizer's is
    refused here (``ValueError``) rather than read without its optimizer state::

        >>> import torch
        >>> from meshgroups.elastic import init_optimizer_state, training_state
        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> init_optimizer_state(model, optimizer)
        >>> sorted(training_state(model, optimizer))
        ['weight', 'weight.exp_avg', 'weight.exp_avg_sq', 'weight.step']
    """
    out: dict[str, Any] = dict(model.named_parameters())
    if optimizer is not None and optimizer.state and not any(p in optimizer.state for p in out.values()):
        raise ValueError(
            f"the optimizer holds state for {len(optimizer.state)} parameter(s), none of them one of the "
            "model's: the model's registered parameters are not the optimizer's. After a step that failed "
            "inside forward() or backward(), FSDP2 still holds the unsharded parameters: call "
            "reset_iter_state() on the root FSDP module first"
        )
    if optimizer is not None:
        for name, param in model.named_parameters():
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    out[f"{name}.{key}"] = value.view(1) if value.dim() == 0 else value
    return out


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give a new replica's optimizer its state tensors (one step on zero gradients), so they
    exist to be filled; the values it writes are overwritten by ``fill_replicas``. Local::

        >>> import torch
        >>> from meshgroups.elastic import init_optimizer_state
        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> init_optimizer_state(model, optimizer)
        >>> sorted(optimizer.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _covered_dims(t: Any) -> tuple[str, ...]:
    """The layout dims a tensor's placement names: a DTensor's mesh dims, none for a plain tensor."""
    if isinstance(t, DTensor):
        return tuple(t.device_mesh.mesh_dim_names or ())
    return ()


def _stage_dims(layout: Layout, dim: str, covered: Sequence[str]) -> tuple[str, ...]:
    """The dims along which a tensor's values may differ although its placement does not say
    so: every dim of ``layout`` other than the replica dim, not covered, of size > 1."""
    return tuple(d for d in layout.names if d != dim and d not in covered and layout.size(d) > 1)


def _stage_of(layout: Layout, rank: int, stage_dims: Sequence[str]) -> tuple[int, ...]:
    coords = layout.coords(rank)
    return tuple(coords[d] for d in stage_dims)


def _describe(stage_dims: Sequence[str], stage: Sequence[int]) -> str:
    return ", ".join(f"{d}={i}" for d, i in zip(stage_dims, stage)) or "(every rank)"


class _HealGroup:
    """The weights healed by one transfer: those whose values may differ along the same dims."""

    def __init__(self, layout: Layout, dim: str, stage_dims: tuple[str, ...]) -> None:
        self.stage_dims = stage_dims
        if not stage_dims:
            self.layout, self.stage_name = layout, None
        elif len(stage_dims) == 1:
            self.layout, self.stage_name = layout, stage_dims[0]
        else:  # several dims: one flattened stage dim, so a Weight's stage names all of them
            name = "heal_stage"
            while name in layout.names:
                name += "_"
            self.layout, self.stage_name = layout.flatten(*stage_dims, name=name), name
        self.weights: dict[str, Weight] = {}  # planned name -> Weight on self.layout
        self.names: dict[str, str] = {}  # planned name -> the state's name

    def key(self, name: str, stage: tuple[int, ...]) -> str:
        return name if not self.stage_dims else f"{name}@{_describe(self.stage_dims, stage)}"

    def stage_index(self, rank: int) -> int:
        return self.layout.coords(rank)[self.stage_name] if self.stage_name is not None else 0


def _gather(entries: dict[str, tuple[tuple[str, ...], Weight]]) -> list[tuple[int, dict[str, Any]] | None]:
    """Every cohort rank's ``(rank, {name: (covered dims, Weight)})``: the survivors' and the
    new replicas' names, so every rank derives the same transfers (and the same refusals)."""
    cohort = current_cohort()
    size = len(cohort.members) if cohort is not None else dist.get_world_size()
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, (dist.get_rank(), entries), group=cohort.group if cohort else None)
    return gathered


def _heal_groups(
    layout: Layout, dim: str, gathered: Sequence[tuple[int, dict[str, Any]] | None]
) -> list[_HealGroup]:
    """The transfers to run, in the same order on every rank; refuses (``ValueError``) every
    weight that cannot be placed by the rule of ``fill_replicas``."""
    held: dict[str, dict[int, tuple[tuple[str, ...], Weight]]] = {}
    for part in gathered:
        if part is None:
            continue
        rank, entries = part
        if rank not in layout:
            continue
        for name, entry in entries.items():
            held.setdefault(name, {})[rank] = entry
    groups: dict[tuple[str, ...], _HealGroup] = {}
    all_ranks = [int(r) for r in layout.grid.ravel()]
    ranks_by_stage: dict[tuple[str, ...], dict[tuple[int, ...], list[int]]] = {}
    for name in sorted(held):
        by_rank = held[name]
        first_rank = min(by_rank)
        covered = by_rank[first_rank][0]
        for rank, (cov, _) in sorted(by_rank.items()):
            if cov != covered:
                raise ValueError(
                    f"fill_replicas: {name!r} is placed over mesh dims {list(cov)} on rank {rank} but over "
                    f"{list(covered)} on rank {first_rank}; a weight's DTensor mesh must cover the same dims on "
                    "every rank"
                )
        stage_dims = _stage_dims(layout, dim, covered)
        group = groups.get(stage_dims) or groups.setdefault(stage_dims, _HealGroup(layout, dim, stage_dims))
        if stage_dims not in ranks_by_stage:  # once per set of stage dims, not per weight
            stages: dict[tuple[int, ...], list[int]] = {}
            for rank in all_ranks:
                stages.setdefault(_stage_of(layout, rank, stage_dims), []).append(rank)
            ranks_by_stage[stage_dims] = stages
        stages = ranks_by_stage[stage_dims]
        for stage, ranks in sorted(stages.items()):
            holders = [r for r in ranks if r in by_rank]
            if not holders:
                continue  # a stage-specific name: this stage holds none of it
            lacking = [r for r in ranks if r not in by_rank]
            if lacking:
                raise ValueError(
                    f"fill_replicas: {name!r} is held on rank(s) {holders[:4]} at {_describe(stage_dims, stage)} "
                    f"but not on rank(s) {lacking[:4]} there; every rank at a weight's coordinates on the dims "
                    f"its mesh does not cover ({', '.join(stage_dims) or 'none'}) must hold it, so that a new "
                    "replica's rank receives exactly the state of the survivors at its own coordinates"
                )
            ref = by_rank[holders[0]][1]
            for r in holders[1:]:
                w = by_rank[r][1]
                if (w.shape, w.dtype, dict(w.placements), w.shard_order) != (
                    ref.shape,
                    ref.dtype,
                    dict(ref.placements),
                    ref.shard_order,
                ):
                    raise ValueError(
                        f"fill_replicas: {name!r} at {_describe(stage_dims, stage)} is {w.shape} {w.dtype} "
                        f"{dict(w.placements)} on rank {r} but {ref.shape} {ref.dtype} {dict(ref.placements)} on rank "
                        f"{holders[0]}; the ranks of one stage must describe a weight alike"
                    )
            key = group.key(name, stage)
            stage_at = None if group.stage_name is None else (group.stage_name, group.stage_index(holders[0]))
            group.weights[key] = Weight(key, ref.shape, ref.dtype, ref.placements, stage_at, ref.shard_order)
            group.names[key] = name
    return [groups[k] for k in sorted(groups)]


def fill_replicas(
    layout: Layout,
    dim: str,
    new: Sequence[int],
    state: Mapping[str, Any],
    *,
    topology: Topology | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: timedelta | float | None = None,
) -> Report:
    """Copy ``state`` from the replicas of ``layout`` along ``dim`` not in ``new`` (indices) into
    those in ``new``. Collective over every rank of ``layout`` (the current cohort); each
    passes its own ``state`` (``training_state``).

    The rule: a new replica's rank receives exactly the state of the surviving ranks at its
    own coordinates on every dim other than ``dim``. A tensor's DTensor placement says how it
    is split over the dims its mesh covers; along every other dim of size > 1 (``pp`` when
    each stage's module has its own mesh, or a plain tensor's every dim) nothing is inferred:
    its values are taken to differ, and each stage is healed from the same stage. So stage-specific
    names (``layers.0.w`` on stage 0 only) work, and a name shared by every stage is healed
    stage by stage, never from another stage's copy. Weights whose values may differ along the
    same dims share one transfer (the planner's stage dim, flattened when there are several).

    Returns:
        this rank's transfer ``Report`` (the sum over the transfers, ``weights`` by state name).

    Raises:
        MeshConfigError: ``new`` empty, out of range, or every replica.
        ValueError: on every rank alike, for a weight that cannot be placed by the rule: held by
            some but not all ranks at its coordinates (a new replica's model lacks a weight the
            survivors have, or the other way round), described differently by two ranks of one
            stage, or placed over different mesh dims on different ranks.
        TransferError: on every rank, when any rank failed (see ``execute``).

    On every rank of the job, after ``Elastic.grow`` admitted new replicas (a world of several
    processes: not run here)::

        >>> init_optimizer_state(model, optimizer)  # the new replicas' ranks  # doctest: +SKIP
        >>> state = training_state(model, optimizer)  # doctest: +SKIP
        >>> report = fill_replicas(el.layout, el.dim, el.grown, state)  # doctest: +SKIP
    """
    size = layout.size(dim)
    fresh = sorted({int(i) for i in new})
    if not fresh or fresh[0] < 0 or fresh[-1] >= size or len(fresh) == size:
        raise MeshConfigError(
            f"new replicas {list(new)} must be some (not all) of the {size} indices of {dim!r}"
        )
    old = [i for i in range(size) if i not in fresh]
    described, tensors = local_weights(state, layout, stage_dim=None)
    covered = {name: _covered_dims(t) for name, t in state.items()}
    entries = {w.name: (covered[w.name], w) for w in described}
    groups = _heal_groups(layout, dim, _gather(entries))
    me = dist.get_rank()
    total = Report()
    for group in groups:
        src, dst = group.layout.select(dim, old), group.layout.select(dim, fresh)
        weights = list(group.weights.values())
        mine: dict[str, Any] = {}
        if me in layout:
            stage = _stage_of(layout, me, group.stage_dims)
            for name, tensor in tensors.items():
                key = group.key(name, stage)
                if group.names.get(key) == name:
                    mine[key] = tensor
        plan = plan_transfer(src, weights, dst, weights, topology, rank=me)
        sending = me in src
        with TransferGroups(plan, timeout=timeout) as transfer_groups:
            report = execute(
                plan,
                mine if sending else {},
                {} if sending else mine,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                groups=transfer_groups,
            )
        total = Report(
            buckets=total.buckets + report.buckets,
            messages=total.messages + report.messages,
            bytes_sent=total.bytes_sent + report.bytes_sent,
            bytes_received=total.bytes_received + report.bytes_received,
            bytes_copied=total.bytes_copied + report.bytes_copied,
            broadcasts=total.broadcasts + report.broadcasts,
            weights=total.weights + tuple(group.names[k] for k in report.weights),
        )
    return total


__all__ = ["fill_replicas", "init_optimizer_state", "training_state"]
