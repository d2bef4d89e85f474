"""The balanced choices of a plan: who sends, who represents a node, how finely to cut.

Every choice is a function of the weights and layouts alone (never of messages exchanged), so
each rank makes the same choice for the pieces it takes part in:
- cross-node senders (:meth:`Choices._replay`): per set of source holders, the units of all its
  pairs (a piece to one node lacking it) are laid end to end and cut into one range of equal
  bytes per holder (see :mod:`~meshgroups.transfer._plan.stream`), cuts inside a piece on multiples
  of ``min_part_bytes`` (whole indices of its longest axis);
- representatives (:meth:`Choices._rep_table`): per destination block key, the holder position
  with the fewest bytes so far represents the nodes for the next weight's block;
- intra-node senders rotate with the weight and the source block (:meth:`Choices._turn`).

:class:`~meshgroups.transfer._plan.routes.Planner` inherits these; for instance, the stream of one
weight's piece over 4 holders, to one node::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer._plan.routes import Planner
    >>> from meshgroups.transfer import Shard, Weight
    >>> w = Weight("w", (8,), placements={"tp": Shard(0)})
    >>> p = Planner(Layout(dp=4, tp=2), Layout(tp=2, rank_offset=8), [(w, w)], node_size=8, min_part_bytes=4)
    >>> s = p.pairs_of(0, (0,))[0][3]  # 4 float32 elements, 16 bytes over 4 holders: one each
    >>> s.set.total, s.set.h, s.length, s.quantum, sorted(s.fragments(1)[3].tolist())
    (16, 4, 4, 1, [0, 1, 2, 3])
"""

from __future__ import annotations

import itertools
import math
import zlib
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from meshgroups.transfer._plan.assign import PairRoute
from meshgroups.transfer._plan.shards import BlockKey, Side
from meshgroups.transfer._plan.stream import Stream, StreamSet
from meshgroups.transfer._spec import Box, Weight

if TYPE_CHECKING:
    from meshgroups.transfer._plan.assign import ByNode


class Choices:
    """The choices, as methods of the planner (state: see ``Planner.__init__``)."""

    sides: list[tuple[Side, Side]]
    weights: list[Weight]
    min_part_bytes: int
    _streams: dict[tuple[int, tuple[int, ...]], list[Stream]]
    _by_signature: dict[tuple[tuple[str, ...], frozenset[str]], dict[tuple[str, int] | None, list[int]]]

    if TYPE_CHECKING:

        def _holders_of(self, which: int, side: Side, key: BlockKey) -> tuple[np.ndarray, ByNode]: ...

        def _listed(
            self, w: int, s_block: tuple[int, ...]
        ) -> list[tuple[tuple[int, ...], Box, PairRoute]]: ...

    def _replay(self, key: BlockKey, free_dims: tuple[str, ...]) -> None:
        """Place every pair whose source block has holders ``key`` in that set's stream.

        The units of all those pairs (every weight with that holder set, in weight then pair
        order, each pair's ``K`` units one per node lacking the piece) are laid end to end;
        :class:`~meshgroups.transfer._plan.stream.Stream` cuts them into one range of equal bytes per
        holder. O(pairs of the set), independent of ``h``; a function of the weights alone, so
        every rank places the same pairs alike."""
        fixed = dict(key)
        stages = self._by_signature.get((free_dims, frozenset(fixed)), {})
        candidates = sorted(
            w for stage, ws in stages.items() if stage is None or fixed.get(stage[0]) == stage[1] for w in ws
        )
        placed: list[tuple[int, tuple[int, ...], int]] = []  # (w, block, pairs before it)
        units: list[tuple[int, int]] = []  # (K, unit bytes) per pair, weight then pair order
        cuts: list[tuple[int, int]] = []  # (indices, bytes per index) of each piece's cut axis
        h = 1
        for w in candidates:
            s_block = self._block_for(w, key)
            if s_block is None:
                continue
            placed.append((w, s_block, len(units)))
            for _, box, route in self._listed(w, s_block):
                h = max(route.src_holders.size, 1)
                length, row = self._cut_axis(w, box)
                units.append((route.n_cross, length * row))
                cuts.append((length, row))
        # Each set starts its slots at its own holder (a checksum of its key: the same in every
        # process, ints normalised so numpy and Python ints read alike), so a rank in several
        # sets does not take the first range of all of them.
        canonical = (tuple((str(d), int(c)) for d, c in key), tuple(str(d) for d in free_dims))
        stream = StreamSet.of(units, h, zlib.crc32(repr(canonical).encode()))
        ends = [i for _, _, i in placed[1:]] + [len(units)]
        for (w, s_block, first), end in zip(placed, ends):
            self._streams[(w, s_block)] = [
                stream.pair(i, *cuts[i], max(1, -(-self.min_part_bytes // max(cuts[i][1], 1))))
                for i in range(first, end)
            ]

    def _block_for(self, w: int, key: BlockKey) -> tuple[int, ...] | None:
        """The non-empty source block of weight ``w`` whose holders are ``key``, if any."""
        ss = self.sides[w][0]
        fixed = dict(key)
        stage = ss.weight.stage
        if stage is not None and fixed.get(stage[0], 0) != stage[1]:
            return None
        block = []
        for dims, sizes, iv in zip(ss.axis_dims, ss.axis_sizes, ss.axis_intervals):
            index = 0
            for d, k in zip(dims, sizes):
                index = index * k + fixed.get(d, 0)  # size-1 dims are not in keys
            if iv[index, 1] <= iv[index, 0]:
                return None
            block.append(index)
        return tuple(block)

    def _cut_axis(self, w: int, box: Box) -> tuple[int, int]:
        """``(indices, bytes per index)`` of the axis a piece is cut along: its longest, the
        first of equals (as :func:`~meshgroups.transfer._plan.routes.cut_box`)."""
        if not box:
            return 1, self._nbytes(w, box)
        longest = max(b - a for a, b in box)
        return longest, self._nbytes(w, box) // max(longest, 1)

    @staticmethod
    def _flat(intervals: tuple[np.ndarray, ...], block: tuple[int, ...]) -> int:
        flat = 0
        for iv, b in zip(intervals, block):
            flat = flat * len(iv) + b
        return flat

    def _turn(self, w: int, s_block: tuple[int, ...]) -> int:
        """Rotation of intra-node senders: the weight plus the source block's row-major index."""
        return w + self._flat(self.sides[w][0].axis_intervals, s_block)

    def _rep_turn(self, w: int, d_block: tuple[int, ...]) -> int:
        """Which holder of a destination block represents its node (number ``turn mod count``
        of the holders there): one choice per (weight, block), so every piece of the block
        lands on the same representative, which can forward the block whole."""
        return self._rep_table[(w, d_block)]

    @cached_property
    def _rep_table(self) -> dict[tuple[int, tuple[int, ...]], int]:
        """Greedy by bytes over the weights in order: per destination block key (blocks placed
        alike share one), the position with the least bytes so far takes the next block, so the
        forwarding load spreads evenly over a node's holders. Positions run over the lcm of the
        key's per-node holder counts, so ``turn mod count`` is even on every node. One pass over
        every weight's destination blocks (the model's structure, not the world)."""
        loads: dict[tuple[BlockKey, tuple[str, ...]], np.ndarray] = {}
        table: dict[tuple[int, tuple[int, ...]], int] = {}
        for w, (_, ds) in enumerate(self.sides):
            sizes = [len(iv) for iv in ds.axis_intervals]
            for d_block in itertools.product(*[range(k) for k in sizes]):
                box = ds.block_box(d_block)
                if any(b <= a for a, b in box):
                    continue
                key = (ds.block_key(d_block), ds.free_dims)
                load = loads.get(key)
                if load is None:
                    counts = np.unique(self._holders_of(1, ds, key[0])[1].count).tolist()
                    positions = math.lcm(*counts)
                    if (
                        positions > 4096
                    ):  # irregular placements: bound the table, evenness is then approximate
                        positions = max(counts)
                    load = loads[key] = np.zeros(positions, np.float64)
                p = int(np.argmin(load))
                load[p] += self._nbytes(w, box)
                table[(w, d_block)] = p
        return table

    @staticmethod
    def _merged_nodes(routes: list[PairRoute]) -> np.ndarray:
        """Nodes that receive *every* piece of a block from outside (so its representative
        gets the whole block and forwards it in one message); none when the block is one piece."""
        if len(routes) < 2:
            return np.zeros(0, np.int64)
        out = routes[0].cross_nodes
        for r in routes[1:]:
            out = np.intersect1d(out, r.cross_nodes, assume_unique=True)
        return out

    def _nbytes(self, w: int, box: Box) -> int:
        n = self.weights[w].itemsize
        for a, b in box:
            n *= b - a
        return n


__all__ = ["Choices"]
