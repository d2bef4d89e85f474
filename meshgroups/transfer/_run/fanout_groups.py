"""``TransferGroups``: the only extra process groups a transfer needs — one per fan-out.

A fan-out is one slice of one weight that one rank sends at one step to two or more other
ranks; it goes as one broadcast over a group of exactly that sender and those receivers
(sender first, receivers sorted). One-to-one slices go point to point. Building the groups is
one collective call (``collective_call("TransferGroups")``):

1. each rank lists the fan-outs it *sends*, from its own messages (``plan.for_rank(me)``);
2. the ranks compare the plan's identity (layouts' fingerprints, weights, node size) at a first
   meeting, so a rank holding another plan is a ``MismatchError`` on every rank, not wrong groups;
3. one ``all_gather_object`` of each sender's *distinct rank sets* and one flag per rank (does
   it send or receive anything) — what every rank must know, since every rank makes the same
   group-creation calls — never the per-slice fan-outs; with them two sums of message hashes
   per rank (sent, received): over all ranks they are equal when the parts pair up (and, but
   for a chance of about 2^-61, only then), so parts of different plans are refused on every
   rank alike, before any group is created;
4. the groups are created through ``init_mesh`` (equal-sized disjoint sets share one call),
   which joins this call: checked, deduplicated through the ``GroupCache``, released by
   ``close()``; first one group over the ranks that talk, for the point-to-point messages
   (``p2p``), so that a failed transfer takes down these groups only, never the default group
   that reports the failure to every rank;
5. each receiver learns which of its slices arrive by broadcast over which set from the
   senders that broadcast to it, point to point over ``p2p``: a sender sends each of its
   fan-out receivers one integer per message it sends that receiver (in plan order, which both
   sides share: the set's index in ``sets``, or -1 for point-to-point); the receiver checks
   each set (it holds the sender first and the receiver).

Per rank: O(its own messages) to list its fan-outs and exchange their sets with its peers;
O(world + Σ distinct sets × their sizes) received by the gather (a flag per rank and the sets:
what every rank needs to create the groups anyway). Never the fan-outs of other ranks, and no
other rank's part of the plan is computed: a rollout rank of ``llama-8b`` on 4,096 ranks has 263
broadcasting senders, whose parts take 27 s to plan against 0.06 s for its side of the exchange
(``benchmarks/bench_transfer_groups.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from meshgroups._lifecycle import Closeable
from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh import (
    GroupCache,
    MeshGroups,
    Strategy,
    as_timedelta,
    collective_call,
    current_cohort,
    default_backend_name,
    default_timeout,
    init_mesh,
)
from meshgroups.transfer._plan.plan import Message, TransferPlan
from meshgroups.transfer._spec import Box

RouteKey = tuple[str, int, Box, int]


def fanouts(plan: TransferPlan | Sequence[Message], rank: int) -> dict[RouteKey, tuple[int, ...]]:
    """The fan-outs ``rank`` sends: one slice of one weight sent at one step to two or more
    other ranks, as ``{(weight, sender, box, step): (sender, *receivers sorted)}``. ``plan`` is
    the whole plan, ``rank``'s own (``plan_transfer(..., rank=rank)``) or its messages.

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Weight, plan_transfer
    >>> w = [Weight("w", (4,))]
    >>> fanouts(plan_transfer(Layout(tp=1), w, Layout(dp=3, rank_offset=1), w), 0)
    {('w', 0, ((0, 4),), 0): (0, 1, 2, 3)}

    Returns:
        The fan-outs, as above.
    """
    messages = plan.for_rank(rank) if isinstance(plan, TransferPlan) else plan
    receivers: dict[RouteKey, list[int]] = {}
    for m in messages:
        if m.src == rank and m.dst != rank:
            receivers.setdefault((m.weight, m.src, m.box, m.step), []).append(m.dst)
    return {key: (key[1], *sorted(dsts)) for key, dsts in receivers.items() if len(dsts) > 1}


def plan_identity(plan: TransferPlan) -> str:
    """What every rank's plan must share (whole or a rank's part): the layouts' fingerprints,
    the node size and a digest of the weights (canonical JSON, so dict order does not count).

    Args:
        plan: a plan, whole or a rank's part.

    Returns:
        A string, equal on every rank that holds a part of the same plan.
    """
    weights = json.dumps([[s.to_dict(), d.to_dict()] for s, d in plan.weights], sort_keys=True, default=str)
    digest = hashlib.sha256(weights.encode()).hexdigest()[:16]
    return (
        f"src={plan.src.fingerprint()} dst={plan.dst.fingerprint()} node={plan.node_size} "
        f"weights={len(plan.weights)}#{digest}"
    )


def exchange_routes(
    own: dict[RouteKey, tuple[int, ...]],
    mine: Sequence[Message],
    me: int,
    sets: Sequence[tuple[int, ...]],
    group: dist.ProcessGroup,
    device: torch.device,
    timeout: timedelta,
) -> dict[RouteKey, tuple[int, ...]]:
    """The fan-outs ``me`` receives, told by their senders over ``group`` (see the module
    docstring, step 5); ``own`` are the fan-outs ``me`` sends, ``mine`` its messages.

    Args:
        own: the fan-outs ``me`` sends.
        mine: ``me``'s messages.
        me: this rank.
        sets: every fan-out set, the same list on every rank.
        group: the point-to-point group.
        device: where the integers travel (a CUDA device on NCCL).
        timeout: bounds the exchange.

    Returns:
        ``{(weight, sender, box, step): ranks}`` for the fan-outs ``me`` receives.

    Raises:
        MeshConfigError: a sender's set does not name it and ``me``.
    """
    index = {ranks: i for i, ranks in enumerate(sets)}
    told = sorted({r for ranks in own.values() for r in ranks[1:]})  # receivers of my fan-outs
    out: dict[int, list[int]] = {r: [] for r in told}
    for m in mine:
        if m.src == me and m.dst in out:
            key = (m.weight, m.src, m.box, m.step)
            out[m.dst].append(index[own[key]] if key in own else -1)
    senders = sorted({ranks[0] for ranks in sets if ranks[0] != me and me in ranks[1:]})
    from_sender: dict[int, list[Message]] = {s: [] for s in senders}
    for m in mine:
        if m.dst == me and m.src in from_sender:
            from_sender[m.src].append(m)
    sends = {r: torch.tensor(v, dtype=torch.int64, device=device) for r, v in out.items()}
    recvs = {s: torch.empty(len(ms), dtype=torch.int64, device=device) for s, ms in from_sender.items()}
    ops = [dist.P2POp(dist.isend, t, r, group) for r, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, s, group) for s, t in recvs.items()]
    works = dist.batch_isend_irecv(ops) if ops else []
    for work in works:
        if work is not None and work.wait(timeout) is False:
            raise TimeoutError(f"rank {me}: a peer did not send its fan-out routes within {timeout}")
    routes: dict[RouteKey, tuple[int, ...]] = {}
    for s, ms in from_sender.items():
        for m, i in zip(ms, recvs[s].tolist()):
            if i < 0:
                continue
            ranks = sets[i] if i < len(sets) else ()
            if not ranks or ranks[0] != s or me not in ranks[1:]:
                raise MeshConfigError(
                    f"rank {me}: rank {s} says {m.weight!r} {m.box} arrives over set #{i} {ranks}, which is not "
                    f"rank {s} sending to rank {me}; the ranks passed different plans (pass parts of one plan)"
                )
            routes[(m.weight, m.src, m.box, m.step)] = ranks
    return routes


_MOD = (1 << 61) - 1


def _message_hash(m: Message) -> int:
    text = f"{m.weight}|{m.src}|{m.dst}|{m.box}|{m.step}|{m.nbytes}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % _MOD


def message_sums(mine: Sequence[Message], me: int) -> tuple[int, int]:
    """Sums (mod 2^61 - 1) of the hashes of the messages ``me`` sends and receives (local
    copies aside). Every message is in its sender's part and in its receiver's, so over all
    ranks the two sums are equal when the ranks hold parts of one plan.

    Args:
        mine: the rank's messages.
        me: the rank.

    Returns:
        ``(sent, received)``.
    """
    sent = received = 0
    for m in mine:
        if m.src == m.dst:
            continue
        if m.src == me:
            sent = (sent + _message_hash(m)) % _MOD
        if m.dst == me:
            received = (received + _message_hash(m)) % _MOD
    return sent, received


def check_sums(sent: int, received: int) -> None:
    """The same verdict on every rank, from the gathered sums: what the ranks plan to send is
    what they plan to receive (else some send would pair with a different receive).

    Args:
        sent: the sum of every rank's sent-message hashes.
        received: the sum of every rank's received-message hashes.

    Raises:
        MeshConfigError: the sums differ (the ranks hold parts of different plans).
    """
    if sent != received:
        raise MeshConfigError(
            "the ranks' plans do not pair up: the messages they plan to send are not the messages "
            "they plan to receive (parts of different plans, e.g. plan_transfer called with other "
            "options on some rank); pass parts of one plan (the same arguments but rank)"
        )


def _device(device_type: str) -> torch.device:
    """Where this rank's small exchange tensors live (NCCL moves CUDA tensors only)."""
    if device_type in ("cpu", "meta"):
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


def _layers(sets: Sequence[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Pack equal-sized rank sets into layers of pairwise disjoint sets: each layer is one
    ``Layout.from_grid`` (rows = groups), one ``init_mesh`` call."""
    layers: list[tuple[int, set[int], list[tuple[int, ...]]]] = []
    for ranks in sorted(sets, key=lambda s: (len(s), s)):
        for size, used, rows in layers:
            if size == len(ranks) and used.isdisjoint(ranks):
                used.update(ranks)
                rows.append(ranks)
                break
        else:
            layers.append((len(ranks), set(ranks), [ranks]))
    return [rows for _, _, rows in layers]


class TransferGroups(Closeable):
    """Collective: one process group per fan-out rank set of ``plan`` (see the module
    docstring). Every rank passes its plan — whole or its own (``plan_transfer(..., rank=r)``),
    parts of one plan (the same ``plan_transfer`` arguments but ``rank``).

    Attributes:
        sets: every fan-out group's ranks (sender first, receivers sorted), the same list on
            every rank.
        routes: the fan-outs this rank takes part in (as sender or receiver):
            ``{(weight, sender, box, step): ranks}``.
        p2p: this rank's group for the point-to-point messages: every rank that sends or
            receives anything, a communicator of its own (never the default group), or ``None``.
        broken: ``None``, or why the groups may no longer be used (a transfer failed in its
            transfer stage: a timed-out send or receive takes the communicator down, and
            broadcasts may be out of step); ``execute`` refuses broken groups.

    The legacy ``WeightTransferGroupInitializer`` (one group of trainer rank 0 and every
    rollout rank) is the special case of a plan where one rank sends everything to all (in a
    world of 8 processes: not run here)::

        >>> groups = TransferGroups(plan)  # doctest: +SKIP
        >>> groups.sets  # doctest: +SKIP
        [(0, 4, 5, 6, 7)]
        >>> groups.group((0, 4, 5, 6, 7))  # this rank's group, or None  # doctest: +SKIP

    A colocated plan needs no group (a one-process world)::

        >>> import torch.distributed as dist
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import TransferGroups, Weight, plan_transfer
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> w = Weight("w", (4, 4))
        >>> with TransferGroups(plan_transfer(Layout(dp=1), [w], Layout(dp=1), [w])) as groups:
        ...     groups.sets, groups.p2p
        ([], None)
        >>> dist.destroy_process_group()

    Cost per rank: see the module docstring (its own messages and peers, the distinct sets).

    Raises (on every rank alike): TypeError (not a ``TransferPlan``), LayoutError (another rank's
    part), MismatchError (ranks hold different plans: ``argument == "plan"``), MeshConfigError
    (a sender's routes that do not fit the receiver's plan), and what ``init_mesh`` raises.

    Args:
        plan: the whole plan or this rank's part.
        cache: a ``GroupCache`` for the groups (default: one of their own).
        device_type: as for ``init_mesh``.
        backend: as for ``init_mesh``.
        timeout: as for ``init_mesh``.
        strategy: as for ``init_mesh``.
        check: as for ``init_mesh``.
    """

    def __init__(
        self,
        plan: TransferPlan,
        *,
        cache: GroupCache | None = None,
        device_type: str = "cpu",
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        strategy: Strategy = "auto",
        check: bool | None = None,
    ) -> None:
        self.cache = cache if cache is not None else GroupCache()
        self.sets: list[tuple[int, ...]] = []
        self.routes: dict[RouteKey, tuple[int, ...]] = {}
        self.broken: str | None = None
        #: this rank's group for point-to-point messages (``None`` on a rank that moves nothing)
        self.p2p: dist.ProcessGroup | None = None
        self._meshes: list[MeshGroups] = []
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        with collective_call("TransferGroups") as call:  # numbered before anything is checked
            if not isinstance(plan, TransferPlan):
                raise TypeError(f"plan must be a meshgroups.transfer.TransferPlan, got {type(plan).__name__}")
            wait = as_timedelta(timeout, default_timeout())
            me = dist.get_rank()
            mine = plan.for_rank(me)  # a LayoutError for another rank's part
            own = fanouts(mine, me)
            call.compare(plan=plan_identity(plan))
            call.agree({}, {}, timeout=wait)  # the first meeting: compared, a failure above shared
            sent, received = message_sums(mine, me)
            talks = any(m.src != m.dst for m in mine)
            mine_out = (sorted(set(own.values())), talks, sent, received)
            # Over the live ranks after a loss (a cohort): its group, never the world with a dead rank.
            cohort = current_cohort()
            over = cohort.group if cohort is not None else None
            order = list(cohort.members) if cohort is not None else list(range(dist.get_world_size()))
            gathered: list[tuple[list[tuple[int, ...]], bool, int, int] | None] = [None] * len(order)
            dist.all_gather_object(gathered, mine_out, group=over)
            parts = [part for part in gathered if part]
            check_sums(sum(p[2] for p in parts) % _MOD, sum(p[3] for p in parts) % _MOD)
            self.sets = sorted({tuple(s) for part in parts for s in part[0]})
            talking = [order[i] for i, part in enumerate(gathered) if part and part[1]]
            self.routes = dict(own)
            try:
                self.p2p = self._p2p_group(talking, device_type, backend, timeout, strategy, check)
                if self.p2p is not None:  # a failure here reaches every rank at the next meeting
                    self.routes.update(
                        exchange_routes(own, mine, me, self.sets, self.p2p, _device(device_type), wait)
                    )
                for rows in _layers(self.sets):  # each init_mesh joins this call (and meets)
                    mg = self._member_mesh(rows, device_type, backend, timeout, strategy, check)
                    ranks = mg.ranks("member")  # None: this rank is in none of these rows
                    if ranks is not None:
                        self._groups[tuple(ranks)] = mg.group("member")
            except BaseException:
                self.close()
                raise

    def _member_mesh(
        self,
        rows: Sequence[Sequence[int]],
        device_type: str,
        backend: str | None,
        timeout: timedelta | float | None,
        strategy: Strategy,
        check: bool | None,
        backend_override: Mapping[int | str, object] | None = None,
    ) -> MeshGroups:
        """One ``init_mesh`` (joining this call) whose ``member`` groups are ``rows`` (pairwise
        disjoint), recorded for ``close()``."""
        mg = init_mesh(
            Layout.from_grid(np.array(rows, dtype=np.int64), ("group", "member")),
            device_type,
            only=[("member",)],
            backend=backend,
            timeout=timeout,
            strategy=strategy,
            cache=self.cache,
            check=check,
            backend_override=backend_override,
            partial=True,  # the transfer groups hold the ranks that talk, not the world
        )
        self._meshes.append(mg)
        return mg

    def _p2p_group(
        self,
        talking: Sequence[int],
        device_type: str,
        backend: str | None,
        timeout: timedelta | float | None,
        strategy: Strategy,
        check: bool | None,
    ) -> dist.ProcessGroup | None:
        """A group over the ``talking`` ranks (every rank that sends or receives anything) for
        the point-to-point messages, never the default group (a backend override gives it a
        communicator of its own even when it spans the world): a send or receive that times out
        takes its communicator down (gloo closes every connection of its context, NCCL aborts),
        and the default group must survive that to tell every rank what failed."""
        if len(talking) < 2:
            return None
        override: dict[int | str, object] = {"member": backend or default_backend_name()}
        mg = self._member_mesh([talking], device_type, backend, timeout, strategy, check, override)
        if mg.ranks("member") is None:
            return None  # this rank neither sends nor receives
        group = mg.group("member")
        dist.barrier(group=group)  # its first call is every member's (NCCL asks that of p2p batches)
        return group

    def group(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """This rank's group over ``ranks`` (sender first, receivers sorted), or ``None``."""
        self._check_open("group()")
        return self._groups.get(tuple(ranks))

    def __len__(self) -> int:
        return len(self.sets)

    def _release(self) -> int:
        # close(): the groups no other mesh of the cache uses
        destroyed = sum(mg.close() for mg in self._meshes)
        self._meshes.clear()
        self._groups.clear()
        self.broken = self.broken or "closed"
        return destroyed

    def __enter__(self) -> TransferGroups:
        return self

    def __repr__(self) -> str:
        return f"TransferGroups({len(self.sets)} fan-out groups, {len(self._groups)} on this rank)"


__all__ = [
    "RouteKey",
    "TransferGroups",
    "check_sums",
    "exchange_routes",
    "fanouts",
    "message_sums",
    "plan_identity",
]
