"""Who sends one piece to whom: the replica choice for one (source block, destination block) pair.

A *pair* is a source block S and a destination block D that intersect; the piece ``S ∩ D`` goes
to every holder of D. Given the holders of both and the node size, :class:`PairRoute` sorts the
destination holders into
- *local*: the rank also holds S (colocated) — a local copy, nothing sent;
- *intra*: a holder of S sits on the same node — it sends directly (step 0), the holders of S
  on that node taking turns;
- *cross*: no holder of S on the node — the node receives the piece once from outside: one
  *representative* gets it (step 0) and forwards it to the others on its node (step 1).
So a node receives each byte it needs and lacks exactly once from outside: the minimum.

The choice is a formula of public quantities only (the pair's holders, the weight's index, a
rotation), so the sender and the receiver of a message compute the same choice without talking:
node ``k`` of the pair's ``K`` cross nodes (in node order) gets the piece from the source holder
:class:`~meshgroups.transfer._plan.senders.Stream` names (see there: whole units, or fragments when a
holder's range of its set's bytes ends inside one); the representative of a node and the intra
sender rotate::

    >>> hs, hd = np.array([0, 8]), np.array([1, 4, 5, 12])  # nodes of 4: S on 0, 2; D on 0, 1, 3
    >>> r = PairRoute.build(hs, ByNode.of(hs, 4), ByNode.of(hd, 4), 4, True)
    >>> from meshgroups.transfer._plan.senders import StreamSet
    >>> one = StreamSet.of([(2, 1)], h=2, start=0).pair(0, 1, 1, 1)  # 2 units of 1 byte, 2 holders
    >>> src, dst, step, lo, hi = r.messages(one, turn=0, rep_turn=0)
    >>> list(zip(src.tolist(), dst.tolist(), step.tolist()))
    [(0, 1, 0), (0, 4, 0), (8, 12, 0), (4, 5, 1)]
    >>> r.messages_for(8, one, turn=0, rep_turn=0)  # rank 8's share, by lookups
    [(8, 12, 0, -1, -1)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshgroups.errors import PlanError
from meshgroups.transfer._plan.senders import Stream


def _runs(keys: np.ndarray, positions: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For ``keys`` sorted: (unique values, start of each run, length of each run, position of
    every element inside its run — empty unless ``positions``). O(len) — no sort."""
    if keys.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e
    new = np.empty(keys.size, bool)
    new[0] = True
    np.not_equal(keys[1:], keys[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, keys.size))
    pos = np.arange(keys.size, dtype=np.int64) - np.repeat(starts, counts) if positions else starts[:0]
    return keys[starts], starts.astype(np.int64), counts.astype(np.int64), pos


def _member(values: np.ndarray, sorted_unique: np.ndarray) -> np.ndarray:
    """``np.isin`` for a sorted array of unique values, by binary search (no sort)."""
    if sorted_unique.size == 0 or values.size == 0:
        return np.zeros(values.size, bool)
    i = np.minimum(np.searchsorted(sorted_unique, values), sorted_unique.size - 1)
    return sorted_unique[i] == values


@dataclass(frozen=True)
class ByNode:
    """Holders of one block grouped by node: ``ranks`` sorted by node (stable, so the holders'
    own order inside a node), the node ids, where each node's run starts and its length. Shared
    by every pair the block takes part in."""

    ranks: np.ndarray
    nodes: np.ndarray
    start: np.ndarray
    count: np.ndarray

    @classmethod
    def of(cls, holders: np.ndarray, node_size: int) -> ByNode:
        nodes = holders // node_size
        if nodes.size > 1 and not (nodes[1:] >= nodes[:-1]).all():
            order = np.argsort(nodes, kind="stable")
            holders, nodes = holders[order], nodes[order]
        values, start, count, _ = _runs(nodes, positions=False)
        return cls(holders, values, start, count)


@dataclass(frozen=True)
class PairRoute:
    """The routing of one pair, independent of the piece's bytes; see the module docstring."""

    src_holders: np.ndarray  # h ranks, canonical order
    local: np.ndarray  # destination holders that hold S themselves
    intra_dst: np.ndarray  # destination holders served from their own node
    intra_cand: np.ndarray  # holders of S sorted by node (candidates of intra senders)
    intra_start: np.ndarray  # per intra_dst: its node's first candidate in intra_cand
    intra_count: np.ndarray  # per intra_dst: how many candidates its node has
    intra_pos: np.ndarray  # per intra_dst: its index among its node's intra receivers
    cross_dst: np.ndarray  # destination holders on nodes without S, sorted by node
    cross_count: np.ndarray  # per cross node: how many holders of D it has
    lower_bound_nodes: int  # nodes that need S ∩ D and hold none of S, counted apart
    node_size: int

    @property
    def n_cross(self) -> int:
        return int(self.cross_count.size)

    @classmethod
    def build(
        cls, src_holders: np.ndarray, s: ByNode, d: ByNode, node_size: int, full_check: bool
    ) -> PairRoute:
        """Route a pair from its holders grouped by node (``s``, ``d``: see :class:`ByNode`).
        ``full_check`` also compares the covered ranks with the holders (O(Q log Q))."""
        hs = src_holders
        in_src = _member(d.nodes, s.nodes)  # per destination node: does it hold S?
        if not in_src.any():  # no node holds both (disjoint layouts): every node is a cross node
            e = np.zeros(0, np.int64)
            route = cls(hs, e, e, s.ranks, e, e, e, d.ranks, d.count, d.nodes.size, node_size)
            route._check(d.ranks, full_check)
            return route
        member_in = np.repeat(in_src, d.count)
        on = d.ranks[member_in]
        # Only a destination holder on a node holding S can hold S itself.
        is_local = np.isin(on, hs) if on.size else np.zeros(0, bool)
        intra = on[~is_local]
        i_nodes = intra // node_size
        _, _, _, intra_pos = _runs(i_nodes)
        where = np.searchsorted(s.nodes, i_nodes)
        cross = d.ranks[~member_in]
        c_count = d.count[~in_src]
        # The bound is computed from the node sets alone, not from the routing above.
        bound = np.setdiff1d(d.nodes, s.nodes, assume_unique=True).size
        route = cls(
            hs, on[is_local], intra, s.ranks, s.start[where], s.count[where], intra_pos,
            cross, c_count, int(bound), node_size,
        )  # fmt: skip
        route._check(d.ranks, full_check)
        return route

    def _check(self, dst_holders: np.ndarray, full: bool) -> None:
        """Every destination holder gets the piece exactly once (raise ``PlanError`` if not)."""
        n = self.local.size + self.intra_dst.size + self.cross_dst.size
        got = (
            np.concatenate([self.local, self.intra_dst, self.cross_dst])
            if full or n != dst_holders.size
            else None
        )
        if got is not None and (
            got.size != dst_holders.size or not np.array_equal(np.sort(got), np.sort(dst_holders))
        ):
            raise PlanError(f"plan bug: destination holders {dst_holders.tolist()} covered as {got.tolist()}")
        if self.n_cross != self.lower_bound_nodes:
            raise PlanError(
                f"plan bug: {self.n_cross} nodes receive from outside, the minimum is {self.lower_bound_nodes}"
            )

    def messages(
        self, stream: Stream, turn: int, rep_turn: int, merged: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, step, lo, hi)`` of every message of the pair: local copies, intra-node
        sends (candidate ``turn`` onwards), the cross-node sends (each unit — the piece to one
        cross node's representative number ``rep_turn mod size`` — from the holders ``stream``
        names, unit by unit) and the representative's forwards — except on the ``merged``
        nodes, whose representative forwards the whole destination block once (see
        ``Planner``). ``lo, hi``: the indices of the piece's cut axis a cross-node fragment
        carries; ``-1, -1`` where the message carries the whole piece."""
        n_cross = self.n_cross
        intra_src = self.intra_cand[
            self.intra_start + (self.intra_pos + turn) % np.maximum(self.intra_count, 1)
        ]
        units, lo, hi, holder = stream.fragments(n_cross)
        rep_pos = rep_turn % np.maximum(self.cross_count, 1)
        is_rep = self.cross_pos == rep_pos[self.cross_k]
        reps = self.cross_dst[is_rep]  # one per cross node, in node order
        forward = ~is_rep
        if merged is not None and merged.size == n_cross:  # merged ⊆ cross nodes: all of them
            forward[:] = False
        elif merged is not None and merged.size:
            forward &= ~np.isin(self.cross_nodes, merged)[self.cross_k]
        fwd_dst = self.cross_dst[forward]
        fwd_src = reps[self.cross_k[forward]]
        step0_src = self.src_holders[holder]
        step0_dst = reps[units]
        src = np.concatenate([self.local, intra_src, step0_src, fwd_src])
        dst = np.concatenate([self.local, self.intra_dst, step0_dst, fwd_dst])
        step = np.zeros(src.size, dtype=np.int8)
        step[src.size - fwd_src.size :] = 1
        lo_all = np.full(src.size, -1, dtype=np.int64)
        hi_all = lo_all.copy()
        head = self.local.size + self.intra_dst.size
        whole = (lo == 0) & (hi == stream.length)
        lo_all[head : head + units.size] = np.where(whole, -1, lo)
        hi_all[head : head + units.size] = np.where(whole, -1, hi)
        return src, dst, step, lo_all, hi_all

    @cached_property
    def cross_nodes(self) -> np.ndarray:
        """Ids of the nodes that receive the piece from outside, ascending."""
        return self.cross_dst[self._cross_start] // self.node_size

    def node_forwards(self, nodes: np.ndarray, rep_turn: int) -> tuple[np.ndarray, np.ndarray]:
        """``(src, dst)``: on each of ``nodes`` (cross nodes), the representative to every
        other holder of the destination block there, in node then holder order."""
        ks = np.searchsorted(self.cross_nodes, nodes)
        starts, counts = self._cross_start[ks], self.cross_count[ks]
        offs = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        idx = np.repeat(starts, counts) + offs
        rep_idx = np.repeat(starts + rep_turn % counts, counts)
        keep = idx != rep_idx
        return self.cross_dst[rep_idx[keep]], self.cross_dst[idx[keep]]

    def is_cross_node(self, node: int) -> bool:
        i = int(np.searchsorted(self.cross_nodes, node))
        return i < self.cross_nodes.size and int(self.cross_nodes[i]) == node

    # ------------------------------------------------------------ one rank's messages
    @cached_property
    def _index(self) -> tuple[tuple[np.ndarray, np.ndarray | None], ...]:
        """(sorted values, position) of the arrays a rank is looked up in."""

        def by_value(a: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            if a.size < 2 or bool((a[1:] > a[:-1]).all()):
                return a, None  # already sorted (regular layouts): no O(h log h) sort
            order = np.argsort(a, kind="stable")
            return a[order], order

        return (
            by_value(self.src_holders),
            by_value(self.local),
            by_value(self.intra_dst),
            by_value(self.cross_dst),
        )

    @cached_property
    def cross_k(self) -> np.ndarray:
        """Per ``cross_dst``: the index of its node among the ``K`` cross nodes."""
        return np.repeat(np.arange(self.cross_count.size, dtype=np.int64), self.cross_count)

    @cached_property
    def cross_pos(self) -> np.ndarray:
        """Per ``cross_dst``: its index inside its node."""
        return np.arange(self.cross_dst.size, dtype=np.int64) - np.repeat(self._cross_start, self.cross_count)

    @cached_property
    def _cross_start(self) -> np.ndarray:
        return np.cumsum(self.cross_count) - self.cross_count

    @cached_property
    def _intra_nodes(self) -> np.ndarray:
        return self.intra_dst // self.node_size

    @staticmethod
    def _find(index: tuple[np.ndarray, np.ndarray | None], rank: int) -> int | None:
        values, where = index
        i = int(np.searchsorted(values, rank))
        if i < values.size and int(values[i]) == rank:
            return i if where is None else int(where[i])
        return None

    def _intra_src(self, i: int, turn: int) -> int:
        return int(self.intra_cand[self.intra_start[i] + (self.intra_pos[i] + turn) % self.intra_count[i]])

    def messages_for(
        self, rank: int, stream: Stream, turn: int, rep_turn: int, merged: bool = False
    ) -> list[tuple[int, int, int, int, int]]:
        """The ``(src, dst, step, lo, hi)`` of :meth:`messages` that ``rank`` sends or
        receives, in the same order, found by lookups: O(log h + its own messages), never
        O(holders). ``merged``: ``rank``'s node is one of the merged nodes (no per-piece
        forwards there)."""
        found: list[tuple[int, int, int, int, int, int, int, int]] = []  # (section, index, lo, ...)
        n_cross = self.n_cross
        i_src, i_local, i_intra, i_cross = self._index

        def whole(lo: int, hi: int) -> tuple[int, int]:
            return (-1, -1) if (lo, hi) == (0, stream.length) else (lo, hi)

        if (i := self._find(i_local, rank)) is not None:
            found.append((0, i, -1, rank, rank, 0, -1, -1))
        if (i := self._find(i_intra, rank)) is not None:
            found.append((1, i, -1, self._intra_src(i, turn), rank, 0, -1, -1))
        j = self._find(i_src, rank)
        if j is not None:
            node = rank // self.node_size
            lo, hi = np.searchsorted(self._intra_nodes, [node, node + 1])
            for i in range(int(lo), int(hi)):
                if self._intra_src(i, turn) == rank:
                    found.append((1, i, -1, rank, int(self.intra_dst[i]), 0, -1, -1))
            for k, a, b in stream.sent_by(j, n_cross):
                rep = int(self.cross_dst[self._cross_start[k] + rep_turn % self.cross_count[k]])
                found.append((2, k, a, rank, rep, 0, *whole(a, b)))
        if (i := self._find(i_cross, rank)) is not None:
            k = int(np.searchsorted(self._cross_start, i, side="right")) - 1
            start, count = int(self._cross_start[k]), int(self.cross_count[k])
            rep_i = start + rep_turn % count
            if i == rep_i:
                for a, b, who in stream.unit(k, n_cross):
                    found.append((2, k, a, int(self.src_holders[who]), rank, 0, *whole(a, b)))
                if not merged:
                    found.extend(
                        (3, m, -1, rank, int(self.cross_dst[m]), 1, -1, -1)
                        for m in range(start, start + count)
                        if m != i
                    )
            elif not merged:
                found.append((3, i, -1, int(self.cross_dst[rep_i]), rank, 1, -1, -1))
        found.sort()
        return [(src, dst, step, lo, hi) for *_, src, dst, step, lo, hi in found]


def merged_nodes(routes: Sequence[PairRoute]) -> np.ndarray:
    """Nodes that receive *every* piece of a destination block from outside (``routes``: its
    pairs'), so its representative gets the whole block and forwards it in one message; none
    when the block is one piece."""
    if len(routes) < 2:
        return np.zeros(0, np.int64)
    out = routes[0].cross_nodes
    for r in routes[1:]:
        out = np.intersect1d(out, r.cross_nodes, assume_unique=True)
    return out


__all__ = ["ByNode", "PairRoute", "PlanError", "merged_nodes"]
