"""The torch bridge on real gloo processes: invariants, strategies, errors."""

from __future__ import annotations

import pytest

from meshgroups import Layout

from ..support.dist import run, scaled


def dense_expert_layout() -> Layout:
    return Layout(pp=2, dp=2, cp=1, tp=2).with_views(expert=Layout(pp=2, edp=1, ep=4, etp=1))


PLAN = {
    "flatten": [("dp", "cp"), ("pp", "tp"), ("pp", "dp", "cp", "tp")],
}


def _subsets(lay):
    return {"embd": (lay.select("pp", [0, -1]), "pp"), "first": (lay.select("pp", 0), ("dp", "tp"))}


def _check_every_family(mg, lay, rank):
    """Position == group rank, members == layout rows, all_reduce sums: for every family."""
    import torch
    import torch.distributed as dist

    seen = {}
    for fam in mg.families:
        dims = (fam,) if isinstance(fam, str) else fam
        group, ranks = mg.group(*dims), mg.ranks(*dims)
        if isinstance(fam, str):
            sub_layout, sub_dims = _subsets(lay)[fam]
            sub_dims = (sub_dims,) if isinstance(sub_dims, str) else sub_dims
            expected = sub_layout.group_of(rank, *sub_dims).tolist() if rank in sub_layout else None
        else:
            expected = lay.group_of(rank, *dims).tolist()
        assert ranks == expected, (fam, ranks, expected)
        if expected is None:
            assert group == dist.GroupMember.NON_GROUP_MEMBER and mg.local_rank(*dims) is None
            assert mg.submesh(*dims).get_coordinate() is None  # a mesh on every rank, as in torch
            continue
        assert dist.get_process_group_ranks(group) == expected, fam
        assert dist.get_rank(group) == expected.index(rank) == mg.local_rank(*dims), fam
        assert mg.size(*dims) == len(expected)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=group)
        assert value.item() == sum(r + 1 for r in expected), fam
        seen[fam] = expected
    return seen


def worker_invariants(rank, world):
    import torch.distributed as dist

    from meshgroups import init_mesh

    lay = dense_expert_layout()
    mg = init_mesh(lay, flatten=PLAN["flatten"], subsets=_subsets(lay), timeout=scaled(30))
    seen = _check_every_family(mg, lay, rank)
    # one process group per distinct rank set
    assert mg.group("dp", "cp") is mg.group("dp")
    assert mg.view_mesh("expert")["pp"].get_group() is mg.mesh["pp"].get_group()
    assert mg.group("cp") is mg.group("edp") is mg.group("etp")  # size-1 dims share this rank alone
    # equal rank set, one group; off it torch's non-member sentinel
    assert mg.group("first") is (mg.group("ep") if rank < 4 else dist.GroupMember.NON_GROUP_MEMBER)
    assert mg.group("pp", "dp", "cp", "tp") is dist.group.WORLD  # spans the world in order
    # the DeviceMesh agrees with the layout
    assert mg.mesh.mesh_dim_names == lay.names
    assert tuple(mg.mesh.get_coordinate()) == tuple(lay.coords(rank).values())
    for d in lay.names:
        assert mg.mesh.get_local_rank(d) == lay.coords(rank)[d]
        assert mg.mesh[d].get_group() is mg.group(d)
    return sorted({tuple(v) for v in seen.values() if len(v) > 1}), mg.cache.calls, len(mg.cache)


@pytest.mark.processes
def test_invariants_world8():
    results = run(worker_invariants, 8)
    lay = dense_expert_layout()
    expected_rows = set()
    families = [(d,) for d in lay.names] + [("edp",), ("ep",), ("etp",)] + PLAN["flatten"]
    for dims in families:
        for row in lay.groups(*dims).tolist():
            if 1 < len(row) < 8:
                expected_rows.add(tuple(row))
    for sub, dims in _subsets(lay).values():
        dims = (dims,) if isinstance(dims, str) else dims
        expected_rows |= {tuple(r) for r in sub.groups(*dims).tolist() if len(r) > 1}
    for distinct_rows, calls, held in results:
        # every rank made exactly one creation call per distinct rank set (plus its one-rank group)
        assert calls == len(expected_rows) + 1, (calls, len(expected_rows))
        assert held == 1 + len(distinct_rows)  # its one-rank group + one per distinct rank set (WORLD too)


def worker_permuted_dtensor(rank, world):
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from meshgroups import init_mesh

    # a topology-aware placement whose ranks do not increase along either dim
    grid = np.array([[3, 1, 2, 0], [7, 5, 4, 6]])
    lay = Layout.from_grid(grid, ("a", "b"))
    mg = init_mesh(lay, flatten=[("a", "b")], timeout=scaled(30))
    _check_every_family(mg, lay, rank)
    coords = lay.coords(rank)
    assert tuple(mg.mesh.get_coordinate()) == (coords["a"], coords["b"])
    x = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    # uneven shards on 1-D submeshes: each rank's shard is the chunk at its mesh position
    for dims, pos in ((("b",), coords["b"]), (("a", "b"), coords["a"] * 4 + coords["b"])):
        sub = mg.submesh(*dims, flatten=True)
        dt = distribute_tensor(x, sub, [Shard(0)])
        chunks = torch.chunk(x, sub.size(), dim=0)
        expected = chunks[pos] if pos < len(chunks) else x[:0]
        assert torch.equal(dt.to_local(), expected), (dims, pos)
        assert torch.equal(dt.full_tensor(), x)
        tag = DTensor.from_local(torch.tensor([float(pos)]), sub, [Shard(0)]).full_tensor()
        assert tag.tolist() == list(range(sub.size())), tag
    # the 2-D mesh of the permuted layout
    dt = distribute_tensor(x, mg.mesh, [Shard(0), Shard(1)])
    rows = torch.chunk(x, 2, dim=0)[coords["a"]]
    cols = torch.chunk(rows, 4, dim=1)
    expected = cols[coords["b"]] if coords["b"] < len(cols) else rows[:, :0]
    assert torch.equal(dt.to_local(), expected)
    assert torch.equal(dt.full_tensor(), x)
    assert torch.equal(dt.redistribute(mg.mesh, [Replicate(), Replicate()]).to_local(), x)
    return True


@pytest.mark.processes
def test_permuted_layout_keeps_position_equal_to_group_rank_world8():
    assert all(run(worker_permuted_dtensor, 8))


def worker_fsdp(rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from meshgroups import init_mesh

    lay = Layout(dp=2, cp=2)
    mg = init_mesh(lay, flatten=[("dp", "cp")], timeout=scaled(30))
    for dims, flatten in ((("dp",), False), (("dp", "cp"), True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        reference = torch.nn.Linear(4, 3)
        reference.load_state_dict(model.state_dict())
        fully_shard(model, mesh=mg.submesh(*dims, flatten=flatten))
        members = mg.ranks(*dims)
        data = {r: torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in members}
        model(data[rank]).pow(2).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        # single-process reference: the gradient averaged over the group's data
        loss = sum(reference(data[r]).pow(2).sum() for r in members) / len(members)
        loss.backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p.full_tensor(), q, atol=1e-6), (dims, name)
    dist.barrier()
    return True


@pytest.mark.processes
def test_fsdp2_on_submesh_and_flattened_mesh_world4():
    assert all(run(worker_fsdp, 4))


def worker_mismatch(rank, world):
    from meshgroups import init_mesh

    # several meshes in one job: no false alarms
    first = init_mesh(Layout(dp=2, tp=2), timeout=scaled(20))
    second = init_mesh(Layout(pp=4), timeout=scaled(20))
    assert first.ranks("tp") is not None and second.ranks("pp") == [0, 1, 2, 3]
    lay = Layout(dp=2, tp=2) if rank != 2 else Layout(dp=4, tp=1)
    try:
        init_mesh(lay, timeout=scaled(20))
    except ValueError as exc:
        from meshgroups import MismatchError

        assert isinstance(exc, MismatchError) and exc.argument == "layout" and exc.ranks == (2,)
        return str(exc)
    return None


@pytest.mark.processes
def test_layout_mismatch_raises_on_every_rank_world4():
    messages = run(worker_mismatch, 4, timeout=90)
    good, bad = Layout(dp=2, tp=2).fingerprint(), Layout(dp=4, tp=1).fingerprint()
    for msg in messages:
        assert msg is not None and "was made with a different 'layout' on rank 2" in msg
        assert "rank 2 has layout=Layout(dp=4, tp=1)" in msg and "rank 0 has layout=Layout(dp=2, tp=2)" in msg
        assert good in msg and bad in msg


def worker_local_strategy(rank, world):
    import torch.distributed as dist

    from meshgroups import GroupCache, init_mesh

    lay = dense_expert_layout()
    cache = GroupCache()
    mg = init_mesh(
        lay, flatten=PLAN["flatten"], subsets=_subsets(lay), strategy="local", cache=cache, timeout=scaled(30)
    )
    _check_every_family(mg, lay, rank)
    calls_first = cache.calls
    # a second, different layout through the same cache: counts stayed aligned, no hang
    other = Layout.from_grid([[7, 6, 5, 4], [3, 2, 1, 0]], ("x", "y"))
    mg2 = init_mesh(other, flatten=[("x", "y")], strategy="local", cache=cache, timeout=scaled(30))
    _check_every_family(mg2, other, rank)
    assert mg2.group("x", "y") is not dist.group.WORLD  # reversed order: not the default group
    return calls_first


@pytest.mark.processes
def test_local_strategy_world8():
    calls = run(worker_local_strategy, 8, timeout=120)
    # per rank: one singleton + one step per non-trivial family (pp, dp, tp, ep, pp_tp, world, embd,
    # first); dp_cp is dp, the size-1 dims need no step. Independent of the world size.
    assert set(calls) == {1 + 8}


def worker_errors(rank, world):
    from datetime import timedelta

    import torch.distributed as dist

    from meshgroups import init_mesh

    errors = {}
    for name, call in {
        "outside": lambda: init_mesh(Layout(dp=8)),
        "strategy": lambda: init_mesh(Layout(dp=4), strategy="eager"),
        "split": lambda: init_mesh(Layout(dp=4), strategy="split"),
        "device": lambda: init_mesh(Layout(dp=4), "cuda:0"),
        "flatten_str": lambda: init_mesh(Layout(dp=2, tp=2), flatten=["dp"]),
        "unknown": lambda: init_mesh(Layout(dp=2, tp=2), flatten=[("dp", "xp")]),
        "timeout": lambda: init_mesh(Layout(dp=4), timeout=-1),
        "type": lambda: init_mesh({"dp": 4}),
        "tpu": lambda: init_mesh(Layout(dp=4), "tpu"),
        "twins": lambda: init_mesh(Layout(dp=4), gloo_twins="no"),
        "check": lambda: init_mesh(Layout(dp=4), check="no"),
        "empty_set": lambda: init_mesh(Layout(dp=4), flatten=[()]),
        "zero": lambda: init_mesh(Layout(dp=4), timeout=timedelta(0)),
        "inf": lambda: init_mesh(Layout(dp=4), timeout=float("inf")),
        "huge": lambda: init_mesh(Layout(dp=4), timeout=1e20),
        "cache": lambda: init_mesh(Layout(dp=4), cache="x"),
        "subset_list": lambda: init_mesh(Layout(dp=4), subsets=[("embd", Layout(dp=4))]),
        "backend": lambda: init_mesh(Layout(dp=4), backend="glo"),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # the failed calls created nothing and left the ranks in step: a real build still works
    lay = Layout(dp=2, tp=1, rank_offset=2)  # part of the world: ranks 2 and 3
    mg = init_mesh(lay, flatten=[("dp", "tp")], gloo_twins=True, timeout=scaled(20), partial=True)
    member = rank in (2, 3)
    assert (mg.mesh.get_coordinate() is None) == (not member)
    outside = mg.group("dp") == dist.GroupMember.NON_GROUP_MEMBER
    assert outside == (not member) and (mg.ranks("dp") is None) == (not member)
    assert mg.size("dp") == 2
    if member:
        assert mg.group("dp", gloo=True) is mg.group("dp")  # backend is gloo: the twin is the group
        assert mg.ranks("dp") == [2, 3]
    try:
        mg.group("dp", "tp", "xx")
    except ValueError as exc:
        errors["unknown_dim"] = str(exc)
    try:
        init_mesh(Layout(dp=2, tp=2), timeout=scaled(20)).group("dp", "tp")
    except ValueError as exc:
        errors["undeclared"] = str(exc)
    # node-aware groups: two "nodes" of two ranks
    nodes = init_mesh(Layout(world=4).split_by_node("world", 2), timeout=scaled(20))
    assert nodes.ranks("world_intra") == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert nodes.ranks("world_inter") == [rank % 2, rank % 2 + 2]
    assert nodes._repr_html_().startswith("<table") and "outline" in nodes._repr_html_()
    dist.barrier()
    return errors


@pytest.mark.processes
def test_errors_before_any_collective_world4():
    for errors in run(worker_errors, 4, timeout=90):
        assert "uses rank 7, outside the default group's world (ranks 0..3)" in errors["outside"]
        assert "strategy='eager' is not one of" in errors["strategy"]
        assert "strategy='split' needs a default process group bound to a device" in errors["split"]
        assert "device_type='cuda:0'" in errors["device"]
        assert errors["flatten_str"].startswith("TypeError: flatten/only take dim sets")
        assert "unknown dim 'xp'" in errors["unknown"]
        assert "timeout=-1" in errors["timeout"]
        assert errors["type"].startswith("TypeError: layout must be a meshgroups.Layout")
        assert "unknown dim 'xx'" in errors["unknown_dim"]
        assert "device_type='tpu' is not a torch device type" in errors["tpu"]
        assert errors["twins"].startswith("TypeError: gloo_twins must be True or False")
        assert errors["check"].startswith("TypeError: check must be True, False or None")
        assert "empty dim set" in errors["empty_set"]
        assert "timeout=datetime.timedelta(0) must be positive" in errors["zero"]
        assert "timeout=inf must be a positive number" in errors["inf"]
        assert "timeout=1e+20 must be a positive number" in errors["huge"]
        assert errors["cache"].startswith("TypeError: cache must be a meshgroups.GroupCache")
        assert errors["subset_list"].startswith("TypeError: subsets must map names")
        assert "'glo' is not a registered backend" in errors["backend"]
        assert "group ('dp', 'tp') was not built" in errors["undeclared"]


def test_init_mesh_without_process_group():
    import torch.distributed as dist

    from meshgroups import init_mesh

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        init_mesh(Layout(dp=2))


def worker_local_uneven_dedup(rank, world):
    """Where one rank finds its group already built and another must create one, the local
    strategy pads so the next shared group still gets the same name on every member."""

    from meshgroups import GroupCache, init_mesh

    main = Layout(a=3, b=2)  # b groups: {0,1} {2,3} {4,5}
    view = Layout.from_grid([[0, 1], [2, 4], [3, 5]], ("c", "d"))  # d groups: {0,1} {2,4} {3,5}
    lay = main.with_views(v=view)
    cache = GroupCache()
    mg = init_mesh(lay, strategy="local", cache=cache, timeout=scaled(20))
    _check_every_family(mg, lay, rank)
    if rank in (0, 1):
        assert mg.group("d") is mg.group("b")  # same ranks: reused, and this rank padded instead
    return cache.calls, len(cache.pads)


@pytest.mark.processes
def test_local_strategy_pads_when_only_some_ranks_reuse_a_group_world6():
    results = run(worker_local_uneven_dedup, 6, timeout=90)
    assert len({calls for calls, _ in results}) == 1  # every rank took the same number of steps
    assert [pads for _, pads in results][:2] == [1, 1] and all(pads == 0 for _, pads in results[2:])
