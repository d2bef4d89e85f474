"""The demo job: build a layout on real processes and verify a collective on every group.

Two ways to run it (``python -m meshgroups demo``):

- on this machine: spawns ``--nproc`` gloo processes on 127.0.0.1;
- under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): joins that job instead, NCCL on GPUs when
  available, so the same check runs on a multi-node cluster::

      torchrun --nnodes 2 --nproc-per-node 8 -m meshgroups demo pp=2 dp=4 tp=2

Every rank builds the mesh with ``init_mesh``, all-reduces ``rank + 1`` on each of its groups
(every dim, its views, and the flattened pairs of dims), checks the sums and that group rank ==
mesh position, shards a DTensor over the root mesh and gathers it back, and rank 0 prints the
report. Exit status 0 if every check passed.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from meshgroups._checks import check_positive, short_repr
from meshgroups.layout import Layout
from meshgroups.render import text as render_text

#: Most processes the demo spawns on this machine (one per rank); torchrun starts its own.
MAX_PROCESSES = 64
#: Longest timeout, in seconds, the demo accepts (a day).
MAX_TIMEOUT = 86400.0


def families(layout: Layout) -> list[tuple[str, ...]]:
    """Every dim of the layout and its views, and every pair of the layout's own dims."""
    out: list[tuple[str, ...]] = [(d,) for d in layout.names]
    out += [(d,) for view in layout.views.values() for d in view.names if d not in layout.names]
    out += list(itertools.combinations(layout.names, 2))
    return out


def run_checks(layout: Layout, device: str, strategy: str, timeout: float) -> dict[str, Any]:
    """This rank's part of the demo, on an initialised default group."""
    import torch
    import torch.distributed as dist

    from meshgroups.mesh import init_mesh

    rank = dist.get_rank()
    fams = families(layout)
    t0 = time.perf_counter()
    mg = init_mesh(
        layout,
        "cuda" if device.startswith("cuda") else "cpu",
        flatten=[f for f in fams if len(f) > 1],
        strategy=strategy,  # type: ignore[arg-type]
        timeout=timeout,
    )
    coordinate = mg.mesh.get_coordinate() if mg.mesh is not None else None
    build_seconds = time.perf_counter() - t0
    failures, checks = [], 0
    if coordinate is not None and tuple(coordinate) != tuple(layout.coords(rank).values()):
        failures.append(f"rank {rank}: mesh coordinate {coordinate} != layout {layout.coords(rank)}")
    for dims in fams:
        ranks = mg.ranks(*dims)
        if ranks is None:
            continue
        group = mg.group(*dims)
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value, group=group)
        expected = float(sum(r + 1 for r in ranks))
        checks += 1
        if value.item() != expected or dist.get_rank(group) != ranks.index(rank):
            failures.append(
                f"group {'×'.join(dims)} {ranks}: all_reduce gave {value.item():g}, expected {expected:g} "
                f"(group rank {dist.get_rank(group)}, position {ranks.index(rank)})"
            )
    if coordinate is not None:
        checks += 1
        failures += _dtensor_check(mg.mesh, device, rank)
    mg.close()  # destroy the groups now (see _shut_down)
    return {"rank": rank, "build_seconds": build_seconds, "checks": checks, "failures": failures}


def _dtensor_check(mesh: Any, device: str, rank: int) -> list[str]:
    """A DTensor on the root mesh: sharded over its first dim, gathered back, redistributed to
    replicated, with the mesh used as a dict key — what DTensor, ``fully_shard`` and redistribute
    do with a mesh (they hash it; torch 2.15's ``__hash__`` reads a field 2.13 did not have)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(mesh.size(0) * 2 * 3, dtype=torch.float32, device=device).reshape(-1, 3)
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    try:
        seen = {mesh: "root"}
        sharded = distribute_tensor(full, mesh, placements)
        gathered = sharded.full_tensor()
        replicated = sharded.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        ok = (
            seen[sharded.device_mesh] == "root"
            and torch.equal(gathered, full)
            and torch.equal(replicated, full)
        )
    except Exception as e:  # reported per rank like every other check, not a crash
        return [f"rank {rank}: DTensor on the root mesh raised {type(e).__name__}: {e}"]
    return [] if ok else [f"rank {rank}: DTensor on the root mesh did not gather back its tensor"]


def _shut_down() -> None:
    """Destroy every process group, then release the group objects while Python is alive.

    gloo's worker threads drop their reference to a finished collective (and its tensors) after
    the caller's ``wait()`` returns; releasing a tensor made in Python takes the GIL. A group
    still referenced at interpreter exit (by a reference cycle, e.g. a DeviceMesh and its
    flattened dims) keeps its worker threads alive into finalization, where such a thread
    taking the GIL is killed mid-C++ and the process aborts ("terminate called without an active
    exception", exit status -6 under torchrun after every check passed). Destroying the
    groups' last Python references here joins those threads (torch releases the GIL for that).
    """
    import gc

    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()


def report(
    layout: Layout, results: list[dict[str, Any]], ranks_per_node: int | None, how: str
) -> tuple[str, bool]:
    """The demo's report from every rank's results.

    Args:
        layout: the layout the demo built.
        results: one dict per rank (``checks``, ``failures``, ``build_seconds``).
        ranks_per_node: for the node verdicts, or None.
        how: how the processes were started, for the first line.

    Returns:
        ``(text, ok)``: the lines to print and whether every check passed.
    """
    checks = sum(r["checks"] for r in results)
    failures = [f for r in results for f in r["failures"]]
    slowest = max(r["build_seconds"] for r in results)
    lines = [
        f"meshgroups demo: {len(results)} processes ({how})",
        "",
        render_text(layout, ranks_per_node=ranks_per_node),
        "",
        f"families checked: {', '.join('×'.join(f) for f in families(layout))}",
        f"time to build the mesh: {slowest * 1e3:.1f} ms (slowest rank)",
    ]
    if failures:
        lines += [f"FAILED: {len(failures)} of {checks} checks"] + [f"  {f}" for f in failures]
    else:
        lines.append(
            f"all {checks} checks passed (all_reduce on every group of every rank, group rank == mesh position, a DTensor on the root mesh)"
        )
    return "\n".join(lines), not failures


def _join_torchrun(layout: Layout, strategy: str, timeout: float, node: int | None, as_json: bool) -> int:
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if layout.max_rank >= world:
        print(f"error: the layout has {layout.world_size} ranks but WORLD_SIZE={world}", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        result = run_checks(layout, device, strategy, timeout)
        results: list[Any] = [None] * world
        dist.all_gather_object(results, result)
        ok = all(not r["failures"] for r in results)
        if dist.get_rank() == 0:
            per_node = node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
            _print(layout, results, per_node, f"torchrun, {backend}", as_json)
    finally:
        _shut_down()
    return 0 if ok else 1


def _spawned_rank(
    rank: int, world: int, port: int, layout: Layout, strategy: str, timeout: float, queue: Any
) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        try:
            queue.put(run_checks(layout, "cpu", strategy, timeout))
        finally:
            _shut_down()
    except Exception as exc:  # reported by the parent, which exits non-zero
        queue.put({"rank": rank, "build_seconds": 0.0, "checks": 0, "failures": [f"rank {rank}: {exc!r}"]})


def _spawn_local(
    layout: Layout, nproc: int, strategy: str, timeout: float, node: int | None, as_json: bool
) -> int:
    import queue as queue_mod

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A fork server that has imported torch once starts each rank in ~0.1 s instead of ~2 s.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "meshgroups.mesh._mesh_groups", "meshgroups.cli._demo"]
    )
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_spawned_rank, args=(r, nproc, port, layout, strategy, timeout, queue), daemon=True
        )
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(nproc):
            results.append(queue.get(timeout=timeout + 60))
    except queue_mod.Empty:
        print(
            f"FAILED: only {len(results)} of {nproc} processes reported within {timeout + 60:.0f}s",
            file=sys.stderr,
        )
        return 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    results.sort(key=lambda r: r["rank"])
    ok = _print(layout, results, node, "spawned on 127.0.0.1, gloo", as_json)
    return 0 if ok else 1


def main(
    layout: Layout,
    nproc: int,
    strategy: str = "global",
    timeout: float = 60.0,
    node: int | None = None,
    as_json: bool = False,
) -> int:
    """Run the demo; returns the process exit status.

    Args:
        layout: the layout built. nproc: processes (one per rank). strategy, timeout: ``init_mesh``'s.
        node: ranks per node, for the report's node verdicts (under torchrun default:
            ``LOCAL_WORLD_SIZE``). as_json: print the report as one JSON document.
    """
    check_args(layout, nproc, strategy, timeout)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _join_torchrun(layout, strategy, timeout, node, as_json)
    return _spawn_local(layout, nproc, strategy, timeout, node, as_json)


def _print(layout: Layout, results: list[dict[str, Any]], node: int | None, how: str, as_json: bool) -> bool:
    """Print the report (text or one JSON document); whether every check passed."""
    text, ok = report(layout, results, node, how)
    if not as_json:
        print(text, flush=True)
        return ok
    from meshgroups.cli._conventions import print_json

    print_json(
        {
            "processes": len(results),
            "how": how,
            "layout": layout.to_dict(),
            "node": node,
            "nodes": {d: layout.node_locality(d, ranks_per_node=node) for d in layout.names}
            if node
            else None,
            "families": ["×".join(f) for f in families(layout)],
            "checks": sum(r["checks"] for r in results),
            "failures": [f for r in results for f in r["failures"]],
            "build_seconds": max(r["build_seconds"] for r in results),
            "ok": ok,
        }
    )
    sys.stdout.flush()
    return ok


def check_args(layout: Layout, nproc: int, strategy: str, timeout: float) -> None:
    """``main``'s arguments: a layout over ranks ``0..nproc-1`` exactly (one process per rank),
    at most :data:`MAX_PROCESSES` spawned here, a known strategy, a timeout of 1 s to a day::

        >>> check_args(Layout(dp=2, tp=2), 4, "global", 60.0)
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"the demo takes a meshgroups.Layout, got {type(layout).__name__}")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_positive(nproc, "nproc", 2**31 if torchrun else MAX_PROCESSES)
    if layout.rank_offset != 0 or layout.max_rank != nproc - 1 or layout.world_size != nproc:
        raise ValueError(
            f"the layout has {layout.world_size} ranks ({layout.describe_ranks()}) but nproc={nproc}; "
            "the demo runs one process per rank 0..nproc-1"
        )
    if strategy not in ("global", "local"):
        raise ValueError(f"strategy={short_repr(strategy)} is not one of 'global', 'local'")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {short_repr(timeout)}")
    if not 1.0 <= timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout={timeout!r} must be between 1 and {MAX_TIMEOUT:g} seconds")


__all__ = [
    "MAX_PROCESSES",
    "MAX_TIMEOUT",
    "check_args",
    "families",
    "main",
    "report",
    "run_checks",
]
