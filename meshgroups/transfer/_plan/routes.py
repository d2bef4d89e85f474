"""The planner: every weight's routing, made once per plan, and the messages read from it.

:class:`Planner` walks the weights in the destination list's order. Each weight is entered once
(:meth:`Planner.routes`): its :class:`WeightRoutes` keeps everything later stages read — the
whole plan's walk, a rank's part, the lazy messages, ``for_rank``, the statistics — so none of
them routes a weight again. For weight ``w`` and a source block ``S`` the planner lists the
destination blocks ``D`` that intersect ``S`` (per axis, by binary search in the two tilings,
then their product) and routes each pair with :class:`~meshgroups.transfer._plan.assign.PairRoute`,
cached by the blocks' keys (stage and sharding coordinates), so weights placed alike share one
routing. The cross-node senders of a piece are chosen by bytes: per set of holders, the units of
all its pairs are laid end to end and cut into one range of equal bytes per holder
(:func:`~meshgroups.transfer._plan.senders.holder_set_streams`); so a block's pairs are routed
when its holder set is placed, every weight of the set at once, and kept. Both the whole plan
and a rank's part read the same :class:`Pair` s, so they agree message for message. A node that
receives *every* piece of a destination block from outside gets them all on one representative,
which forwards the whole block in one message::

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
from functools import cached_property

import numpy as np

from meshgroups.errors import PlanError
from meshgroups.layout import Layout
from meshgroups.transfer._plan.assign import ByNode, PairRoute, merged_nodes
from meshgroups.transfer._plan.senders import Stream, cut_axis, holder_set_streams, representatives, turn
from meshgroups.transfer._plan.shards import BlockKey, Side, axis_pairs, holders
from meshgroups.transfer._spec import Box, Weight, volume

Block = tuple[int, ...]


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
class Pair:
    """One source block's piece for one destination block ``d_block``: its ``box``, its
    ``route`` (who holds it, who gets it from where) and its place in its holder set's
    ``stream`` (who sends which indices of it across nodes)."""

    d_block: Block
    box: Box
    route: PairRoute
    stream: Stream


class WeightRoutes:
    """One weight's routing, made once per plan (:meth:`Planner.routes`), read by every stage:

    - ``pairs``: per non-empty source block, its :class:`Pair` s in destination block order,
      filled when the block's holder set is placed (every weight of the set at once), never
      again;
    - ``meeting``: per destination block asked for, the source blocks that tile it (checked);
    - ``whole``: the whole plan's walk, made on the first: every ``(source block, pair)`` and,
      per destination block, its first route and the nodes that get it merged.
    """

    def __init__(self, w: int, src: Side, dst: Side) -> None:
        self.w, self.src, self.dst = w, src, dst
        self.pairs: dict[Block, list[Pair]] = {}
        self.meeting: dict[Block, list[Block]] = {}
        self.whole: tuple[list[tuple[Block, Pair]], dict[Block, tuple[PairRoute, np.ndarray]]] | None = None


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


class Planner:
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
        self._weights: list[WeightRoutes | None] = [None] * len(self.sides)
        self._coords: dict[tuple[int, int], dict[str, int] | None] = {}
        # Weights whose source blocks are keyed by the same dims and vary over the same dims,
        # by pipeline stage: the candidates when placing one holder set.
        self._by_signature: dict[
            tuple[tuple[str, ...], frozenset[str]], dict[tuple[str, int] | None, list[int]]
        ] = {}
        for w, (ss, _) in enumerate(self.sides):
            stages = self._by_signature.setdefault((ss.free_dims, ss.keyed_dims), {})
            stages.setdefault(ss.stage_key, []).append(w)
        self._holders: dict[tuple[int, BlockKey, tuple[str, ...]], tuple[np.ndarray, ByNode]] = {}
        self._routes: dict[tuple[BlockKey, tuple[str, ...], BlockKey, tuple[str, ...]], PairRoute] = {}

    # ------------------------------------------------------------------ one weight, once
    def routes(self, w: int) -> WeightRoutes:
        """Weight ``w``'s routing: made by :meth:`_route` on first use, kept for the plan."""
        got = self._weights[w]
        if got is None:
            got = self._weights[w] = self._route(w)
        return got

    def _route(self, w: int) -> WeightRoutes:
        """The planner's entry for one weight: runs once per weight per plan (a test counts)."""
        ss, ds = self.sides[w]
        return WeightRoutes(w, ss, ds)

    # ------------------------------------------------------------------ holders and routes
    def _holders_of(self, which: int, side: Side, key: BlockKey) -> tuple[np.ndarray, ByNode]:
        ck = (which, key, side.free_dims)
        got = self._holders.get(ck)
        if got is None:
            ranks = holders(side.layout, key, side.free_dims)
            got = self._holders[ck] = (ranks, ByNode.of(ranks, self.node_size))
        return got

    def route(self, ss: Side, s_block: Block, ds: Side, d_block: Block) -> PairRoute:
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
    ) -> Iterator[tuple[Block, Block, Box]]:
        """Cartesian product of per-axis overlap rows: (src block, dst block, box)."""
        for rows in itertools.product(*per_axis):
            yield (
                tuple(r[0] for r in rows),
                tuple(r[1] for r in rows),
                tuple((r[2], r[3]) for r in rows),
            )

    def _list(self, w: int, s_block: Block) -> list[tuple[Block, Box, PairRoute]]:
        """Every destination block meeting source block ``s_block`` of weight ``w``, in block
        order, with the piece's box and the pair's route (once per block: see :meth:`_place`)."""
        ss, ds = self.sides[w]
        per_axis = [
            axis_pairs(s_t, d_t, b, None) for s_t, d_t, b in zip(ss.axis_tilings, ds.axis_tilings, s_block)
        ]
        return [
            (d_block, box, self.route(ss, s_block, ds, d_block))
            for _, d_block, box in self._product(per_axis)
        ]

    def _place(self, key: BlockKey, free_dims: tuple[str, ...]) -> None:
        """Route the pairs of every weight's source block with holders ``key`` (over
        ``free_dims``) and place them in that set's stream; keep them in each weight's routes."""
        fixed = dict(key)
        stages = self._by_signature.get((free_dims, frozenset(fixed)), {})
        candidates = sorted(
            w for stage, ws in stages.items() if stage is None or fixed.get(stage[0]) == stage[1] for w in ws
        )
        members: list[tuple[WeightRoutes, Block, list[tuple[Block, Box, PairRoute]]]] = []
        units: list[tuple[int, int, int]] = []  # (K, cut-axis indices, bytes per index) per pair
        h = 1
        for w in candidates:
            routes = self.routes(w)
            s_block = routes.src.block_with(key)
            if s_block is None:
                continue
            listed = self._list(w, s_block)
            members.append((routes, s_block, listed))
            for _, box, route in listed:
                h = max(route.src_holders.size, 1)
                units.append((route.n_cross, *cut_axis(box, self.weights[w].itemsize)))
        streams = iter(holder_set_streams(key, free_dims, h, units, self.min_part_bytes))
        for routes, s_block, listed in members:
            routes.pairs[s_block] = [Pair(d, box, route, next(streams)) for d, box, route in listed]

    def pairs_of(self, w: int, s_block: Block) -> list[Pair]:
        """The pairs of source block ``s_block`` of weight ``w`` with their senders (its holder
        set placed on first use)."""
        routes = self.routes(w)
        got = routes.pairs.get(s_block)
        if got is None:
            self._place(routes.src.block_key(s_block), routes.src.free_dims)
            got = routes.pairs[s_block]
        return got

    def src_blocks_meeting(self, w: int, d_block: Block) -> list[Block]:
        """Source blocks of weight ``w`` that intersect destination block ``d_block``; checks
        that they tile it exactly (``PlanError`` otherwise)."""
        routes = self.routes(w)
        got = routes.meeting.get(d_block)
        if got is not None:
            return got
        ss, ds = routes.src, routes.dst
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
        got = routes.meeting[d_block] = [s for s, _, _ in self._product(per_axis)]
        return got

    # ------------------------------------------------------------------ the choices read
    def _turn(self, w: int, s_block: Block) -> int:
        return turn(w, self.sides[w][0].axis_intervals, s_block)

    @cached_property
    def _rep_turn(self) -> dict[tuple[int, Block], int]:
        """Per ``(weight, destination block)``: its representatives' position (see
        :func:`~meshgroups.transfer._plan.senders.representatives`)."""
        return representatives(
            [ds for _, ds in self.sides], lambda ds, key: self._holders_of(1, ds, key)[1].count
        )

    # ------------------------------------------------------------------ messages
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

    def _forward_chunk(self, w: int, d_block: Block, route: PairRoute, nodes: np.ndarray) -> Chunk:
        src, dst = route.node_forwards(nodes, self._rep_turn[(w, d_block)])
        box = self.sides[w][1].block_box(d_block)
        return Chunk(w, box, self._nbytes(w, box), src, dst, np.ones(src.size, np.int8), route, True)

    def _nbytes(self, w: int, box: Box) -> int:
        return self.weights[w].itemsize * volume(box)

    # ------------------------------------------------------------------ whole and local walks
    def _walk(
        self, routes: WeightRoutes
    ) -> tuple[list[tuple[Block, Pair]], dict[Block, tuple[PairRoute, np.ndarray]]]:
        """Every pair of a weight, source block by source block, and per destination block its
        first route and the nodes that get it merged (the whole plan's walk, made once)."""
        ss, ds = routes.src, routes.dst
        for axis, (s_iv, d_iv) in enumerate(zip(ss.axis_intervals, ds.axis_intervals)):
            tiles = (
                s_iv[0, 0] == 0 and s_iv[-1, 1] == d_iv[-1, 1] and np.array_equal(s_iv[1:, 0], s_iv[:-1, 1])
            )
            if not tiles:
                raise PlanError(
                    f"plan bug: source pieces of {self.weights[routes.w].name!r} axis {axis} do not tile it"
                )
        sizes = [len(iv) for iv in ss.axis_intervals]
        pairs = []
        by_d: dict[Block, list[PairRoute]] = {}
        for flat in range(int(np.prod(sizes))):
            s_block = tuple(int(i) for i in np.unravel_index(flat, sizes)) if sizes else ()
            if any(iv[b, 1] <= iv[b, 0] for iv, b in zip(ss.axis_intervals, s_block)):
                continue
            for pair in self.pairs_of(routes.w, s_block):
                pairs.append((s_block, pair))
                by_d.setdefault(pair.d_block, []).append(pair.route)
        return pairs, {d: (rs[0], merged_nodes(rs)) for d, rs in by_d.items()}

    def weight_chunks(self, w: int) -> Iterator[Chunk]:
        """Every message of weight ``w`` (the whole plan), source block by source block."""
        routes = self.routes(w)
        if routes.whole is None:
            routes.whole = self._walk(routes)
        pairs, merged = routes.whole
        for s_block, p in pairs:
            got = p.route.messages(
                p.stream, self._turn(w, s_block), self._rep_turn[(w, p.d_block)], merged[p.d_block][1]
            )
            out = self._runs(w, p.box, p.route, *got)
            out[0] = dataclasses.replace(
                out[0], piece_nbytes=self._nbytes(w, p.box), quantum_nbytes=p.stream.quantum_nbytes
            )
            yield from out
        for d_block in sorted(merged):
            route, nodes = merged[d_block]
            if nodes.size:
                yield self._forward_chunk(w, d_block, route, nodes)

    def _coords_of(self, which: int, rank: int) -> dict[str, int] | None:
        key = (which, rank)
        if key not in self._coords:
            layout = self.src if which == 0 else self.dst
            self._coords[key] = layout.coords(rank) if rank in layout else None
        return self._coords[key]

    def rank_chunks(self, w: int, rank: int) -> Iterator[Chunk]:
        """The pairs of weight ``w`` that ``rank`` takes part in (as a source holder, a receiver
        or a forwarder), each restricted to its messages from or to ``rank``."""
        routes = self.routes(w)
        seen: set[tuple[Block, Block]] = set()
        wanted: list[tuple[Block, Block | None]] = []
        s_coords, d_coords = self._coords_of(0, rank), self._coords_of(1, rank)
        s_own = routes.src.block_of(rank, s_coords) if s_coords is not None else None
        if s_own is not None:
            wanted.append((s_own, None))
        d_own = routes.dst.block_of(rank, d_coords) if d_coords is not None else None
        if d_own is not None:
            wanted.extend((s, d_own) for s in self.src_blocks_meeting(w, d_own))
        found: list[tuple[Block, Pair]] = []
        for s_block, only in wanted:
            for p in self.pairs_of(w, s_block):
                if (only is not None and p.d_block != only) or (s_block, p.d_block) in seen:
                    continue
                seen.add((s_block, p.d_block))
                found.append((s_block, p))
        found.sort(
            key=lambda f: (f[0], f[1].d_block)
        )  # the whole plan's order: source, then destination blocks
        node = rank // self.node_size
        own_routes = [p.route for _, p in found if p.d_block == d_own]
        merged = len(own_routes) >= 2 and all(r.is_cross_node(node) for r in own_routes)
        for s_block, p in found:
            got = p.route.messages_for(
                rank,
                p.stream,
                self._turn(w, s_block),
                self._rep_turn[(w, p.d_block)],
                merged and p.d_block == d_own,
            )
            cols = (
                [np.array(col, dtype=np.int64) for col in zip(*got)] if got else [np.zeros(0, np.int64)] * 5
            )
            out = self._runs(w, p.box, p.route, cols[0], cols[1], cols[2].astype(np.int8), cols[3], cols[4])
            if (
                p.d_block == d_own
            ):  # the piece arrives whole, or not at all on a merged node's non-representative
                arrived = sum(volume(c.box) * int((c.dst == rank).sum()) for c in out)
                if arrived not in ((0, volume(p.box)) if merged else (volume(p.box),)):
                    raise PlanError(
                        f"plan bug: rank {rank} gets {arrived} elements of piece {p.box} of {self.weights[w].name!r}"
                    )
            yield from out
        if merged and d_own is not None:
            c = self._forward_chunk(w, d_own, own_routes[0], np.array([node], np.int64))
            mine = (c.src == rank) | (c.dst == rank)
            yield Chunk(w, c.box, c.nbytes, c.src[mine], c.dst[mine], c.step[mine], c.route, True)


__all__ = ["Chunk", "Pair", "Planner", "WeightRoutes", "cut_box"]
