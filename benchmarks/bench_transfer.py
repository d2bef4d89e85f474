"""Weight transfer for RL: ``plan_transfer`` against three schemes RL frameworks use today.

Run: ``python benchmarks/bench_transfer.py [--worlds 1024,16384,131072]``. Prints Markdown.

The job: half the ranks train, half generate. Trainer ``pp=8 × dp × tp=8`` (tp inside a node,
dp replicas), rollout ``dp × tp=4`` on the other half (two rollout replicas per 8-rank node).
The model is shaped like a 70B Llama in bf16: 80 layers × 12 weights (q/k/v/o, q/k/v biases,
gate/up/down, two norms) + embedding, final norm, lm_head = 963 weights, 141 GB. The trainer
holds layers 10·p..10·p+9 on stage p (embedding on 0, head on 7); tp shards q/k/v/gate/up and
the biases on rows, o/down on columns, the vocabulary of embedding and head; norms replicate.

Schemes (their data movement modelled in closed form; the plan's is the real plan):
- ``rank-0 broadcast`` (OpenRLHF): every distinct shard is gathered on trainer rank 0, which
  broadcasts each full weight to every rollout rank through one NCCL ring (rank 0 + rollout).
- ``per-stage sender`` (slime): per pipeline stage the dp = tp = 0 rank all-gathers its stage's
  tp shards, then broadcasts each full weight through its stage's ring over every rollout rank.
- ``all-gather + scatter``: every trainer tp group all-gathers its stage; then each rollout rank
  receives its own shard of each weight from one trainer rank of the stage (round-robin), with
  no regard to nodes.
- ``plan``: :func:`meshgroups.transfer.plan_transfer` with ``Topology(node=8)``.

A table feeds a small rollout (4 nodes) from the same trainers: the plan's send balance with
pieces never cut and cut on multiples of 1 MiB and of 64 KiB (``min_part_bytes``, the default),
each against the issue's ideal (step-0 bytes over the ranks holding data) and against the achievable
bound (``Plan.send_lower_bound``: a pipeline stage's bytes can only leave from its ranks).

A last table times one rank's part (``plan_transfer(..., rank=r)``), each in a fresh process
(cold caches, as a rank computes it), for trainer rank 0 and rollout rank 0 from 8k to 1M
ranks, in this setup and in one with many replicas per block and no pipeline (trainer
``dp × tp=8``, rollout ``dp × tp=4``: 8,192 holders of each trainer block at 131k ranks).

Link model (printed): per rank an NVLink port (intra-node) and a NIC (inter-node), full
bisection. A rank's time is its busiest port (bytes in or out over that bandwidth) plus its
messages × the inter-node latency; the transfer takes the slowest rank's time (ring broadcasts
add their pipeline fill, ring length × latency, per weight). An estimate for comparison, not a
measurement.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from meshgroups import Layout, Topology
from meshgroups.transfer import Plan, Replicate, Shard, Weight, plan_transfer

T = TypeVar("T")

NODE = 8
INTRA_BW, INTER_BW = 300e9, 50e9  # bytes/s per rank: NVLink port, 400 Gb/s NIC
INTER_LAT = 10e-6  # s per message (and per ring hop)
H, F, KV, VOCAB, LAYERS, PP, TP_TRAIN, TP_ROLL = 8192, 28672, 1024, 128256, 80, 8, 8, 4


def llama(stages: int | None) -> list[Weight]:
    """The 963 weights; with ``stages`` each carries its pipeline stage on dim ``pp``."""
    out: list[Weight] = []

    def add(name: str, shape: tuple[int, ...], axis: int | None, stage: int) -> None:
        pl = {"tp": Shard(axis) if axis is not None else Replicate()}
        out.append(Weight(name, shape, "bfloat16", pl, ("pp", stage) if stages else None))

    per = LAYERS // (stages or 1)
    add("embed", (VOCAB, H), 0, 0)
    for layer in range(LAYERS):
        s = layer // per
        for name, shape, axis in (
            ("q", (H, H), 0), ("k", (KV, H), 0), ("v", (KV, H), 0), ("o", (H, H), 1),
            ("q_bias", (H,), 0), ("k_bias", (KV,), 0), ("v_bias", (KV,), 0),
            ("gate", (F, H), 0), ("up", (F, H), 0), ("down", (H, F), 1),
            ("ln1", (H,), None), ("ln2", (H,), None),
        ):  # fmt: skip
            add(f"layers.{layer}.{name}", shape, axis, s)
    add("norm", (H,), None, (stages or 1) - 1)
    add("lm_head", (VOCAB, H), 0, (stages or 1) - 1)
    return out


@dataclass
class Row:
    scheme: str
    cross: float  # bytes crossing nodes
    busiest: float  # bytes sent by the busiest rank
    messages: float
    seconds: float


def ring_fill(n_weights: int, ring: int) -> float:
    return n_weights * ring * INTER_LAT


def baselines(trainer: Layout, rollout: Layout, weights: list[Weight]) -> list[Row]:
    sizes = np.array([w.nbytes for w in weights], dtype=np.float64)
    stage = np.array([w.stage[1] if w.stage else 0 for w in weights])
    sharded = np.array([isinstance(w.placements.get("tp"), Shard) for w in weights])
    model, n_w, r = sizes.sum(), len(weights), rollout.world_size
    per_stage = np.bincount(stage, weights=sizes, minlength=PP)
    rollout_nodes = r // NODE
    # rank-0 broadcast: gather one copy of each shard on rank 0 (stage 0's tp group shares its node)
    gather_msgs = float(np.where(sharded, TP_TRAIN, 1).sum() - np.sum(stage == 0))
    gather_cross = model - per_stage[0]
    ring_cross = model * rollout_nodes  # the ring enters each rollout node once
    t_gather = gather_cross / INTER_BW + per_stage[0] / INTRA_BW + gather_msgs * INTER_LAT
    t_ring = model / INTER_BW + ring_fill(n_w, r + 1)
    rows = [
        Row("rank-0 broadcast", gather_cross + ring_cross, model, gather_msgs + n_w * r, t_gather + t_ring)
    ]
    # per-stage sender: tp all-gather inside the node, then 8 rings in parallel; every rollout
    # rank is in all 8 rings, so its NIC carries the whole model in and out
    ag = (TP_TRAIN - 1) / TP_TRAIN * per_stage.max() / INTRA_BW
    ag_msgs = float(np.where(sharded, TP_TRAIN * (TP_TRAIN - 1), 0).sum())
    fill = max(ring_fill(int((stage == p).sum()), r + 1) for p in range(PP))
    rows.append(Row("per-stage sender", ring_cross, model, ag_msgs + n_w * r, ag + model / INTER_BW + fill))
    # all-gather + scatter: each rollout rank pulls its shard of every weight from one trainer rank
    t_stage = trainer.world_size // PP
    shard_bytes = sizes / np.where(sharded, TP_ROLL, 1)
    per_sender = np.bincount(stage, weights=shard_bytes * r, minlength=PP) / min(t_stage, r)
    recv = shard_bytes.sum()
    msgs_rank = max(n_w, int(np.ceil(r / t_stage)) * n_w)
    t_scatter = max(recv, per_sender.max()) / INTER_BW + msgs_rank * INTER_LAT
    ag_all = ag_msgs * (trainer.world_size // (PP * TP_TRAIN))
    rows.append(Row("all-gather + scatter", recv * r, per_sender.max(), ag_all + n_w * r, ag + t_scatter))
    return rows


def plan_row(plan: Plan) -> Row:
    s = plan.stats
    cross_out, cross_in = s.send_cross, s.recv_cross
    intra_out, intra_in = s.send - cross_out, s.recv - cross_in
    port = np.maximum.reduce(
        [cross_out / INTER_BW, cross_in / INTER_BW, intra_out / INTRA_BW, intra_in / INTRA_BW]
    )
    seconds = float((port + (s.n_send + s.n_recv) * INTER_LAT).max())
    sent = plan.n_messages - plan.n_local
    return Row("plan", plan.cross_node_bytes, int(s.send.max()), sent, seconds)


def layouts(world: int, setup: str) -> tuple[Layout, list[Weight], Layout, list[Weight]]:
    """``bench``: the pipeline trainer of the tables above; ``replicas``: no pipeline, trainer
    ``dp × tp=8`` and rollout ``dp × tp=4`` (every trainer block held by world / 16 ranks)."""
    half = world // 2
    if setup == "bench":
        trainer = Layout(pp=PP, dp=half // (PP * TP_TRAIN), tp=TP_TRAIN)
        return trainer, llama(PP), Layout(dp=half // TP_ROLL, tp=TP_ROLL, rank_offset=half), llama(None)
    trainer = Layout(dp=half // TP_TRAIN, tp=TP_TRAIN)
    return trainer, llama(None), Layout(dp=half // TP_ROLL, tp=TP_ROLL, rank_offset=half), llama(None)


def rank_part(world: int, setup: str, rank: int) -> None:
    """Print the CPU seconds of ``rank``'s part (run in a fresh process by :func:`fresh`)."""
    src, src_w, dst, dst_w = layouts(world, setup)
    c0 = time.process_time()
    plan_transfer(src, src_w, dst, dst_w, topology=Topology(node=NODE), rank=rank)
    print(time.process_time() - c0)


def fresh(world: int, setup: str, rank: int) -> float:
    """CPU seconds of one rank's part, planned in a new process (nothing cached)."""
    args = [sys.executable, __file__, "--rank-part", f"{world},{setup},{rank}"]
    return float(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def timed(fn: Callable[[], T]) -> tuple[T, tuple[float, float]]:
    """``(result, (wall seconds, CPU seconds))``: the planner is single-threaded, so its CPU time
    is what it costs on an idle core even when this shared machine is oversubscribed."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, (time.perf_counter() - w0, time.process_time() - c0)


def fmt(t: tuple[float, float]) -> str:
    return f"{t[1]:.3f} ({t[0]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1024,16384,131072")
    parser.add_argument("--rank-worlds", default="8192,32768,131072,1048576")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)  # world,setup,rank: one timing
    args = parser.parse_args()
    if args.rank_part:
        world, setup, rank = args.rank_part.split(",")
        rank_part(int(world), setup, int(rank))
        return
    print(
        f"Link model: intra-node {INTRA_BW / 1e9:.0f} GB/s, inter-node {INTER_BW / 1e9:.0f} GB/s per rank, "
        f"{INTER_LAT * 1e6:.0f} us per message or ring hop; {NODE} ranks per node.\n"
    )
    src_w, dst_w = llama(PP), llama(None)
    topo = Topology(node=NODE)
    print("| ranks | scheme | cross-node GB | busiest sender GB | messages | est. time (s) | vs plan |")
    print("|---|---|---|---|---|---|---|")
    timing = []
    for world in (int(x) for x in args.worlds.split(",")):
        half = world // 2
        trainer = Layout(pp=PP, dp=half // (PP * TP_TRAIN), tp=TP_TRAIN)
        rollout = Layout(dp=half // TP_ROLL, tp=TP_ROLL, rank_offset=half)
        plan, t_whole = timed(lambda t=trainer, r=rollout: plan_transfer(t, src_w, r, dst_w, topology=topo))
        assert plan.cross_node_bytes == plan.cross_node_lower_bound
        local = {}
        for who, rank in (("trainer rank 0", 0), ("rollout rank 0", half)):
            part = plan_transfer(trainer, src_w, rollout, dst_w, topology=topo, rank=rank)
            assert part.messages == plan.for_rank(rank)
            local[who] = fresh(world, "bench", rank)
        busiest = plan.busiest_send_bytes
        assert plan.send_lower_bound <= busiest <= plan.busiest_send_bound
        ratios = (busiest / plan.ideal_send_bytes, busiest / plan.send_lower_bound)
        timing.append((world, t_whole, local, plan.n_messages, ratios))
        mine = plan_row(plan)
        for row in [*baselines(trainer, rollout, src_w), mine]:
            print(
                f"| {world:,} | {row.scheme} | {row.cross / 1e9:,.0f} | {row.busiest / 1e9:,.1f} | {row.messages:,.0f} "
                f"| {row.seconds:,.2f} | {row.seconds / mine.seconds:,.1f}× |"
            )
    print()
    print("Planning time, CPU seconds (the whole plan's wall seconds in brackets; a rank's part in a")
    print("fresh process), and the busiest sender against the ideal and the achievable bound:\n")
    print(
        "| ranks | messages | whole plan | trainer rank 0's part | rollout rank 0's part "
        "| busiest / ideal | busiest / achievable |"
    )
    print("|---|---|---|---|---|---|---|")
    for world, t_whole, local, n, (ideal, achievable) in timing:
        print(
            f"| {world:,} | {n:,} | {fmt(t_whole)} | {local['trainer rank 0']:.3f} "
            f"| {local['rollout rank 0']:.3f} | {ideal:.3f} | {achievable:.3f} |"
        )
    print()
    print("A small rollout (4 nodes, `dp=4 × tp=8`) fed by the same trainers: each piece has many")
    print("more holders than nodes to reach; pieces never cut vs cut on multiples of `min_part_bytes`")
    print("= 1 MiB and 64 KiB (the default): busiest sender / ideal (/ achievable bound), messages")
    print("and the estimated time (ms) under the link model:\n")
    print(
        "| trainer ranks | never cut | cuts on 1 MiB | cuts on 64 KiB "
        "| messages: never, 1 MiB, 64 KiB | est. ms: never, 1 MiB, 64 KiB |"
    )
    print("|---|---|---|---|---|---|")
    for world in (int(x) for x in args.worlds.split(",")):
        half = world // 2
        trainer = Layout(pp=PP, dp=half // (PP * TP_TRAIN), tp=TP_TRAIN)
        small = Layout(dp=4, tp=TP_TRAIN, rank_offset=half)
        small_w = [Weight(w.name, w.shape, w.dtype, {"tp": w.placements["tp"]}) for w in dst_w]
        plans = [
            plan_transfer(trainer, src_w, small, small_w, topology=topo, min_part_bytes=mpb)
            for mpb in (1 << 62, 1 << 20, 1 << 16)
        ]
        cells = []
        for p in plans:
            assert p.send_lower_bound <= p.busiest_send_bytes <= p.busiest_send_bound
            b = p.busiest_send_bytes
            cells.append(f"{b / p.ideal_send_bytes:.3f} ({b / p.send_lower_bound:.3f})")
        counts = ", ".join(f"{p.n_messages:,}" for p in plans)
        ms = ", ".join(f"{plan_row(p).seconds * 1e3:.2f}" for p in plans)
        print(f"| {half:,} | {' | '.join(cells)} | {counts} | {ms} |")
    print()
    print("One rank's part alone, CPU seconds, each in a fresh process (`bench`: the setup above;")
    print("`replicas`: trainer `dp × tp=8`, rollout `dp × tp=4`, no pipeline):\n")
    print(
        "| ranks | bench: trainer rank 0 | bench: rollout rank 0 | replicas: trainer rank 0 | replicas: rollout rank 0 |"
    )
    print("|---|---|---|---|---|")
    for world in (int(x) for x in args.rank_worlds.split(",")):
        cells = [
            f"{fresh(world, setup, rank):.3f}" for setup in ("bench", "replicas") for rank in (0, world // 2)
        ]
        print(f"| {world:,} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
