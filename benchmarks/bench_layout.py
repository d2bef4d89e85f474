"""Layout core speed: all groups of every dim plus ("dp", "cp"), meshgroups vs a Python loop;
then the identity operations (hash, ==, fingerprint, ``in``) of a fresh layout.

Run: ``python benchmarks/bench_layout.py [--max-world 1048576]``. Prints two Markdown tables.
The baseline of the first is the straightforward enumeration most codebases use (nested loops
over coordinates and strides, one Python int at a time), run in the same process on the same
layouts. The second compares affine layouts with the same placement given as an explicit grid
(``Layout.from_grid``; a permuted one stays explicit): the affine columns must stay flat in W.
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


def identity_costs(make) -> tuple[float, float, float, float]:
    """µs per operation on a fresh layout (nothing cached): hash, ==, fingerprint, ``in``."""

    def fresh_op(op):
        layouts = [make() for _ in range(5)]
        others = [make() for _ in range(5)]
        t0 = time.perf_counter()
        for a, b in zip(layouts, others):
            op(a, b)
        return (time.perf_counter() - t0) / len(layouts) * 1e6

    return (
        fresh_op(lambda a, b: hash(a)),
        fresh_op(lambda a, b: a == b),
        fresh_op(lambda a, b: a.fingerprint()),
        fresh_op(lambda a, b: (a.world_size // 3) in a),
    )


def bench_identity(world: int) -> str:
    lay = layout_for(world)
    sizes = dict(zip(lay.names, lay.shape))
    affine = identity_costs(lambda: Layout(sizes))
    grid = lay.grid[..., ::-1].copy()  # reversed tp: not affine, so it stays an explicit array
    explicit = identity_costs(lambda: Layout.from_grid(grid, lay.names))
    cells = " | ".join(f"{a:.1f} | {e:.0f}" for a, e in zip(affine, explicit))
    return f"| {world:,} | {cells} |"


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
    print()
    print(
        "| W | hash affine (µs) | hash explicit (µs) | == affine | == explicit | fingerprint affine "
        "| fingerprint explicit | in affine | in explicit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in (1024, 16384, 131072, 1 << 20):
        if world > args.max_world:
            break
        print(bench_identity(world), flush=True)


if __name__ == "__main__":
    main()
