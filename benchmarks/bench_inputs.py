"""Cost in proportion to the input: the cases of issue 18 (case 11), before-style vs now.

Run: ``python benchmarks/bench_inputs.py``. For each case, the time at n and at 2n (median of 3,
ms) and their ratio: about 2 for a linear cost, about 4 for a quadratic one, about 1 for a cost
bounded by a cap. "before" re-states the old algorithm (or lifts the old cap) in this process, as
the baseline; "now" calls the library. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
from meshgroups.compat.group_initializer import TrainDPGroupInitializer

from meshgroups import Layout, Topology
from meshgroups.layout import _placement as placement
from meshgroups.render._formats import span_table


def median_ms(fn: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def old_rank_check(ranks: list[int]) -> list[int]:
    """The legacy initializers' duplicate check before this round: ``list.count`` per rank."""
    return sorted({r for r in ranks if ranks.count(r) > 1})


def label_passes(families: dict[str, np.ndarray], skip_singletons: bool) -> None:
    """``infer``'s component passes: before, every family joined every other (F² passes); now,
    size-1 families (every rank alone) are skipped, as they join nothing."""
    world = next(iter(families.values())).size
    gid = {}
    for name, rows in families.items():
        gid[name] = np.empty(world, dtype=np.int64)
        gid[name][rows.ravel()] = np.repeat(np.arange(rows.shape[0]), rows.shape[1])
    joining = [e for e in families if not skip_singletons or families[e].shape[1] > 1]
    for d in families:
        if skip_singletons and families[d].shape[1] == 1:
            continue
        label = np.arange(world, dtype=np.int64)
        for e in joining:
            if e != d:
                label = label[families[e]].min(axis=1)[gid[e]]


def infer_families(singletons: int, world: int = 2**15) -> dict[str, np.ndarray]:
    lay = Layout(dp=world // 8, tp=8)
    fams = {"dp": lay.groups("dp"), "tp": lay.groups("tp")}
    fams.update({f"s{i}": np.arange(world).reshape(-1, 1) for i in range(singletons)})
    return fams


def place_dims(n: int) -> None:
    topo = Topology(**{f"l{i}": 2**i for i in range(1, 25)})
    sizes = {f"d{i}": 4 for i in range(n)}
    Layout.place(sizes, topo, fast_first=list(sizes))


LEVELS = Topology(**{f"l{i}": 2**i for i in range(1, 25)})


def _span_case(world: int) -> tuple[Layout, Topology]:
    sizes = {f"d{i}": 2 for i in range(9)}
    sizes["d9"] = world // 2**9
    return Layout(**sizes), LEVELS


def old_span_table(world: int) -> None:
    """The span table before this round: every group array divided by every level's size."""
    lay, topo = _span_case(world)
    for d in lay.names:
        rows = lay.groups(d)
        for _, size in topo.levels:
            units = rows // size
            int((units != units[:, :1]).any(axis=1).sum())


def row(case: str, n: int, prepare: Callable[[int], Callable[[], object]], m: int | None = None) -> str:
    """Times ``prepare(n)()`` and ``prepare(m)()`` (m = 2n by default); the input is built by
    ``prepare``, outside the timer."""
    m = 2 * n if m is None else m
    at_n, at_m = prepare(n), prepare(m)
    at_n()  # warm up
    a, b = median_ms(at_n), median_ms(at_m)
    return f"| {case} | {n:,} → {m:,} | {a:.1f} | {b:.1f} | {b / a:.1f} |"


def main() -> None:
    fmt = {"format": "meshgroups.Layout/1"}
    print("| case | n → 2n | ms at n | ms at 2n | ratio |")
    print("|---|---|---|---|---|")
    print(
        row("legacy ranks check, before (list.count)", 4000, lambda n: lambda: old_rank_check(list(range(n))))
    )
    print(
        row(
            "TrainDPGroupInitializer(0, n, range(n)), now",
            20000,
            lambda n: lambda: TrainDPGroupInitializer(0, n, list(range(n))),
        )
    )
    for label, skip in (("before (F² passes)", False), ("now (size-1 skipped)", True)):
        print(
            row(
                f"infer passes, n size-1 families + 2, {label}",
                30,
                lambda n, skip=skip: (lambda f: lambda: label_passes(f, skip))(infer_families(n)),
            )
        )
    print(
        row(
            "Layout.infer, 2 families over n ranks, now",
            2**16,
            lambda n: (lambda f: lambda: Layout.infer(f))(infer_families(0, n)),
        )
    )
    print(
        row(
            "from_dict, n size-1 dims (≤ 64), now",
            32,
            lambda n: (lambda d: lambda: Layout.from_dict(d))(
                {**fmt, "dims": [[f"d{i}", 1] for i in range(n)]}
            ),
        )
    )
    print(
        row(
            "from_dict, n size-1 dims (> 64: refused), now",
            8000,
            lambda n: (lambda d: lambda: _refused(lambda: Layout.from_dict(d)))(
                {**fmt, "dims": [[f"d{i}", 1] for i in range(n)]}
            ),
        )
    )
    print(
        row(
            "Layout.infer, n size-1 families (> 64: refused), now",
            2000,
            lambda n: (lambda g: lambda: _refused(lambda: Layout.infer(g)))(
                {f"f{i}": [[0], [1]] for i in range(n)}
            ),
        )
    )
    saved = placement.MAX_BRANCHING
    placement.MAX_BRANCHING = 64  # the search before this round: both splits for every ranked dim
    print(
        row(
            "place, n dims of size 4 on 24 levels, before (unbounded search)",
            9,
            lambda n: lambda: place_dims(n),
            12,
        )
    )
    placement.MAX_BRANCHING = saved
    print(
        row(
            "place, n dims of size 4 on 24 levels, now (2**8 evaluations at most)",
            9,
            lambda n: lambda: place_dims(n),
            12,
        )
    )
    print(
        row(
            "span table, 10 dims × 24 levels over n ranks, before (per-rank units)",
            2**16,
            lambda n: lambda: old_span_table(n),
        )
    )
    print(
        row(
            "span table, 10 dims × 24 levels over n ranks, now (group extents)",
            2**16,
            lambda n: lambda: span_table(*_span_case(n)),
        )
    )
    try:
        from meshgroups.render._formats import plot

        print(
            row(
                "plot pp=2 tp=n (a window of 64 columns), now",
                4096,
                lambda n: lambda: plot(Layout(pp=2, tp=n)),
            )
        )
    except ImportError:
        print("| plot | (matplotlib not installed) | | | |")


def _refused(fn: Callable[[], object]) -> None:
    try:
        fn()
    except ValueError:
        return
    raise AssertionError("expected a refusal")


if __name__ == "__main__":
    main()
