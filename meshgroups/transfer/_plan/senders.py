"""Who sends which indices of a piece across nodes: one holder set's units laid end to end.

A *unit* is one piece to one node that lacks it. Per set of source holders (the ``h`` ranks
holding one distinct block), the units of all its pairs are laid end to end, a *stream* of
``X`` bytes, and cut into ``h`` consecutive ranges of ``⌊X/h⌋`` or ``⌈X/h⌉`` bytes, one per
holder. A cut inside a unit falls on the next multiple of ``quantum`` indices of the piece's
cut axis (its longest, the first of equals), so every message is a box, and a holder's bytes
exceed ``X/h`` by less than one quantum: the balance of infinitely fine parts, with at most
``h - 1`` messages more than sending whole units.

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

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


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


__all__ = ["Stream", "StreamSet"]
