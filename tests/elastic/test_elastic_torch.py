"""Elastic meshes on real gloo processes: lose a rank mid-step, agree, shrink, keep training, heal.

The store is hosted by this (parent) test process, outside the workers, as torchrun's agent
store is: losing any worker, rank 0 included, leaves it up. Every wait is scaled
(MESHGROUPS_TEST_TIME_SCALE); collectives of the mesh time out after ``T`` seconds.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from meshgroups import Layout

from ..support.dist import run, scaled
from ..support.elastic_train import (
    LAYOUT_SIZES,
    batch,
    build,
    connect,
    load,
    replicas_equal,
    snapshot,
    train_step,
)

pytestmark = pytest.mark.processes  # every test here starts processes

T = 6.0  # nominal seconds: the mesh's collective timeout


def _elastic(layout, spares):
    from meshgroups.elastic._elastic_mesh import Elastic

    # stale_after: generous, so a live rank whose heartbeat thread a loaded machine starves is
    # not taken for dead; verdict_timeout: generous too, so a live rank that a loaded machine
    # slows on its way to the verdict is waited for (the dead are found by their heartbeats,
    # so a verdict with a death in it never waits this long)
    return Elastic(
        layout,
        spares=spares,
        timeout=scaled(T),
        verdict_timeout=scaled(60),
        heartbeat=scaled(0.2),
        stale_after=scaled(6),
    )


def worker_core(rank, world, port, ckpt):
    """HSDP × TP on ranks 0-7, spare 8. Rank 5 dies mid-step 2; survivors shrink to
    dp_replicate=1, keep training (checked against a reference run), then heal with 4, 6, 7, 8."""
    from meshgroups import GroupCache, RanksLostError, init_mesh

    connect(rank, world, port, scaled(60))
    out = {}
    layout = Layout(**LAYOUT_SIZES)
    el = _elastic(layout, spares=(8,))
    if rank == 8:
        return _spare_heals(el, out)
    mg = el.mg
    model, opt = build(mg)
    for step in range(2):
        with el.step():
            train_step(model, opt, el.layout, rank, step, el=el)
    before = {"tp": mg.group("tp"), "dp_shard": mg.group("dp_shard")}
    known = {id(g) for g in el.cache.groups()}
    started = time.monotonic()
    try:
        with el.step():
            train_step(model, opt, el.layout, rank, 2, die_rank=5, el=el)
        raise AssertionError("the step did not fail")
    except RanksLostError as exc:
        out["lost"], out["elapsed"], out["message"] = exc.lost, time.monotonic() - started, str(exc)
        out["bound"] = el.verdict_timeout + scaled(T)
        model.reset_iter_state()  # FSDP2: the failed step's unsharded parameters out
    assert out["lost"] == (5,) and "rank 5 lost" in out["message"], out
    assert out["elapsed"] < out["bound"], out
    snap = snapshot(model, opt)  # step 2 never reached the optimizer: the state after step 1
    del model, opt
    mg = el.shrink()
    if mg is None:  # 4, 6, 7: their replica was dropped; they wait as spares
        assert rank in (4, 6, 7) and el.is_spare
        out["spare"] = True
        return _spare_heals(el, out)
    # Kept groups are the same objects; no group made after the failure holds rank 5.
    out["kept"] = {d: mg.group(d) is g for d, g in before.items()}
    assert all(out["kept"].values()), out["kept"]
    created = [dist.get_process_group_ranks(g) for g in el.cache.groups() if id(g) not in known]
    assert created and all(5 not in r for r in created), created
    assert dist.get_process_group_ranks(el.live_group) == [0, 1, 2, 3]
    # Keep training on dp_replicate=1; a reference run on a fresh mesh from the same state.
    # The reference's parameters come back through DCP, saved on the new mesh over el.live_group (the
    # default group holds the dead rank: DCP gets the survivors' group).
    import torch
    import torch.distributed.checkpoint as dcp

    runs = {}
    for name in ("recovered", "reference"):
        ref = None if name == "recovered" else init_mesh(el.layout, cache=GroupCache(), strategy="local")
        model, opt = build(mg if ref is None else ref)
        load(model, opt, snap)
        if ref is None:
            dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt, process_group=el.live_group)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().zero_()
            dcp.load({"model": model.state_dict()}, checkpoint_id=ckpt, process_group=el.live_group)
        losses = [train_step(model, opt, el.layout, rank, s) for s in (3, 4)]
        runs[name] = (losses, snapshot(model, opt))
        if ref is not None:
            del model, opt
            ref.close()
        else:
            kept_model, kept_opt = model, opt
    assert runs["recovered"][0] == runs["reference"][0], runs
    for k, v in runs["recovered"][1].items():
        assert v.equal(runs["reference"][1][k]), k
    out["losses"] = runs["recovered"][0]
    # Heal: 4, 6, 7 and 8 come back as replica 1.
    snap = snapshot(kept_model, kept_opt)
    del kept_model, kept_opt
    mg = el.grow([4, 6, 7, 8])
    return _after_heal(el, mg, rank, out, snap)


def _spare_heals(el, out):
    mg = el.standby(timeout=scaled(120))
    out["admitted"] = True
    return _after_heal(el, mg, dist.get_rank(), out, None)


def _after_heal(el, mg, rank, out, snap):
    from meshgroups.elastic._heal import fill_replicas, init_optimizer_state, training_state

    assert el.layout.size("dp_replicate") == 2 and el.grown == (1,)
    model, opt = build(mg)
    if snap is not None:
        load(model, opt, snap)
    else:
        init_optimizer_state(model, opt)
    report = fill_replicas(el.layout, "dp_replicate", el.grown, training_state(model, opt))
    out["received"] = report.bytes_received
    same = replicas_equal(snapshot(model, opt), mg.group("dp_replicate"))
    assert same is True, same
    out["losses_after_heal"] = [train_step(model, opt, el.layout, rank, s) for s in (5, 6)]
    same = replicas_equal(snapshot(model, opt), mg.group("dp_replicate"))
    assert same is True, same
    # A step that fails inside forward() leaves FSDP2's unsharded parameters registered: the
    # state is refused, not read without the optimizer's; torch's reset_iter_state() mends it.
    hook = model[1].register_forward_hook(_fail_forward)
    with pytest.raises(RuntimeError, match="a peer timed out"):
        model(batch(el.layout, rank, 7))
    hook.remove()
    with pytest.raises(ValueError, match="reset_iter_state"):
        training_state(model, opt)
    model.reset_iter_state()
    assert (
        sorted(training_state(model, opt)) == sorted(snapshot(model, opt)) and len(snapshot(model, opt)) == 8
    )
    el.close()
    return out


def _fail_forward(*_):
    raise RuntimeError("a peer timed out")


def _host_store():
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=scaled(300))
    )


@pytest.mark.timeout(900)
def test_lose_a_rank_shrink_keep_training_and_heal(tmp_path):
    store = _host_store()
    results = run(
        worker_core,
        9,
        store.port,
        str(tmp_path / "ckpt"),
        backend=None,
        may_exit={5},
        timeout=300,
        port_retries=0,
    )
    assert results[5] is None
    for r in (0, 1, 2, 3):
        assert results[r]["kept"] == {"tp": True, "dp_shard": True}
    for r in (4, 6, 7):
        assert results[r]["spare"] and results[r]["admitted"]
    assert results[8]["admitted"]
    for r in (0, 1, 2, 3, 4, 6, 7):
        assert results[r]["lost"] == (5,)
    for r in (4, 6, 7, 8):
        assert results[r]["received"] > 0


def worker_scenarios(rank, world, port):
    """dp_replicate=3 × tp=2 on ranks 0-5, one replica per node of 2 ranks, spare node 6-7.
    1. rank 0 dies (the store is this test's, not rank 0's): the spare node replaces node 0-1;
    2. rank 3 dies in the next step (two failures in a row): shrink; 3. rank 5 dies during that
    recovery: one verdict, and the retried shrink works; training goes on every time."""
    from meshgroups import RanksLostError
    from meshgroups.elastic._heal import fill_replicas, training_state

    connect(rank, world, port, scaled(60))
    out = {"lost": [], "why": []}
    layout = Layout(dp_replicate=3, dp_shard=1, tp=2)
    el = _elastic(layout, spares=(6, 7))
    mg = el.mg if not el.is_spare else el.standby(timeout=scaled(200))
    step = 0

    def guarded(model, opt, die_rank=None):
        nonlocal step
        step += 1
        started = time.monotonic()
        try:
            with el.step():
                train_step(model, opt, el.layout, rank, step, die_rank=die_rank, el=el)
            return None
        except RanksLostError as exc:
            assert time.monotonic() - started < el.verdict_timeout + scaled(T), exc
            model.reset_iter_state()  # FSDP2: the failed step's unsharded parameters out
            out["lost"].append(exc.lost)
            out["why"].append(el.verdicts[-1].why)
            return exc

    def fresh(mg, fill=True):
        model, opt = build(mg)
        if snap is not None and rank in snap_owner:
            load(model, opt, snap)
        else:
            from meshgroups.elastic._heal import init_optimizer_state

            init_optimizer_state(model, opt)
        if fill:
            fill_replicas(el.layout, "dp_replicate", el.grown, training_state(model, opt))
        return model, opt

    snap, snap_owner = None, ()
    if rank in (6, 7):  # admitted by the substitution below
        model, opt = fresh(mg)
    else:
        model, opt = build(mg)
        failed = guarded(model, opt)
        assert failed is None, failed
        before = {"tp": mg.group("tp")}
        assert isinstance(failed := guarded(model, opt, die_rank=0), RanksLostError), failed
        snap, snap_owner = snapshot(model, opt), (2, 3, 4, 5)
        del model, opt
        mg = el.substitute(node=2)
        if mg is None:  # rank 1: its node was replaced
            assert rank == 1 and el.is_spare
            el.close()
            return out
        out["kept_tp"] = mg.group("tp") is before["tp"]
        model, opt = fresh(mg)
    assert el.layout.grid.ravel().tolist() == [6, 7, 2, 3, 4, 5]
    same = replicas_equal(snapshot(model, opt), mg.group("dp_replicate"))
    assert same is True, same
    # 2. Two failures in a row: rank 3 dies mid-step; 3. rank 5 dies during the shrink.
    assert isinstance(failed := guarded(model, opt, die_rank=3), RanksLostError), failed
    snap, snap_owner = snapshot(model, opt), (4, 5, 6, 7)
    del model, opt
    if rank == 5:
        import os

        import meshgroups.elastic._recover

        meshgroups.elastic._recover._retire_out_of_step = lambda *a, **k: os._exit(0)
    try:
        mg = el.shrink()
    except RanksLostError as exc:  # the recovery itself failed: one verdict, then the retry
        out["lost"].append(exc.lost)
        out["why"].append(el.verdicts[-1].why)
        # the meeting saw rank 5 die (its heartbeat), it did not wait out its timeout
        out["recovery_failure"] = exc.cause
        mg = el.shrink()
    else:  # rank 2: its replica was dropped before the rebuild; it is a spare and leaves
        assert rank == 2 and mg is None and el.is_spare, (rank, mg)
        el.close()
        return out
    if mg is None:
        assert rank == 4 and el.is_spare
        el.close()
        return out
    assert el.layout.grid.ravel().tolist() == [6, 7]
    model, opt = build(mg)
    load(model, opt, snap)
    failed = guarded(model, opt)
    assert failed is None, failed
    out["epoch"] = el.epoch
    el.close()
    return out


@pytest.mark.timeout(900)
def test_rank0_lost_node_substituted_two_failures_and_a_failure_during_recovery():
    store = _host_store()
    results = run(
        worker_scenarios, 8, store.port, backend=None, may_exit={0, 3, 5}, timeout=400, port_retries=0
    )
    assert [results[r] for r in (0, 3, 5)] == [None] * 3
    for r in (2, 4):
        assert results[r]["lost"][0] == (0,) and results[r]["kept_tp"]
    assert results[2]["lost"] == [(0,), (3,)]
    for r in (6, 7):
        assert results[r]["lost"] == [(3,), (5,)], results[r]
    assert results[4]["lost"] == [(0,), (3,), (5,)]
    assert results[1]["lost"] == [(0,)]
    # Every death was found by liveness (the process gone, or its heartbeat stopped), never by a
    # verdict's timeout running out; the death during the recovery was seen by the recovery's
    # own meeting.
    for r in (1, 2, 4, 6, 7):
        whys = results[r]["why"]
        assert whys and all(" exited" in w or " stopped responding" in w for w in whys), results[r]
        assert not any("did not report within" in w for w in whys), results[r]
    for r in (4, 6, 7):
        failure = results[r]["recovery_failure"]
        assert "RanksGoneError" in failure and "rank 5 never reached" in failure, results[r]


def worker_step_failed(rank, world, port):
    """Nobody dies: rank 1 raises before a tp all_reduce that rank 0 makes (and times out in).
    Every rank gets StepFailedError with nobody lost; rebuild() retires the out-of-step tp group
    {0, 1} (its members issued different numbers of collectives) and keeps {2, 3} as is."""
    import torch

    from meshgroups import StepFailedError

    connect(rank, world, port, scaled(60))
    el = _elastic(Layout(dp_replicate=2, tp=2), spares=())
    mg = el.mg
    tp = mg.group("tp")
    try:
        with el.step():
            if rank == 1:
                raise ValueError("a bad batch on rank 1")
            if rank == 0:
                dist.all_reduce(torch.ones(1), group=tp)  # rank 1 never comes: a timeout
            el.commit()
        raise AssertionError("the step did not fail")
    except StepFailedError as exc:
        assert exc.lost == () and "a bad batch on rank 1" in exc.cause, exc
        assert type(exc) is StepFailedError
    mg = el.rebuild()
    same = mg.group("tp") is tp
    assert same == (rank in (2, 3)), (rank, same)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mg.group("tp"))
    assert t.item() == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[rank]
    # A rank still finishing step 1 when a peer fails in step 2 (rank 3 holds on until rank 2's
    # failure is published): its step 1 succeeded, and it fails in step 2, as the rest.
    from meshgroups.elastic._verdict import failure_published

    epoch = el.epoch
    with el.step():
        dist.all_reduce(torch.ones(1), group=mg.group("tp"))
        deadline = time.monotonic() + scaled(60)
        while rank == 3 and not failure_published(el.store, epoch):
            assert time.monotonic() < deadline, "rank 2's failure was never published"
            time.sleep(0.05)
    try:
        with el.step():
            if rank == 2:
                raise ValueError("a bad batch on rank 2 in step 2")
            el.commit()  # ranks 0, 1 and 3: aborted by rank 2's failure
        raise AssertionError("step 2 did not fail")
    except StepFailedError as exc:
        assert exc.epoch == epoch and "a bad batch on rank 2 in step 2" in exc.cause, exc
    el.close()
    return same


def test_a_step_failed_with_everyone_alive_replaces_out_of_step_groups_only():
    store = _host_store()
    assert run(worker_step_failed, 4, store.port, backend=None, timeout=200, port_retries=0) == [
        False,
        False,
        True,
        True,
    ]
