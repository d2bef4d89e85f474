"""The balanced choices of a plan: who sends, who represents a node, how finely to cut.

Every choice is a function of the weights and layouts alone (never of messages exchanged), so
each rank makes the same choice for the pieces it takes part in:
- cross-node senders (:meth:`Choices._replay`): per set of source holders, the units of all its
  pieces (a piece, or a part of it, to one node lacking it) are dealt round the holders in
  ascending order of bytes, so the holders' bytes differ by at most the largest unit;
- parts (:meth:`Choices._parts`): a piece with more holders than nodes to reach is cut so every
  holder can send one part, the parts near-equal (lengths differ by at most one);
- representatives (:meth:`Choices._rep_table`): per destination block key, the holder position
  with the fewest bytes so far represents the nodes for the next weight's block;
- intra-node senders rotate with the weight and the source block (:meth:`Choices._turn`).

:class:`~meshgroups.transfer.routes.Planner` inherits these; for instance, an even split::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer.routes import Planner
    >>> from meshgroups.transfer.spec import Shard, Weight
    >>> w = Weight("w", (8,), placements={"tp": Shard(0)})
    >>> p = Planner(Layout(dp=4, tp=2), Layout(tp=2, rank_offset=8), [(w, w)], node_size=8, min_part_bytes=4)
    >>> p._parts(0, ((0, 4),), n_cross=1, h=4)  # 4 holders, 1 node to reach: 4 parts of 1 element
    4
"""

from __future__ import annotations

import itertools
import math
import zlib
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .assign import PairRoute, Senders
from .shards import BlockKey, Side
from .spec import Box, Weight

if TYPE_CHECKING:
    from .assign import ByNode


class Choices:
    """The choices, as methods of the planner (state: see ``Planner.__init__``)."""

    sides: list[tuple[Side, Side]]
    weights: list[Weight]
    min_part_bytes: int
    _senders: dict[tuple[int, tuple[int, ...]], list[Senders]]
    _by_signature: dict[tuple[tuple[str, ...], frozenset[str]], dict[tuple[str, int] | None, list[int]]]

    if TYPE_CHECKING:

        def _holders_of(self, which: int, side: Side, key: BlockKey) -> tuple[np.ndarray, ByNode]: ...

        def _listed(
            self, w: int, s_block: tuple[int, ...]
        ) -> list[tuple[tuple[int, ...], Box, PairRoute]]: ...

    def _replay(self, key: BlockKey, free_dims: tuple[str, ...]) -> None:
        """Choose the cross-node senders of every pair whose source block has holders ``key``.

        The units of all those pairs (every weight with that holder set) are dealt round the
        ``h`` holders, one after the other, in ascending order of their bytes (ties: weight,
        pair, larger parts first) — the order only fixes who sends, the messages keep the
        weights' order. Dealt so, the holders' loads in bytes, read round the circle from the
        next holder to deal to, never decrease and differ by at most the unit last dealt: each
        deal of units of ``c`` bytes (``c`` no smaller than any before) raises a run starting
        at the least-loaded holder. So the holders of one set send cross-node bytes that
        differ by at most their largest unit — what a greedy "least-loaded takes the next
        unit" gives, with one counter of state instead of one load per holder: O(pairs log
        pairs), independent of ``h``. A function of the weights alone, so every rank replays
        the same choices."""
        fixed = dict(key)
        stages = self._by_signature.get((free_dims, frozenset(fixed)), {})
        candidates = sorted(
            w for stage, ws in stages.items() if stage is None or fixed.get(stage[0]) == stage[1] for w in ws
        )
        deals: list[tuple[int, int, int, int, int]] = []  # (unit bytes, w, pair, class, units)
        shapes: dict[tuple[int, int], tuple[int, int]] = {}  # (w, pair) -> (parts, big units)
        blocks: dict[int, tuple[int, ...]] = {}
        for w in candidates:
            s_block = self._block_for(w, key)
            if s_block is None:
                continue
            blocks[w] = s_block
            for i, (_, box, route) in enumerate(self._listed(w, s_block)):
                k, h = route.n_cross, route.src_holders.size
                parts = self._parts(w, box, k, h)
                big, small = self._part_bytes(w, box, parts)
                n_big = k * (parts - small[1])
                shapes[(w, i)] = (parts, n_big)
                if n_big:
                    deals.append((big, w, i, 0, n_big))
                if k * small[1]:
                    deals.append((small[0], w, i, 1, k * small[1]))
        starts: dict[tuple[int, int, int], int] = {}
        # Each set starts its deal at its own holder (a checksum of its key: the same in every
        # process, ints normalised so numpy and Python ints read alike), so a rank in several
        # sets is not the first dealt to in all of them.
        canonical = (tuple((str(d), int(c)) for d, c in key), tuple(str(d) for d in free_dims))
        dealt = zlib.crc32(repr(canonical).encode())
        for _, w, i, cls, n in sorted(deals):
            starts[(w, i, cls)] = dealt
            dealt += n
        for w, s_block in blocks.items():
            out = []
            for i, (_, _, route) in enumerate(self._listed(w, s_block)):
                h = max(route.src_holders.size, 1)
                parts, n_big = shapes[(w, i)]
                first = starts.get((w, i, 1), 0) % h
                out.append(Senders(first, parts, n_big, starts.get((w, i, 0), 0) % h))
            self._senders[(w, s_block)] = out

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

    def _parts(self, w: int, box: Box, n_cross: int, h: int) -> int:
        """How many parts a piece is cut into for its cross-node sends: when it has more
        holders than nodes to reach, enough parts for every holder to send one (at most
        ``h // n_cross``), cut along the longest axis into near-equal parts (lengths differ by
        at most one, see :func:`~meshgroups.transfer.routes.part_box`), none smaller than
        ``min_part_bytes``."""
        if n_cross == 0 or h <= n_cross or not box:
            return 1
        longest = max(b - a for a, b in box)
        row = self._nbytes(w, box) // max(longest, 1)  # bytes per index of the longest axis
        rows = max(1, -(-self.min_part_bytes // max(row, 1)))  # a part's fewest indices
        return max(1, min(h // n_cross, longest // rows))

    def _part_bytes(self, w: int, box: Box, parts: int) -> tuple[int, tuple[int, int]]:
        """``(bytes of a larger part, (bytes of a smaller part, how many smaller parts))``:
        ``n`` indices in ``parts`` parts are ``n mod parts`` parts one index longer than the
        others."""
        if parts == 1:
            return 0, (self._nbytes(w, box), 1)
        longest = max(b - a for a, b in box)
        row = self._nbytes(w, box) // longest
        base, extra = divmod(longest, parts)
        return (base + 1) * row, (base * row, parts - extra)

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
