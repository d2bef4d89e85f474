"""A SIGKILLed rank costs a fraction of a second of liveness, not the collective timeout, and a
process started afterwards takes its place (issue 51), on 8 real gloo processes + 1.

The store is hosted by this (parent) test process, as torchrun's agent hosts it. HSDP × TP
(dp_replicate=2 × dp_shard=2 × tp=2); rank 5 is SIGKILLed in the middle of step 2. The
collective timeout is long (``T_COLLECTIVE``): the bound on kill -> next good step is a multiple
of the heartbeat interval, far below it, so only liveness (and the woken collectives) can meet
it. Then rank 0 starts a brand-new process with the store's address; the survivors admit it as
rank 5, grow back to two replicas (4, 6, 7 were spares after the shrink), heal the new replica
bit-exact through the transfer plan, train on, and the whole model equals a single-process
reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from meshgroups import Layout

from ..support.dist import run, scaled
from ..support.elastic_train import LAYOUT_SIZES, batch, build, connect, load, snapshot, train_step

pytestmark = pytest.mark.processes  # every test here starts processes

HEARTBEAT = scaled(0.25)  # the liveness interval of the job
T_COLLECTIVE = scaled(60)  # the mesh's collective timeout: what a timer-bound recovery would wait
BOUND = 10 * HEARTBEAT  # kill -> next good step (measured ~1.2 s at scale 1: 5 intervals)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _host_store():
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=scaled(300))
    )


def worker(rank, world, port):
    from meshgroups import RanksLostError
    from meshgroups.elastic import Elastic
    from meshgroups.mesh import default_store

    from ..support.elastic_join import STEPS, heal_and_train, kill_self

    connect(rank, world, port, scaled(60))
    store = default_store()
    el = Elastic(
        Layout(**LAYOUT_SIZES),
        timeout=T_COLLECTIVE,
        verdict_timeout=scaled(120),
        heartbeat=HEARTBEAT,
        stale_after=scaled(6),
    )
    out = {}
    mg = el.mg
    model, opt = build(mg)
    for step, _ in STEPS[:2]:
        with el.step():
            train_step(model, opt, el.layout, rank, step, el=el)
    before = {"tp": mg.group("tp"), "dp_shard": mg.group("dp_shard")}
    try:
        with el.step():
            loss = model(batch(el.layout, rank, 2)).pow(2).mean()
            if rank == 5:
                kill_self(store)
            loss.backward()
            el.commit()
            opt.step()
        raise AssertionError("the step did not fail")
    except RanksLostError as exc:
        out["lost"], out["why"] = exc.lost, el.verdicts[-1].why
        model.reset_iter_state()
    snap = snapshot(model, opt)
    del model, opt
    mg = el.shrink()
    if mg is None:  # 4, 6, 7: their replica was dropped; spares until the newcomer arrives
        out["spare"] = True
        return heal_and_train(el, el.standby(timeout=scaled(240)), None, out)
    out["kept"] = {d: mg.group(d) is g for d, g in before.items()}
    model, opt = build(mg)
    load(model, opt, snap)
    with el.step():
        train_step(model, opt, el.layout, rank, STEPS[2][0], el=el)
    out["kill_to_good_step"] = time.time() - float(store.get("test/kill_t"))
    # A brand-new process, started now with the store's address only.
    proc = None
    if rank == 0:
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"newcomer-{port}.log"), "w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-X",
                "faulthandler",
                "-m",
                "tests.support.elastic_join",
                str(port),
                str(HEARTBEAT),
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    out["newcomers"] = el.admit_newcomers(count=1, timeout=scaled(120))
    out["spares_then"] = el.spares
    snap = snapshot(model, opt)
    del model, opt
    mg = el.grow([4, 5, 6, 7])
    out["kept_after_grow"] = {d: mg.group(d) is g for d, g in before.items()}
    heal_and_train(el, mg, snap, out)
    if proc is not None:
        proc.wait(timeout=scaled(120))
        out["newcomer"] = json.loads(store.get("test/newcomer"))
        out["newcomer_exit"] = proc.returncode
    return out


def test_sigkill_costs_liveness_not_timeout_and_a_new_process_takes_its_place():
    store = _host_store()
    results = run(worker, 8, store.port, backend=None, may_exit={5}, timeout=400, port_retries=0)
    assert results[5] is None
    for r in (0, 1, 2, 3, 4, 6, 7):
        res = results[r]
        assert res["lost"] == (5,) and res["why"] == "rank 5 exited", res
        assert res["healed_equal"] is True and res["equal_after"] is True, res
        assert res["reference_close"], (r, res["vs_reference"])
    for r in (0, 1, 2, 3):
        res = results[r]
        assert res["kept"] == {"tp": True, "dp_shard": True}, res
        # Untouched groups survive the grow too: tp {0,1}/{2,3} and dp_shard {0,2}/{1,3}.
        assert res["kept_after_grow"] == {"tp": True, "dp_shard": True}, res
        assert res["kill_to_good_step"] < BOUND < T_COLLECTIVE, (res["kill_to_good_step"], BOUND)
        assert res["newcomers"] == (5,) and res["spares_then"] == (4, 5, 6, 7), res
    for r in (4, 6, 7):
        assert results[r]["spare"] and results[r]["received"] > 0
    new = results[0]["newcomer"]
    assert results[0]["newcomer_exit"] == 0 and "error" not in new, new
    assert new["rank"] == 5 and new["world"] == 8 and new["pid"] not in (None, 0)
    assert new["received"] > 0 and new["healed_equal"] is True and new["equal_after"] is True, new
    assert new["reference_close"], new["vs_reference"]
