"""Placing dims on a machine, and reading a running job's groups back as a layout (numpy only).

``place`` answers "in which order do I put my dims so the bandwidth-hungry ones stay on fast
levels?": dims are served in priority order, each taking the innermost capacity left, level by
level; a dim that does not fit in a level keeps its inner factor there and spills the outer factor
to the next level, as JAX's hybrid device mesh splits a dim between ICI and DCN. ``infer``
answers "what layout is this?" for the groups a job printed: each dim's coordinate is a connected
component of the other families' groups, found with vectorised min-label passes, then the whole
result is checked group by group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import gcd
from typing import TYPE_CHECKING

import numpy as np

from meshgroups._checks import (
    MAX_RANK,
    MAX_WORLD_SIZE,
    check_names,
    check_size,
    formula,
    is_int,
    product,
    short_repr,
)
from meshgroups.errors import LayoutError
from meshgroups.layout._topology import WORLD, Topology

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout


def place(
    cls: type[Layout],
    sizes: Mapping[str, int],
    topology: Topology,
    fast_first: Sequence[str] = (),
    require: Mapping[str, str] | None = None,
) -> Layout:
    """See ``Layout.place``, which calls it with ``cls=Layout``::

    >>> from meshgroups import Layout, Topology
    >>> place(Layout, {"dp": 4, "tp": 4}, Topology(node=8), fast_first=["dp"])
    Layout(dp=4, tp=4, strides=(1, 4))
    """
    if not isinstance(sizes, Mapping) or not sizes:
        raise TypeError(f"sizes must be a non-empty mapping of dim name to size, got {short_repr(sizes)}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a meshgroups.Topology, got {type(topology).__name__}")
    names = check_names(list(sizes))
    shape = [check_size(n, sizes[n]) for n in names]
    world = product(shape)
    if world > MAX_WORLD_SIZE:
        raise LayoutError(f"{formula(names, shape)} ranks exceeds the {MAX_WORLD_SIZE} a layout may hold")
    fast = (
        list(check_names(fast_first, "fast_first dim")) if not isinstance(fast_first, str) else [fast_first]
    )
    for d in fast:
        if d not in names:
            raise LayoutError(
                f"fast_first names {short_repr(d)}, which is not one of the dims {', '.join(names)}"
            )
    if require is not None and not isinstance(require, Mapping):
        raise TypeError(
            f"require must map dim names to level names, e.g. {{'tp': 'node'}}, got {short_repr(require)}"
        )
    require = dict(require or {})
    for d, level in require.items():
        if d not in names:
            raise LayoutError(
                f"require names {short_repr(d)}, which is not one of the dims {', '.join(names)}"
            )
        if level != WORLD:
            topology.size(level)  # names the known levels if unknown
    # Capacity of each level in units of the level below (the world last), up to this world.
    bounds = [size for _, size in topology.levels if size < world]
    for size in bounds:
        if world % size:
            raise LayoutError(f"the world of {world} ranks is not a whole number of units of {size} ranks")
    level_names = [name for name, size in topology.levels if size < world] + [WORLD]
    capacity, below = [], 1
    for size in [*bounds, world]:
        capacity.append(size // below)
        below = size

    def level_of(d: str) -> int:
        return level_names.index(require[d]) if require[d] in level_names else len(level_names) - 1

    # Required dims first (the tightest level first), then the fast_first order, then the rest.
    order = sorted(require, key=lambda d: (level_of(d), fast.index(d) if d in fast else len(fast)))
    order += [d for d in fast if d not in order]
    order += [d for d in names if d not in order]
    scored = len([d for d in order if d in fast or d in require])  # only these spans are compared
    best = _assign(order, [sizes[d] for d in order], capacity, scored, MAX_BRANCHING)
    if best is None:
        # the sizes multiply to the world (checked above), so some assignment always fits
        raise RuntimeError("meshgroups internal error: no placement of sizes that multiply to the world")
    spans, allocation = best
    for d in require:
        if spans[order.index(d)] > level_of(d):
            before = order[: order.index(d)]
            raise LayoutError(
                f"{d}={sizes[d]} cannot stay inside a {require[d]} ({topology.size(require[d])} ranks)"
                + (f" with {', '.join(f'{o}={sizes[o]}' for o in before)} placed first" if before else "")
            )
    pieces: list[list[tuple[str, int]]] = [[] for _ in capacity]  # per level, innermost first
    for d, takes in zip(order, allocation):
        for index, take in takes:
            pieces[index].append((d, take))
    return _grid_of_pieces(cls, names, shape, pieces)


Allocation = list[tuple[int, int]]  # (level index, factor placed there)
#: How many ranked dims ``place`` tries both splits for (2**8 = 256 evaluations at most); the
#: rest take the innermost split. Bounds the search however many dims and levels are given.
MAX_BRANCHING = 8


def _take(size: int, capacity: list[int], levels: Sequence[int]) -> Allocation | None:
    """Place ``size`` into ``capacity`` visiting ``levels`` in that order, a gcd at a time."""
    takes, remaining = [], size
    for index in levels:
        if remaining == 1:
            break
        take = gcd(remaining, capacity[index])
        if take > 1:
            takes.append((index, take))
            remaining //= take
    return takes if remaining == 1 else None


def _assign(
    order: list[str], sizes: list[int], capacity: list[int], scored: int, branching: int
) -> tuple[list[int], list[Allocation]] | None:
    """The allocation of every dim (in priority order) whose span levels — of the first
    ``scored`` dims, the ones the caller ranked — are lexicographically smallest. Each dim first
    gets its smallest span; within it, its factors go innermost first (JAX's split: fewest units
    crossed) unless putting them outermost first leaves a later ranked dim a smaller span. Two
    choices for each of the first ``branching`` ranked dims (:data:`MAX_BRANCHING`), the
    innermost split for the rest: at most 2**branching small evaluations, whatever the input."""
    if not order:
        return [], []
    inner = _take(sizes[0], capacity, range(len(capacity)))
    if inner is None:
        return None
    span = max((index for index, _ in inner), default=0)
    outer = _take(sizes[0], capacity, range(span, -1, -1)) if scored > 1 and branching > 0 else None
    best: tuple[list[int], list[Allocation]] | None = None
    for takes in [inner] if outer == inner or outer is None else [inner, outer]:
        left = list(capacity)
        for index, take in takes:
            left[index] //= take
        rest = _assign(order[1:], sizes[1:], left, max(scored - 1, 0), branching - (outer is not None))
        if rest is None:
            continue
        candidate = ([span if scored else 0, *rest[0]], [takes, *rest[1]])
        if best is None or candidate[0] < best[0]:  # ties keep the innermost split
            best = candidate
    return best


def _grid_of_pieces(
    cls: type[Layout], names: tuple[str, ...], shape: list[int], pieces: list[list[tuple[str, int]]]
) -> Layout:
    flat = [p for level in pieces for p in level]  # innermost first
    strides = _piece_strides(names, flat)
    if strides is not None:  # the usual case: O(ndim), no grid of W ranks to build and check
        return cls.from_strides(names, shape, strides)
    sizes = [size for _, size in flat] or [1]
    ranks = np.arange(product(sizes), dtype=np.int64).reshape(sizes[::-1])  # outermost axis first
    axis_of = {i: len(flat) - 1 - i for i in range(len(flat))}
    order = []
    for d in names:  # each dim's pieces, outer (slower level) factor first
        order += [axis_of[i] for i in reversed(range(len(flat))) if flat[i][0] == d]
    grid = np.transpose(ranks, order).reshape(shape) if flat else ranks.reshape(shape)
    return cls.from_grid(grid, names)


def _piece_strides(names: tuple[str, ...], flat: list[tuple[str, int]]) -> list[int] | None:
    """Each dim's rank stride if every dim's pieces sit next to each other in ``flat`` (innermost
    first), which makes the placement affine; None otherwise."""
    strides = []
    for d in names:
        where = [i for i, (name, _) in enumerate(flat) if name == d]
        if not where:
            strides.append(0)  # a size-1 dim
            continue
        if where != list(range(where[0], where[-1] + 1)):
            return None
        strides.append(product(size for _, size in flat[: where[0]]))
    return strides


def infer(cls: type[Layout], groups: Mapping[str, Sequence[Sequence[int]]]) -> Layout:
    """See ``Layout.infer``, which calls it with ``cls=Layout``::

    >>> from meshgroups import Layout
    >>> infer(Layout, {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]})
    Layout(dp=2, tp=2)
    """
    if not isinstance(groups, Mapping) or not groups:
        raise TypeError(
            "infer needs a mapping of family name to a list of rank lists, e.g. {'tp': [[0, 1], [2, 3]]}"
        )
    names = check_names(list(groups), "family name")
    arrays = {}
    for name in names:
        arrays[name] = _family_rows(name, groups[name])
    # (sorting, not np.unique: numpy's hash-based unique is several times slower at 1M ranks)
    ranks = np.sort(arrays[names[0]], axis=None)
    if ranks.size > 1 and (ranks[1:] == ranks[:-1]).any():
        raise LayoutError(f"family {names[0]!r} holds a rank twice; each family's groups must not overlap")
    world = ranks.size
    dense = int(ranks[-1]) - int(ranks[0]) == world - 1  # ranks a..a+W-1: positions are rank - a
    for name, rows in arrays.items():
        if rows.size != world or not np.array_equal(np.sort(rows, axis=None), ranks):
            raise LayoutError(
                f"family {name!r} does not cover the same {world} ranks exactly once as family {names[0]!r}"
            )
    sizes = [arrays[n].shape[1] for n in names]
    if product(sizes) != world:
        raise LayoutError(
            f"group sizes {formula(names, sizes)} do not multiply to the {world} ranks: the families are not "
            "the dims of one layout"
        )
    # pos[name]: the groups as positions 0..W-1; gid[name][i]: the group holding position i
    pos = {n: rows - ranks[0] if dense else np.searchsorted(ranks, rows) for n, rows in arrays.items()}
    gid = {}
    for name, rows in arrays.items():
        gid[name] = np.empty(world, dtype=np.int64)
        gid[name][pos[name].ravel()] = np.repeat(np.arange(rows.shape[0]), rows.shape[1])
    coords = {}
    # Size-1 families (every rank alone) join nothing: they are skipped in the passes below and
    # their coordinate is 0, so the cost is O(families × W), not O(families² × W).
    joining = [e for e in names if arrays[e].shape[1] > 1]
    for d in names:
        if arrays[d].shape[1] == 1:
            coords[d] = np.zeros(world, dtype=np.int64)
            continue
        # Positions joined by the groups of every other family: in a product layout that is one
        # pass per family (each collapses one dim); the checks below catch anything else.
        label = np.arange(world, dtype=np.int64)
        for e in joining:
            if e != d:
                label = label[pos[e]].min(axis=1)[gid[e]]
        present = np.zeros(world, dtype=bool)
        present[label] = True
        coords[d] = (np.cumsum(present) - 1)[label]  # components numbered by their smallest position
        if int(present.sum()) != arrays[d].shape[1]:
            _explain(arrays, pos, gid, names)
    # Outermost first: the dim whose members sit furthest apart in rank.
    spread = {
        d: int(np.diff(np.sort(arrays[d][0])).min()) if arrays[d].shape[1] > 1 else world for d in names
    }
    ordered = sorted(names, key=lambda d: -spread[d])
    index = np.zeros(world, dtype=np.int64)
    stride = {}
    for d in reversed(ordered):
        stride[d] = product(arrays[e].shape[1] for e in ordered[ordered.index(d) + 1 :])
        index += coords[d] * stride[d]
    if np.bincount(index, minlength=world).max() > 1:
        _explain(arrays, pos, gid, names)
    for d in names:  # every group of d: one fixed point of the other coordinates, all of d's values
        rest = (index - coords[d] * stride[d])[pos[d]]
        if not (rest == rest[:, :1]).all():
            _explain(arrays, pos, gid, names)
    grid = np.empty(world, dtype=np.int64)
    grid[index] = ranks
    return cls.from_grid(grid.reshape([arrays[d].shape[1] for d in ordered]), ordered)


def _family_rows(name: str, groups: object) -> np.ndarray:
    """One family's groups as an int64 ``(n_groups, size)`` array of ranks in ``0..MAX_RANK``.
    Strings, floats and bools are refused, not converted (``1.9`` is no rank)."""
    what = f"family {name!r}: groups must be equal-sized lists of integer ranks"
    if isinstance(groups, (str, bytes, Mapping)):
        raise TypeError(f"{what}, got {type(groups).__name__}")
    try:
        rows = np.asarray(groups)
    except (TypeError, ValueError, OverflowError, RecursionError):
        raise LayoutError(f"{what} (these are ragged or not numbers)") from None
    if rows.ndim != 2 or rows.size == 0:
        raise LayoutError(f"family {name!r}: give a non-empty list of equal-sized rank lists")
    if rows.dtype == object:  # Python ints beyond int64, or mixed objects
        items = rows.ravel().tolist()
        if not all(is_int(v) for v in items):
            raise TypeError(f"{what}, got {type(next(v for v in items if not is_int(v))).__name__}")
        bad = next((v for v in items if not 0 <= v <= MAX_RANK), None)
        if bad is not None:
            raise LayoutError(f"family {name!r} holds rank {bad}; ranks are 0..{MAX_RANK}")
        rows = np.array(items, dtype=np.int64).reshape(rows.shape)
    elif rows.dtype.kind not in "iu":
        raise TypeError(f"{what}, got values of dtype {rows.dtype}")
    low, high = int(rows.min()), int(rows.max())
    if low < 0 or high > MAX_RANK:
        raise LayoutError(f"family {name!r} holds rank {low if low < 0 else high}; ranks are 0..{MAX_RANK}")
    return rows.astype(np.int64, copy=False)


def _explain(
    arrays: dict[str, np.ndarray],
    pos: dict[str, np.ndarray],
    gid: dict[str, np.ndarray],
    names: tuple[str, ...],
) -> None:
    """Raise the most precise error for families that are not the dims of one layout."""
    for i, d in enumerate(names):  # two dims of one layout share at most one rank per pair of groups
        for e in names[:i]:
            if arrays[d].shape[1] == 1 or arrays[e].shape[1] == 1:
                continue  # singletons share at most one rank with anything
            rows_d = np.repeat(np.arange(arrays[d].shape[0]), arrays[d].shape[1])
            keys = np.sort(rows_d * arrays[e].shape[0] + gid[e][pos[d].ravel()])
            repeated = np.flatnonzero(keys[1:] == keys[:-1])
            if repeated.size:
                g_d, g_e = divmod(int(keys[repeated[0]]), arrays[e].shape[0])
                raise LayoutError(
                    f"family {d!r} is not a factor of the others: its group {arrays[d][g_d].tolist()[:16]} shares "
                    f"more than one rank with {e!r} group {arrays[e][g_e].tolist()[:16]}"
                )
    raise LayoutError(
        f"family {names[-1]!r} is not a factor of the others: no layout has the groups of {', '.join(names)}"
    )


__all__ = [
    "MAX_BRANCHING",
    "infer",
    "place",
]
