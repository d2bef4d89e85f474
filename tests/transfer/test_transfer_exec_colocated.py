"""Weight transfer on real gloo processes (world 8), colocated and failing: one spawned job.

Collective calls checked across ranks (``init_job``, ``TransferGroups``, plans that do not pair
up), colocated layouts with local copies, failures on one rank (a bad buffer, a progress
callback, receives never posted mid-transfer, a rank that never arrives) each followed by a
retry checked element for element, tags that keep a failed call's pending send from a retry,
and the legacy one-group ``WeightTransferGroupInitializer`` case.
"""

from __future__ import annotations

import pytest

from meshgroups import Layout, LayoutError

from ..support.dist import run, scaled
from ..support.transfer_exec_util import _buffers, _check, _full, _run, _sends_only, _shards, _talk_only

pytestmark = pytest.mark.processes  # every test here starts processes


def _checked_calls(rank, out):
    """``init_job`` and ``TransferGroups`` are collective calls checked across ranks; parts of
    different plans are refused before any group or data moves."""
    import torch

    from meshgroups import MeshConfigError, MismatchError, Topology
    from meshgroups.mesh._torch_seam import held_group_count
    from meshgroups.transfer import Shard, Weight, plan_transfer
    from meshgroups.transfer._run.execute import TransferError, execute
    from meshgroups.transfer._run.jobs import init_job

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


def _colocated_and_failures(rank, out):
    """Colocated trainer tp=2 × dp=4 -> rollout tp=4 × dp=2, then failures on one rank, each
    followed by a retry checked element for element."""
    import torch
    import torch.distributed as dist

    from meshgroups.transfer import Replicate, Shard, Weight, plan_transfer
    from meshgroups.transfer._run.execute import TransferError, execute
    from meshgroups.transfer._run.jobs import init_job

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
        # but never those receives, and fails. One bucket at a time (overlap=False), its peers'
        # sends to it stay pending and time out (on gloo that closes every connection of the
        # transfer's p2p group; the default group reports it). Overlapped, that batch is the
        # next bucket's, posted ahead: the agreement of the bucket in hand reports rank 2's
        # failure before any peer waits on it — rank 2 alone fails, nobody times out.
        real = dist.batch_isend_irecv
        for overlap in (False, True):
            dropped: list = []
            if rank == 2:
                dist.batch_isend_irecv = _sends_only(real, dropped)
            dsts = _buffers(rollout, dst_w, rank)
            with pytest.raises(TransferError, match="rank 2: RuntimeError: injected") as err:
                execute(
                    plan, srcs, dsts, bucket_bytes=56, groups=transfer, timeout=scaled(2), overlap=overlap
                )
            dist.batch_isend_irecv = real
            assert err.value.stage == "transfer" and 2 in err.value.ranks, err.value
            assert rank != 2 or dropped, "rank 2 had receives to drop"
            if overlap:
                assert err.value.ranks == (2,), err.value
            else:
                out["timed_out"] = rank in err.value.ranks  # a peer whose sends to rank 2 timed out
            # its broadcast groups may be out of step: refused, on every rank
            with pytest.raises(TransferError, match="TransferGroups cannot be used"):
                execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer)
            transfer.close()
            transfer = job.transfer_groups(plan)
        # the retry at once, with new groups and new source values (the next training step):
        # no receive may get a stale send of the failed call; every element checked
        full = _full(src_w, seed=7)
        srcs = _shards(trainer, src_w, full, rank)
        # the rollout's own parameters as buffers (leaves that require grad: written in place)
        dsts = {n: torch.nn.Parameter(t) for n, t in _buffers(rollout, dst_w, rank).items()}
        report = execute(plan, srcs, dsts, bucket_bytes=56, groups=transfer, timeout=60)
        out["retried_received"] = report.bytes_received
        _check(rollout, dst_w, dsts, full, rank, "retry after a mid-transfer failure")


def _legacy(rank, world, out):
    import torch
    import torch.distributed as dist
    from meshgroups.compat.group_initializer import WeightTransferGroupInitializer, reset_group_cache

    from meshgroups.transfer import Weight, plan_transfer
    from meshgroups.transfer._run.execute import execute
    from meshgroups.transfer._run.jobs import init_job

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
    return one, many, ws, full


def _tags_on_a_live_group(rank, out):
    import torch
    import torch.distributed as dist

    from meshgroups.transfer import Weight, plan_transfer
    from meshgroups.transfer._run.execute import TransferError, execute
    from meshgroups.transfer._run.status import next_tag

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
    return plan


def worker_colocated(rank, world):
    import time

    from meshgroups.transfer._run.execute import TransferError, execute

    out = {}
    _checked_calls(rank, out)
    _colocated_and_failures(rank, out)
    one, many, ws, full = _legacy(rank, world, out)
    plan = _tags_on_a_live_group(rank, out)
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
