"""The worker of tests/elastic/test_elastic_torchrun.py, started by ``torchrun`` (one agent per node, each
with its own rendezvous and ``--max-restarts=1``)::

    MESHGROUPS_NODE_RANK=1 python -m torch.distributed.run --nnodes=1 --nproc-per-node=4 \\
        --max-restarts=1 ... -m tests.support.elastic_torchrun <store port> <heartbeat>

One code path for every worker: ``meshgroups.elastic.start`` starts the job (first run) or joins
it (``TORCHELASTIC_RESTART_COUNT`` > 0). The job is the HSDP × TP run of
``tests/support/elastic_join.py``: rank 5 (node 1) SIGKILLs itself in the middle of step 2;
node 1's agent stops its other workers and starts four new ones, which take ranks 4-7 back.
Each worker writes what it saw to the store, ``test/result/<rank>/<restart count>``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from .elastic_join import STEPS, heal_and_train, kill_self
from .elastic_train import LAYOUT_SIZES, batch, build, load, snapshot, train_step
from .timing import scaled

KILLED = 5  # the rank that SIGKILLs itself mid-step (node 1, replica 1)
WAIT = scaled(120)  # any wait of a worker: a bug fails the test, never hangs it


def result_key(rank: int, restart: int) -> str:
    return f"test/result/{rank}/{restart}"


def first_run(el, store, out) -> None:
    """Ranks 0-7 as first started: train, lose rank 5 mid-step; node 0 shrinks, trains, admits
    node 1's restarted workers, grows, heals; node 1's other workers wait for their agent."""
    from meshgroups import ExcludedError, RanksLostError

    rank = el.rank
    mg = el.mg
    model, opt = build(mg)
    for step, _ in STEPS[:2]:
        with el.step():
            train_step(model, opt, el.layout, rank, step, el=el)
    before = {"tp": mg.group("tp"), "dp_shard": mg.group("dp_shard")}
    out["lost"] = []
    try:
        try:
            with el.step():
                loss = model(batch(el.layout, rank, 2)).pow(2).mean()
                if rank == KILLED:
                    kill_self(store)
                loss.backward()
                el.commit()
                opt.step()
            raise AssertionError("the step did not fail")
        except RanksLostError as exc:
            out["lost"].append(list(exc.lost))
            out["why"] = el.verdicts[-1].why
            out["t_verdict"] = time.time()
            model.reset_iter_state()
        snap = snapshot(model, opt)
        del model, opt
        while True:  # a failure during the shrink is a new verdict: shrink again
            try:
                mg = el.shrink()
                break
            except RanksLostError as exc:
                out["lost"].append(list(exc.lost))
    except ExcludedError:
        mg = None  # node 1's worker, declared lost before it reported: its agent stops it too
    if mg is None:  # node 1: the agent stops this worker (its peer died) and starts a new one
        time.sleep(WAIT)
        raise TimeoutError(f"rank {rank}: torchrun's agent did not stop this worker within {WAIT:g}s")
    out["t_shrunk"] = time.time()
    out["kept"] = {d: mg.group(d) is g for d, g in before.items()}
    model, opt = build(mg)
    load(model, opt, snap)
    with el.step():
        train_step(model, opt, el.layout, rank, STEPS[2][0], el=el)
    out["kill_to_good_step"] = time.time() - float(store.get("test/kill_t"))
    out["spares_before"] = list(el.spares)
    # node 1's four restarted workers: wait until they all ask (the spares the agent stopped
    # are found gone here, and their ranks are free)
    out["newcomers"] = list(el.admit_newcomers(count=4, timeout=WAIT))
    out["t_admitted"] = time.time()
    out["spares_then"] = list(el.spares)
    snap = snapshot(model, opt)
    del model, opt
    mg = el.grow(list(el.spares))
    out["kept_after_grow"] = {d: mg.group(d) is g for d, g in before.items()}
    heal_and_train(el, mg, snap, out)


def main(port: int, heartbeat: float) -> None:
    started = time.time()
    from .reaper import die_with_parent

    die_with_parent()  # the agent ends: so does this worker
    from datetime import timedelta

    import torch.distributed as dist

    from meshgroups import Layout
    from meshgroups.elastic import start

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node = int(os.environ["MESHGROUPS_NODE_RANK"])
    rank = node * int(os.environ["LOCAL_WORLD_SIZE"]) + int(os.environ["LOCAL_RANK"])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=WAIT))
    out: dict = {"pid": os.getpid(), "restart": restart, "node": node, "t_start": started}
    try:
        el = start(
            Layout(**LAYOUT_SIZES),
            store,
            timeout=scaled(60),
            verdict_timeout=WAIT,
            heartbeat=heartbeat,
            stale_after=scaled(6),
            join_timeout=WAIT,
        )
        out["t_joined"] = time.time()
        out["rank"], out["world"] = el.rank, dist.get_world_size()
        if el.is_spare:  # restarted by the agent: admitted by the survivors' grow()
            heal_and_train(el, el.standby(timeout=WAIT), None, out)
        else:
            first_run(el, store, out)
        rank = el.rank
    except BaseException as exc:  # reported to the test, which fails with it
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(out["error"], file=sys.stderr, flush=True)
    out["t_done"] = time.time()
    store.set(result_key(rank, restart), json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
