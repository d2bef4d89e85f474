"""Who sends: the balanced choices of a plan, functions of the weights and layouts alone.

Never of messages exchanged, so each rank makes the same choice for the pieces it takes part
in. The planner (:class:`~meshgroups.transfer._plan.routes.Planner`) routes the pairs and hands
them here; nothing here calls back into it:

- cross-node senders (:func:`holder_set_streams`, :class:`StreamSet`, :class:`Stream`): one
  holder set's units laid end to end and cut into one range of equal bytes per holder;
- representatives (:func:`representatives`): per destination block key, the holder position
  with the fewest bytes so far represents the nodes for the next weight's block;
- intra-node senders rotate with the weight and the source block (:func:`turn`).

**The stream.** A *unit* is one piece to one node that lacks it. Per set of source holders (the
``h`` ranks holding one distinct block), the units of all its pairs are laid end to end, a
*stream* of ``X`` bytes, and cut into ``h`` consecutive ranges of ``⌊X/h⌋`` or ``⌈X/h⌉`` bytes,
one per holder. A cut inside a unit falls on the next multiple of ``quantum`` indices of the
piece's cut axis (its longest, the first of equals: :func:`cut_axis`; ``quantum`` from
``min_part_bytes``), so every message is a box, and a holder's bytes exceed ``X/h`` by less
than one quantum: the balance of infinitely fine parts, with at most ``h - 1`` messages more
than sending whole units.

The stream is node-major: *period* ``k`` holds the ``k``-th unit of every pair that has one
(pairs ordered by their unit count ``K``, most first, then weight and pair), so a range of the
stream holds every weight's pieces in proportion, and each holder sends about as many messages
as any other (a pair-major stream would give some holders runs of small pieces only). Every
offset is arithmetic over the set's few distinct ``K``; no table of the ``h`` holders::

    >>> s = StreamSet.of([(2, 20), (2, 20)], h=3, start=0)  # two pairs, K = 2 units of 20 bytes
    >>> a = s.pair(0, length=4, row=5, quantum=1)  # units at 0 and 40; pair 1's at 20 and 60
    >>> [(k, lo, hi, who) for k, lo, hi, who in zip(*(x.tolist() for x in a.fragments(2)))]
    [(0, 0, 4, 0), (1, 0, 3, 1), (1, 3, 4, 2)]
    >>> a.sent_by(1, 2), a.unit(1, 2)  # holder 1's (unit, lo, hi); unit 1's (lo, hi, holder)
    ([(1, 0, 3)], [(0, 3, 1), (3, 4, 2)])

Holder ``j``'s range is that of *slot* ``(j - start) mod h``: each holder set starts its slots
at its own holder, so a rank in several sets is not the first of all of them.
"""

from __future__ import annotations

import itertools
import math
import zlib
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshgroups.transfer._plan.shards import BlockKey, Side
from meshgroups.transfer._spec import Box, volume


@dataclass(frozen=True, eq=False)
class StreamSet:
    """One holder set's stream: ``order`` (stream position of each pair as given), per
    position its unit bytes ``sizes`` and unit count ``ks`` (``ks`` descending), ``prefix``
    (bytes of the positions before, within a period) and the periods' segments: periods
    ``seg_lo[g] ≤ k < seg_lo[g + 1]`` hold the first ``seg_m[g]`` positions and start at
    ``seg_start[g] + (k - seg_lo[g]) · prefix[seg_m[g]]``."""

    total: int
    h: int
    start: int
    order: np.ndarray
    sizes: np.ndarray
    ks: np.ndarray
    prefix: np.ndarray
    seg_lo: np.ndarray
    seg_m: np.ndarray
    seg_start: np.ndarray

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]], h: int, start: int) -> StreamSet:
        """``pairs``: ``(K, unit bytes)`` per pair, in weight then pair order."""
        k_in = np.array([k for k, _ in pairs], np.int64)
        b_in = np.array([b for _, b in pairs], np.int64)
        by = np.argsort(-k_in, kind="stable")
        ks, sizes = k_in[by], b_in[by]
        order = np.empty(by.size, np.int64)
        order[by] = np.arange(by.size)
        prefix = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # Segment g: the periods k with the same pairs, between two consecutive distinct K.
        bounds = np.unique(np.concatenate([[0], ks]))  # ascending, from 0
        seg_lo = bounds[:-1]
        seg_m = np.array([int((ks > lo).sum()) for lo in seg_lo.tolist()], np.int64)
        lengths = (bounds[1:] - seg_lo) * prefix[seg_m]
        seg_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        total = int(lengths.sum())
        return cls(total, max(h, 1), start % max(h, 1), order, sizes, ks, prefix, seg_lo, seg_m, seg_start)

    def period_start(self, k: np.ndarray) -> np.ndarray:
        g = np.searchsorted(self.seg_lo, k, side="right") - 1
        return self.seg_start[g] + (k - self.seg_lo[g]) * self.prefix[self.seg_m[g]]

    @cached_property
    def _segments(self) -> tuple[list[int], list[int], list[int]]:
        """Python lists of (first period, start, period bytes) per segment: the scalar
        lookups of one rank's part stay off numpy's per-call overhead."""
        lengths = self.prefix[self.seg_m]
        return self.seg_lo.tolist(), self.seg_start.tolist(), lengths.tolist()

    def period_start_of(self, k: int) -> int:
        lo, start, length = self._segments
        g = bisect_right(lo, k) - 1
        return start[g] + (k - lo[g]) * length[g]

    def first_period_from(self, y: int) -> int:
        """The first period ``k`` starting at or after byte ``y`` (the period count if none)."""
        lo, start, length = self._segments
        g = bisect_right(start, y) - 1
        if g < 0:
            return 0
        k = lo[g] + -(-(y - start[g]) // length[g])
        end = lo[g + 1] if g + 1 < len(lo) else int(self.ks[0]) if self.ks.size else 0
        return min(k, end)

    def pair(self, index: int, length: int, row: int, quantum: int) -> Stream:
        """Pair number ``index`` (as given to :meth:`of`), its piece ``length`` indices of
        ``row`` bytes along the cut axis, cuts on multiples of ``quantum`` indices."""
        return Stream(self, int(self.order[index]) if self.order.size else 0, length, row, quantum)


@dataclass(frozen=True, eq=False)
class Stream:
    """One pair's place in its holder set's stream: unit ``k`` (the piece to the ``k``-th node
    lacking it) occupies ``length · row`` bytes from ``period_start(k) + prefix[position]``."""

    set: StreamSet
    position: int
    length: int
    row: int
    quantum: int

    @property
    def unit_nbytes(self) -> int:
        return self.length * self.row

    @property
    def quantum_nbytes(self) -> int:
        """The most a cut can move a holder's load off ``X/h``: one quantum, or the unit."""
        return min(self.quantum, self.length) * self.row

    @cached_property
    def _head(self) -> int:
        """Bytes before this pair's unit inside each period."""
        return int(self.set.prefix[self.position])

    def _offset(self, k: np.ndarray) -> np.ndarray:
        return self.set.period_start(k) + self._head

    def _offset_of(self, k: int) -> int:
        return self.set.period_start_of(k) + self._head

    def _slot_of(self, p: np.ndarray | int) -> np.ndarray | int:
        """The slot whose byte range holds stream byte ``p``: the largest ``s`` with
        ``⌊s·X/h⌋ ≤ p``."""
        return np.minimum(self.set.h - 1, ((p + 1) * self.set.h - 1) // self.set.total)

    def _edge(self, s: np.ndarray | int) -> np.ndarray | int:
        return (s * self.set.total) // self.set.h

    def _cut(self, offset: np.ndarray | int, edge: np.ndarray | int) -> np.ndarray | int:
        """Where a slot edge falls in the unit at ``offset``, in indices: rounded to the nearest
        multiple of ``quantum`` (ties down), so a range ends within half a quantum of its
        share; 0 before the unit, ``length`` at or after its end."""
        inside = np.clip(edge - offset, 0, self.unit_nbytes)
        step = self.quantum * self.row
        cut = np.clip(-(-(inside - self._half) // step) * self.quantum, 0, self.length)
        return np.where(inside >= self.unit_nbytes, self.length, cut)

    @cached_property
    def _half(self) -> int:
        return self.quantum_nbytes // 2

    def _owner(self, offset: np.ndarray | int, lo: np.ndarray | int) -> np.ndarray | int:
        """The slot that sends the fragment starting at index ``lo`` of the unit at ``offset``:
        the last whose edge rounds to ``lo`` or before, i.e. lies at most half a quantum past
        it (and inside the unit)."""
        p = np.minimum(offset + lo * self.row + self._half, offset + self.unit_nbytes - 1)
        return self._slot_of(p)

    def _holder(self, slot: np.ndarray | int) -> np.ndarray | int:
        return (slot + self.set.start) % self.set.h

    def fragments(self, n_units: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(unit, lo, hi, holder)`` of every fragment of the pair's ``n_units`` units, unit
        by unit, ``lo`` ascending: O(units + slot edges inside them), vectorised."""
        k = np.arange(n_units, dtype=np.int64)
        if n_units == 0 or self.set.total == 0:
            return k, k, k, k
        offset = np.asarray(self._offset(k), np.int64)
        first = np.asarray(self._slot_of(offset), np.int64)
        n_edges = np.asarray(self._slot_of(offset + self.unit_nbytes - 1), np.int64) - first
        if not n_edges.any():  # no slot edge inside any unit: every unit whole
            whole = np.full(n_units, self.length, np.int64)
            return k, np.zeros(n_units, np.int64), whole, np.asarray(self._holder(first), np.int64)
        in_unit = np.repeat(k, n_edges)
        slots = np.repeat(first, n_edges) + 1
        slots += np.arange(slots.size, dtype=np.int64) - np.repeat(np.cumsum(n_edges) - n_edges, n_edges)
        cuts = np.asarray(self._cut(offset[in_unit], self._edge(slots)), np.int64)
        keep = (cuts > 0) & (cuts < self.length)
        units = np.concatenate([k, in_unit[keep]])
        lo = np.concatenate([np.zeros(n_units, np.int64), cuts[keep]])
        order = np.lexsort((lo, units))
        units, lo = units[order], lo[order]
        fresh = np.ones(units.size, bool)  # two edges rounded to one cut make one fragment
        fresh[1:] = (units[1:] != units[:-1]) | (lo[1:] != lo[:-1])
        units, lo = units[fresh], lo[fresh]
        hi = np.full(units.size, self.length, np.int64)
        same = units[1:] == units[:-1]
        hi[:-1][same] = lo[1:][same]
        slot = self._owner(offset[units], lo)
        return units, lo, hi, np.asarray(self._holder(slot), np.int64)

    def unit(self, k: int, n_units: int) -> list[tuple[int, int, int]]:
        """``(lo, hi, holder)`` of unit ``k``'s fragments: what its receiver gets, O(fragments)."""
        if self.set.total == 0 or not 0 <= k < n_units:
            return []
        offset = self._offset_of(k)
        out = []
        lo = 0
        while lo < self.length:
            slot = int(self._owner(offset, lo))
            hi = int(self._cut(offset, self._edge(slot + 1)))  # the last slot's edge is X: length
            out.append((lo, hi, int(self._holder(slot))))
            lo = hi
        return out

    def sent_by(self, holder: int, n_units: int) -> list[tuple[int, int, int]]:
        """``(unit, lo, hi)`` of the fragments holder ``holder`` sends, ascending: O(log K +
        its own)."""
        if self.set.total == 0 or n_units == 0:
            return []
        slot = (holder - self.set.start) % self.set.h
        a, b = int(self._edge(slot)), int(self._edge(slot + 1))
        if a == b:
            return []
        # Offsets rise with k: the units that end after a and start before b.
        first = self.set.first_period_from(a + 1 - self.unit_nbytes - self._head)
        last = min(n_units, self.set.first_period_from(b - self._head))
        out = []
        for k in range(first, last):
            offset = self._offset_of(k)
            lo, hi = int(self._cut(offset, a)), int(self._cut(offset, b))
            if lo < hi:
                out.append((k, lo, hi))
        return out


def holder_set_streams(
    key: BlockKey,
    free_dims: tuple[str, ...],
    h: int,
    pairs: Sequence[tuple[int, int, int]],
    min_part_bytes: int,
) -> list[Stream]:
    """Each pair's place in the stream of the holder set ``key`` (its ``h`` holders vary over
    ``free_dims``).

    ``pairs``: per pair of every weight with that holder set, in weight then pair order,
    ``(K, length, row)``: its ``K`` units (one per node lacking the piece), each ``length``
    indices of ``row`` bytes along its cut axis (:func:`cut_axis`). O(pairs), independent of
    ``h``; a function of the weights alone, so every rank places the same pairs alike. One
    piece of 4 float32 elements (16 bytes) over 4 holders, to one node, cut on multiples of 4
    bytes: one element from each holder::

        >>> s = holder_set_streams((("tp", 0),), ("dp",), 4, [(1, 4, 4)], min_part_bytes=4)[0]
        >>> s.set.total, s.set.h, s.length, s.quantum, sorted(s.fragments(1)[3].tolist())
        (16, 4, 4, 1, [0, 1, 2, 3])
    """
    # Each set starts its slots at its own holder (a checksum of its key: the same in every
    # process, ints normalised so numpy and Python ints read alike), so a rank in several
    # sets does not take the first range of all of them.
    canonical = (tuple((str(d), int(c)) for d, c in key), tuple(str(d) for d in free_dims))
    stream = StreamSet.of(
        [(k, length * row) for k, length, row in pairs], h, zlib.crc32(repr(canonical).encode())
    )
    return [
        stream.pair(i, length, row, max(1, -(-min_part_bytes // max(row, 1))))
        for i, (_, length, row) in enumerate(pairs)
    ]


def cut_axis(box: Box, itemsize: int) -> tuple[int, int]:
    """``(indices, bytes per index)`` of the axis a piece is cut along: its longest, the first
    of equals (as :func:`~meshgroups.transfer._plan.routes.cut_box`)::

        >>> cut_axis(((0, 2), (0, 8)), 4)
        (8, 8)
    """
    nbytes = itemsize * volume(box)
    if not box:
        return 1, nbytes
    longest = max(b - a for a, b in box)
    return longest, nbytes // max(longest, 1)


def turn(w: int, intervals: tuple[np.ndarray, ...], block: tuple[int, ...]) -> int:
    """Rotation of intra-node senders: the weight plus the source block's row-major index (its
    axes' pieces ``intervals``)::

        >>> turn(3, (np.zeros((2, 2)), np.zeros((4, 2))), (1, 2))
        9
    """
    flat = 0
    for iv, b in zip(intervals, block):
        flat = flat * len(iv) + b
    return w + flat


def representatives(
    sides: Sequence[Side], counts: Callable[[Side, BlockKey], np.ndarray]
) -> dict[tuple[int, tuple[int, ...]], int]:
    """Which holder of each destination block represents its node (number ``turn mod count``
    of the holders there), per ``(weight, block)``: one choice per block, so every piece of the
    block lands on the same representative, which can forward the block whole.

    Greedy by bytes over the weights in order (``sides``: each weight's destination side):
    per destination block key (blocks placed alike share one), the position with the least
    bytes so far takes the next block, so the forwarding load spreads evenly over a node's
    holders. Positions run over the lcm of the key's per-node holder counts (``counts``), so
    ``turn mod count`` is even on every node. One pass over every weight's destination blocks
    (the model's structure, not the world)."""
    loads: dict[tuple[BlockKey, tuple[str, ...]], np.ndarray] = {}
    table: dict[tuple[int, tuple[int, ...]], int] = {}
    for w, ds in enumerate(sides):
        sizes = [len(iv) for iv in ds.axis_intervals]
        for d_block in itertools.product(*[range(k) for k in sizes]):
            box = ds.block_box(d_block)
            if any(b <= a for a, b in box):
                continue
            key = (ds.block_key(d_block), ds.free_dims)
            load = loads.get(key)
            if load is None:
                per_node = np.unique(counts(ds, key[0])).tolist()
                positions = math.lcm(*per_node)
                if positions > 4096:  # irregular placements: bound the table, evenness is then approximate
                    positions = max(per_node)
                load = loads[key] = np.zeros(positions, np.float64)
            p = int(np.argmin(load))
            load[p] += ds.weight.itemsize * volume(box)
            table[(w, d_block)] = p
    return table


__all__ = ["Stream", "StreamSet", "cut_axis", "holder_set_streams", "representatives", "turn"]
