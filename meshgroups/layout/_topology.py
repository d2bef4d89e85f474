"""Machine topology: named levels of consecutive ranks, and which groups stay inside them.

A ``Topology`` is a list of named levels from the smallest to the largest — e.g. 8 GPUs per
``node``, 32 per NVLink ``domain`` — each the number of *consecutive global ranks* in one unit
(the torchrun convention: consecutive ranks share a node), each dividing the next. A group stays
inside a level if all its ranks fall in one unit; the world is the level above all others.

Functions take group arrays as ``Layout.groups`` returns them; ``node_locality`` and
``node_split_sizes`` are the one-level case.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

from meshgroups._checks import MAX_RANK, check_name, check_positive, is_int, parse_int, short_repr
from meshgroups.errors import LayoutError

WORLD = "world"
#: Most levels a topology may have: each level at least doubles the one below, and a rank is
#: below 2**31.
MAX_LEVELS = 32


class Topology:
    """Named levels of consecutive ranks, smallest first — e.g. 8 GPUs per ``node``, 32 per
    NVLink ``domain`` — each the number of consecutive global ranks in one unit, each dividing
    the next. A group stays inside a level if all its ranks fall in one unit; the world is the
    level above all others::

        >>> from meshgroups import Topology
        >>> t = Topology(node=8, domain=32)
        >>> t.span([[0, 1, 2, 3], [8, 9, 10, 11]]), t.span([[0, 8]]), t.span([[0, 40]])
        ('node', 'domain', 'world')

    Args:
        **levels: level sizes in ranks, smallest first (``node=8, domain=32``).

    Raises:
        LayoutError: no level, a size that is not a positive int, a level that does not divide
            the next (or is not larger), or the reserved name ``world``.
    """

    __slots__ = ("_levels",)
    _levels: tuple[tuple[str, int], ...]

    def __init__(self, /, **levels: int) -> None:
        if not levels:
            raise LayoutError("a Topology needs at least one level, e.g. Topology(node=8)")
        checked: list[tuple[str, int]] = []
        for name, size in levels.items():
            check_name(name, "level name")
            if name == WORLD:
                raise LayoutError("'world' is the level above every other; do not name a level so")
            size = check_positive(size, f"level {name}", MAX_RANK + 1)
            if checked:
                prev_name, prev = checked[-1]
                if size <= prev or size % prev:
                    raise LayoutError(
                        f"level {name}={size} must be a multiple of the level below it, {prev_name}={prev} "
                        "(levels go from the smallest to the largest, each dividing the next)"
                    )
            checked.append((name, size))
        object.__setattr__(self, "_levels", tuple(checked))

    @classmethod
    def parse(cls, text: str) -> Topology:
        """``"node=8,domain=32"`` (the command line's form): sizes in ASCII digits, each level
        named once::

            >>> Topology.parse("node=8,domain=32")
            Topology(node=8, domain=32)
        """
        if not isinstance(text, str):
            raise TypeError(
                f"a topology is parsed from a str like 'node=8,domain=32', got {short_repr(text)}"
            )
        parts = text.split(",", MAX_LEVELS)
        if len(parts) > MAX_LEVELS:
            raise LayoutError(f"more than {MAX_LEVELS} levels in {text[:40]!r}…; each level at least doubles")
        levels: dict[str, int] = {}
        for part in parts:
            name, sep, size = part.strip().partition("=")
            if not sep or not name:
                raise LayoutError(f"topology levels are name=size separated by commas, got {part!r}")
            if name in levels:
                raise LayoutError(f"level {name!r} is given twice in {text!r}; name each level once")
            levels[name] = parse_int(size, f"size of level {name!r}")
        return cls(**levels)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Topology is immutable")

    @property
    def levels(self) -> tuple[tuple[str, int], ...]:
        """``((name, ranks per unit), ...)``, smallest first."""
        return self._levels

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._levels)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._levels)

    def size(self, level: str) -> int:
        """Ranks per unit of ``level``."""
        for name, size in self._levels:
            if name == level:
                return size
        raise LayoutError(f"unknown level {short_repr(level)}; levels are {', '.join(self.names)}")

    def span(self, rows: object) -> str:
        """The smallest level whose units each hold a whole group of ``rows`` (an array of groups,
        one per row, or one group as a flat list), or ``"world"``."""
        groups = group_rows(rows)
        return self.span_of_extents(groups.min(axis=1), groups.max(axis=1))

    def crossings(self, rows: object) -> dict[str, int]:
        """For every level, how many groups of ``rows`` leave a unit of it."""
        groups = group_rows(rows)
        return self.crossings_of_extents(groups.min(axis=1), groups.max(axis=1))

    # Units are intervals of consecutive ranks, so a group stays in one unit exactly when its
    # smallest and largest rank do: each level costs O(groups), not O(ranks).
    def span_of_extents(self, lows: np.ndarray, highs: np.ndarray) -> str:
        """:meth:`span` from each group's smallest and largest rank."""
        for name, size in self._levels:
            if (lows // size == highs // size).all():
                return name
        return WORLD

    def crossings_of_extents(self, lows: np.ndarray, highs: np.ndarray) -> dict[str, int]:
        """:meth:`crossings` from each group's smallest and largest rank."""
        return {name: int((lows // size != highs // size).sum()) for name, size in self._levels}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._levels == other.levels

    def __hash__(self) -> int:
        return hash(self._levels)

    def __repr__(self) -> str:
        return "Topology(" + ", ".join(f"{n}={s}" for n, s in self._levels) + ")"


def group_rows(rows: object) -> np.ndarray:
    """``rows`` as a non-empty int64 array of groups ``(n_groups, size)``: integer ranks in
    ``0..MAX_RANK`` (a flat list is one group). Floats, strings, bools, a bare number and an
    empty list are refused, not converted."""
    if isinstance(rows, (str, bytes)) or is_int(rows) or not isinstance(rows, (Sequence, np.ndarray)):
        raise TypeError(f"groups must be a list of rank lists (or an array), got {short_repr(rows)}")
    try:
        arr = np.asarray(rows)
    except (TypeError, ValueError, OverflowError, RecursionError):
        raise LayoutError("groups must be equal-sized lists of integer ranks (these are ragged)") from None
    if arr.dtype == object:
        items = arr.ravel().tolist()
        if not all(is_int(v) for v in items):
            raise TypeError(f"groups must hold integer ranks, got {short_repr(rows)}")
        bad = next((v for v in items if not 0 <= v <= MAX_RANK), None)
        if bad is not None:
            raise LayoutError(f"groups hold rank {bad}; ranks are 0..{MAX_RANK}")
        arr = np.array(items, dtype=np.int64).reshape(arr.shape)
    if arr.size == 0 or arr.ndim not in (1, 2):
        raise LayoutError(f"groups must be a non-empty list of rank lists, got an array of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"groups must hold integer ranks, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high > MAX_RANK:
        raise LayoutError(f"groups hold rank {low if low < 0 else high}; ranks are 0..{MAX_RANK}")
    return np.atleast_2d(arr.astype(np.int64, copy=False))


def _nodes(rows: np.ndarray, ranks_per_node: int) -> np.ndarray:
    per_node = check_positive(ranks_per_node, "ranks_per_node", MAX_RANK + 1)
    return group_rows(rows) // per_node


def node_locality(rows: np.ndarray, ranks_per_node: int) -> Literal["intra", "inter", "mixed"]:
    """``"intra"``: every group on one node; ``"inter"``: every group has each rank on a
    distinct node; ``"mixed"``: anything else. Single-rank groups count as intra-node.
    ``rows`` are groups as ``Layout.groups`` returns them; node = rank // ``ranks_per_node``::

        >>> from meshgroups import Layout
        >>> lay = Layout(dp=2, tp=4)
        >>> [node_locality(lay.groups(*dims), ranks_per_node=4) for dims in (["tp"], ["dp"], ["dp", "tp"])]
        ['intra', 'inter', 'mixed']
    """
    nodes = _nodes(rows, ranks_per_node)
    if (nodes == nodes[:, :1]).all():
        return "intra"
    ordered = np.sort(nodes, axis=1)
    if (ordered[:, 1:] != ordered[:, :-1]).all():
        return "inter"
    return "mixed"


def node_split_sizes(rows: np.ndarray, ranks_per_node: int, dim: str) -> tuple[int, int]:
    """``(inter, intra)`` sizes such that each group is ``inter`` blocks of ``intra``
    consecutive members, each block on one node and every block on a different node."""
    nodes = _nodes(rows, ranks_per_node)
    n_groups, size = nodes.shape
    intra = 1
    while intra < size and nodes[0, intra] == nodes[0, 0]:
        intra += 1
    blocks = nodes.reshape(n_groups, size // intra, intra) if size % intra == 0 else None
    ok = blocks is not None and (blocks == blocks[:, :, :1]).all()
    if ok:
        heads = np.sort(blocks[:, :, 0], axis=1)  # type: ignore[index]
        ok = bool((heads[:, 1:] != heads[:, :-1]).all())
    if not ok:
        raise LayoutError(
            f"the groups of dim {dim!r} do not split into an inter-node part and an intra-node part "
            f"with ranks_per_node={ranks_per_node}: group {rows[0].tolist()} lies on nodes "
            f"{nodes[0].tolist()}, and every group must be equal-sized runs of one node each"
        )
    return size // intra, intra
