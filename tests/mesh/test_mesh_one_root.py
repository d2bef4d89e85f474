"""One root mesh, as torchtitan and Megatron users combine meshes (real gloo, world 8).

Row-major and permuted (``from_grid``) layouts: slices compose, declared flattened dims live on
the root, torch's own ``_flatten``/``_unflatten`` build groups in mesh order, TP + FSDP2 (and
HSDP) gradients equal a single-process reference, DTensor round trips hold after every
``_flatten`` with each local shard at the offset its metadata names, DCP checkpoints move
between layouts, and no process group is ever created twice.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshgroups import Layout

from ..support.dist import run, scaled

pytestmark = pytest.mark.processes  # every test here starts processes

# ranks do not increase along any dim: torch's sorted groups would permute data here
PERMUTED = np.array([[[6, 3], [0, 5]], [[2, 7], [4, 1]]])


def layout_for(kind: str) -> Layout:
    if kind == "row_major":
        return Layout(dp=2, cp=2, tp=2)
    return Layout.from_grid(PERMUTED, ("dp", "cp", "tp"))


def _no_group_outside_meshgroups(mg):
    """Every group this process holds is WORLD, one of meshgroups' or a pad; no two share ranks."""
    import torch.distributed as dist

    from meshgroups.mesh._torch_seam import held_group_count

    groups = mg.cache.groups()
    ranks = [tuple(dist.get_process_group_ranks(g)) for g in groups]
    assert len(set(ranks)) == len(ranks), ranks
    assert held_group_count() == 1 + len(groups) + len(mg.cache.pads), (held_group_count(), len(groups))


def _check_group(group, expected, rank):
    import torch
    import torch.distributed as dist

    assert dist.get_process_group_ranks(group) == expected
    assert dist.get_rank(group) == expected.index(rank)
    got = [torch.zeros(1, dtype=torch.int64) for _ in expected]
    dist.all_gather(got, torch.tensor([rank]), group=group)
    assert [int(t) for t in got] == expected


def _dtensor_round_trips(mesh, rank):
    """Multi-dim placements on the root: full tensor back, local shard at its metadata offset."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    x = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    for placements in (
        [Shard(0), Shard(0), Replicate()],
        [Shard(0), Shard(1), Shard(1)],
        [Replicate(), Shard(0), Shard(1)],
        [Shard(1), Replicate(), Shard(0)],
    ):
        dt = distribute_tensor(x, mesh, placements)
        assert torch.equal(dt.full_tensor(), x), placements
        shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        assert torch.equal(dt.to_local(), x[index]), (placements, rank)
        assert torch.equal(dt.redistribute(mesh, [Replicate()] * 3).to_local(), x)


def _mlp(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _tp_fsdp_step(tp_mesh, dp_mesh, replicas, replica_index, rank, hsdp=False):
    """TP (colwise, rowwise) on ``tp_mesh`` + FSDP2 on ``dp_mesh``; compares to a reference."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, reference = _mlp(1), _mlp(1)
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dp_mesh)
    data = {r: torch.randn(3, 6, generator=torch.Generator().manual_seed(100 + r)) for r in range(replicas)}
    model(data[replica_index]).pow(2).sum().backward()
    loss = sum(reference(data[r]).pow(2).sum() for r in range(replicas)) / replicas
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-5), (name, hsdp, rank)
    return model


def worker_one_root(rank, world, kind):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from meshgroups import init_mesh

    lay = layout_for(kind)
    mg = init_mesh(lay, flatten=[("dp", "cp")], timeout=scaled(60))
    root = mg.mesh
    held = len(mg.cache.groups())
    # 1. One root: submeshes are its slices; the declared flattened dim lives on it.
    assert isinstance(root, DeviceMesh) and mg.submesh("tp") == root["tp"]
    assert mg.submesh("dp", "cp") == root["dp", "cp"]
    dp_cp = root["dp_cp"]
    assert mg.submesh("dp", "cp", flatten=True) is dp_cp
    assert root["dp", "cp"]._flatten("dp_cp") is dp_cp  # torchtitan's pattern returns it
    assert root["dp", "cp"]._flatten() is dp_cp
    assert dp_cp.get_group() is mg.group("dp", "cp")
    assert dp_cp._get_root_mesh() is root and root["tp"]._get_root_mesh() is root
    import pickle

    for m in (root, root["tp"], dp_cp):  # still a DeviceMesh to pickle (DCP, torch.compile)
        copy = pickle.loads(pickle.dumps(m))
        assert isinstance(copy, DeviceMesh) and copy == m
        if m.ndim == 1:
            assert copy.get_group() is m.get_group()
    _check_group(dp_cp.get_group(), lay.group_of(rank, "dp", "cp").tolist(), rank)
    assert len(mg.cache.groups()) == held  # no new group for any of this
    _dtensor_round_trips(root, rank)

    # 2. torch's _flatten of undeclared dims: groups in mesh order, built once, registered.
    cp_tp = root["cp", "tp"]._flatten()
    _check_group(cp_tp.get_group(), lay.group_of(rank, "cp", "tp").tolist(), rank)
    assert root["cp", "tp"]._flatten() is cp_tp and root["cp_tp"] is cp_tp
    everything = root._flatten("world_flat")
    _check_group(everything.get_group(), lay.grid.ravel().tolist(), rank)
    _dtensor_round_trips(root, rank)  # DTensor now routes through the flattened meshes
    # mg.flatten reuses what torch's _flatten built (same ranks, same order)
    before = len(mg.cache.groups())
    assert mg.flatten("cp", "tp").get_group() is cp_tp.get_group() and len(mg.cache.groups()) == before
    assert mg.group("cp", "tp") is cp_tp.get_group()

    # 3. torch's _unflatten: new dims' groups in mesh order too.
    split = dp_cp._unflatten("dp_cp", (2, 2), ("dp_a", "cp_b"))
    expected = lay.flatten("dp", "cp", name="dp_cp").split("dp_cp", dp_a=2, cp_b=2)
    for d in ("dp_a", "cp_b"):
        _check_group(split[d].get_group(), expected.group_of(rank, d).tolist(), rank)
    assert split._get_root_mesh() is root
    _no_group_outside_meshgroups(mg)

    # 4. TP + FSDP2 on slices of the root (flattened dp×cp included) vs a reference.
    coords = lay.coords(rank)
    replica = coords["dp"] * 2 + coords["cp"]
    _tp_fsdp_step(root["tp"], root["dp_cp"], 4, replica, rank)
    _tp_fsdp_step(mg.submesh("tp"), mg.submesh("dp"), 2, coords["dp"], rank)  # cp replicas see dp's data
    _tp_fsdp_step(root["tp"], root["dp", "cp"]._flatten(), 4, replica, rank)
    _no_group_outside_meshgroups(mg)
    dist.barrier()
    mg.close()
    return True


def test_one_root_row_major_world8():
    assert all(run(worker_one_root, 8, "row_major", timeout=240))


def test_one_root_permuted_world8():
    assert all(run(worker_one_root, 8, "permuted", timeout=240))


def worker_hsdp(rank, world):
    """torchtitan's recipe: dp_replicate × dp_shard × cp × tp with flattened dp, dp_shard_cp,
    dp_cp made by torch's own _flatten on the meshgroups root; HSDP + TP vs a reference."""
    from meshgroups import init_mesh

    lay = Layout(dp_replicate=2, dp_shard=2, cp=1, tp=2)
    mg = init_mesh(lay, timeout=scaled(60))
    root = mg.mesh
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    dp_shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    for flat, dims in (
        (dp, ("dp_replicate", "dp_shard")),
        (dp_shard_cp, ("dp_shard", "cp")),
        (dp_cp, ("dp_replicate", "dp_shard", "cp")),
    ):
        _check_group(flat.get_group(), lay.group_of(rank, *dims).tolist(), rank)
    assert dp_cp.get_group() is dp.get_group()  # cp=1: the same ranks, one group
    coords = lay.coords(rank)
    replica = coords["dp_replicate"] * 2 + coords["dp_shard"]
    _tp_fsdp_step(root["tp"], root["dp_replicate", "dp_shard_cp"], 4, replica, rank, hsdp=True)
    _no_group_outside_meshgroups(mg)
    mg.close()
    return True


def test_torchtitan_hsdp_recipe_world8():
    assert all(run(worker_hsdp, 8, timeout=240))


def worker_dcp(rank, world, path):
    """Save an FSDP2 + TP model on one layout, load it on another (permuted) of the same world."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshgroups import init_mesh

    def sharded(kind, seed):
        mg = init_mesh(layout_for(kind), flatten=[("dp", "cp")], timeout=scaled(60))
        model = _mlp(seed)
        parallelize_module(model, mg.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mg.mesh["dp_cp"])
        return mg, model

    mg_a, saved = sharded("row_major", seed=7)
    full = {k: v.full_tensor().clone() for k, v in saved.state_dict().items()}
    dcp.save(saved.state_dict(), checkpoint_id=path)
    dist.barrier()
    mg_b, loaded = sharded("permuted", seed=8)  # other values, other placement
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=path)
    loaded.load_state_dict(state)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v.full_tensor(), full[k]), k
    dist.barrier()
    mg_a.close()
    mg_b.close()
    return True


def test_dcp_checkpoint_moves_between_layouts_world8(tmp_path):
    assert all(run(worker_dcp, 8, str(tmp_path / "ckpt"), timeout=240))
