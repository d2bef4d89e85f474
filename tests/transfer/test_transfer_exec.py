"""Weight transfer on real gloo processes (world 8), disjoint layouts: jobs, DTensor placements,
groups, execute.

Every scenario fills the rollout buffers with NaN, runs ``execute`` in buckets small enough to
need several, and compares EVERY rollout buffer element with the slice of the full tensor it
must hold (the full tensors are known on every rank: seeded modules or ``arange`` values). One
spawned job: an FSDP2 × TP trainer, a pipeline trainer into a permuted rollout, experts, uneven
shapes, pieces cut into fragments from several senders; colocated layouts and failures are in
``test_transfer_exec_colocated.py``.
"""

from __future__ import annotations

import pytest

from meshgroups import Layout, LayoutError

from ..support.dist import run
from ..support.transfer_exec_util import _buffers, _check, _full, _run, _shards, _talk_only


# --------------------------------------------------------------------------------- job 1: disjoint
def _fsdp_tp(rank):
    """Trainer FSDP2 × TP (dp_shard=2, tp=2) on ranks 0-3 -> rollout tp=4 on ranks 4-7."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshgroups import Topology
    from meshgroups.transfer import Replicate, Shard, Weight, plan_transfer
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.torch_io import module_weights

    trainer, rollout = Layout(dp_shard=2, tp=2), Layout(tp=4, rank_offset=4)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        assert job.roles() == (("trainer",) if rank < 4 else ("rollout",))
        assert (job["trainer"].mesh.get_coordinate() is None) == (rank >= 4)
        assert (job["rollout"].mesh.get_coordinate() is None) == (rank < 4)
        assert (job["trainer"].group("tp") == dist.GroupMember.NON_GROUP_MEMBER) == (rank >= 4)
        if rank < 4:
            mesh = job["trainer"].mesh
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp_shard"])
        src = module_weights(model if rank < 4 else None, trainer)
        if rank < 4:  # local checks of the mesh against the layout (no collective)
            from meshgroups.transfer._run.torch_io import local_weights

            with pytest.raises(LayoutError, match="mesh dim 'dp_shard' is not a dim of the layout"):
                local_weights(model, Layout(dp=2, tp=2))
            renamed, _ = local_weights(model, Layout(dp=2, tp=2), dims={"dp_shard": "dp"})
            assert renamed[0].placements == {"dp": Shard(0), "tp": Shard(0)}
            with pytest.raises(LayoutError, match="holds ranks"):
                local_weights(model, Layout.from_grid([[0, 2], [1, 3]], ("dp_shard", "tp")))
            from torch.distributed.tensor import DTensor, Partial

            partial = DTensor.from_local(torch.ones(2), job["trainer"].mesh["tp"], [Partial()])
            with pytest.raises(LayoutError, match="Partial.* holds no complete values"):
                local_weights({"grad": partial}, trainer)
        # FSDP2 splits TP's row shards again (_StridedShard): tp nests outside dp_shard there
        placed = {w.name: (dict(w.placements), w.shard_order) for w in src.weights}
        assert placed["0.weight"] == ({"dp_shard": Shard(0), "tp": Shard(0)}, ("tp", "dp_shard")), placed
        assert placed["2.weight"] == ({"dp_shard": Shard(0), "tp": Shard(1)}, None), placed
        dst_w = [
            Weight("0.weight", (10, 6), placements={"tp": Shard(0)}),
            Weight("0.bias", (10,), placements={"tp": Shard(0)}),
            Weight("2.weight", (5, 10), placements={"tp": Shard(1)}),
            Weight("2.bias", (5,), placements={"tp": Replicate()}),
        ]
        plan = plan_transfer(src.layout, src.weights, rollout, dst_w, topology=Topology(node=4))
        groups = job.transfer_groups(plan)
        _talk_only(plan, groups, rank)
        assert all(s[0] >= 4 for s in groups.sets)  # fan-outs are forwards inside the rollout node
        dsts = _buffers(rollout, dst_w, rank)
        report = _run(plan, src.tensors, dsts, groups, 64, rank)
        checked = _check(rollout, dst_w, dsts, full, rank, "fsdp_tp")
    return checked, report.broadcasts, len(plan.messages)


def _pipeline_permuted(rank):
    """A pipeline trainer pp=2 × tp=2 (DTensors on each stage's tp mesh) -> a rollout without
    pp, both on permuted placements; plus uneven shapes with empty shards."""
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor

    from meshgroups.transfer import Replicate, Shard, Weight, plan_transfer
    from meshgroups.transfer._run.jobs import init_job
    from meshgroups.transfer._run.torch_io import module_weights

    trainer = Layout.from_grid([[3, 0], [1, 2]], ("pp", "tp"))  # permuted: stage 0 is ranks 3, 0
    rollout = Layout.from_grid([[6, 4], [7, 5]], ("dp", "tp"))  # non-contiguous, ranks decrease
    dst_w = [
        Weight("emb", (9, 4), placements={"tp": Shard(0)}),
        Weight("head", (4, 7), placements={"tp": Shard(1)}),
        Weight("norm", (3,), placements={"dp": Replicate()}),
        Weight("tiny", (3,), placements={"tp": Shard(0)}),
    ]
    full = _full(dst_w)
    stage_params = {0: {"emb": [TS(0)], "tiny": [TS(0)]}, 1: {"head": [TS(1)], "norm": [TR()]}}
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        state = None
        if rank < 4:
            stage = trainer.coords(rank)["pp"]
            tp = job["trainer"].mesh["tp"]
            state = {n: distribute_tensor(full[n], tp, p) for n, p in stage_params[stage].items()}
        src = module_weights(state, trainer)
        assert src.layout is trainer
        by_name = {w.name: w for w in src.weights}
        assert by_name["emb"].stage == ("pp", 0) and by_name["head"].stage == ("pp", 1)
        plan = plan_transfer(src.layout, src.weights, rollout, dst_w)
        assert {m.src for m in plan.messages if m.weight == "emb"} <= {3, 0}  # stage 0 only
        groups = job.transfer_groups(plan)
        _talk_only(plan, groups, rank)
        dsts = _buffers(rollout, dst_w, rank)
        _run(plan, src.tensors, dsts, groups, 40, rank)
        checked = _check(rollout, dst_w, dsts, full, rank, "pipeline")
    return checked


def _experts(rank):
    """Experts ep=4 (uneven: 6 experts, the last rank holds none) -> ep=2 × etp=2, rank plans."""
    from meshgroups import Topology
    from meshgroups.transfer import Shard, Weight, plan_transfer
    from meshgroups.transfer._run.jobs import init_job

    trainer, rollout = Layout(ep=4), Layout(ep=2, etp=2, rank_offset=4)
    src_w = [
        Weight("experts", (6, 3, 5), placements={"ep": Shard(0)}),
        Weight("router", (6, 3)),
        Weight("norm", (6,), placements={"ep": Shard(0)}),
    ]
    dst_w = [
        Weight("experts", (6, 3, 5), placements={"ep": Shard(0), "etp": Shard(2)}),
        Weight("router", (6, 3), placements={"ep": Shard(0)}),
        Weight("norm", (6,)),  # on every rollout rank: enters the node once, then fans out
    ]
    node = Topology(node=4)
    assert src_w[0].box(trainer, 3) is None  # ceil(6/4) = 2 experts each: none left for rank 3
    full = _full(src_w, seed=3)
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        plan = plan_transfer(trainer, src_w, rollout, dst_w, node, rank=rank)  # this rank's part only
        groups = job.transfer_groups(plan)  # receivers derive their routes from senders' parts
        received = _talk_only(plan_transfer(trainer, src_w, rollout, dst_w, node), groups, rank)
        dsts = _buffers(rollout, dst_w, rank)
        _run(plan, _shards(trainer, src_w, full, rank), dsts, groups, 48, rank)
        checked = _check(rollout, dst_w, dsts, full, rank, "experts")
    return checked, received


def _cut_pieces(rank):
    """Four trainer replicas (dp=4, two nodes of 2) feed a rollout tp=2 × dp=2 whose nodes each
    need one tp block: every piece has 4 holders for 1 node, so the holders' ranges cut pieces
    into fragments (``min_part_bytes=4``: cuts on single indices) sent by different ranks; the
    rollout reassembles them from its rank's own part of the plan."""
    from meshgroups import Topology
    from meshgroups.transfer import Replicate, Shard, Weight, plan_transfer
    from meshgroups.transfer._run.jobs import init_job

    trainer, rollout = Layout(dp=4), Layout(tp=2, dp=2, rank_offset=4)
    src_w = [Weight("a", (13, 7)), Weight("b", (9, 11)), Weight("c", (5,))]
    dst_w = [
        Weight("a", (13, 7), placements={"tp": Shard(0)}),
        Weight("b", (9, 11), placements={"tp": Shard(1)}),
        Weight("c", (5,), placements={"tp": Replicate()}),
    ]
    node = Topology(node=2)
    full = _full(src_w, seed=5)
    whole = plan_transfer(trainer, src_w, rollout, dst_w, node, min_part_bytes=4)
    cross = [m for m in whole.messages if m.step == 0]
    assert {m.src for m in cross} == {0, 1, 2, 3}  # every replica sends
    senders = {}
    for m in cross:
        senders.setdefault((m.weight, m.dst), set()).add(m.src)
    assert any(len(s) > 1 for s in senders.values()), senders  # a piece arrives in fragments
    assert whole.busiest_send_bytes <= whole.busiest_send_bound
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        plan = plan_transfer(trainer, src_w, rollout, dst_w, node, rank=rank, min_part_bytes=4)
        assert list(plan.messages) == whole.for_rank(rank)
        groups = job.transfer_groups(plan)
        _talk_only(whole, groups, rank)
        dsts = _buffers(rollout, dst_w, rank)
        _run(plan, _shards(trainer, src_w, full, rank), dsts, groups, 60, rank)
        checked = _check(rollout, dst_w, dsts, full, rank, "cut pieces")
    return checked


def worker_disjoint(rank, world):
    import torch.distributed as dist

    from meshgroups.mesh._torch_seam import held_group_count

    held = held_group_count()
    out = {"fsdp_tp": _fsdp_tp(rank), "pipeline": _pipeline_permuted(rank), "experts": _experts(rank)}
    out["cut"] = _cut_pieces(rank)
    assert held_group_count() == held, "every job and transfer group closed"
    dist.barrier()
    return out


@pytest.mark.processes
def test_disjoint_layouts_world8():
    results = run(worker_disjoint, 8, timeout=400, pg_timeout=120)
    # every rollout element checked once per rank that holds it (sizes from the layouts)
    assert sum(r["fsdp_tp"][0] for r in results) == 60 + 10 + 50 + 5 * 4
    assert sum(r["fsdp_tp"][1] for r in results) > 0  # the replicated bias went by broadcast
    assert sum(r["pipeline"] for r in results) == 2 * (36 + 28 + 3 * 2 + 3)
    assert sum(r["experts"][0] for r in results) == 90 + 18 * 2 + 6 * 4
    assert sum(r["experts"][1] for r in results) > 0  # some receivers derived broadcast routes
    assert sum(r["cut"] for r in results) == 2 * (13 * 7 + 9 * 11) + 4 * 5


# ------------------------------------------------------------------------------- no processes
def test_sharing_rules_name_a_rank():
    from meshgroups.transfer._run.jobs import check_sharing

    check_sharing({"t": Layout(tp=4), "r": Layout.from_grid([[5, 7], [4, 6]], ("dp", "tp"))}, "disjoint")
    with pytest.raises(LayoutError, match="share rank 6"):
        check_sharing({"t": Layout(tp=8), "r": Layout.from_grid([[9, 6]], ("dp", "tp"))}, "disjoint")
    with pytest.raises(LayoutError, match="rank 0 is in 't' and not in 'r'"):
        check_sharing({"t": Layout(dp=4, tp=2), "r": Layout(tp=8, rank_offset=1)}, "colocated")
    check_sharing({"t": Layout(dp=4, tp=2), "r": Layout(tp=8)}, "colocated")
    with pytest.raises(ValueError, match="sharing='apart'"):
        check_sharing({"t": Layout(tp=2)}, "apart")


def test_buckets_cut_rows_and_pack_whole_weights():
    from meshgroups.transfer import Weight
    from meshgroups.transfer._run.buckets import Buckets

    ws = [Weight("a", (4, 2)), Weight("b", (10, 2)), Weight("c", ()), Weight("d", (1, 100))]
    b = Buckets.of(ws, bucket_bytes=40)
    assert b.count == 5 and b.rows == (4, 5, 1, 1)
    assert b.split(1, ((3, 9), (0, 2))) == [(1, ((3, 5), (0, 2))), (2, ((5, 9), (0, 2)))]
    assert b.split(2, ()) == [(3, ())] and b.last_bucket(1) == 2 and b.last_bucket(3) == 4
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        Buckets.of(ws, 0)


@pytest.mark.parametrize(
    "module",
    [
        "meshgroups.transfer._run.buckets",
        "meshgroups.transfer._run.jobs",
        "meshgroups.transfer._run.fanout_groups",
        "meshgroups.transfer._run.status",
        "meshgroups.transfer._names.presets",
        "meshgroups.transfer._run.steps",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
