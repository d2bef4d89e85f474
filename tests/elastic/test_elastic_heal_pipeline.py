"""Shrink → grow → heal with a two-stage pipeline model on 9 real gloo processes: each stage
holds its own parameters (``stage0.*``, ``stage1.*``); after the lost replica is healed both
replicas equal the survivors' state bit for bit, stage by stage, and stay equal for more steps."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from ..support.dist import run, scaled
from ..support.elastic_train import connect, local, replicas_equal

pytestmark = pytest.mark.processes  # every test here starts processes

T = 6.0
SIZES = {"pp": 2, "dp_replicate": 2, "tp": 2}  # rank = 4 pp + 2 dp_replicate + tp; spare 8


def _build(mg, rank, layout):
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    stage = layout.coords(rank)["pp"]
    torch.manual_seed(stage)  # each stage its own weights
    seq = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    parallelize_module(seq, mg.mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    model = torch.nn.ModuleDict({f"stage{stage}": seq})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt, mg, layout, rank, step, el=None, die_rank=None):
    """One pipeline step: stage 0 forwards its batch to stage 1 (p2p over pp), stage 1 takes
    the loss and sends the activation's gradient back; gradients averaged over dp_replicate."""
    import torch

    c = layout.coords(rank)
    peer = layout.rank_at(**dict(c, pp=1 - c["pp"]))
    (seq,) = model.values()
    pp = mg.group("pp")
    if c["pp"] == 0:
        g = torch.Generator().manual_seed(1000 * step + c["dp_replicate"])
        h = seq(torch.randn(4, 8, generator=g))
        dist.send(h.detach().contiguous(), peer, group=pp)
        grad = torch.empty_like(h)
        dist.recv(grad, peer, group=pp)
        h.backward(grad)
    else:
        h = torch.empty(4, 8)
        dist.recv(h, peer, group=pp)
        h.requires_grad_(True)
        seq(h).pow(2).mean().backward()
        if die_rank == rank:
            os._exit(0)
        dist.send(h.grad.contiguous(), peer, group=pp)
    if layout.size("dp_replicate") > 1:
        for p in model.parameters():
            dist.all_reduce(local(p.grad), group=mg.group("dp_replicate"))
            local(p.grad).div_(layout.size("dp_replicate"))
    if el is not None:
        el.commit()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt):
    from meshgroups.elastic._heal import training_state

    return {k: local(v).detach().clone() for k, v in training_state(model, opt).items()}


def _heal(el, mg, rank, out, snap):
    from meshgroups.elastic._heal import fill_replicas, init_optimizer_state, training_state

    layout = el.layout
    model, opt = _build(mg, rank, layout)
    init_optimizer_state(model, opt)
    if snap is None:  # a new replica: zero everything, so only the heal can make it right
        import torch

        with torch.no_grad():
            for v in training_state(model, opt).values():
                local(v).zero_()
    else:  # a survivor keeps its state (its coordinates on every dim but dp_replicate kept)
        import torch

        with torch.no_grad():
            for k, v in training_state(model, opt).items():
                local(v).copy_(snap[k])
    report = fill_replicas(layout, "dp_replicate", el.grown, training_state(model, opt))
    out["received"] = report.bytes_received
    out["names"] = sorted(training_state(model, opt))
    out["stage"] = layout.coords(rank)["pp"]
    healed = _snapshot(model, opt)
    # both replicas equal, stage by stage: a healed rank holds its own stage's state
    same = replicas_equal(healed, mg.group("dp_replicate"))
    assert same is True, same
    for step in (5, 6, 7):
        _step(model, opt, mg, layout, rank, step)
    same = replicas_equal(_snapshot(model, opt), mg.group("dp_replicate"))
    assert same is True, same
    out["after"] = {k: v.sum().item() for k, v in _snapshot(model, opt).items()}
    el.close()
    return out


def worker(rank, world, port):
    from meshgroups import Layout, RanksLostError
    from meshgroups.elastic._elastic_mesh import Elastic

    connect(rank, world, port, scaled(60))
    el = Elastic(
        Layout(**SIZES),
        spares=(8,),
        timeout=scaled(T),
        verdict_timeout=scaled(60),
        heartbeat=scaled(0.2),
        stale_after=scaled(6),
    )
    out = {}
    if rank == 8:
        return _heal(el, el.standby(timeout=scaled(120)), rank, out, None)
    mg = el.mg
    model, opt = _build(mg, rank, el.layout)
    for step in range(2):
        with el.step():
            _step(model, opt, mg, el.layout, rank, step, el=el)
    try:
        with el.step():
            _step(model, opt, mg, el.layout, rank, 2, el=el, die_rank=7)
        raise AssertionError("the step did not fail")
    except RanksLostError as exc:
        out["lost"] = exc.lost
    snap = _snapshot(model, opt)  # the state after step 1 on every survivor
    del model, opt
    mg = el.shrink()
    if mg is None:  # 2, 3, 6: their replica was dropped
        return _heal(el, el.standby(timeout=scaled(120)), rank, out, None)
    model, opt = _build(mg, rank, el.layout)
    import torch

    from meshgroups.elastic._heal import init_optimizer_state, training_state

    init_optimizer_state(model, opt)
    with torch.no_grad():
        for k, v in training_state(model, opt).items():
            local(v).copy_(snap[k])
    for step in (3, 4):  # the survivors keep training alone
        with el.step():
            _step(model, opt, mg, el.layout, rank, step, el=el)
    snap = _snapshot(model, opt)
    out["before_heal"] = {k: v.sum().item() for k, v in snap.items()}
    del model, opt
    mg = el.grow([2, 3, 6, 8])
    return _heal(el, mg, rank, out, snap)


def _host_store():
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=scaled(300))
    )


@pytest.mark.timeout(900)
def test_shrink_grow_heal_a_two_stage_pipeline():
    store = _host_store()
    results = run(worker, 9, store.port, backend=None, may_exit={7}, timeout=300, port_retries=0)
    assert results[7] is None
    for r in (0, 1, 4, 5):  # the survivors
        assert results[r]["lost"] == (7,)
    for r in (2, 3, 6, 8):  # the new replica, healed: stage-specific names, its own stage's
        assert results[r]["received"] > 0
    # every rank holds its own stage's parameters and optimizer state, healed ones included
    for res in results:
        if res is not None:
            assert {n.split(".")[0] for n in res["names"]} == {f"stage{res['stage']}"}, res["names"]
    stages = {res["stage"] for res in results if res is not None}
    assert stages == {0, 1}
