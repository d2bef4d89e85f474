"""Shared by tests/elastic/test_elastic_join.py and its newcomer process: an 8-process HSDP × TP job
that loses rank 5 to SIGKILL, recovers, and admits a process started afterwards in its place.

The newcomer runs ``python -m tests.support.elastic_join <port> <heartbeat>``: started by rank
0 after the loss, with nothing but the job's store address, it joins through
``Elastic.join`` and reports to the store (``test/newcomer``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from .elastic_train import LAYOUT_SIZES, batch, build, load, replicas_equal, snapshot, train_step

#: the steps of the run: (step, dp_replicate of the layout it runs on)
STEPS = ((0, 2), (1, 2), (2, 1), (3, 2), (4, 2))


def reference(steps=STEPS):
    """The same training on one process, no mesh: the full model, each step's loss the mean of
    the data-parallel ranks' losses (what FSDP2's averaged gradients follow)."""
    import torch

    from meshgroups import Layout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step, replicas in steps:
        layout = Layout(**{**LAYOUT_SIZES, "dp_replicate": replicas})
        ranks = [int(layout.group_of(0, "dp_replicate", "dp_shard").ravel()[i]) for i in range(2 * replicas)]
        loss = torch.stack([model(batch(layout, r, step)).pow(2).mean() for r in ranks]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {f"{i}.weight": layer.weight.detach() for i, layer in enumerate(model)}


def full_params(model):
    """Every parameter gathered whole (collective over the model's mesh)."""
    return {k: v.full_tensor().detach() for k, v in model.named_parameters()}


def heal_and_train(el, mg, snap, out):
    """After grow(): build, fill the new replica, check it bit-exact, train steps 3-4, compare
    the whole model with the single-process reference."""
    import torch

    from meshgroups.elastic import fill_replicas, init_optimizer_state, training_state

    rank = el.rank
    model, opt = build(mg)
    if snap is not None:
        load(model, opt, snap)
    else:
        init_optimizer_state(model, opt)
    report = fill_replicas(el.layout, el.dim, el.grown, training_state(model, opt))
    out["received"] = report.bytes_received
    out["healed_equal"] = replicas_equal(snapshot(model, opt), mg.group("dp_replicate"))
    for step, _ in STEPS[3:]:
        with el.step():
            train_step(model, opt, el.layout, rank, step, el=el)
    out["equal_after"] = replicas_equal(snapshot(model, opt), mg.group("dp_replicate"))
    ref = reference()
    got = full_params(model)
    out["vs_reference"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    out["reference_close"] = all(torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
    el.close()
    return out


def newcomer(port: int, heartbeat: float) -> None:
    """The process started after the loss (see the module docstring)."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshgroups.elastic import Elastic

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    out: dict = {"pid": os.getpid()}
    try:
        el = Elastic.join(store, timeout=300)
        out["rank"] = el.rank
        out["world"] = dist.get_world_size()
        mg = el.standby(timeout=300)
        out["layout"] = el.layout.to_dict()
        heal_and_train(el, mg, None, out)
    except BaseException as exc:  # reported to the job, which fails the test with it
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(out["error"], file=sys.stderr, flush=True)
    dist.PrefixStore("0/", store).set("test/newcomer", json.dumps(out))  # where the job's default store reads


def kill_self(store) -> None:
    """SIGKILL this process, the time written first (the survivors measure from it)."""
    store.set("test/kill_t", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from .reaper import die_with_parent

    die_with_parent()
    newcomer(int(sys.argv[1]), float(sys.argv[2]))
