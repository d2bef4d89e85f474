"""Elastic on real gloo processes: what a step costs with and without ``Elastic``, what a SIGKILL
costs from the kill to the next good step, and what adding a brand-new replacement process costs.

Run: ``python benchmarks/bench_elastic_live.py [--trials 5] [--hidden 512] [--layers 4]
[--steps 20] [--replicas 2]`` (``python benchmarks/bench_elastic.py --live`` runs it too).

Each trial is one job: 4R processes for ``--replicas R`` (``dp_replicate=R × dp_shard=2 × tp=2``,
HSDP × TP; 8 by default; the store hosted by this process as torchrun's agent hosts it), an MLP
of ``--layers`` blocks (``Linear(h, 4h)``, GELU, ``Linear(4h, h)``, tensor-parallel
colwise/rowwise, FSDP2 over the data dims), Adam, a batch of 16 × h per data-parallel rank.

- **step overhead**: ``--steps`` steps without ``Elastic``'s protocol, ``--steps`` with a gloo
  barrier over the ranks before ``opt.step()`` (what waiting for every rank costs by itself),
  and ``--steps`` with the protocol (``with el.step(): ... el.commit() ...``), interleaved in
  blocks of 5 on the same mesh and model; the medians of rank 0's step times.
  Also the protocol alone: an empty ``with el.step(): el.commit()`` after a barrier.
- **kill → next good step**: rank 5 SIGKILLs itself after a forward; the survivors' time from
  the kill (written to the store just before it) to the end of their first good step after
  ``shrink()``, rebuilding the model and loading its state (the collective timeout is 60 s:
  only liveness can make this short). ``verdict`` is the part until ``RanksLostError``,
  ``shrink()`` until the survivors' new mesh is built, ``rebuilt`` until the model is rebuilt on
  it and its state loaded (each from the kill; the rest is the step).
- **add a replacement**: rank 0 starts a new Python process with the store's address only;
  ``admit_newcomers(count=1)``, ``grow()``, rebuild, ``fill_replicas`` and one good step on
  every rank. ``start-up`` is the new process's own time until it announced itself (importing
  torch and meshgroups); ``admit + heal`` the rest.

Medians over the trials (each trial's value: the slowest survivor for the kill, rank 0 else).
A 2-core machine shared by 4R + 1 processes: the step times are slow, and the figures are for this
machine only.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"dp_shard": 2, "tp": 2}
LOST_REPLICA = (4, 5, 6, 7)  # replica 1: rank 5 is killed, 4, 6 and 7 wait as spares


def sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"dp_replicate": args.replicas, **SIZES}


def build(mg, hidden: int, layers: int):
    return parallel_mlp(mg.mesh["tp"], mg.mesh["dp_replicate", "dp_shard"], hidden, layers)


def parallel_mlp(tp_mesh, dp_mesh, hidden: int, layers: int):
    """The benchmark's MLP, tensor-parallel over ``tp_mesh`` and FSDP2 over ``dp_mesh``, and its Adam
    (``bench_elastic_torchft.py`` builds the same one inside each torchft replica group)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    model = torch.nn.Sequential(*blocks)
    plan = {}
    for i in range(layers):
        plan[str(3 * i)], plan[str(3 * i + 2)] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    fully_shard(model, mesh=dp_mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(layout, rank: int, step: int, hidden: int):
    import torch

    c = layout.coords(rank)
    index = c["dp_replicate"] * layout.size("dp_shard") + c["dp_shard"]
    return torch.randn(16, hidden, generator=torch.Generator().manual_seed(1000 * step + index))


def step_once(model, opt, x, el=None, barrier=None) -> None:
    import torch.distributed as dist

    loss = model(x).pow(2).mean()
    loss.backward()
    if el is not None:
        el.commit()
    if barrier is not None:
        dist.barrier(group=barrier)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(rank: int, port: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from meshgroups import Layout, RanksLostError
    from meshgroups.elastic import Elastic, fill_replicas, init_optimizer_state, training_state
    from meshgroups.mesh import default_store

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=4 * args.replicas, timeout=timedelta(seconds=300)
    )
    el = Elastic(Layout(**sizes(args)), timeout=60, heartbeat=0.25, stale_after=5)
    st = default_store()
    out: dict = {"rank": rank}
    model, opt = build(el.mg, args.hidden, args.layers)
    times: dict[str, list[float]] = {"plain": [], "barrier": [], "elastic": []}
    step = 0
    for block in range(3 * args.steps // 5):
        kind = ("plain", "barrier", "elastic")[block % 3]
        for _ in range(5):
            x = batch(el.layout, rank, step, args.hidden)
            t = time.perf_counter()
            if kind == "plain":
                step_once(model, opt, x)
            elif kind == "barrier":  # what any "apply only if every rank got here" costs
                step_once(model, opt, x, barrier=el.live_group)
            else:
                with el.step():
                    step_once(model, opt, x, el)
            times[kind].append(time.perf_counter() - t)
            step += 1
    out["plain"] = statistics.median(times["plain"][2:])
    out["elastic"] = statistics.median(times["elastic"][2:])
    out["barrier"] = statistics.median(times["barrier"][2:])
    # The protocol alone: an empty guarded step, the ranks lined up first by a barrier (so no
    # rank's wait for a slower one is counted).
    alone = []
    for _ in range(args.steps):
        dist.barrier(group=el.live_group)
        t = time.perf_counter()
        with el.step():
            el.commit()
        alone.append(time.perf_counter() - t)
    out["protocol"] = statistics.median(alone)
    # SIGKILL rank 5 mid-step.
    try:
        with el.step():
            loss = model(batch(el.layout, rank, step, args.hidden)).pow(2).mean()
            if rank == 5:
                st.set("bench/kill_t", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            el.commit()
            opt.step()
        raise RuntimeError("the step did not fail")
    except RanksLostError:
        now = time.time()
        kill_t = float(st.get("bench/kill_t"))
        out["verdict"] = now - kill_t
        model.reset_iter_state()
    state = {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        for k, v in training_state(model, opt).items()
    }
    del model, opt
    mg = el.shrink()
    out["shrunk"] = time.time() - kill_t
    spare = mg is None
    if not spare:
        model, opt = build(mg, args.hidden, args.layers)
        init_optimizer_state(model, opt)
        for k, v in training_state(model, opt).items():
            (v.to_local() if hasattr(v, "to_local") else v).detach().copy_(state[k])
        out["rebuilt"] = time.time() - kill_t
        with el.step():
            step_once(model, opt, batch(el.layout, rank, step + 1, args.hidden), el)
        out["kill_to_good"] = time.time() - kill_t
        # A replacement: a brand-new process.
        proc = None
        if rank == 0:
            st.set("bench/launch_t", repr(time.time()))
            proc = subprocess.Popen(
                [sys.executable, __file__, "newcomer", str(port), json.dumps(vars(args))],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        el.admit_newcomers(count=1, timeout=300)
        del model, opt
        mg = el.grow(list(LOST_REPLICA))
    else:
        mg = el.standby(timeout=300)
    model, opt = build(mg, args.hidden, args.layers)
    if spare:
        init_optimizer_state(model, opt)
    else:
        init_optimizer_state(model, opt)
        for k, v in training_state(model, opt).items():
            (v.to_local() if hasattr(v, "to_local") else v).detach().copy_(state[k])
    fill_replicas(el.layout, el.dim, el.grown, training_state(model, opt))
    with el.step():
        step_once(model, opt, batch(el.layout, rank, step + 2, args.hidden), el)
    if rank == 0:
        launched = float(st.get("bench/launch_t"))
        out["replacement"] = time.time() - launched
        out["startup"] = float(st.get("bench/newcomer_announce_t")) - launched
        proc.wait(timeout=120)  # type: ignore[union-attr]
    el.close()
    return out


def newcomer(port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from meshgroups.elastic import Elastic, fill_replicas, init_optimizer_state, training_state

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.PrefixStore("0/", store).set("bench/newcomer_announce_t", repr(time.time()))
    el = Elastic.join(store, timeout=300)
    mg = el.standby(timeout=300)
    model, opt = build(mg, args.hidden, args.layers)
    init_optimizer_state(model, opt)
    fill_replicas(el.layout, el.dim, el.grown, training_state(model, opt))
    with el.step():
        step_once(model, opt, batch(el.layout, el.rank, 10_000, args.hidden), el)
    el.close()


def trial(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    procs = []
    results = []
    try:  # each child in a session of its own (with the newcomer it starts): all killed on any exit
        for r in range(4 * args.replicas):
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "child", str(r), str(store.port), json.dumps(vars(args))],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=open(
                        os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-elastic-{r}.log"), "w"
                    ),
                    text=True,
                    start_new_session=True,
                )
            )
        results = collect(procs, timeout=900)
    finally:
        kill_sessions(procs)
    return results


def collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Each child's ``RESULT {json}`` lines, once it ended (killed after ``timeout`` seconds)."""
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return results


def kill_sessions(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process of each child's session (a child and what it started)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The trials and the MLP's sizes, the same in every elastic benchmark."""
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--replicas", type=int, default=2, help="dp_replicate; the world is 4 × this")
    if len(sys.argv) > 1 and sys.argv[1] in ("child", "newcomer"):
        sub = argparse.Namespace(**json.loads(sys.argv[-1]))
        if sys.argv[1] == "child":
            print("RESULT " + json.dumps(worker(int(sys.argv[2]), int(sys.argv[3]), sub)), flush=True)
        else:
            newcomer(int(sys.argv[2]), sub)
        return
    args = parser.parse_args()
    if args.replicas < 2:
        parser.error(f"--replicas must be at least 2 (replica 1 is the one lost), got {args.replicas}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run trial()'s cleanup
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            *("plain", "barrier", "elastic", "protocol", "verdict", "shrunk", "rebuilt", "kill"),
            *("replacement", "startup"),
        )
    }
    for _ in range(args.trials):
        res = {r["rank"]: r for r in trial(args)}
        if 0 not in res or "replacement" not in res[0]:
            print(f"trial failed: ranks {sorted(res)} reported", flush=True)
            continue
        survivors = [v for r, v in res.items() if r not in LOST_REPLICA]
        rows["plain"].append(res[0]["plain"])
        rows["elastic"].append(res[0]["elastic"])
        rows["protocol"].append(res[0]["protocol"])
        rows["barrier"].append(res[0]["barrier"])
        rows["verdict"].append(max(r["verdict"] for r in survivors))
        rows["shrunk"].append(max(r["shrunk"] for r in survivors))
        rows["rebuilt"].append(max(r["rebuilt"] for r in survivors))
        rows["kill"].append(max(r["kill_to_good"] for r in survivors))
        rows["replacement"].append(res[0]["replacement"])
        rows["startup"].append(res[0]["startup"])
        print("trial:", {k: round(v[-1], 4) for k, v in rows.items()}, flush=True)
    if not rows["plain"]:
        return
    med = {k: statistics.median(v) for k, v in rows.items()}
    n = len(rows["plain"])
    over = med["elastic"] - med["plain"]
    print(
        f"\nMLP {args.layers} × (Linear({args.hidden}, {4 * args.hidden}), GELU, Linear) on HSDP {args.replicas}×2 × TP 2, {4 * args.replicas} gloo processes; medians of {n} trials\n"
    )
    print("| | meshgroups |")
    print("|---|---|")
    print(f"| step without Elastic | {1e3 * med['plain']:.1f} ms |")
    bar = med["barrier"] - med["plain"]
    print(
        f"| step + a gloo barrier before the optimizer (no Elastic) | {1e3 * med['barrier']:.1f} ms (+{1e3 * bar:.1f} ms) |"
    )
    print(
        f"| step with Elastic (step() + commit()) | {1e3 * med['elastic']:.1f} ms (+{1e3 * over:.1f} ms, {100 * over / med['plain']:.1f} %) |"
    )
    print(f"| the protocol alone (an empty guarded step, ranks lined up) | {1e3 * med['protocol']:.2f} ms |")
    print(
        f"| kill → next good step | {med['kill']:.2f} s (verdict {med['verdict']:.2f} s; from the kill, "
        f"`shrink()` done {med['shrunk']:.2f} s, the model rebuilt and reloaded {med['rebuilt']:.2f} s) |"
    )
    print(
        f"| add a replacement (a brand-new process) | {med['replacement']:.2f} s "
        f"(start-up {med['startup']:.2f} s, admit + heal {med['replacement'] - med['startup']:.2f} s) |"
    )


if __name__ == "__main__":
    main()
