"""Topology at scale: ``Layout.place`` and ``Layout.infer`` at 16k, 131k and 1M ranks.

Run: ``python benchmarks/bench_topology.py [--repeat 5]``. Prints a Markdown table of medians
(ms). ``place`` puts pp, dp, cp, tp (tp and cp ranked fastest) on a machine of 8-GPU nodes and
64-GPU domains; ``infer`` reads the four families of groups of a *permuted* placement back (the
groups are computed before the timer starts) and is checked to reproduce every family. Target:
both under 100 ms at 131k ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from meshgroups import Layout, Topology

TOPOLOGY = Topology(node=8, domain=64)


def sizes_for(world: int) -> dict[str, int]:
    pp = 16 if world >= 131072 else 8
    return {"pp": pp, "dp": world // (pp * 4 * 8), "cp": 4, "tp": 8}


def as_sets(rows: np.ndarray) -> np.ndarray:
    members = np.sort(rows, axis=1)
    return members[np.lexsort(members.T[::-1])]


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| W | layout | place (ms) | infer, permuted placement (ms) | spans after place |")
    print("|---|---|---|---|---|")
    for world in (16384, 131072, 1 << 20):
        sizes = sizes_for(world)
        place_ms = median_ms(lambda s=sizes: Layout.place(s, TOPOLOGY, fast_first=["tp", "cp"]), args.repeat)
        placed = Layout.place(sizes, TOPOLOGY, fast_first=["tp", "cp"])
        shuffled = Layout.from_grid(
            np.random.default_rng(0).permutation(world).reshape(placed.shape), placed.names
        )
        families = {d: shuffled.groups(d) for d in shuffled.names}
        infer_ms = median_ms(lambda f=families: Layout.infer(f), args.repeat)
        back = Layout.infer(families)
        for d, rows in families.items():  # same groups as sets, or the timing means nothing
            assert np.array_equal(as_sets(back.groups(d)), as_sets(rows)), d
        spans = ", ".join(f"{d}:{placed.span(d, topology=TOPOLOGY)}" for d in placed.names)
        dims = ", ".join(f"{k}={v}" for k, v in sizes.items())
        print(f"| {world:,} | {dims} | {place_ms:.1f} | {infer_ms:.1f} | {spans} |", flush=True)


if __name__ == "__main__":
    main()
