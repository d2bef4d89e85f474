"""Heal: fill new replicas' parameters and optimizer state from the surviving replicas.

A replica admitted by ``Elastic.grow`` has the model and optimizer built on the new mesh but
holds no values. ``fill_replicas`` moves them with the weight-transfer machinery of RL
(``plan_transfer`` + ``TransferGroups`` + ``execute``): the source layout is the grown layout's
old replicas, the destination its new ones, every tensor placed as its DTensor says. One code
path: the plan picks the senders (fewest cross-node bytes, even send load), the transfer
checks shapes, dtypes and pairing, and a failure is a ``TransferError`` on every rank.

    >>> state = training_state(model, optimizer)                 # doctest: +SKIP
    >>> fill_replicas(el.layout, el.dim, el.grown, state)         # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import MeshConfigError
from .layout import Layout
from .topology import Topology
from .transfer.execute import DEFAULT_BUCKET_BYTES, Report, execute
from .transfer.fanout_groups import TransferGroups
from .transfer.plan import plan_transfer
from .transfer.torch_io import local_weights


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{name: tensor}``: the model's parameters (DTensors as they are) and, per parameter,
    each tensor of its optimizer state as ``<param>.<key>`` (a 0-dim tensor such as Adam's
    ``step`` as a 1-element view, so writing it writes the state). Every rank of one model
    gets the same names once the optimizer state exists (see ``init_optimizer_state``).

    After a step that failed inside ``forward()`` or ``backward()``, FSDP2 still holds the
    failed step's unsharded parameters: call ``reset_iter_state()`` on the root FSDP module
    first (torch's recovery call), or a model whose parameters are none of the optimizer's is
    refused here (``ValueError``) rather than read without its optimizer state."""
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
    exist to be filled; the values it writes are overwritten by ``fill_replicas``. Local."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


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
    passes its own ``state`` (``training_state``: the same names everywhere).

    Returns:
        this rank's transfer ``Report``.

    Raises:
        MeshConfigError: ``new`` empty, out of range, or every replica.
        TransferError: on every rank, when any rank failed (see ``execute``).
    """
    size = layout.size(dim)
    fresh = sorted({int(i) for i in new})
    if not fresh or fresh[0] < 0 or fresh[-1] >= size or len(fresh) == size:
        raise MeshConfigError(
            f"new replicas {list(new)} must be some (not all) of the {size} indices of {dim!r}"
        )
    old = [i for i in range(size) if i not in fresh]
    src, dst = layout.select(dim, old), layout.select(dim, fresh)
    weights, tensors = local_weights(state, layout, stage_dim=None)
    me = dist.get_rank()
    plan = plan_transfer(src, weights, dst, weights, topology, rank=me)
    sending = me in src
    with TransferGroups(plan, timeout=timeout) as groups:
        return execute(
            plan,
            tensors if sending else {},
            {} if sending else tensors,
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            groups=groups,
        )


__all__ = ["fill_replicas", "init_optimizer_state", "training_state"]
