"""``plan_transfer``: which rank sends which slice of each weight to which rank (numpy only).

For every destination shard the plan names the source ranks and exact boxes, choosing among
replicas so that a node receives each byte it needs and lacks exactly once from outside (then
forwards it inside the node), each holder sends within one cut quantum of its share of the
cross-node bytes (see :mod:`~meshgroups.transfer._plan.senders`), nothing goes to a rank that already
holds it (colocated ranks copy locally) and every destination element is covered exactly once —
checked while the plan is built (``plan_transfer``'s docstring shows one).

``plan_transfer(..., rank=r)`` computes only the messages ``r`` sends or receives, from its
own shards (equal to the whole plan's messages filtered to ``r``). The whole plan keeps
statistics and materialises its messages lazily, weight by weight.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import overload

import numpy as np

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout, Topology
from meshgroups.transfer._names.expand import Cast, check_weights, map_weights
from meshgroups.transfer._names.mapped import Mapped, Move
from meshgroups.transfer._names.names import NameMap
from meshgroups.transfer._names.quant import BlockFP8
from meshgroups.transfer._plan.routes import Chunk, Planner
from meshgroups.transfer._plan.stats import HolderSets, RankStats, Tally
from meshgroups.transfer._spec import Box, Weight


@dataclass(frozen=True)
class Message:
    """One slice of one weight from ``src`` to ``dst``; ``src == dst`` is a local copy.

    ``step`` 0: sent by a source holder; 1: forwarded inside a node by a destination rank after
    it received the slice at step 0.

    Attributes:
        weight: the weight's name.
        src: the sending rank.
        dst: the receiving rank.
        box: the slice, a global ``[start, stop)`` per axis.
        nbytes: its size in bytes.
        step: 0 or 1, as above.

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight, plan_transfer
    >>> w = Weight("wq", (8, 4), placements={"tp": Shard(0)})
    >>> plan_transfer(Layout(tp=2), [w], Layout(tp=4, rank_offset=2), [w]).messages[0]
    Message(weight='wq', src=0, dst=2, box=((0, 2), (0, 4)), nbytes=32, step=0)
    """

    weight: str
    src: int
    dst: int
    box: Box
    nbytes: int
    step: int


def _messages(names: Sequence[str], chunks: Iterator[Chunk]) -> Iterator[Message]:
    for c in chunks:
        for s, d, t in zip(c.src.tolist(), c.dst.tolist(), c.step.tolist()):
            yield Message(names[c.weight], s, d, c.box, c.nbytes, t)


class _LazyMessages(Sequence[Message]):
    """The whole plan's messages, generated weight by weight on access (never all held)."""

    def __init__(self, planner: Planner, counts: np.ndarray) -> None:
        self._planner, self._counts = planner, counts
        self._ends = np.cumsum(counts)
        self._names = [w.name for w in planner.weights]
        self._last: tuple[int, list[Message]] = (-1, [])  # one weight's, for indexing in order

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends.size else 0

    def __iter__(self) -> Iterator[Message]:
        for w in range(len(self._names)):
            yield from _messages(self._names, self._planner.weight_chunks(w))

    @overload
    def __getitem__(self, i: int) -> Message: ...
    @overload
    def __getitem__(self, i: slice) -> list[Message]: ...
    def __getitem__(self, i: int | slice) -> Message | list[Message]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"message index {i} out of range ({n} messages)")
        w = int(np.searchsorted(self._ends, j, side="right"))
        first = int(self._ends[w] - self._counts[w])
        if self._last[0] != w:
            self._last = (w, list(_messages(self._names, self._planner.weight_chunks(w))))
        return self._last[1][j - first]


class TransferPlan:
    """A transfer plan: for every destination shard, the source ranks and exact boxes (made by
    ``plan_transfer``, numpy only), with its statistics and bounds::

        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import Shard, Weight, plan_transfer
        >>> w = Weight("wq", (8, 4), placements={"tp": Shard(0)})
        >>> plan = plan_transfer(Layout(tp=2), [w], Layout(tp=4, rank_offset=2), [w])
        >>> plan, plan.send_bytes, plan.recv_bytes
        (<TransferPlan whole: 4 messages, 128 cross-node bytes>, {0: 64, 1: 64}, {2: 32, 3: 32, 4: 32, 5: 32})

    Attributes:
        messages: every message (``rank=None``) or those ``rank`` sends or receives.
        send_bytes, recv_bytes: per rank, local copies excluded (for a rank's plan: of its
            messages only).
        cross_node_bytes: bytes whose sender and receiver sit on different nodes.
        cross_node_lower_bound: Σ over nodes of the bytes the node needs and holds none of —
            no plan can move fewer across nodes (``None`` for a rank's plan).
        busiest_send_bytes: the most any source holder sends at step 0 (local copies excluded).
        ideal_send_bytes: the bytes sent at step 0 over the ranks holding distinct data (source
            ranks with a non-empty shard of a moved weight): what the busiest sender would send
            if every holder sent alike (the issue's ideal); ``nan`` for a rank's plan.
        send_lower_bound: the achievable bound: max over groups of source ranks (each set of
            holders of one block, and each union of such sets that share ranks, e.g. one
            pipeline stage) of the step-0 bytes only that group holds, over its ranks. No
            choice of senders does better; below ``ideal_send_bytes`` is out of reach when
            the groups hold unequal bytes (stages of unequal size). ``nan`` for a rank's plan.
        busiest_send_bound: what the planner guarantees (``nan`` for a rank's plan): the
            busiest step-0 sender sends at most this, the max over source ranks ``r`` of
            ``intra(r) + Σ_{H ∋ r} (⌈X_H / |H|⌉ + Q_H)`` — ``intra(r)``: its intra-node sends
            (the node's holders take turns), ``H``: the holder sets ``r`` is in, ``X_H``: their
            cross-node bytes, ``Q_H``: their largest cut quantum (``min_part_bytes`` rounded up
            to whole indices of a piece's longest axis, or the whole unit if smaller). Proof:
            per holder set, the units are laid end to end and cut into ``|H|`` ranges of
            ``⌊X_H/|H|⌋`` or ``⌈X_H/|H|⌉`` bytes, a cut inside a unit moved up to its next
            quantum, so a member's range grows by less
            than ``Q_H``. When no source node holds a destination rank (``intra = 0``) and the
            holder sets of one kind (the same sharding dims: one set per coordinate, together
            covering their group) carry equal bytes, as with even shards in
            ``bench_transfer``, ``Σ_{H ∋ r} X_H / |H|`` is the group's mean, so the busiest
            sender sends at most ``send_lower_bound + Σ_{H ∋ r} (Q_H + 1)``: the rest is the
            cut's granularity.
        busiest_forward_bytes: the most any rank forwards inside its node (step 1).
        n_messages: messages including local copies; ``n_local`` of them are local copies.
        mapping: with a name map or a cast, the links each plan weight stands for
            (a ``Mapped``: ``mapping.links``, ``mapping.sources(rollout name)``; see
            :meth:`moves`), else ``None``.
        stats: per-rank arrays (bytes and messages by step and node crossing), a
            ``RankStats``.

    Made by ``plan_transfer``, not by hand: the constructor's ``tally`` (per-rank statistics),
    ``n_holders`` and ``send_bounds`` (the send bounds above) are the planner's.
    """

    def __init__(
        self,
        planner: Planner,
        rank: int | None,
        messages: Sequence[Message],
        tally: Tally,
        bound: int | None,
        n_holders: int,
        send_bounds: tuple[float, float] = (float("nan"), float("nan")),
    ) -> None:
        self._planner = planner
        self.rank = rank
        self.messages = messages
        self._tally = tally
        self.cross_node_bytes = tally.cross_bytes
        self.cross_node_lower_bound = bound
        # A rank's plan is tallied over the ranks it names only (``_touched``); the whole
        # plan's over the world (``_touched`` None). The figures come from those values.
        self._touched = tally.touched
        self._send, self._recv = tally.values("send"), tally.values("recv")
        step0 = tally.values("send_step0")
        self.busiest_send_bytes = int(step0.max()) if step0.size else 0
        forwards = self._send - step0
        self.busiest_forward_bytes = int(forwards.max()) if forwards.size else 0
        self.send_lower_bound, self.busiest_send_bound = send_bounds
        # n_holders < 0: a rank's plan, which cannot know the ideal; 0: nothing to send.
        self.ideal_send_bytes = (
            float(step0.sum()) / n_holders if n_holders > 0 else float("nan") if n_holders else 0.0
        )
        self.n_messages = tally.n_messages
        self.n_local = tally.n_local
        self.node_size = planner.node_size
        self.mapping: Mapped | None = None
        self._by_rank: dict[int, tuple[Message, ...]] = {}  # for_rank of a whole plan, the last ranks'

    @property
    def src(self) -> Layout:
        """The source layout."""
        return self._planner.src

    @property
    def dst(self) -> Layout:
        """The destination layout."""
        return self._planner.dst

    @property
    def weights(self) -> list[tuple[Weight, Weight]]:
        """``(source weight, destination weight)`` per moved weight, in destination order."""
        return list(self._planner.pairs)

    @cached_property
    def stats(self) -> RankStats:
        """Per-rank arrays over the whole world (a ``RankStats``: bytes and messages by step and
        node crossing); for a rank's plan built on first use."""
        return self._tally.result()

    def _nonzero(self, values: np.ndarray) -> dict[int, int]:
        idx = np.flatnonzero(values)
        ranks = idx if self._touched is None else self._touched[idx]
        return {int(r): int(v) for r, v in zip(ranks.tolist(), values[idx].tolist())}

    @property
    def send_bytes(self) -> Mapping[int, int]:
        return self._nonzero(self._send)

    @property
    def recv_bytes(self) -> Mapping[int, int]:
        return self._nonzero(self._recv)

    def send_array(self) -> np.ndarray:
        """Bytes sent per rank as an int64 array indexed by rank (a copy)."""
        return self.stats.send.copy()

    def recv_array(self) -> np.ndarray:
        """Bytes received per rank as an int64 array indexed by rank (a copy)."""
        return self.stats.recv.copy()

    def per_node(self) -> dict[str, np.ndarray]:
        """:attr:`stats` summed per node (index = node id = rank // ranks per node)."""
        out = {}
        for name, arr in self.stats.as_dict().items():
            pad = -arr.size % self.node_size
            out[name] = (
                np.concatenate([arr, np.zeros(pad, arr.dtype)]).reshape(-1, self.node_size).sum(axis=1)
            )
        return out

    def for_rank(self, r: int) -> list[Message]:
        """The messages ``r`` sends or receives, in plan order."""
        if self.rank is None:
            got = self._by_rank.get(r)
            if got is None:  # a rank reads its part several times (its groups, execute, a delta)
                got = tuple(
                    _messages([w.name for w in self._planner.weights], _rank_chunks(self._planner, r))
                )
                if len(self._by_rank) >= 4:
                    del self._by_rank[next(iter(self._by_rank))]
                self._by_rank[r] = got
            return list(got)
        if r != self.rank:
            raise LayoutError(f"this plan holds rank {self.rank}'s messages only, not rank {r}'s")
        return list(self.messages)

    def moves(self, r: int) -> list[Move]:
        """:meth:`for_rank` resolved to tensor names and local slices (a mapped plan only)."""
        if self.mapping is None:
            raise LayoutError("moves() needs a plan made with name_map= or cast=")
        return [self.mapping.resolve(m) for m in self.for_rank(r)]

    def summary(self) -> str:
        """A text table of the plan's figures."""
        rows = [
            ("messages (local copies)", f"{self.n_messages} ({self.n_local})"),
            ("bytes sent", f"{int(self._send.sum()):,}"),
            ("cross-node bytes", f"{self.cross_node_bytes:,}"),
            (
                "cross-node lower bound",
                "-" if self.cross_node_lower_bound is None else f"{self.cross_node_lower_bound:,}",
            ),
            ("busiest sender bytes", f"{self.busiest_send_bytes:,}"),
            ("ideal sender bytes", _num(self.ideal_send_bytes)),
            ("sender lower bound", _num(self.send_lower_bound)),
            ("busiest sender bound", _num(self.busiest_send_bound)),
            ("busiest forwarder bytes", f"{self.busiest_forward_bytes:,}"),
            ("busiest receiver bytes", f"{int(self._recv.max()) if self._recv.size else 0:,}"),
            ("ranks per node", str(self.node_size)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def __repr__(self) -> str:
        who = "whole" if self.rank is None else f"rank {self.rank}"
        return f"<TransferPlan {who}: {self.n_messages} messages, {self.cross_node_bytes:,} cross-node bytes>"


def _num(x: float) -> str:
    return "-" if x != x else f"{x:,.0f}"  # nan: a rank's plan cannot know it


def _rank_chunks(planner: Planner, rank: int) -> Iterator[Chunk]:
    for w in range(len(planner.weights)):
        yield from planner.rank_chunks(w, rank)


def _node_size(topology: Topology | None) -> int:
    if topology is None:
        return 1
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a meshgroups.Topology or None, got {topology!r}")
    return topology.size("node") if "node" in topology.names else topology.levels[0][1]


def _match(
    src: Layout, src_weights: Sequence[Weight], dst: Layout, dst_weights: Sequence[Weight]
) -> list[tuple[Weight, Weight]]:
    check_weights(src, src_weights, dst, dst_weights)
    by_name = {w.name: w for w in src_weights}
    pairs = []
    for dw in dst_weights:
        sw = by_name.get(dw.name)
        if sw is None:
            raise LayoutError(
                f"weight {dw.name!r} is in dst_weights but not in src_weights: nothing to send it from"
            )
        if sw.shape != dw.shape or sw.dtype != dw.dtype:
            raise LayoutError(
                f"weight {dw.name!r}: source {sw.shape} {sw.dtype} and destination {dw.shape} {dw.dtype} "
                "must have the same shape and dtype"
            )
        pairs.append((sw, dw))
    return pairs


def plan_transfer(
    src: Layout,
    src_weights: Sequence[Weight],
    dst: Layout,
    dst_weights: Sequence[Weight],
    topology: Topology | None = None,
    rank: int | None = None,
    *,
    min_part_bytes: int = 1 << 16,
    name_map: NameMap | Mapping[str, object] | None = None,
    cast: Cast = None,
    allow_unused: bool | Sequence[str] = False,
    quantize: BlockFP8 | None = None,
) -> TransferPlan:
    """TransferPlan moving ``dst_weights`` (matched by name to ``src_weights``) from ``src`` to ``dst``.

    Args:
        topology: its ``node`` level (else its smallest) is the node; ``None``: each rank its
            own node.
        rank: ``None`` for the whole plan; a rank for only its messages (O(its shards)).
        min_part_bytes: the granularity of cuts: where one holder's share of its set's
            cross-node bytes ends inside a piece, the piece is cut there, on a multiple of this
            many bytes (rounded up to whole indices of its longest axis) from its start. Finer
            is better balanced (a sender's bytes stay within one quantum of its share) and
            costs no more messages (at most one per holder more than whole pieces).
        name_map, cast, allow_unused: given any (``name_map={}`` for same names), the plan
            maps rollout weights to trainer weights (fusions, splits, ties, casts; coverage
            checked both ways): see :func:`~meshgroups.transfer.map_weights`.
        quantize: ``BlockFP8()``: every ``float8_e4m3fn`` rollout weight is block-quantized
            at the sender, its ``<name>_scale_inv`` planned beside it
            (:class:`~meshgroups.transfer.BlockFP8`); implies a mapped plan.

    Raises:
        TypeError: an argument of the wrong kind.
        LayoutError: (a ``ValueError``) a weight names a dim its layout lacks, a destination
            weight has no source, shapes or dtypes differ, a name repeats.

    Returns:
        The ``TransferPlan``: every message (or only ``rank``'s), with its statistics and bounds.

    A trainer (dp=2 × tp=2, ranks 0-3) to a rollout (tp=4, ranks 4-7), four ranks a node: each
    byte crosses nodes once, and rank 4 receives its rows from two senders::

        >>> from meshgroups import Layout, Topology
        >>> from meshgroups.transfer import Shard, Weight, plan_transfer
        >>> trainer, rollout = Layout(dp=2, tp=2), Layout(tp=4, rank_offset=4)
        >>> w = [Weight("wq", (8, 8), placements={"dp": Shard(0), "tp": Shard(1)})]
        >>> r = [Weight("wq", (8, 8), placements={"tp": Shard(0)})]
        >>> plan = plan_transfer(trainer, w, rollout, r, topology=Topology(node=4))
        >>> plan.cross_node_bytes == plan.cross_node_lower_bound == 8 * 8 * 4
        True
        >>> [(m.src, m.dst, m.box) for m in plan.for_rank(4)]
        [(0, 4, ((0, 2), (0, 4))), (1, 4, ((0, 2), (4, 8)))]
    """
    mapping = None
    if name_map is None and cast is None and allow_unused is False and quantize is None:
        pairs = _match(src, src_weights, dst, dst_weights)
    else:
        mapping = map_weights(src, src_weights, dst, dst_weights, name_map, cast, allow_unused, quantize)
        pairs = mapping.pairs
    # A rank's part checks its own coverage (routes.rank_chunks); the whole plan every holder's.
    if isinstance(min_part_bytes, bool) or not isinstance(min_part_bytes, int) or min_part_bytes < 1:
        raise TypeError(f"min_part_bytes must be a positive int, got {min_part_bytes!r}")
    planner = Planner(
        src, dst, pairs, _node_size(topology), full_check=rank is None, min_part_bytes=min_part_bytes
    )
    if rank is not None:
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
            raise TypeError(f"rank must be an int or None, got {rank!r}")
        chunks = list(_rank_chunks(planner, int(rank)))
        tally = Tally(max(src.max_rank, dst.max_rank) + 1, planner.node_size)
        for c in chunks:
            tally.add(c.src, c.dst, np.full(c.src.size, c.nbytes, np.int64), c.step)
        msgs = list(_messages([w.name for w in planner.weights], iter(chunks)))
        plan = TransferPlan(planner, int(rank), msgs, tally, None, -1)
    else:
        plan = _whole(planner, src, dst)
    plan.mapping = mapping
    return plan


def _whole(planner: Planner, src: Layout, dst: Layout) -> TransferPlan:
    """Walk every weight once, keeping only statistics (messages stay lazy)."""
    size = max(src.max_rank, dst.max_rank) + 1
    tally = Tally(size, planner.node_size)
    holds = np.zeros(size, bool)
    counts = np.zeros(len(planner.weights), np.int64)
    bound = 0
    sets = HolderSets()
    for w in range(len(planner.weights)):
        for c in planner.weight_chunks(w):
            tally.add(c.src, c.dst, np.full(c.src.size, c.nbytes, np.int64), c.step)
            counts[w] += c.src.size
            if c.piece_nbytes:  # once per pair
                r = c.route
                bound += r.lower_bound_nodes * c.piece_nbytes
                holds[r.src_holders] = True
                step0 = (r.intra_dst.size + r.n_cross) * c.piece_nbytes
                sets.add(r.src_holders, step0, r.n_cross * c.piece_nbytes, c.quantum_nbytes)
    s = tally.result()
    send_bounds = sets.bounds(s.send_step0, s.send_cross)
    return TransferPlan(
        planner, None, _LazyMessages(planner, counts), tally, bound, int(holds.sum()), send_bounds
    )


__all__ = ["Message", "TransferPlan", "plan_transfer"]
