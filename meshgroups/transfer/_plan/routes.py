"""The planner: every (source block, destination block) pair of every weight, and its messages.

:class:`Planner` walks the weights in the destination list's order. For weight ``w`` and a
source block ``S`` it lists the destination blocks ``D`` that intersect ``S`` (per axis, by
binary search in the two tilings, then their product) and routes each pair with
:class:`~meshgroups.transfer._plan.assign.PairRoute`, cached by the blocks' keys (stage and sharding
coordinates), so weights placed alike share one routing. The cross-node senders of a piece are
chosen by bytes: per set of holders, the units of all its pairs are laid end to end and cut into
one range of equal bytes per holder (see :mod:`~meshgroups.transfer._plan.stream`).
Both the whole plan and a rank's part call :meth:`Planner.pairs_of` for the same ``(w, S)``, so
they agree message for message. A node that receives *every* piece of a destination block from
outside gets them all on one representative, which forwards the whole block in one message::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight
    >>> w = Weight("w", (4,), placements={"tp": Shard(0)})
    >>> p = Planner(Layout(tp=2), Layout(dp=2, rank_offset=2), [(w, Weight("w", (4,)))], node_size=2)
    >>> [(c.box, c.src.tolist(), c.dst.tolist(), c.step.tolist()) for c in p.weight_chunks(0)]
    [(((0, 2),), [0], [2], [0]), (((2, 4),), [1], [2], [0]), (((0, 4),), [2], [3], [1])]
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from meshgroups.errors import PlanError
from meshgroups.layout import Layout
from meshgroups.transfer._plan.assign import ByNode, PairRoute
from meshgroups.transfer._plan.choose import Choices
from meshgroups.transfer._plan.shards import BlockKey, Side, axis_pairs, holders
from meshgroups.transfer._plan.stream import Stream
from meshgroups.transfer._spec import Box, Weight


def cut_box(box: Box, lo: int, hi: int) -> Box:
    """Indices ``[lo, hi)`` (counted from the box's start) of ``box``'s longest axis, the
    first of equals — the axis a piece is cut along::

        >>> cut_box(((0, 2), (3, 10)), 2, 5)
        ((0, 2), (5, 8))
    """
    axis = max(range(len(box)), key=lambda a: (box[a][1] - box[a][0], -a))
    start = box[axis][0]
    return (*box[:axis], (start + lo, start + hi), *box[axis + 1 :])


@dataclass(frozen=True)
class Chunk:
    """The messages of one pair: one box, many ``(src, dst, step)``."""

    weight: int  # index into the planner's weights
    box: Box
    nbytes: int
    src: np.ndarray
    dst: np.ndarray
    step: np.ndarray
    route: PairRoute
    forward: bool = False  # a merged forward of a whole destination block (see the module doc)
    piece_nbytes: int = 0  # set on the first chunk of a pair: the bytes of its whole piece
    quantum_nbytes: int = 0  # ... and the most a cut inside it can move a sender's load


class Planner(Choices):
    """Routes for matched weights between two layouts; see the module docstring."""

    def __init__(
        self,
        src: Layout,
        dst: Layout,
        pairs: Sequence[tuple[Weight, Weight]],
        node_size: int,
        full_check: bool = True,
        min_part_bytes: int = 1 << 16,
    ) -> None:
        self.src, self.dst, self.node_size, self.full_check = src, dst, node_size, full_check
        self.min_part_bytes = min_part_bytes
        self.weights = [dw for _, dw in pairs]
        self.pairs = list(pairs)
        # Weights placed alike (every layer's q, k, ...) share one Side's arithmetic.
        cache: dict[tuple[object, ...], Side] = {}

        def side(which: int, layout: Layout, wt: Weight) -> Side:
            window = getattr(wt, "window", None)  # a SegmentWeight's cut axis (mapped.py)
            key = (which, wt.shape, tuple(wt.placements.items()), wt.stage, wt.shard_order, window)
            got = cache.get(key)
            if got is None:
                got = cache[key] = Side(layout, wt)
            return got.like(wt)

        self.sides = [(side(0, src, sw), side(1, dst, dw)) for sw, dw in pairs]
        self._coords: dict[tuple[int, int], dict[str, int] | None] = {}
        self._streams: dict[tuple[int, tuple[int, ...]], list[Stream]] = {}
        # Weights whose source blocks are keyed by the same dims (and vary over the same dims).
        # Weights whose source blocks are keyed by the same dims and vary over the same dims,
        # by pipeline stage: the candidates when replaying one holder set's history.
        self._by_signature: dict[
            tuple[tuple[str, ...], frozenset[str]], dict[tuple[str, int] | None, list[int]]
        ] = {}
        for w, (ss, _) in enumerate(self.sides):
            stages = self._by_signature.setdefault((ss.free_dims, ss.keyed_dims), {})
            stages.setdefault(ss.stage_key, []).append(w)
        self._holders: dict[tuple[int, BlockKey, tuple[str, ...]], tuple[np.ndarray, ByNode]] = {}
        self._routes: dict[tuple[BlockKey, tuple[str, ...], BlockKey, tuple[str, ...]], PairRoute] = {}
        self._pairs: dict[tuple[int, tuple[int, ...]], list[tuple[tuple[int, ...], Box, PairRoute]]] = {}

    # ------------------------------------------------------------------ holders and routes
    def _holders_of(self, which: int, side: Side, key: BlockKey) -> tuple[np.ndarray, ByNode]:
        ck = (which, key, side.free_dims)
        got = self._holders.get(ck)
        if got is None:
            ranks = holders(side.layout, key, side.free_dims)
            got = self._holders[ck] = (ranks, ByNode.of(ranks, self.node_size))
        return got

    def route(self, ss: Side, s_block: tuple[int, ...], ds: Side, d_block: tuple[int, ...]) -> PairRoute:
        skey, dkey = ss.block_key(s_block), ds.block_key(d_block)
        ck = (skey, ss.free_dims, dkey, ds.free_dims)
        got = self._routes.get(ck)
        if got is None:
            hs, s_by = self._holders_of(0, ss, skey)
            _, d_by = self._holders_of(1, ds, dkey)
            got = self._routes[ck] = PairRoute.build(hs, s_by, d_by, self.node_size, self.full_check)
        return got

    # ------------------------------------------------------------------ blocks and pairs
    @staticmethod
    def _product(
        per_axis: list[tuple[tuple[int, int, int, int], ...]],
    ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], Box]]:
        """Cartesian product of per-axis overlap rows: (src block, dst block, box)."""
        for rows in itertools.product(*per_axis):
            yield (
                tuple(r[0] for r in rows),
                tuple(r[1] for r in rows),
                tuple((r[2], r[3]) for r in rows),
            )

    def _listed(self, w: int, s_block: tuple[int, ...]) -> list[tuple[tuple[int, ...], Box, PairRoute]]:
        """Every destination block meeting source block ``s_block`` of weight ``w``, in block
        order, with the piece's box and the pair's route."""
        ck = (w, s_block)
        got = self._pairs.get(ck)
        if got is not None:
            return got
        ss, ds = self.sides[w]
        per_axis = [
            axis_pairs(s_t, d_t, b, None) for s_t, d_t, b in zip(ss.axis_tilings, ds.axis_tilings, s_block)
        ]
        got = [
            (d_block, box, self.route(ss, s_block, ds, d_block))
            for _, d_block, box in self._product(per_axis)
        ]
        if len(self._pairs) > 4096:  # bound the memory of a whole plan's walk
            self._pairs.clear()
        self._pairs[ck] = got
        return got

    def pairs_of(
        self, w: int, s_block: tuple[int, ...]
    ) -> list[tuple[tuple[int, ...], Box, PairRoute, Stream]]:
        """:meth:`_listed` with each pair's cross-node senders."""
        streams = self._streams.get((w, s_block))
        if streams is None:
            ss = self.sides[w][0]
            self._replay(ss.block_key(s_block), ss.free_dims)
            streams = self._streams[(w, s_block)]
        return [(d, box, route, who) for (d, box, route), who in zip(self._listed(w, s_block), streams)]

    def src_blocks_meeting(self, w: int, d_block: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Source blocks of weight ``w`` that intersect destination block ``d_block``; checks
        that they tile it exactly (``PlanError`` otherwise)."""
        ss, ds = self.sides[w]
        per_axis = []
        for axis, (s_t, d_t, b) in enumerate(zip(ss.axis_tilings, ds.axis_tilings, d_block)):
            rows = axis_pairs(s_t, d_t, None, b)
            covered = sum(r[3] - r[2] for r in rows)
            lo, hi = ds.axis_intervals[axis][b].tolist()
            if covered != hi - lo:
                raise PlanError(
                    f"plan bug: weight {self.weights[w].name!r} axis {axis}: destination piece "
                    f"[{lo}, {hi}) covered by {covered} elements"
                )
            per_axis.append(rows)
        return [s for s, _, _ in self._product(per_axis)]

    def chunks(
        self,
        w: int,
        s_block: tuple[int, ...],
        d_block: tuple[int, ...],
        box: Box,
        route: PairRoute,
        stream: Stream,
        merged: np.ndarray | None = None,
    ) -> list[Chunk]:
        """The pair's messages as chunks of one box each (the piece, or a fragment of it)."""
        got = route.messages(stream, self._turn(w, s_block), self._rep_turn(w, d_block), merged)
        return self._runs(w, box, route, *got)

    def _runs(
        self,
        w: int,
        box: Box,
        route: PairRoute,
        src: np.ndarray,
        dst: np.ndarray,
        step: np.ndarray,
        lo: np.ndarray,
        hi: np.ndarray,
    ) -> list[Chunk]:
        """Cut messages into runs of equal ``(lo, hi)`` (-1: the whole piece), one chunk each."""
        if src.size == 0:
            return []
        cuts = np.flatnonzero((lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1])) + 1
        out = []
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), src.size]):
            piece = box if lo[a] < 0 else cut_box(box, int(lo[a]), int(hi[a]))
            out.append(Chunk(w, piece, self._nbytes(w, piece), src[a:b], dst[a:b], step[a:b], route))
        return out

    def _forward_chunk(self, w: int, d_block: tuple[int, ...], route: PairRoute, nodes: np.ndarray) -> Chunk:
        src, dst = route.node_forwards(nodes, self._rep_turn(w, d_block))
        box = self.sides[w][1].block_box(d_block)
        return Chunk(w, box, self._nbytes(w, box), src, dst, np.ones(src.size, np.int8), route, True)

    # ------------------------------------------------------------------ whole and local walks
    def weight_chunks(self, w: int) -> Iterator[Chunk]:
        """Every message of weight ``w`` (the whole plan), source block by source block."""
        ss, ds = self.sides[w]
        for axis, (s_iv, d_iv) in enumerate(zip(ss.axis_intervals, ds.axis_intervals)):
            tiles = (
                s_iv[0, 0] == 0 and s_iv[-1, 1] == d_iv[-1, 1] and np.array_equal(s_iv[1:, 0], s_iv[:-1, 1])
            )
            if not tiles:
                raise PlanError(
                    f"plan bug: source pieces of {self.weights[w].name!r} axis {axis} do not tile it"
                )
        sizes = [len(iv) for iv in ss.axis_intervals]
        pairs = []
        by_d: dict[tuple[int, ...], list[PairRoute]] = {}
        for flat in range(int(np.prod(sizes))):
            s_block = tuple(int(i) for i in np.unravel_index(flat, sizes)) if sizes else ()
            if any(iv[b, 1] <= iv[b, 0] for iv, b in zip(ss.axis_intervals, s_block)):
                continue
            for d_block, box, route, stream in self.pairs_of(w, s_block):
                pairs.append((s_block, d_block, box, route, stream))
                by_d.setdefault(d_block, []).append(route)
        merged = {d: self._merged_nodes(routes) for d, routes in by_d.items()}
        for s_block, d_block, box, route, stream in pairs:
            out = self.chunks(w, s_block, d_block, box, route, stream, merged[d_block])
            out[0] = dataclasses.replace(
                out[0], piece_nbytes=self._nbytes(w, box), quantum_nbytes=stream.quantum_nbytes
            )
            yield from out
        for d_block in sorted(merged):
            if merged[d_block].size:
                yield self._forward_chunk(w, d_block, by_d[d_block][0], merged[d_block])

    def _coords_of(self, which: int, rank: int) -> dict[str, int] | None:
        key = (which, rank)
        if key not in self._coords:
            layout = self.src if which == 0 else self.dst
            self._coords[key] = layout.coords(rank) if rank in layout else None
        return self._coords[key]

    def rank_chunks(self, w: int, rank: int) -> Iterator[Chunk]:
        """The pairs of weight ``w`` that ``rank`` takes part in (as a source holder, a receiver
        or a forwarder), each restricted to its messages from or to ``rank``."""
        ss, ds = self.sides[w]
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        wanted: list[tuple[tuple[int, ...], tuple[int, ...] | None]] = []
        s_coords, d_coords = self._coords_of(0, rank), self._coords_of(1, rank)
        s_own = ss.block_of(rank, s_coords) if s_coords is not None else None
        if s_own is not None:
            wanted.append((s_own, None))
        d_own = ds.block_of(rank, d_coords) if d_coords is not None else None
        if d_own is not None:
            wanted.extend((s, d_own) for s in self.src_blocks_meeting(w, d_own))
        found = []
        for s_block, only in wanted:
            for d_block, box, route, stream in self.pairs_of(w, s_block):
                if (only is not None and d_block != only) or (s_block, d_block) in seen:
                    continue
                seen.add((s_block, d_block))
                found.append((s_block, d_block, box, route, stream))
        found.sort(key=lambda f: (f[0], f[1]))  # the whole plan's order: source, then destination blocks
        node = rank // self.node_size
        own_routes = [f[3] for f in found if f[1] == d_own]
        merged = len(own_routes) >= 2 and all(r.is_cross_node(node) for r in own_routes)
        for s_block, d_block, box, route, stream in found:
            got = route.messages_for(
                rank, stream, self._turn(w, s_block), self._rep_turn(w, d_block), merged and d_block == d_own
            )
            cols = (
                [np.array(col, dtype=np.int64) for col in zip(*got)] if got else [np.zeros(0, np.int64)] * 5
            )
            out = self._runs(w, box, route, cols[0], cols[1], cols[2].astype(np.int8), cols[3], cols[4])
            if (
                d_block == d_own
            ):  # the piece arrives whole, or not at all on a merged node's non-representative
                arrived = sum(_volume(c.box) * int((c.dst == rank).sum()) for c in out)
                if arrived not in ((0, _volume(box)) if merged else (_volume(box),)):
                    raise PlanError(
                        f"plan bug: rank {rank} gets {arrived} elements of piece {box} of {self.weights[w].name!r}"
                    )
            yield from out
        if merged and d_own is not None:
            c = self._forward_chunk(w, d_own, own_routes[0], np.array([node], np.int64))
            mine = (c.src == rank) | (c.dst == rank)
            yield Chunk(w, c.box, c.nbytes, c.src[mine], c.dst[mine], c.step[mine], c.route, True)


def _volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


__all__ = ["Chunk", "Planner", "cut_box"]
