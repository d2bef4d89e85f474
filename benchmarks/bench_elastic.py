"""Per-rank cost of recovering from one lost node: the elastic path (recovery plan + only the
changed groups + the new root mesh) against three restarts (destroy every group and the
default group, re-initialise on the survivors, build the mesh again) and the torchft model
(only the replicate dim's group rebuilt).

Run: ``python benchmarks/bench_elastic.py [--repeat 3] [--worlds 1024,16384,131072]
[--global-max-world 131072] [--plan-worlds 1048576]``; ``--live [--trials 5 ...]`` runs
``bench_elastic_live.py`` instead (real gloo processes: a step's overhead with and without
``Elastic``, kill → next good step, a brand-new replacement process).

Times are this process's CPU time (``time.process_time``): the fake backend does no I/O, so
that is the work done, and a loaded machine's waiting for a core does not count.

Fake backend: one process acts as rank W//3+7 of a world of W (a survivor in an intact replica);
each measurement runs in a fresh process; runs of the methods interleave and the fastest of
``--repeat`` is shown (a shared machine's load only ever adds time). The layout is 4-D
(pp, dp, cp, tp) with tp=8 = one node; the node holding ranks (pp=0, dp=1, cp=0, tp=*) is lost,
so the dp replica 1 is dropped (its other ranks become spares) and the survivors' layout is
``layout.select("dp", [0, 2, 3, ...])``. Families: every dim plus the flattened dp_cp and
dp_cp_tp (FSDP/HSDP's data dims). Methods (rows):

- ``elastic (local)``: ``plan_shrink`` and its new layout, then ``meshgroups.elastic._recover.rebuild``
  (the new ``MeshGroups`` through the old mesh's GroupCache, local strategy), then the root mesh.
- ``elastic (global)``: the same plan, then ``init_mesh(strategy="global")`` on the old mesh's
  cache and closing the old mesh (a mesh built with init_mesh's default strategy).
- ``restart, init_mesh default (global)`` / ``restart, init_mesh local``: the old mesh closed,
  ``destroy_process_group()``, ``init_process_group`` on the survivors renumbered densely,
  ``init_mesh`` of the renumbered layout with that strategy, the root mesh.
- ``restart, torch init_device_mesh``: the same restart, then what torch users run: torch's
  ``init_device_mesh("cpu", shape, mesh_dim_names=...)`` and ``mesh["dp", "cp"]._flatten()``,
  ``mesh["dp", "cp", "tp"]._flatten()``.
- ``torchft (replicate only)``: one ``new_group`` over this rank's new dp group, no mesh.

"new_group calls" counts every creation call on this rank (including the one-rank pads the local
strategy makes to keep torch's group counts aligned); "groups created" the groups it is a member
of — on real hardware, each is a communicator to set up, the dominant cost fake groups don't
show, as is the world-wide rendezvous of a restart's new default group (the fake store answers
at once). Each ``vs ...`` column is that restart's time divided by the row's.

The second table is the plan alone (numpy, no torch) up to 1M ranks: ``plan_shrink``, building
the survivors' layout, and one rank's questions (its role, new coordinates, every family's
status).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any

FLATTEN = (("dp", "cp"), ("dp", "cp", "tp"))

#: (label, method, strategy) of each row, in the order printed
ROWS = (
    ("elastic (local)", "elastic", "local"),
    ("elastic (global)", "elastic", "global"),
    ("restart, init_mesh default (global)", "restart", "global"),
    ("restart, init_mesh local", "restart", "local"),
    ("restart, torch init_device_mesh", "torch", "-"),
    ("torchft (replicate only)", "torchft", "-"),
)
#: (column, label of the row it divides by)
BASELINES = (
    ("vs restart (init_mesh default)", "restart, init_mesh default (global)"),
    ("vs restart (local)", "restart, init_mesh local"),
    ("vs init_device_mesh", "restart, torch init_device_mesh"),
)


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
    from meshgroups.elastic._plans import plan_shrink
    from meshgroups.elastic._recover import rebuild
    from meshgroups.mesh._torch_seam import group_count, held_group_count

    sizes = shape_for(world)
    layout = Layout(sizes)
    rank = world // 3 + 7
    lost = [layout.rank_at(pp=0, dp=1, cp=0, tp=t) for t in range(sizes["tp"])]
    assert layout.coords(rank)["dp"] != 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # the job's mesh before the loss, as each method's users build it (torch's own for torch)
    cache = GroupCache()
    if method == "torch":
        old_root = torch_mesh(tuple(sizes.values()), tuple(sizes))
    else:
        old = init_mesh(
            layout, flatten=FLATTEN, strategy=strategy.strip("-") or "local", cache=cache, check=False
        )
        old.mesh  # noqa: B018  the old root, as a training job holds it
    calls, created = cache.calls, cache.created
    plan_seconds = 0.0
    t0 = time.process_time()
    if method == "elastic":
        plan = plan_shrink(layout, lost, topology=Topology(node=sizes["tp"]), flatten=FLATTEN)
        new_layout = plan.new_layout
        plan_seconds = time.process_time() - t0
        if strategy == "local":
            new = rebuild(old, new_layout)
        else:  # rebuild() is for local meshes; a global one is rebuilt through the same cache
            new = init_mesh(
                new_layout, flatten=FLATTEN, strategy=strategy, cache=cache, check=False, partial=True
            )
            old.close()
        root = new.mesh
        seconds = time.process_time() - t0
        counts = (cache.calls - calls, cache.created - created)
        assert root.get_coordinate() is not None and new.ranks("tp") == old_tp(layout, rank)
    elif method in ("restart", "torch"):
        if method == "restart":
            old.close()
        else:
            del old_root  # torch's groups are all destroyed with the default group
        dist.destroy_process_group()
        survivors = (sizes["dp"] - 1) * world // sizes["dp"]
        new_rank = rank - (world // sizes["dp"] if layout.coords(rank)["dp"] > 1 else 0)
        dist.init_process_group("fake", store=FakeStore(), rank=new_rank, world_size=survivors)
        shape = {**sizes, "dp": sizes["dp"] - 1}
        if method == "restart":
            fresh = GroupCache()
            new = init_mesh(Layout(shape), flatten=FLATTEN, strategy=strategy, cache=fresh, check=False)
            root = new.mesh
            seconds = time.process_time() - t0
            counts = (fresh.calls, fresh.created)
        else:
            before = (group_count(), held_group_count())
            root = torch_mesh(tuple(shape.values()), tuple(shape))
            seconds = time.process_time() - t0
            counts = (group_count() - before[0], held_group_count() - before[1])
            assert root["_".join(FLATTEN[-1])].size() == survivors // shape["pp"]
        assert root.get_coordinate() is not None
    else:  # torchft: the replicate group only
        coords = layout.coords(rank)
        mine = [layout.rank_at(**{**coords, "dp": i}) for i in range(sizes["dp"]) if i != 1]
        dist.new_group(mine, use_local_synchronization=True)
        seconds = time.process_time() - t0
        counts = (1, 1)
    return {"seconds": seconds, "plan": plan_seconds, "calls": counts[0], "created": counts[1]}


def torch_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """torch's own mesh with the flattened data dims, as torchtitan builds it."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for dims in FLATTEN:
        root[dims]._flatten()
    return root


def one_plan(world: int) -> dict[str, float]:
    """The plan alone (numpy, no torch) in this (fresh) process: seconds of each step."""
    from meshgroups import Layout, Topology
    from meshgroups.elastic._plans import plan_shrink

    sizes = shape_for(world)
    layout = Layout(sizes)
    rank = world // 3 + 7
    lost = [layout.rank_at(pp=0, dp=1, cp=0, tp=t) for t in range(sizes["tp"])]
    t0 = time.process_time()
    plan = plan_shrink(layout, lost, topology=Topology(node=sizes["tp"]), flatten=FLATTEN)
    t1 = time.process_time()
    role, coords = plan.role(rank), plan.new_coords(rank)
    status = {f: plan.status(rank, f) for f in plan.families}
    t2 = time.process_time()
    new_layout = plan.new_layout
    t3 = time.process_time()
    assert role == "survivor" and coords is not None and new_layout.coords(rank) == coords
    assert [f for f, s in status.items() if s == "created"] == [("dp",), ("dp", "cp"), ("dp", "cp", "tp")]
    return {"plan": t1 - t0, "questions": t2 - t1, "layout": t3 - t2}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def fake_table(repeat: int, worlds: list[int], global_max_world: int) -> None:
    print(
        "| W | layout | method | plan (ms) | total (ms) | new_group calls | groups created | "
        + " | ".join(column for column, _ in BASELINES)
        + " |"
    )
    print("|---" * (7 + len(BASELINES)) + "|")
    for world in worlds:
        rows_here = [r for r in ROWS if r[2] != "global" or world <= global_max_world]
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in rows_here}
        for _ in range(repeat):
            for label, method, strategy in rows_here:
                runs[label].append(run_child("--one-fake", method, strategy, str(world)))
        rows = {label: min(r, key=lambda run: run["seconds"]) for label, r in runs.items()}
        dims = ", ".join(f"{k}={v}" for k, v in shape_for(world).items())
        for label, row in rows.items():
            plan = f"{row['plan'] * 1e3:.2f}" if label.startswith("elastic") else "—"
            ratios = [
                ratio(rows[base]["seconds"], row["seconds"]) if base in rows else "—" for _, base in BASELINES
            ]
            print(
                f"| {world:,} | {dims} | {label} | {plan} | {row['seconds'] * 1e3:.2f} "
                f"| {row['calls']:,} | {row['created']:,} | " + " | ".join(ratios) + " |",
                flush=True,
            )


def ratio(base: float, value: float) -> str:
    """``base / value`` as ``"12.3x"`` (two significant digits below 1: ``"0.05x"``)."""
    r = base / value
    return f"{r:.1f}x" if r >= 1 else f"{r:.2g}x"


def plan_table(repeat: int, worlds: list[int]) -> None:
    print("| W | layout | plan_shrink (ms) | one rank's questions (ms) | new layout (ms) |")
    print("|---|---|---|---|---|")
    for world in worlds:
        runs = [run_child("--one-plan", str(world)) for _ in range(repeat)]
        best = {k: min(r[k] for r in runs) for k in ("plan", "questions", "layout")}
        dims = ", ".join(f"{k}={v}" for k, v in shape_for(world).items())
        print(
            f"| {world:,} | {dims} | {best['plan'] * 1e3:.2f} | {best['questions'] * 1e3:.2f} "
            f"| {best['layout'] * 1e3:.2f} |",
            flush=True,
        )


def main() -> None:
    if "--live" in sys.argv:  # the real-process figures: bench_elastic_live.py, with its options
        live = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_elastic_live.py")
        sys.exit(subprocess.call([sys.executable, live, *(a for a in sys.argv[1:] if a != "--live")]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", default="1024,16384,131072", help="world sizes, comma separated")
    parser.add_argument(
        "--global-max-world", type=int, default=131072, help="largest world of the global-strategy rows"
    )
    parser.add_argument(
        "--plan-worlds", default="1048576", help="world sizes of the plan-only table ('' for none)"
    )
    parser.add_argument(
        "--one-fake", nargs=3, metavar=("METHOD", "STRATEGY", "WORLD"), help=argparse.SUPPRESS
    )
    parser.add_argument("--one-plan", metavar="WORLD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_fake or args.one_plan:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        warnings.simplefilter("ignore")  # torch's deprecation notes on flattened-dim slicing
        if args.one_plan:
            print(json.dumps(one_plan(int(args.one_plan))))
            return
        method, strategy, world = args.one_fake
        print(json.dumps(one_fake(method, strategy, int(world))))
        return
    worlds = [int(w) for w in args.worlds.split(",") if w]
    fake_table(args.repeat, worlds, args.global_max_world)
    plan_worlds = [int(w) for w in args.plan_worlds.split(",") if w]
    if plan_worlds:
        print()
        plan_table(args.repeat, sorted(set(worlds + plan_worlds)))


def old_tp(layout, rank: int) -> list[int]:
    return layout.group_of(rank, "tp").tolist()


if __name__ == "__main__":
    main()
