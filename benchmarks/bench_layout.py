"""Layout core speed: all groups of every dim plus ("dp", "cp"), meshgroups vs a Python loop.

Run: ``python benchmarks/bench_layout.py [--max-world 1048576]``. Prints a Markdown table.
The baseline is the straightforward enumeration most codebases use (nested loops over
coordinates and strides, one Python int at a time), run in the same process on the same layouts.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from meshgroups import Layout

FAMILIES = (("pp",), ("dp",), ("cp",), ("tp",), ("dp", "cp"))


def layout_for(world: int) -> Layout:
    tp, cp = 8, 4 if world >= 16384 else 2
    pp = 16 if world >= 131072 else 8 if world >= 16384 else 4
    return Layout(pp=pp, dp=world // (pp * cp * tp), cp=cp, tp=tp)


def loop_groups(names, shape, dims):
    """Reference enumeration in pure Python (no numpy)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    inner = [i for i, n in enumerate(names) if n in dims]
    outer = [i for i, n in enumerate(names) if n not in dims]
    groups = []
    for oc in itertools.product(*(range(shape[i]) for i in outer)):
        base = sum(c * strides[i] for c, i in zip(oc, outer))
        groups.append(
            [
                base + sum(c * strides[i] for c, i in zip(ic, inner))
                for ic in itertools.product(*(range(shape[i]) for i in inner))
            ]
        )
    return groups


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def per_call(fn, n=2000):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def bench_one(world: int) -> str:
    lay = layout_for(world)
    sizes = dict(zip(lay.names, lay.shape))
    # a fresh Layout each time, so no cached grid flatters meshgroups
    t_np, _ = timed(lambda: [Layout(sizes).groups(*f) for f in FAMILIES], 5)
    loop_repeat = 1 if world > 16384 else 3
    t_loop, loops = timed(lambda: [loop_groups(lay.names, lay.shape, f) for f in FAMILIES], loop_repeat)
    for f, rows in zip(FAMILIES, loops):  # same answer, or the timing means nothing
        assert lay.groups(*f).tolist() == rows, f
    rank = world // 3 + 7
    t_tp = per_call(lambda: lay.group_of(rank, "tp"))
    t_dpcp = per_call(lambda: lay.group_of(rank, "dp", "cp"))
    dims = ", ".join(f"{k}={v}" for k, v in sizes.items())
    return (
        f"| {world:,} | {dims} | {t_np * 1e3:.1f} | {t_loop * 1e3:.0f} | {t_loop / t_np:.0f}x "
        f"| {t_tp * 1e6:.1f} | {t_dpcp * 1e6:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-world", type=int, default=1 << 20)
    args = parser.parse_args()
    print(
        "| W | layout | meshgroups groups (ms) | Python loop (ms) | speed-up | group_of tp (µs) | group_of dp,cp (µs) |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in (1024, 16384, 131072, 1 << 20):
        if world > args.max_world:
            break
        print(bench_one(world), flush=True)


if __name__ == "__main__":
    main()
