"""Weight transfer on real gloo processes (world 8): jobs, DTensor placements, groups, execute.

Every scenario fills the rollout buffers with NaN, runs ``execute`` in buckets small enough to
need several, and compares EVERY rollout buffer element with the slice of the full tensor it
must hold (the full tensors are known on every rank: seeded modules or ``arange`` values).
Two spawned jobs: disjoint layouts (FSDP2 × TP trainer, a pipeline trainer into a permuted
rollout, experts, uneven shapes, pieces cut into fragments from several senders) and colocated
layouts (local copies, failures, the legacy
one-group case).
"""

from __future__ import annotations

import pytest

from meshgroups import Layout, LayoutError

from ._dist import run, scaled


def _full(weights, seed=0):
    import torch

    out = {}
    for i, w in enumerate(weights):
        n = 1
        for s in w.shape:
            n *= s
        out[w.name] = (torch.arange(n, dtype=torch.float32) + 1000.0 * (i + 1) + seed).reshape(w.shape)
    return out


def _cut(t, box):
    return t[tuple(slice(a, b) for a, b in box)].clone()


def _shards(layout, weights, full, rank):
    return {w.name: _cut(full[w.name], w.box(layout, rank)) for w in weights if w.box(layout, rank)}


def _buffers(layout, weights, rank):
    import torch

    out = {}
    for w in weights:
        box = w.box(layout, rank)
        if box:
            out[w.name] = torch.full([b - a for a, b in box], float("nan"), dtype=getattr(torch, w.dtype))
    return out


def _check(layout, weights, buffers, full, rank, what):
    """Every element of every buffer equals the full tensor's slice; returns elements checked."""
    import torch

    checked = 0
    for w in weights:
        box = w.box(layout, rank)
        if box is None:
            assert w.name not in buffers
            continue
        want = _cut(full[w.name], box)
        assert torch.equal(buffers[w.name], want), (what, rank, w.name, box, buffers[w.name], want)
        checked += want.numel()
    return checked


def _talk_only(plan, groups, rank):
    """Every transfer group is one sender and receivers that all get one same slice from it,
    and this rank's routes (derived locally on receivers) are every fan-out it takes part in:
    checked against the whole plan's messages (``plan`` must be whole)."""
    fanout = {}
    for m in plan.messages:
        if m.src != m.dst:
            fanout.setdefault((m.weight, m.src, m.box, m.step), set()).add(m.dst)
    every = {k: (k[1], *sorted(d)) for k, d in fanout.items() if len(d) > 1}
    assert set(groups.sets) == set(every.values()), (groups.sets, every)
    assert groups.routes == {k: r for k, r in every.items() if rank in r}, (rank, groups.routes)
    return sum(1 for r in groups.routes.values() if r[0] != rank)  # fan-outs received


def _run(plan, srcs, dsts, groups, bucket_bytes, rank):
    from meshgroups.transfer.execute import execute

    seen = []
    report = execute(
        plan, srcs, dsts, bucket_bytes=bucket_bytes, progress=seen.append, groups=groups, timeout=60
    )
    assert [p.bucket for p in seen] == list(range(1, report.buckets + 1)), seen
    assert report.buckets >= 3, report.buckets  # small buckets: several of them
    names = [n for p in seen for n in p.weights_done]
    assert sorted(names) == sorted(d.name for _, d in plan.weights), names  # each once
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and (not seen or done[-1] == seen[-1].bytes_total), done
    return report


# --------------------------------------------------------------------------------- job 1: disjoint
def _fsdp_tp(rank):
    """Trainer FSDP2 × TP (dp_shard=2, tp=2) on ranks 0-3 -> rollout tp=4 on ranks 4-7."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshgroups import Topology
    from meshgroups.transfer import Replicate, Shard, Weight, plan_transfer
    from meshgroups.transfer.jobs import init_job
    from meshgroups.transfer.torch_io import module_weights

    trainer, rollout = Layout(dp_shard=2, tp=2), Layout(tp=4, rank_offset=4)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with init_job({"trainer": trainer, "rollout": rollout}) as job:
        assert job.roles() == (("trainer",) if rank < 4 else ("rollout",))
        assert (job["trainer"].mesh.get_coordinate() is None) == (rank >= 4)
        assert (job["rollout"].mesh.get_coordinate() is None) == (rank < 4)
        assert (job["trainer"].group("tp") is None) == (rank >= 4)
        if rank < 4:
            mesh = job["trainer"].mesh
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp_shard"])
        src = module_weights(model if rank < 4 else None, trainer)
        if rank < 4:  # local checks of the mesh against the layout (no collective)
            from meshgroups.transfer.torch_io import local_weights

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
    from meshgroups.transfer.jobs import init_job
    from meshgroups.transfer.torch_io import module_weights

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
    from meshgroups.transfer.jobs import init_job

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
    from meshgroups.transfer.jobs import init_job

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

    from meshgroups._torch_seam import held_group_count

    held = held_group_count()
    out = {"fsdp_tp": _fsdp_tp(rank), "pipeline": _pipeline_permuted(rank), "experts": _experts(rank)}
    out["cut"] = _cut_pieces(rank)
    assert held_group_count() == held, "every job and transfer group closed"
    dist.barrier()
    return out


def test_disjoint_layouts_world8():
    results = run(worker_disjoint, 8, timeout=400, pg_timeout=120)
    # every rollout element checked once per rank that holds it (sizes from the layouts)
    assert sum(r["fsdp_tp"][0] for r in results) == 60 + 10 + 50 + 5 * 4
    assert sum(r["fsdp_tp"][1] for r in results) > 0  # the replicated bias went by broadcast
    assert sum(r["pipeline"] for r in results) == 2 * (36 + 28 + 3 * 2 + 3)
    assert sum(r["experts"][0] for r in results) == 90 + 18 * 2 + 6 * 4
    assert sum(r["experts"][1] for r in results) > 0  # some receivers derived broadcast routes
    assert sum(r["cut"] for r in results) == 2 * (13 * 7 + 9 * 11) + 4 * 5


# -------------------------------------------------------------------------------- job 2: colocated
def worker_colocated(rank, world):
    import time

    import torch
    import torch.distributed as dist
    from meshgroups.compat.group_initializer import WeightTransferGroupInitializer, reset_group_cache

    from meshgroups import MeshConfigError, MismatchError, Topology
    from meshgroups._torch_seam import held_group_count
    from meshgroups.transfer import Replicate, Shard, Weight, plan_transfer
    from meshgroups.transfer.execute import TransferError, execute
    from meshgroups.transfer.jobs import init_job
    from meshgroups.transfer.status import next_tag

    out = {}
    held = held_group_count()
    # init_job is one collective call, checked across ranks: rank 1 alone passes sharing="any"
    t4, r4 = Layout(tp=4), Layout(tp=4, rank_offset=4)
    with pytest.raises(MismatchError, match="different 'sharing' on rank 1") as err:
        init_job({"trainer": t4, "rollout": r4}, sharing="any" if rank == 1 else "disjoint")
    assert err.value.argument == "sharing" and err.value.ranks == (1,), err.value
    # rank 2 alone passes overlapping layouts declared disjoint: its LayoutError on every rank
    bad = {"trainer": t4, "rollout": Layout(tp=4, rank_offset=3) if rank == 2 else r4}
    with pytest.raises(LayoutError, match="share rank 3") as err:
        init_job(bad)
    assert "rank 2" in str(err.value) + "".join(getattr(err.value, "__notes__", [])), err.value
    assert held_group_count() == held  # nothing was built
    # the identical correct call, at once, works; TransferGroups is checked alike
    w = [Weight("w", (8, 4), placements={"tp": Shard(0)})]
    whole = plan_transfer(t4, w, r4, [Weight("w", (8, 4))], topology=Topology(node=4))
    other = plan_transfer(t4, w, r4, [Weight("w", (8, 4), placements={"tp": Shard(1)})])
    with init_job({"trainer": t4, "rollout": r4}) as job:
        assert job.roles() == (("trainer",) if rank < 4 else ("rollout",))
        with pytest.raises(MismatchError, match="different 'plan' on rank 3") as err:
            job.transfer_groups(other if rank == 3 else whole)
        assert err.value.ranks == (3,), err.value
        # a rank's own part gives the same groups and routes as the whole plan (receivers
        # derive theirs locally: the rollout ranks forward each slice inside their node)
        by_whole = job.transfer_groups(whole)
        by_part = job.transfer_groups(plan_transfer(t4, w, r4, [Weight("w", (8, 4))], Topology(node=4), rank))
        assert by_part.sets == by_whole.sets and by_part.routes == by_whole.routes
        # parts of different plans (rank 0 planned with other options; the plans' identity is
        # the same): the sums of message hashes differ, refused on every rank before any group
        t22, w64, d64 = (
            Layout(dp=2, tp=2),
            [Weight("w", (64, 64), placements={"tp": Shard(0)})],
            [Weight("w", (64, 64))],
        )
        odd = {"min_part_bytes": 1} if rank == 0 else {}
        odd_plan = plan_transfer(t22, w64, r4, d64, Topology(node=4), rank=rank, **odd)
        with pytest.raises(MeshConfigError, match="plans do not pair up"):
            job.transfer_groups(odd_plan)
        # and execute (no groups) refuses them at its check, before any data moves
        full64 = _full(w64)
        bufs = _buffers(r4, d64, rank)
        with pytest.raises(TransferError, match="plans do not pair up") as err:
            execute(odd_plan, _shards(t22, w64, full64, rank), bufs, timeout=60)
        assert err.value.stage == "check" and all(torch.isnan(t).all() for t in bufs.values())
        out["forwards_received"] = _talk_only(whole, by_whole, rank)
    assert held_group_count() == held  # the job closed its transfer groups too

    trainer, rollout = Layout(dp=4, tp=2), Layout(dp=2, tp=4)
    src_w = [
        Weight("wq", (8, 6), placements={"tp": Shard(1)}),
        Weight("wo", (6, 10), placements={"tp": Shard(0)}),
        Weight("ln", (5,)),
    ]
    dst_w = [  # plan order: "ln" fills bucket 0 alone
        Weight("ln", (5,), placements={"dp": Replicate()}),
        Weight("wq", (8, 6), placements={"tp": Shard(0)}),
        Weight("wo", (6, 10), placements={"tp": Shard(1)}),
    ]
    full = _full(src_w, seed=1)
    srcs = _shards(trainer, src_w, full, rank)
    with init_job({"trainer": trainer, "rollout": rollout}, sharing="colocated") as job:
        groups = [tuple(dist.get_process_group_ranks(g)) for g in job.cache.groups()]
        assert len(groups) == len(set(groups)), groups  # one process group per rank set
        plan = plan_transfer(trainer, src_w, rollout, dst_w)
        transfer = job.transfer_groups(plan)
        _talk_only(plan, transfer, rank)
        dsts = _buffers(rollout, dst_w, rank)
        report = _run(plan, srcs, dsts, transfer, 56, rank)
        out["checked"] = _check(rollout, dst_w, dsts, full, rank, "colocated")
        out["copied"] = report.bytes_copied

        # a bad buffer on rank 6: every rank fails at the check, nothing is written anywhere
        dsts = _buffers(rollout, dst_w, rank)
        if rank == 6:
            dsts["wo"] = dsts["wo"][:, :1]
        with pytest.raises(TransferError, match=r"rank 6: MeshConfigError: dst_buffers\['wo'\]") as err:
            execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer)
        assert err.value.ranks == (6,) and err.value.stage == "check" and err.value.done == ()
        assert all(torch.isnan(t).all() for n, t in dsts.items() if not (rank == 6 and n == "wo"))

        # progress raising on rank 5 after the second bucket: every rank fails there, and the
        # weights reported done are complete on every rank
        def fail_on_5(p):
            if rank == 5 and p.bucket == 2:
                raise RuntimeError("disk full")

        dsts = _buffers(rollout, dst_w, rank)
        with pytest.raises(TransferError, match="rank 5: RuntimeError: disk full") as err:
            execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer, progress=fail_on_5)
        assert err.value.ranks == (5,) and err.value.bucket == 1 and err.value.stage == "progress"
        done = [w for w in dst_w if w.name in err.value.done]
        assert done and len(done) < len(dst_w)
        _check(rollout, done, {n: t for n, t in dsts.items() if n in err.value.done}, full, rank, "done")

        # the same call again, without the failure, completes
        dsts = _buffers(rollout, dst_w, rank)
        execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer)
        _check(rollout, dst_w, dsts, full, rank, "retry")

        # mid-transfer: rank 2 posts the sends of its first point-to-point batch with receives
        # but never those receives, and fails; its peers' sends to it stay pending and time out (on gloo that
        # closes every connection of the transfer's p2p group; the default group reports it)
        real, dropped = dist.batch_isend_irecv, []

        def sends_only(ops):
            receives = [op for op in ops if op.op is dist.irecv]
            if not receives:
                return real(ops)
            dist.batch_isend_irecv = real
            dropped.extend(receives)
            sends = [op for op in ops if op.op is not dist.irecv]
            if sends:
                real(sends)
            raise RuntimeError("injected: receives never posted")

        if rank == 2:
            dist.batch_isend_irecv = sends_only
        dsts = _buffers(rollout, dst_w, rank)
        with pytest.raises(TransferError, match="rank 2: RuntimeError: injected") as err:
            execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer, timeout=scaled(2))
        dist.batch_isend_irecv = real
        assert err.value.stage == "transfer" and 2 in err.value.ranks, err.value
        assert rank != 2 or dropped, "rank 2 had receives to drop"
        out["timed_out"] = rank in err.value.ranks  # a peer whose sends to rank 2 timed out
        # its broadcast groups may be out of step: refused, on every rank
        with pytest.raises(TransferError, match="TransferGroups cannot be used"):
            execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer)
        # the retry at once, with new groups and new source values (the next training step):
        # no receive may get a stale send of the failed call; every element checked
        transfer.close()
        transfer = job.transfer_groups(plan)
        full = _full(src_w, seed=7)
        srcs = _shards(trainer, src_w, full, rank)
        # the rollout's own parameters as buffers (leaves that require grad: written in place)
        dsts = {n: torch.nn.Parameter(t) for n, t in _buffers(rollout, dst_w, rank).items()}
        report = execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer, timeout=60)
        out["retried_received"] = report.bytes_received
        _check(rollout, dst_w, dsts, full, rank, "retry after a mid-transfer failure")

    # legacy WeightTransferGroupInitializer: one group of the sender and every receiver is the
    # plan's single fan-out when trainer rank 0 alone holds the weights (rank 7: in neither
    # layout, it takes part in the collective calls with nothing to move; bf16 weights)
    one, many = Layout(tp=1), Layout(dp=6, rank_offset=1)
    ws = [Weight("w", (4, 3), "bfloat16")]
    full = {"w": _full(ws, seed=2)["w"].to(torch.bfloat16)}
    with init_job({"trainer": one, "rollout": many}) as job:
        plan = plan_transfer(one, ws, many, ws)
        transfer = job.transfer_groups(plan)
        _, _, legacy_group, legacy_ranks, _ = WeightTransferGroupInitializer(
            rank, world, list(range(7))
        ).init_dist_group(backend="gloo")
        assert transfer.sets == [tuple(range(7))]
        if rank < 7:
            assert transfer.sets == [tuple(legacy_ranks)], (transfer.sets, legacy_ranks)
            assert dist.get_process_group_ranks(legacy_group) == legacy_ranks
            assert dist.get_process_group_ranks(transfer.group(legacy_ranks)) == legacy_ranks
            # the point-to-point group: exactly the ranks that talk (rank 7 moves nothing)
            assert dist.get_process_group_ranks(transfer.p2p) == list(range(7))
        else:
            assert legacy_group is None and transfer.group(range(7)) is None and job.roles() == ()
            assert transfer.p2p is None
        dsts = _buffers(many, ws, rank)
        report = execute(plan, _shards(one, ws, full, rank), dsts, bucket_bytes=12, groups=transfer)
        assert report.buckets == 2
        _check(many, ws, dsts, full, rank, "legacy")
        out["legacy_broadcasts"] = report.broadcasts
        reset_group_cache()

    # tags on a live group (the default one: no groups): rank 5 fails before it posts its
    # receive of bucket 0, rank 2 posts its send and fails before waiting on it. Nobody waits,
    # nothing times out, the group stays healthy, and rank 2's send of the failed call stays
    # pending; the retry (new values) must not receive it
    out["tags"] = [next_tag()]
    from_2, to_5 = Layout.from_grid([2], ("tp",)), Layout.from_grid([5], ("tp",))
    vs = [Weight("v", (6,))]
    plan = plan_transfer(from_2, vs, to_5, vs)
    real = dist.batch_isend_irecv

    def post_then_fail(ops):
        dist.batch_isend_irecv = real
        real(ops)
        raise RuntimeError("injected after posting")

    def fail_before_posting(ops):
        dist.batch_isend_irecv = real
        raise RuntimeError("injected before posting")

    dist.batch_isend_irecv = {2: post_then_fail, 5: fail_before_posting}.get(rank, real)
    stale = {"v": torch.arange(6.0)} if rank == 2 else {}
    buf = {"v": torch.full((6,), float("nan"))} if rank == 5 else {}
    with pytest.raises(TransferError, match="rank 2: RuntimeError: injected after posting") as err:
        execute(plan, stale, buf, timeout=60)
    dist.batch_isend_irecv = real
    assert err.value.ranks == (2, 5) and err.value.bucket == 0 and err.value.stage == "transfer"
    out["tags"].append(next_tag())
    fresh = {"v": torch.arange(6.0) + 100} if rank == 2 else {}
    execute(plan, fresh, buf, timeout=60)
    out["tags"].append(next_tag())
    if rank == 5:
        assert torch.equal(buf["v"], torch.arange(6.0) + 100), buf  # not the stale send's values

    # a rank that never arrives: the others fail after the timeout instead of hanging (last:
    # their unanswered status exchange stays pending on the default group)
    if rank == 7:
        time.sleep(6)
        return out
    with pytest.raises(TransferError, match="got no status from every rank in the check") as err:
        execute(plan, _shards(one, ws, full, rank), _buffers(many, ws, rank), timeout=2)
    assert err.value.ranks == () and err.value.done == ()
    return out


def test_colocated_failures_and_legacy_world8():
    results = run(worker_colocated, 8, timeout=400, pg_timeout=120)
    assert sum(r["checked"] for r in results) == 2 * (48 + 60) + 8 * 5
    assert sum(r["copied"] for r in results) > 0  # colocated: some slices are local copies
    # 4 rows of 6 B bf16, 12 B buckets: 2 buckets, one broadcast each; rank 7 in none
    assert [r["legacy_broadcasts"] for r in results] == [2] * 7 + [0]
    assert sum(r["forwards_received"] for r in results) > 0  # receivers derived their routes
    assert sum(r["timed_out"] for r in results) > 1  # rank 2 and a peer left waiting on it
    assert results[2]["retried_received"] > 0
    tags = [r["tags"] for r in results]
    assert all(t == tags[0] for t in tags), tags  # agreed: the same next tag on every rank
    assert tags[0] == sorted(set(tags[0])), tags  # and only growing, failed calls included


# ------------------------------------------------------------------------------- no processes
def test_sharing_rules_name_a_rank():
    from meshgroups.transfer.jobs import check_sharing

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
    from meshgroups.transfer.buckets import Buckets

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
        "meshgroups.transfer.buckets",
        "meshgroups.transfer.jobs",
        "meshgroups.transfer.fanout_groups",
        "meshgroups.transfer.status",
        "meshgroups.transfer.presets",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
