"""torchft 0.2.0 and meshgroups side by side on real gloo processes: the same MLP, layout, SIGKILL
and replacement, each system's trials interleaved with the other's.

Run: ``python benchmarks/bench_elastic_torchft.py [--trials 5] [--hidden 512] [--layers 4]
[--steps 20] [--configs default,tuned]``, with torchft installed (``pip install -e '.[torchft]'``:
a benchmark-only extra, never a dependency of meshgroups).

Both sides: 8 processes, HSDP ``dp_replicate=2 × dp_shard=2`` × TP 2, the MLP, Adam and batches of
``bench_elastic_live.py`` (``parallel_mlp``), rank 5 SIGKILLed after a forward.

- **meshgroups**: one trial of ``bench_elastic_live.py`` (``Elastic``, ``shrink()``, a brand-new
  process joining with ``Elastic.join``, healed by ``fill_replicas``).
- **torchft**: a ``LighthouseServer`` in this process; two replica groups of 4 processes, each with
  a ``TCPStore`` of its own hosted here (as torchrun's agent hosts it) and its own default group;
  inside a group a 2-D ``DeviceMesh`` (``dp_shard × tp``) for TP and FSDP2. The replicate dim is
  torchft's: a ``Manager`` per process, and FSDP2's all-reduce hook runs ``Manager.allreduce``
  (torchft's reconfigurable ``ProcessGroupGloo`` across the replicas). A step: ``start_quorum()``,
  forward, backward, ``should_commit()``, ``opt.step()`` if it commits.

  torchft's unit of failure is the replica group: this process watches each group as torchrun's
  agent watches its workers (every 0.1 s) and kills the rest of a group one of whose processes
  exited. **kill → next good step**: the survivors' time from the kill to the end of their first
  committed step (``failed step``: to the end of the step that did not commit). **add a
  replacement**: once the survivors committed, a new replica group of 4 brand-new processes (a new
  store), healed by torchft from the survivors (its HTTP checkpoint transport); from its launch to
  the end of the first committed step in which both replicas took part (``num_participants() ==
  2``); ``start-up``: until the slowest new process announced itself (importing torch and
  torchft), ``built``: until its default group, mesh, model and ``Manager`` exist. The survivors
  keep training meanwhile (their committed steps are counted; on 2 cores they compete with the new
  processes for the CPU). The new replica's parameters are checked equal to the survivors'.

torchft's timeouts: the lighthouse's ``heartbeat_timeout_ms`` and ``join_timeout_ms`` are
``default`` (5000, 60000: ``torchft_lighthouse``'s defaults) or ``tuned`` (1000, 1000);
``quorum_tick_ms`` 100 (default). The ``Manager``: ``timeout``, ``quorum_timeout`` and
``connect_timeout`` 60 s (its defaults, and meshgroups' collective timeout here), heartbeats every
100 ms (default). Steady-state step: the median of rank 0's step times over ``--steps`` steps.
Medians over the trials (the kill: the slowest survivor). A 2-core machine shared by 9 processes:
the figures are for this machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_elastic_live as live

GROUP = 4  # processes per replica group: dp_shard 2 × tp 2
KILLED = (1, 1)  # (replica, group rank): global rank 5, as in bench_elastic_live.py
CONFIGS = {"default": (5000, 60000), "tuned": (1000, 1000)}  # heartbeat_timeout_ms, join_timeout_ms
TIMEOUT = timedelta(seconds=60)
LOGS = os.environ.get("TMPDIR", "/tmp")


def sharded(model, opt) -> dict:
    """The parameters by name as FSDP2 keeps them sharded (the optimizer's): torchft reads them in
    its quorum thread, during a forward, when the module holds the unsharded ones."""
    return dict(zip([n for n, _ in model.named_parameters()], opt.param_groups[0]["params"]))


def local_state(params: dict, opt) -> dict:
    """This rank's shard of every parameter and of its Adam state, by name: what torchft sends
    the same group rank of a healing replica."""
    out = {}
    for name, p in params.items():
        out[name] = p.to_local().detach()
        for k, v in opt.state.get(p, {}).items():
            out[f"{name}/{k}"] = v.to_local() if hasattr(v, "to_local") else v
    return out


def load_local_state(params: dict, opt, state: dict) -> None:
    import torch

    with torch.no_grad():
        for name, p in params.items():
            p.to_local().copy_(state[name])
            st = opt.state[p]
            if not st:  # a new process: Adam's state as its first step would create it
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            for k, v in st.items():
                (v.to_local() if hasattr(v, "to_local") else v).copy_(state[f"{name}/{k}"])


def ft_worker(g: int, r: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchft import Manager, ProcessGroupGloo

    bench = dist.TCPStore("127.0.0.1", cfg["bench"], is_master=False, timeout=timedelta(seconds=300))
    out: dict = {"g": g, "r": r, "role": cfg["role"]}
    if cfg["role"] == "new":
        out["announce"] = time.time()
    store = dist.TCPStore("127.0.0.1", cfg["group"], is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=r, world_size=GROUP, timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model, opt = live.parallel_mlp(mesh["tp"], mesh["dp_shard"], cfg["hidden"], cfg["layers"])
    params = sharded(model, opt)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=lambda sd: load_local_state(params, opt, sd),
        state_dict=lambda: local_state(params, opt),
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        rank=r,
        world_size=GROUP,
        store_addr="127.0.0.1",
        store_port=cfg["group"],
        lighthouse_addr=cfg["lighthouse"],
        replica_id=f"replica_{g}",
        hostname="127.0.0.1",
        init_sync=False,  # both replicas start from the same seed
    )
    model.set_all_reduce_hook(lambda t: manager.allreduce(t).wait())
    out["built"] = time.time()
    if cfg["role"] == "first":  # both replica groups' managers up before the first quorum
        bench.add("ft/ready", 1)
        while int(bench.add("ft/ready", 0)) < 2 * GROUP:
            time.sleep(0.05)
    kill_at = cfg["steps"] if cfg["role"] == "first" else -1
    times: list[float] = []
    step = 0
    while True:
        x = torch.randn(
            16, cfg["hidden"], generator=torch.Generator().manual_seed(1000 * step + 2 * g + r // 2)
        )
        t = time.perf_counter()
        manager.start_quorum()
        loss = model(x).pow(2).mean()
        if step == kill_at and (g, r) == KILLED:
            bench.set("ft/kill_t", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        ok = manager.should_commit()
        if ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
        now, step = time.time(), step + 1
        if step <= kill_at:
            times.append(time.perf_counter() - t)
            continue
        if kill_at >= 0 and "kill" not in out:  # a survivor (replica 1's others are killed)
            kill_t = float(bench.get("ft/kill_t"))
            if not ok:
                out.setdefault("failed", now - kill_t)
                continue
            out["kill"], out["recovered_step"] = now - kill_t, manager.current_step()
            bench.set(f"ft/recovered/{r}", "1")
            continue
        if ok and manager.num_participants() == 2 and "joined" not in out:
            out["joined"], out["joined_step"] = now, manager.current_step()
            if (g, r) == (0, 0):  # every process stops after the same committed step
                bench.set("ft/stop", str(manager.current_step() + 2))
        if bench.check(["ft/stop"]) and manager.current_step() >= int(bench.get("ft/stop")):
            break
    if times:
        out["step"] = statistics.median(times[2:])
    out["params"] = [float(p.to_local().double().sum()) for p in params.values()]
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return out


def ft_trial(args: argparse.Namespace, config: str) -> list[dict]:
    """One torchft job: 2 replica groups, the kill, a replacement group; each process's RESULT."""
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    heartbeat_ms, join_ms = CONFIGS[config]
    saved = os.dup(2)  # the lighthouse logs every quorum to this process's stderr: to a file
    os.dup2(
        os.open(os.path.join(LOGS, "bench-torchft-lighthouse.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2
    )
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=join_ms,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=heartbeat_ms,
    )
    stores: list = []  # hosted here until the trial ends

    def new_store() -> int:
        s = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        stores.append(s)
        return s.port

    bench_port = new_store()
    bench = stores[0]
    base = {
        "bench": bench_port,
        "lighthouse": "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1],
        **{k: getattr(args, k) for k in ("hidden", "layers", "steps")},
    }
    procs: list[subprocess.Popen] = []

    def launch(g: int, role: str) -> list[subprocess.Popen]:
        cfg = json.dumps({**base, "group": new_store(), "role": role})
        group = [
            subprocess.Popen(
                [sys.executable, __file__, "ft", str(g), str(r), cfg],
                cwd=live.ROOT,
                stdout=subprocess.PIPE,
                stderr=open(os.path.join(LOGS, f"bench-torchft-{role}-{g}-{r}.log"), "w"),
                text=True,
                start_new_session=True,
            )
            for r in range(GROUP)
        ]
        procs.extend(group)
        return group

    try:
        first = [launch(g, "first") for g in (0, 1)]
        while all(p.poll() is None for p in first[1]):  # torchrun's agent: a group fails whole
            if any(p.poll() is not None for p in first[0]):
                raise RuntimeError(f"replica 0 exited, see {LOGS}/bench-torchft-first-0-*.log")
            time.sleep(0.1)
        live.kill_sessions(first[1])
        bench.wait([f"ft/recovered/{r}" for r in range(GROUP)], timedelta(seconds=300))
        bench.set("ft/launch_t", repr(time.time()))
        new = launch(1, "new")
        results = live.collect(first[0] + new, timeout=600)
        launched = float(bench.get("ft/launch_t"))
        for res in results:
            res["launched"] = launched
        return results
    finally:
        live.kill_sessions(procs)
        lighthouse.shutdown()
        os.dup2(saved, 2)
        os.close(saved)


def ft_row(results: list[dict]) -> dict | None:
    survivors = [x for x in results if x["role"] == "first"]
    new = [x for x in results if x["role"] == "new"]
    if len(survivors) != GROUP or len(new) != GROUP:
        return None
    launched = survivors[0]["launched"]
    rank0 = next(x for x in survivors if x["r"] == 0)
    by_rank = {x["r"]: x["params"] for x in survivors}
    if any(x["params"] != by_rank[x["r"]] for x in new):
        raise RuntimeError("torchft: the new replica's parameters differ from the survivors'")
    return {
        "step": rank0["step"],
        "kill": max(x["kill"] for x in survivors),
        "failed": max(x.get("failed", 0.0) for x in survivors),
        "replacement": max(x["joined"] for x in results) - launched,
        "startup": max(x["announce"] for x in new) - launched,
        "built": max(x["built"] for x in new) - launched,
        # steps the survivors committed between their recovery and the replacement's first step
        "steps": rank0["joined_step"] - rank0["recovered_step"] - 1,
    }


def mg_row(results: list[dict]) -> dict | None:
    res = {x["rank"]: x for x in results}
    if 0 not in res or "replacement" not in res[0]:
        return None
    survivors = [res[r] for r in range(4) if r in res]
    return {
        "step": res[0]["elastic"],
        "plain": res[0]["plain"],
        "kill": max(x["kill_to_good"] for x in survivors),
        "failed": max(x["verdict"] for x in survivors),
        "replacement": res[0]["replacement"],
        "startup": res[0]["startup"],
    }


def table(rows: dict[str, list[dict]], args: argparse.Namespace) -> None:
    med = {
        name: {k: statistics.median(r[k] for r in trials) for k in trials[0]}
        for name, trials in rows.items()
        if trials
    }
    names = [n for n in rows if n in med]
    n = min(len(rows[k]) for k in names)
    print(
        f"\nMLP {args.layers} × (Linear({args.hidden}, {4 * args.hidden}), GELU, Linear), HSDP 2 × 2 × TP 2, "
        f"8 gloo processes; medians of {n} trials\n"
    )
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    kill = {
        k: f"{m['kill']:.2f} s ({'verdict' if k == 'meshgroups' else 'failed step'} {m['failed']:.2f} s)"
        for k, m in med.items()
    }
    repl = {
        k: f"{m['replacement']:.2f} s (1 process, start-up {m['startup']:.2f} s)"
        if k == "meshgroups"
        else f"{m['replacement']:.2f} s ({GROUP} processes, start-up {m['startup']:.2f} s, "
        f"built {m['built']:.2f} s; the survivors committed {m['steps']:.0f} steps meanwhile)"
        for k, m in med.items()
    }
    step = {k: f"{1e3 * m['step']:.1f} ms" for k, m in med.items()}
    if "meshgroups" in med:
        step["meshgroups"] += f" ({1e3 * med['meshgroups']['plain']:.1f} ms without Elastic)"
    what = {
        k: "any dim shrinks (the replicas holding the lost rank dropped, or a spare substituted); "
        "one new process takes the lost rank"
        if k == "meshgroups"
        else "only the replicate dim: the lost rank's whole replica group stops; a new group of "
        f"{GROUP} processes replaces it"
        for k in med
    }
    for label, cells in (
        ("kill → next good step", kill),
        ("add a replacement (brand-new processes)", repl),
        ("steady-state step", step),
        ("what recovers", what),
    ):
        print(f"| {label} | " + " | ".join(cells[k] for k in names) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    live.model_arguments(parser)
    parser.add_argument("--configs", default="default,tuned", help=f"torchft timeouts, of {sorted(CONFIGS)}")
    parser.add_argument("--no-meshgroups", action="store_true", help="torchft only")
    if len(sys.argv) > 1 and sys.argv[1] == "ft":
        print(
            "RESULT " + json.dumps(ft_worker(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))),
            flush=True,
        )
        return
    args = parser.parse_args()
    args.replicas = 2  # bench_elastic_live's world: the same 8 processes as torchft's side
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the trials' cleanup
    configs = [c for c in args.configs.split(",") if c]
    rows: dict[str, list[dict]] = {f"torchft ({c} timeouts)": [] for c in configs}
    if not args.no_meshgroups:
        rows["meshgroups"] = []
    for _ in range(args.trials):
        for name in rows:
            row = (
                mg_row(live.trial(args))
                if name == "meshgroups"
                else ft_row(ft_trial(args, name.split()[1][1:]))
            )
            if row is None:
                print(f"{name}: trial failed (logs in {LOGS}/bench-*.log)", flush=True)
                continue
            rows[name].append(row)
            print(
                f"{name}:",
                {k: round(v, 4) for k, v in row.items()},
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    table(rows, args)


if __name__ == "__main__":
    main()
