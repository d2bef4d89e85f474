"""Per-rank cost of recovering from one lost node: the elastic path (recovery plan + only the
changed groups + the new root mesh) against a restart (destroy every group and the default
group, re-initialise on the survivors, ``init_mesh``) and the torchft model (only the replicate
dim's group rebuilt, no mesh).

Run: ``python benchmarks/bench_elastic.py [--repeat 3] [--worlds 1024,16384,131072]
[--global-max-world 16384]``

Times are this process's CPU time (``time.process_time``): the fake backend does no I/O, so
that is the work done, and a loaded machine's waiting for a core does not count.

Fake backend: one process acts as rank W//3+7 of a world of W (a survivor in an intact replica);
each measurement runs in a fresh process; runs of the methods interleave and the fastest of
``--repeat`` is shown (a shared machine's load only ever adds time). The layout is 4-D
(pp, dp, cp, tp) with tp=8 = one node; the node holding ranks (pp=0, dp=1, cp=0, tp=*) is lost,
so the dp replica 1 is dropped (its other ranks become spares) and the survivors' layout is
``layout.select("dp", [0, 2, 3, ...])``. Families: every dim plus the flattened dp_cp and
dp_cp_tp (FSDP/HSDP's data dims).

- ``elastic``: ``plan_shrink`` (and its new layout), then the new ``MeshGroups`` through the old
  mesh's GroupCache — ``meshgroups.recover.rebuild`` (the torch side; local meshes only), or for
  the global strategy ``init_mesh`` on the same cache and closing the old mesh — then the root
  mesh.
- ``restart``: the old mesh closed, ``destroy_process_group()``, ``init_process_group`` on the
  survivors renumbered densely, ``init_mesh`` of the renumbered layout, the root mesh.
- ``torchft``: one ``new_group`` over this rank's new dp group (what torchft's replicate-only
  model reconfigures), no DeviceMesh.

"new_group calls" counts every creation call on this rank (including the one-rank pads the local
strategy makes to keep torch's group counts aligned); "groups created" the groups it is a member
of — on real hardware, each is a communicator to set up, the dominant cost fake groups don't
show. Both strategies are measured (the restart with the strategy of the elastic path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FLATTEN = (("dp", "cp"), ("dp", "cp", "tp"))


def shape_for(world: int) -> dict[str, int]:
    tp, cp = 8, 4 if world >= 16384 else 2
    pp = 16 if world >= 131072 else 8 if world >= 16384 else 4
    return {"pp": pp, "dp": world // (pp * cp * tp), "cp": cp, "tp": tp}


def one_fake(method: str, strategy: str, world: int) -> dict[str, float]:
    """One measurement in this (fresh) process; returns seconds and counts."""
    import torch.distributed as dist
    import torch.distributed.device_mesh  # imports stay outside the timing
    import torch.distributed.tensor.debug  # noqa: F401  (MeshGroups.close clears its caches)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshgroups import GroupCache, Layout, Topology, init_mesh
    from meshgroups.elastic import plan_shrink

    try:
        from meshgroups.recover import rebuild  # the torch side (branch i28t), when merged
    except ImportError:
        rebuild = None

    sizes = shape_for(world)
    layout = Layout(sizes)
    rank = world // 3 + 7
    lost = [layout.rank_at(pp=0, dp=1, cp=0, tp=t) for t in range(sizes["tp"])]
    assert layout.coords(rank)["dp"] != 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    cache = GroupCache()
    old = init_mesh(layout, flatten=FLATTEN, strategy=strategy, cache=cache, check=False)
    old.mesh  # noqa: B018  the old root, as a training job holds it
    calls, created = cache.calls, cache.created
    plan_seconds = 0.0
    t0 = time.process_time()
    if method == "elastic":
        plan = plan_shrink(layout, lost, topology=Topology(node=sizes["tp"]), flatten=FLATTEN)
        new_layout = plan.new_layout
        plan_seconds = time.process_time() - t0
        if rebuild is not None and strategy == "local":  # rebuild() is for local meshes only
            new = rebuild(old, new_layout)
        else:
            new = init_mesh(new_layout, flatten=FLATTEN, strategy=strategy, cache=cache, check=False)
            old.close()
        root = new.mesh
        seconds = time.process_time() - t0
        counts = (cache.calls - calls, cache.created - created)
        assert root.get_coordinate() is not None and new.ranks("tp") == old_tp(layout, rank)
    elif method == "restart":
        old.close()
        dist.destroy_process_group()
        survivors = (sizes["dp"] - 1) * world // sizes["dp"]
        new_rank = rank - (world // sizes["dp"] if layout.coords(rank)["dp"] > 1 else 0)
        dist.init_process_group("fake", store=FakeStore(), rank=new_rank, world_size=survivors)
        fresh = GroupCache()
        new = init_mesh(
            Layout({**sizes, "dp": sizes["dp"] - 1}),
            flatten=FLATTEN,
            strategy=strategy,
            cache=fresh,
            check=False,
        )
        root = new.mesh
        seconds = time.process_time() - t0
        counts = (fresh.calls, fresh.created)
        assert root.get_coordinate() is not None
    else:  # torchft: the replicate group only
        coords = layout.coords(rank)
        mine = [layout.rank_at(**{**coords, "dp": i}) for i in range(sizes["dp"]) if i != 1]
        dist.new_group(mine, use_local_synchronization=True)
        seconds = time.process_time() - t0
        counts = (1, 1)
    return {
        "seconds": seconds,
        "plan": plan_seconds,
        "calls": counts[0],
        "created": counts[1],
        "rebuild": rebuild is not None and strategy == "local" and method == "elastic",
    }


def old_tp(layout, rank: int) -> list[int]:
    return layout.group_of(rank, "tp").tolist()


def fake_table(repeat: int, worlds: list[int], global_max_world: int) -> None:
    print(
        "| W | layout | strategy | method | plan (ms) | total (ms) | new_group calls | groups created "
        "| restart / method |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in worlds:
        for strategy in ("local", "global"):
            if strategy == "global" and world > global_max_world:
                continue
            methods = ["elastic", "restart"] + (["torchft"] if strategy == "local" else [])
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for _ in range(repeat):
                for method in methods:
                    out = subprocess.run(
                        [sys.executable, __file__, "--one-fake", method, strategy, str(world)],
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout
                    runs[method].append(json.loads(out.strip().splitlines()[-1]))
            rows = {m: min(r, key=lambda run: run["seconds"]) for m, r in runs.items()}
            base = rows["restart"]["seconds"]
            dims = ", ".join(f"{k}={v}" for k, v in shape_for(world).items())
            for method, row in rows.items():
                plan = f"{row['plan'] * 1e3:.2f}" if method == "elastic" else "—"
                print(
                    f"| {world:,} | {dims} | {strategy} | {method} | {plan} | {row['seconds'] * 1e3:.2f} "
                    f"| {row['calls']:,} | {row['created']:,} | {base / row['seconds']:.1f}x |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", default="1024,16384,131072", help="world sizes, comma separated")
    parser.add_argument("--global-max-world", type=int, default=16384)
    parser.add_argument(
        "--one-fake", nargs=3, metavar=("METHOD", "STRATEGY", "WORLD"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one_fake:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        method, strategy, world = args.one_fake
        print(json.dumps(one_fake(method, strategy, int(world))))
        return
    fake_table(args.repeat, [int(w) for w in args.worlds.split(",")], args.global_max_world)


if __name__ == "__main__":
    main()
