"""``TransferGroups``: the only extra process groups a transfer needs — one per fan-out.

A fan-out is one slice of one weight that one rank sends at one step to two or more other
ranks; it goes as one broadcast over a group of exactly that sender and those receivers
(sender first, receivers sorted). One-to-one slices need no group (point-to-point on the
default group). Building the groups is one collective call (``collective_call("TransferGroups")``):

1. each rank lists the fan-outs it *sends*, from its own messages (``plan.for_rank(me)``);
2. the ranks compare the plan's identity (layouts' fingerprints, weights, node size) at a first
   meeting, so a rank holding another plan is a ``MismatchError`` on every rank, not wrong groups;
3. one ``all_gather_object`` of each sender's *distinct rank sets* — what every rank must know,
   since every rank makes the same group-creation calls — never the per-slice fan-outs;
4. each receiver derives locally which of its slices arrive by broadcast over which set: for
   each sender whose sets include it, that sender's part of the plan (``plan.for_rank(sender)``
   of a whole plan, ``plan_transfer(..., rank=sender)`` from a rank's plan), checked against its
   own messages from that sender;
5. the groups are created through ``init_mesh`` (equal-sized disjoint sets share one call),
   which joins this call: checked, deduplicated through the ``GroupCache``, released by
   ``close()``; plus one group over every rank that sends or receives anything, for the
   point-to-point messages (``p2p``; each rank's flag travels with its sets), so that a failed
   transfer takes down these groups only, never the default group that reports the failure to
   every rank.

Per rank: O(its own messages) to list its fan-outs; O(world + Σ distinct sets × their sizes)
received by the gather (a flag per rank and the sets: what every rank needs to create the
groups anyway); and, as a receiver of fan-outs, one rank part per distinct sender that includes
it (O(that sender's shards)). Never the per-slice fan-outs of other ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from .._torch_seam import default_backend_name, default_timeout
from ..collective import collective_call
from ..errors import MeshConfigError
from ..groups import GroupCache
from ..layout import Layout
from ..mesh import MeshGroups, init_mesh
from ..plan import as_timedelta
from ..strategies import Strategy
from ..topology import Topology
from .plan import Message, Plan, plan_transfer
from .spec import Box

RouteKey = tuple[str, int, Box, int]


def fanouts(plan: Plan | Sequence[Message], rank: int) -> dict[RouteKey, tuple[int, ...]]:
    """The fan-outs ``rank`` sends: one slice of one weight sent at one step to two or more
    other ranks, as ``{(weight, sender, box, step): (sender, *receivers sorted)}``. ``plan`` is
    the whole plan, ``rank``'s own (``plan_transfer(..., rank=rank)``) or its messages.

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Weight, plan_transfer
    >>> w = [Weight("w", (4,))]
    >>> fanouts(plan_transfer(Layout(tp=1), w, Layout(dp=3, rank_offset=1), w), 0)
    {('w', 0, ((0, 4),), 0): (0, 1, 2, 3)}
    """
    messages = plan.for_rank(rank) if isinstance(plan, Plan) else plan
    receivers: dict[RouteKey, list[int]] = {}
    for m in messages:
        if m.src == rank and m.dst != rank:
            receivers.setdefault((m.weight, m.src, m.box, m.step), []).append(m.dst)
    return {key: (key[1], *sorted(dsts)) for key, dsts in receivers.items() if len(dsts) > 1}


def plan_identity(plan: Plan) -> str:
    """What every rank's plan must share (whole or a rank's part): the layouts' fingerprints,
    the node size and a digest of the weights (canonical JSON, so dict order does not count)."""
    weights = json.dumps([[s.to_dict(), d.to_dict()] for s, d in plan.weights], sort_keys=True, default=str)
    digest = hashlib.sha256(weights.encode()).hexdigest()[:16]
    return (
        f"src={plan.src.fingerprint()} dst={plan.dst.fingerprint()} node={plan.node_size} "
        f"weights={len(plan.weights)}#{digest}"
    )


def sender_part(plan: Plan, sender: int) -> list[Message]:
    """``sender``'s messages: from the whole plan, or planned afresh from a rank's plan (its
    layouts, weights and node size; ``plan_transfer``'s other options at their defaults)."""
    if plan.rank is None or plan.rank == sender:
        return plan.for_rank(sender)
    pairs = plan.weights
    topology = Topology(node=plan.node_size) if plan.node_size > 1 else None
    part = plan_transfer(
        plan.src, [s for s, _ in pairs], plan.dst, [d for _, d in pairs], topology, rank=sender
    )
    return list(part.messages)


def received_routes(
    plan: Plan, me: int, mine: Sequence[Message], sets: Sequence[tuple[int, ...]]
) -> dict[RouteKey, tuple[int, ...]]:
    """The fan-outs ``me`` receives, derived locally from the senders' parts of the plan: only
    senders with a rank set that includes ``me`` are planned."""
    senders = sorted({s[0] for s in sets if s[0] != me and me in s[1:]})
    routes: dict[RouteKey, tuple[int, ...]] = {}
    for sender in senders:
        part = sender_part(plan, sender)
        theirs = [m for m in part if m.src == sender and m.dst == me]
        ours = [m for m in mine if m.src == sender and m.dst == me]
        if theirs != ours:
            raise MeshConfigError(
                f"rank {me}: its plan's messages from rank {sender} ({len(ours)}) differ from rank {sender}'s "
                f"part planned from the same layouts and weights ({len(theirs)}); a rank's plan made with "
                "non-default plan_transfer options cannot be matched: pass the whole plan to TransferGroups"
            )
        routes.update({key: ranks for key, ranks in fanouts(part, sender).items() if me in ranks})
    return routes


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


class TransferGroups:
    """Collective: one process group per fan-out rank set of ``plan`` (see the module
    docstring). Every rank passes its plan — whole or its own (``plan_transfer(..., rank=r)``).

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
    rollout rank) is the special case of a plan where one rank sends everything to all.

        >>> groups = TransferGroups(plan)                                  # doctest: +SKIP
        >>> groups.sets                                                     # doctest: +SKIP
        [(0, 4, 5, 6, 7)]
        >>> groups.group((0, 4, 5, 6, 7))  # this rank's group, or None    # doctest: +SKIP

    Cost per rank: see the module docstring (its own messages, the distinct sets, one part per
    sender that broadcasts to it).

    Raises (on every rank alike): TypeError (not a ``Plan``), LayoutError (another rank's
    part), MismatchError (ranks hold different plans: ``argument == "plan"``), MeshConfigError
    (a rank's plan that its senders' parts do not match), and what ``init_mesh`` raises.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        cache: GroupCache | None = None,
        device_type: str = "cpu",
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        strategy: Strategy = "global",
        check: bool | None = None,
    ) -> None:
        self.cache = cache if cache is not None else GroupCache()
        self.sets: list[tuple[int, ...]] = []
        self.routes: dict[RouteKey, tuple[int, ...]] = {}
        self.broken: str | None = None
        #: this rank's group for point-to-point messages (``None`` outside the plan's layouts)
        self.p2p: dist.ProcessGroup | None = None
        self._meshes: list[MeshGroups] = []
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        with collective_call("TransferGroups") as call:  # numbered before anything is checked
            if not isinstance(plan, Plan):
                raise TypeError(f"plan must be a meshgroups.transfer.Plan, got {type(plan).__name__}")
            wait = as_timedelta(timeout, default_timeout())
            me = dist.get_rank()
            mine = plan.for_rank(me)  # a LayoutError for another rank's part
            own = fanouts(mine, me)
            call.compare(plan=plan_identity(plan))
            call.agree({}, {}, timeout=wait)  # the first meeting: compared, a failure above shared
            talks = any(m.src != m.dst for m in mine)
            gathered: list[tuple[list[tuple[int, ...]], bool] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (sorted(set(own.values())), talks))
            self.sets = sorted({tuple(s) for part in gathered if part for s in part[0]})
            talking = [r for r, part in enumerate(gathered) if part and part[1]]
            self.routes = {**own, **received_routes(plan, me, mine, self.sets)}
            try:
                self.p2p = self._p2p_group(talking, device_type, backend, timeout, strategy, check)
                for rows in _layers(self.sets):  # each init_mesh joins this call (and meets)
                    layout = Layout.from_grid(np.array(rows, dtype=np.int64), ("group", "member"))
                    mg = init_mesh(
                        layout,
                        device_type,
                        only=[("member",)],
                        backend=backend,
                        timeout=timeout,
                        strategy=strategy,
                        cache=self.cache,
                        check=check,
                    )
                    self._meshes.append(mg)
                    ranks, group = mg.ranks("member"), mg.group("member")
                    if ranks is not None and group is not None:
                        self._groups[tuple(ranks)] = group
            except BaseException:
                self.close()
                raise

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
        mg = init_mesh(
            Layout.from_grid(np.array([talking], dtype=np.int64), ("group", "member")),
            device_type,
            only=[("member",)],
            backend=backend,
            timeout=timeout,
            strategy=strategy,
            cache=self.cache,
            check=check,
            backend_override={"member": backend or default_backend_name()},
        )
        self._meshes.append(mg)
        group = mg.group("member")
        if group is not None:  # its first call is every member's (NCCL asks that of p2p batches)
            dist.barrier(group=group)
        return group

    def group(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """This rank's group over ``ranks`` (sender first, receivers sorted), or ``None``."""
        return self._groups.get(tuple(ranks))

    def __len__(self) -> int:
        return len(self.sets)

    def close(self) -> int:
        """Destroy the groups (those no other mesh of the cache uses). Local, idempotent."""
        destroyed = sum(mg.close() for mg in self._meshes)
        self._meshes.clear()
        self._groups.clear()
        self.broken = self.broken or "closed"
        return destroyed

    def __enter__(self) -> TransferGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferGroups({len(self.sets)} fan-out groups, {len(self._groups)} on this rank)"


__all__ = ["RouteKey", "TransferGroups", "fanouts", "plan_identity", "received_routes", "sender_part"]
