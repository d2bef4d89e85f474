"""What building ``TransferGroups`` costs one rank, and what the old all-gather carried.

Run: ``python benchmarks/bench_transfer_groups.py [--worlds 1024,4096] [--model llama-8b]``.
Prints Markdown. No processes: the per-rank bookkeeping measured on this machine.

The job: half the ranks train (``pp=4 × dp_shard × tp=8``, FSDP2 after tp), half generate
(``dp × tp=8``), nodes of 8 ranks, a preset model from ``meshgroups.transfer._names.presets``.

- ``gathered (old)``: every fan-out key of the world — what one ``all_gather_object`` of every
  rank's fan-outs delivered to each rank before; ``gathered (now)``: the distinct rank sets.
- For a few rollout ranks that receive broadcasts: ``own part`` (``plan_transfer(...,
  rank=me)``), ``replan senders`` (the baseline: planning the part of every sender that
  broadcasts to it, to derive its routes locally) and ``exchange`` (what it does instead: list
  its own fan-outs and the integers it sends, read the integers it receives; the transfer of a
  few bytes per message over ``p2p`` is not included). Ratio: replan / exchange.
"""

from __future__ import annotations

import argparse
import time

from meshgroups import Layout, Topology
from meshgroups.transfer import plan_transfer
from meshgroups.transfer._names.presets import model_weights
from meshgroups.transfer._run.fanout_groups import fanouts


def _receiver_lists(mine: list, me: int, sets_index: dict, parts: dict[int, list]) -> int:
    """The exchange's local work on ``me``: its own fan-outs, the integers it would send, and
    routes from the integers its senders computed (given here as ``parts``)."""
    own = fanouts(mine, me)
    told = {r for ranks in own.values() for r in ranks[1:]}
    out: dict[int, list[int]] = {r: [] for r in told}
    for m in mine:
        if m.src == me and m.dst in out:
            key = (m.weight, m.src, m.box, m.step)
            out[m.dst].append(sets_index[own[key]] if key in own else -1)
    routes = {}
    for s, ints in parts.items():
        ms = [m for m in mine if m.src == s and m.dst == me]
        for m, i in zip(ms, ints):
            if i >= 0:
                routes[(m.weight, m.src, m.box, m.step)] = i
    return len(routes)


def run(world: int, model: str, samples: int) -> list[str]:
    half = world // 2
    trainer = Layout(pp=4, dp_shard=half // 32, tp=8)
    rollout = Layout(dp=half // 8, tp=8, rank_offset=half)
    sw, dw = model_weights(model, trainer), model_weights(model, rollout)
    topo = Topology(node=8)
    whole = plan_transfer(trainer, sw, rollout, dw, topo)
    receivers: dict[tuple, set[int]] = {}
    for m in whole.messages:
        if m.src != m.dst:
            receivers.setdefault((m.weight, m.src, m.box, m.step), set()).add(m.dst)
    fan = {k: (k[1], *sorted(d)) for k, d in receivers.items() if len(d) > 1}
    sets = sorted(set(fan.values()))
    index = {s: i for i, s in enumerate(sets)}
    rows = []
    for me in [half + 9 + k * (half // samples) for k in range(samples)]:
        t0 = time.perf_counter()
        mine = list(plan_transfer(trainer, sw, rollout, dw, topo, rank=me).messages)
        t_own = time.perf_counter() - t0
        senders = sorted({s[0] for s in sets if s[0] != me and me in s[1:]})
        t0 = time.perf_counter()
        parts = {s: list(plan_transfer(trainer, sw, rollout, dw, topo, rank=s).messages) for s in senders}
        t_replan = time.perf_counter() - t0
        ints = {}  # what each sender would send ``me`` (computed outside the timing)
        for s, part in parts.items():
            own = fanouts(part, s)
            ints[s] = [index[own[k]] if (k := (m.weight, m.src, m.box, m.step)) in own else -1
                       for m in part if m.dst == me]  # fmt: skip
        t0 = time.perf_counter()
        n = _receiver_lists(mine, me, index, ints)
        t_exchange = time.perf_counter() - t0
        rows.append(
            f"| {world:,} | {len(fan):,} | {len(sets):,} | {me} | {len(senders)} | {n:,} | {t_own:.3f} | "
            f"{t_replan:.3f} | {t_exchange:.4f} | {t_replan / max(t_exchange, 1e-9):,.0f}× |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1024,4096")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--samples", type=int, default=2, help="rollout ranks measured per world")
    args = ap.parse_args()
    print(f"model {args.model}; seconds on this machine, one process\n")
    print(
        "| ranks | gathered (old): fan-outs | gathered (now): sets | rank | broadcasting senders | "
        "routes received | own part s | replan senders s | exchange s | replan / exchange |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in (int(w) for w in args.worlds.split(",")):
        for row in run(world, args.model, args.samples):
            print(row, flush=True)


if __name__ == "__main__":
    main()
