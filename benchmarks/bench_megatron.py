"""Megatron start-up at scale: megatron-core vs meshgroups.compat.parallel_state (global and local), per rank.

Run: ``python benchmarks/bench_megatron.py [--repeat 3] [--max-world 131072]``. Needs the
optional megatron-core test extra (``pip install --no-deps megatron-core==0.16.1 packaging
einops``); without it the Megatron rows are skipped.

Table 1, fake backend (one process acts as rank W//3+7 of a world of W; each measurement in a
fresh process; median of ``--repeat``): ``initialize_model_parallel(tp=8, pp=8, cp=2, ep=8,
etp=1)`` of megatron-core; of megatron-core on meshgroups (``meshgroups.compat.megatron.install
(strategy="local")`` before ``import megatron.core``, then megatron-core's own
``parallel_state.initialize_model_parallel`` call, unchanged); and of
``meshgroups.compat.parallel_state`` directly with ``strategy="global"`` and ``"local"``. Each
run reports this rank's rank list of every group both sides build; every row is checked equal to
megatron-core's before any time is printed. Fake groups never
communicate: this is the Python-side bookkeeping that dominates start-up at scale, not NCCL.

Table 2, the per-rank steps meshgroups owns and torch's DeviceMesh constructor, from 16k to 1M
ranks (fresh process each): ``megatron_plan`` (the layout and its views), ``init_mesh`` of the
dense layout with ``strategy="local"``, our part of the root DeviceMesh (the int32 rank map) and
torch's part (``DeviceMesh.from_group``: a ``tolist`` and a coordinate search over the map).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIG = {"tp": 8, "pp": 8, "cp": 2, "ep": 8, "etp": 1}
METHODS = ("megatron-core", "megatron-core on meshgroups", "compat-global", "compat-local")
# Megatron getter -> group name, for the cross-check of this rank's groups
GETTERS = {
    "tp": "get_tensor_model_parallel_group",
    "pp": "get_pipeline_model_parallel_group",
    "cp": "get_context_parallel_group",
    "mp": "get_model_parallel_group",
    "tp_cp": "get_tensor_and_context_parallel_group",
    "ep": "get_expert_model_parallel_group",
    "expt_tp": "get_expert_tensor_parallel_group",
    "tp_ep": "get_expert_tensor_and_model_parallel_group",
    "expt_dp": "get_expert_data_parallel_group",
    "embd": "get_embedding_group",
    "pos_embd": "get_position_embedding_group",
}


def _fake_world(world: int) -> int:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = world // 3 + 7
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return rank


def one_init(method: str, world: int) -> dict:
    import torch.distributed as dist

    if method == "megatron-core":
        from megatron.core import parallel_state as ps
    elif method == "megatron-core on meshgroups":
        import meshgroups.compat.megatron

        meshgroups.compat.megatron.install(strategy="local")
        from megatron.core import parallel_state as ps  # type: ignore[no-redef]

        assert ps.__name__ == "meshgroups.compat.parallel_state"
    else:
        import meshgroups.compat.parallel_state as ps  # type: ignore[no-redef]
    _fake_world(world)
    kwargs = {
        "tensor_model_parallel_size": CONFIG["tp"],
        "pipeline_model_parallel_size": CONFIG["pp"],
        "context_parallel_size": CONFIG["cp"],
        "expert_model_parallel_size": CONFIG["ep"],
        "expert_tensor_parallel_size": CONFIG["etp"],
        "create_gloo_process_groups": False,
    }
    if method.startswith("compat-"):
        kwargs["strategy"] = method.split("-")[1]
    t0 = time.perf_counter()
    ps.initialize_model_parallel(**kwargs)
    seconds = time.perf_counter() - t0
    groups = {}
    for name, getter in GETTERS.items():
        group = getattr(ps, getter)(check_initialized=False)
        groups[name] = None if group is None else dist.get_process_group_ranks(group)
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    groups["dp_cp"] = dist.get_process_group_ranks(dp)
    groups["dp"] = dist.get_process_group_ranks(ps.get_data_parallel_group())
    return {"seconds": seconds, "groups": groups}


def one_step(step: str, world: int) -> dict:
    """Table 2: one meshgroups-owned step (or torch's DeviceMesh constructor) at ``world``."""
    import numpy as np
    from meshgroups.compat.megatron_layout import megatron_plan

    kwargs = {
        "context_parallel_size": CONFIG["cp"],
        "expert_model_parallel_size": CONFIG["ep"],
        "expert_tensor_parallel_size": CONFIG["etp"],
    }
    if step == "megatron_plan":
        megatron_plan(world, CONFIG["tp"], CONFIG["pp"], **kwargs)  # warm (imports, caches)
        t0 = time.perf_counter()
        megatron_plan(world, CONFIG["tp"], CONFIG["pp"], **kwargs)
        return {"seconds": time.perf_counter() - t0}
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from meshgroups import init_mesh

    layout = megatron_plan(world, CONFIG["tp"], CONFIG["pp"], **kwargs).layout.without_views()
    _fake_world(world)
    in_torch = [0.0]
    real_new_group = dist.new_group

    def timed_new_group(*args, **kw):  # times torch's own share; the call itself is unchanged
        t = time.perf_counter()
        try:
            return real_new_group(*args, **kw)
        finally:
            in_torch[0] += time.perf_counter() - t

    dist.new_group = timed_new_group
    t0 = time.perf_counter()
    mg = init_mesh(layout, strategy="local")
    init_seconds = time.perf_counter() - t0
    dist.new_group = real_new_group
    groups = [mg.group(d) for d in layout.names]
    t0 = time.perf_counter()
    ranks = torch.from_numpy(layout.grid_as(np.int32))
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    DeviceMesh.from_group(groups, "cpu", mesh=ranks, mesh_dim_names=layout.names)
    torchs = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"init_mesh": init_seconds, "new_group": in_torch[0], "rank_map": ours, "torch": torchs}


def _fresh(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def megatron_available() -> bool:
    """Whether megatron-core is installed (not imported: each measurement imports it in a
    fresh child, where meshgroups may install itself first)."""
    import importlib.util

    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


def init_table(repeat: int, max_world: int, worlds: tuple[int, ...] = (16384, 131072)) -> None:
    methods = METHODS if megatron_available() else METHODS[2:]
    if len(methods) < len(METHODS):
        print("(megatron-core is not installed: its rows are skipped)")
    dims = ", ".join(f"{k}={v}" for k, v in CONFIG.items())
    print(f"| W | method ({dims}) | initialize_model_parallel (ms) | vs megatron-core |")
    print("|---|---|---|---|")
    for world in worlds:
        if world > max_world:
            break
        results = {}
        for method in methods:
            runs = [_fresh(["--one-init", method, str(world)]) for _ in range(repeat)]
            results[method] = (statistics.median(r["seconds"] for r in runs), runs[0]["groups"])
        if "megatron-core" in results:
            reference = results["megatron-core"][1]
            for method, (_, groups) in results.items():
                for name, ranks in reference.items():
                    assert groups[name] == ranks, (world, method, name, groups[name], ranks)
        base = results["megatron-core"][0] if "megatron-core" in results else None
        for method, (seconds, _) in results.items():
            ratio = f"{base / seconds:.0f}x" if base else "-"
            print(f"| {world:,} | {method} | {seconds * 1e3:.1f} | {ratio} |", flush=True)


def steps_table(repeat: int) -> None:
    print(
        "\n| W | megatron_plan (ms) | init_mesh local (ms) | of which torch's new_group (ms) "
        "| rank map, ours (ms) | DeviceMesh, torch's (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for world in (16384, 131072, 1 << 20):
        plan = statistics.median(
            _fresh(["--one-step", "megatron_plan", str(world)])["seconds"] for _ in range(repeat)
        )
        runs = [_fresh(["--one-step", "mesh", str(world)]) for _ in range(repeat)]
        keys = ("init_mesh", "new_group", "rank_map", "torch")
        cells = " | ".join(f"{statistics.median(r[k] for r in runs) * 1e3:.1f}" for k in keys)
        print(f"| {world:,} | {plan * 1e3:.2f} | {cells} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-world", type=int, default=131072)
    parser.add_argument("--steps-only", action="store_true", help="print the second table only")
    parser.add_argument("--init-only", action="store_true", help="print the first table only")
    parser.add_argument("--worlds", default="16384,131072", help="comma-separated world sizes of table 1")
    parser.add_argument("--one-init", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--one-step", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.one_init:
        print(json.dumps(one_init(args.one_init[0], int(args.one_init[1]))))
        return
    if args.one_step:
        print(json.dumps(one_step(args.one_step[0], int(args.one_step[1]))))
        return
    if not args.steps_only:
        init_table(args.repeat, args.max_world, tuple(int(w) for w in args.worlds.split(",")))
    if not args.init_only:
        steps_table(args.repeat)


if __name__ == "__main__":
    main()
