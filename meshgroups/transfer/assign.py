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
node ``k`` of the pair's ``K`` cross nodes (in node order) gets the piece from source holder
``(base + k) mod h``; the representative of a node and the intra sender rotate with the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import LayoutError


class PlanError(LayoutError):
    """The plan breaks one of its guarantees (coverage exactly once); a bug, never silent."""


def _runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For ``keys`` sorted: (unique values, start of each run, length of each run, position of
    every element inside its run)."""
    if keys.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e
    values, starts, counts = np.unique(keys, return_index=True, return_counts=True)
    pos = np.arange(keys.size, dtype=np.int64) - np.repeat(starts, counts)
    return values, starts.astype(np.int64), counts.astype(np.int64), pos


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
    cross_k: np.ndarray  # per cross_dst: index of its node among the K cross nodes
    cross_pos: np.ndarray  # per cross_dst: index inside its node
    cross_count: np.ndarray  # per cross node: how many holders of D it has
    lower_bound_nodes: int  # nodes that need S ∩ D and hold none of S, counted apart

    @property
    def n_cross(self) -> int:
        return int(self.cross_count.size)

    @classmethod
    def build(cls, src_holders: np.ndarray, dst_holders: np.ndarray, node_size: int) -> PairRoute:
        hs = np.asarray(src_holders, dtype=np.int64)
        hd = np.asarray(dst_holders, dtype=np.int64)
        s_nodes = hs // node_size
        order = np.argsort(s_nodes, kind="stable")
        cand = hs[order]
        node_vals, node_start, node_count, _ = _runs(s_nodes[order])
        is_local = np.isin(hd, hs)
        rest = hd[~is_local]
        r_nodes = rest // node_size
        on_src_node = np.isin(r_nodes, node_vals)
        intra = rest[on_src_node]
        i_nodes = r_nodes[on_src_node]
        i_order = np.argsort(i_nodes, kind="stable")
        intra, i_nodes = intra[i_order], i_nodes[i_order]
        _, _, _, intra_pos = _runs(i_nodes)
        where = np.searchsorted(node_vals, i_nodes)
        cross = rest[~on_src_node]
        c_nodes = cross // node_size
        c_order = np.argsort(c_nodes, kind="stable")
        cross, c_nodes = cross[c_order], c_nodes[c_order]
        _, _, c_count, c_pos = _runs(c_nodes)
        cross_k = np.repeat(np.arange(c_count.size, dtype=np.int64), c_count)
        # The bound is computed from the node sets alone, not from the routing above.
        bound = np.setdiff1d(np.unique(hd // node_size), node_vals).size
        route = cls(
            hs, hd[is_local], intra, cand, node_start[where], node_count[where], intra_pos,
            cross, cross_k, c_pos, c_count, int(bound),
        )  # fmt: skip
        route._check(hd)
        return route

    def _check(self, dst_holders: np.ndarray) -> None:
        """Every destination holder gets the piece exactly once (raise ``PlanError`` if not)."""
        got = np.concatenate([self.local, self.intra_dst, self.cross_dst])
        if got.size != dst_holders.size or not np.array_equal(np.sort(got), np.sort(dst_holders)):
            raise PlanError(f"plan bug: destination holders {dst_holders.tolist()} covered as {got.tolist()}")
        if self.n_cross != self.lower_bound_nodes:
            raise PlanError(
                f"plan bug: {self.n_cross} nodes receive from outside, the minimum is {self.lower_bound_nodes}"
            )

    def messages(self, base: int, turn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, step)`` of every message of the pair: local copies, intra-node sends,
        one cross-node send per node (source holder ``(base + k) mod h``, representative number
        ``turn mod size`` of the node) and the representative's forwards."""
        h = self.src_holders.size
        intra_src = self.intra_cand[
            self.intra_start + (self.intra_pos + turn) % np.maximum(self.intra_count, 1)
        ]
        k = np.arange(self.n_cross, dtype=np.int64)
        rep_pos = turn % np.maximum(self.cross_count, 1)
        is_rep = self.cross_pos == rep_pos[self.cross_k]
        reps = self.cross_dst[is_rep]  # one per cross node, in node order
        fwd_dst = self.cross_dst[~is_rep]
        fwd_src = reps[self.cross_k[~is_rep]]
        step0_src = self.src_holders[(base + k) % h] if h else k
        src = np.concatenate([self.local, intra_src, step0_src, fwd_src])
        dst = np.concatenate([self.local, self.intra_dst, reps, fwd_dst])
        step = np.zeros(src.size, dtype=np.int8)
        step[src.size - fwd_src.size :] = 1
        return src, dst, step


__all__ = ["PairRoute", "PlanError"]
