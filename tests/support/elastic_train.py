"""Shared by the elastic tests: a tiny TP + FSDP2 (HSDP) model on a meshgroups mesh, a
deterministic training step, snapshots of local state, and comparisons across replicas."""

from __future__ import annotations

import os
from datetime import timedelta

LAYOUT_SIZES = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}


def connect(rank, world, port, pg_timeout):
    """init_process_group on the TCPStore the parent test process hosts (workers are clients)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=pg_timeout))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout)
    )


def build(mg, lr=1e-2):
    """The model on ``mg.mesh``: TP over ``tp`` (colwise then rowwise), HSDP over
    (dp_replicate, dp_shard); an Adam optimizer."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    mesh = mg.mesh
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def batch(layout, rank, step):
    """This rank's batch of ``step``: one per data-parallel index (replicate × shard), the same
    on the tp ranks of one index."""
    import torch

    c = layout.coords(rank)
    index = c["dp_replicate"] * layout.size("dp_shard") + c["dp_shard"]
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(4, 8, generator=g)


def train_step(model, opt, layout, rank, step, die_rank=None, el=None):
    """One step; the loss. ``die_rank`` exits (os._exit) after the forward, mid-step; with
    ``el`` (an ``Elastic``) the step commits before the optimizer applies it."""
    import torch.distributed as dist

    x = batch(layout, rank, step)
    loss = model(x).pow(2).mean()
    if die_rank is not None and dist.get_rank() == die_rank:
        os._exit(0)
    loss.backward()
    if el is not None:
        el.commit()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(model, opt):
    """This rank's local shards of parameters and optimizer state, cloned, by name."""
    from meshgroups.elastic._heal import training_state

    return {k: local(v).detach().clone() for k, v in training_state(model, opt).items()}


def load(model, opt, snap):
    """Write ``snap`` into the local shards of a model built on a mesh where this rank keeps its
    coordinates (its shard boxes are the same)."""
    import torch

    from meshgroups.elastic._heal import init_optimizer_state, training_state

    init_optimizer_state(model, opt)
    state = training_state(model, opt)
    assert sorted(state) == sorted(snap), (sorted(state), sorted(snap))
    with torch.no_grad():
        for k, v in state.items():
            local(v).copy_(snap[k])


def replicas_equal(snap, group):
    """Whether every member of ``group`` (this rank's dp_replicate group) holds bit-identical
    local state: each tensor gathered over the group and compared exactly."""
    import torch
    import torch.distributed as dist

    for k in sorted(snap):
        t = snap[k].contiguous()
        got = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(got, t, group=group)
        if not all(torch.equal(g, got[0]) for g in got):
            return k
    return True
