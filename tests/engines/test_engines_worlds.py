"""A transfer world over two independent torch.distributed worlds (no vLLM needed).

Four processes: ranks 0-1 are a "trainer" world of their own (its own store, its own default
group, a tensor-parallel DTensor model), ranks 2-3 an "engine" world of their own (plain local
shards in vLLM's fused layout). A ``TransferWorld`` joins them at a store the trainer's rank 0
hosts; ``WeightSync`` runs unchanged inside ``world.active()``. Checked: every element after
each of three syncs (fused q/k/v, a bf16 cast), one plan and one group build, both worlds'
default groups untouched and usable afterwards, and a member that stops mid-sync failing every
other member within the timeout with a ``TransferError``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.support.dist import free_port, run, scaled

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]  # every test here starts processes

SIZES = [("q_proj", 16), ("k_proj", 8), ("v_proj", 8)]


def _own_world(rank: int, port_a: int, port_b: int) -> tuple[int, int]:
    """Init this process's own world: ranks 0-1 one world, 2-3 another. Returns (own rank, own size)."""
    import torch.distributed as dist

    own, port = (rank, port_a) if rank < 2 else (rank - 2, port_b)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=own,
        world_size=2,
        timeout=timedelta(seconds=scaled(60)),
    )
    return own, 2


def _models(rank: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({n: torch.nn.Linear(16, s, bias=False) for n, s in SIZES})
    if rank < 2:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {n: ColwiseParallel() for n in model})
    return model


def worker_sync(rank: int, world: int, port_a: int, port_b: int, port_t: int, steps: int):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from meshgroups import Layout
    from meshgroups.engines._worlds import TransferWorld
    from meshgroups.transfer import Shard, Weight
    from meshgroups.transfer._run.sync import WeightSync

    own, _ = _own_world(rank, port_a, port_b)
    own_pg, own_count = c10d._world.default_pg, c10d._world.group_count
    model = _models(rank)
    qkv = {"qkv_proj.weight": torch.full((16, 16), float("nan"), dtype=torch.bfloat16)}
    if rank == 0:
        store = TransferWorld.serve(port=port_t, timeout=scaled(60))
        tw = TransferWorld(store, 0, 4, timeout=scaled(60))
    else:
        tw = TransferWorld.join(f"127.0.0.1:{port_t}", rank, 4, timeout=scaled(60))
    trainer, rollout = Layout(tp=2), Layout(tp=2, rank_offset=2)
    fused = Weight("qkv_proj.weight", (32, 16), "bfloat16", {"tp": Shard(0)})
    names = {"qkv_proj.weight": [f"{n}.weight" for n, _ in SIZES]}
    seen = []
    with tw.active():
        assert dist.get_rank() == rank and dist.get_world_size() == 4
        sync = WeightSync(
            model if rank < 2 else None,
            trainer,
            qkv if rank >= 2 else None,
            rollout,
            rollout_weights=[fused],
            name_map=names,
            cast="bfloat16",
        )
    assert (
        c10d._world.default_pg is own_pg and dist.get_rank() == own and c10d._world.group_count == own_count
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        # a training step: the trainer's on its DTensors, the engine's ranks the same step on a
        # plain copy (the same seed and gradients), as their oracle of the trainer's weights
        sum(m(torch.ones(2, 16)).sum() for m in model.values()).backward()
        optimizer.step()
        optimizer.zero_grad()
        full = {
            f"{n}.weight": (m.weight.full_tensor() if rank < 2 else m.weight).detach()
            for n, m in model.items()
        }
        with tw.active():
            report = sync.sync()
        if rank >= 2:
            r = own
            want = torch.cat([full[f"{n}.weight"].chunk(2)[r] for n, _ in SIZES])
            seen.append(bool(torch.equal(qkv["qkv_proj.weight"], want.to(torch.bfloat16))))
            assert report.bytes_received == 16 * 16 * 2
        else:
            seen.append(report.bytes_sent)
        # the process's own world, untouched: its default group still works
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2 and dist.get_rank() == own
    counters = (sync.plans, sync.group_builds, sync.syncs)
    with tw.active():
        sync.close()
    tw.close()
    dist.destroy_process_group()
    return seen, counters


def test_weight_sync_across_two_worlds():
    ports = [free_port() for _ in range(3)]
    out = run(worker_sync, 4, *ports, 3, backend=None, timeout=240, port_retries=0)
    for rank, (seen, counters) in enumerate(out):
        assert counters == (1, 1, 3), (rank, counters)
        if rank >= 2:
            assert seen == [True, True, True], (rank, seen)
        else:
            assert sum(seen) > 0


def worker_member_stops(rank: int, world: int, port_a: int, port_b: int, port_t: int):
    import os
    import time

    import torch

    from meshgroups import Layout
    from meshgroups.engines._worlds import TransferWorld
    from meshgroups.transfer import Shard, Weight
    from meshgroups.transfer._run.status import TransferError
    from meshgroups.transfer._run.sync import WeightSync

    _own_world(rank, port_a, port_b)
    model = _models(rank)
    qkv = {"qkv_proj.weight": torch.zeros((16, 16))}
    wait = scaled(10)
    if rank == 0:
        tw = TransferWorld(TransferWorld.serve(port=port_t, timeout=wait), 0, 4, timeout=wait)
    else:
        tw = TransferWorld.join(f"127.0.0.1:{port_t}", rank, 4, timeout=wait)
    fused = Weight("qkv_proj.weight", (32, 16), "float32", {"tp": Shard(0)})
    with tw.active():
        sync = WeightSync(
            model if rank < 2 else None,
            Layout(tp=2),
            qkv if rank >= 2 else None,
            Layout(tp=2, rank_offset=2),
            rollout_weights=[fused],
            name_map={"qkv_proj.weight": [f"{n}.weight" for n, _ in SIZES]},
            timeout=wait,
        )
    if rank == 3:  # an engine worker dies before the sync
        os._exit(0)
    start = time.monotonic()
    try:
        with tw.active():
            sync.sync()
    except TransferError as exc:
        return "TransferError", time.monotonic() - start, str(exc)[:200]
    return "no error", time.monotonic() - start, ""


def test_member_gone_fails_every_other_member():
    ports = [free_port() for _ in range(3)]
    out = run(worker_member_stops, 4, *ports, backend=None, timeout=240, may_exit={3}, port_retries=0)
    for rank in (0, 1, 2):
        kind, took, _ = out[rank]
        assert kind == "TransferError", (rank, out[rank])
        assert took < 4 * scaled(10) + scaled(10), (rank, took)
