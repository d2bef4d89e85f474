"""Delta sync: the plan of ``execute`` — same peers, same boxes, same buckets and steps — with
a payload of what changed since the version each receiver holds.

Per slice (a message cut to a bucket), the sender compares the wire values it would send
(after the name map's cut, the cast and the block-fp8 quantization: what the receiver holds)
with its shadow of what it last sent (``delta_codec.Shadows``) and sends the smallest of
dense, sparse positions or changed blocks (``delta_codec``); then it keeps the new values as
its shadow. The receiver writes the new values at the changed positions: bit for bit what a
dense copy writes. Collective, like ``execute``: ``execute_delta(plan, src, dst, shadows,
version=5, held=4)``.

**Before any byte moves** (the base check): every sender tells each of its receivers, per
slice, the version of its shadow and its digest (``delta_codec.digest``); each receiver
compares them with the version it holds and the digest of its own slice. A receiver whose
version differs (it missed a sync, it was restored or restarted) or whose values differ (a
failed transfer half-wrote them, someone wrote them) *refuses*: every rank learns which
receivers refused and why (one small all-reduce, and the reasons only when one did), and every
slice to a refusing receiver goes dense — never a delta on the wrong base. A sender without a
shadow for a slice sends it dense.

**Each step of each bucket** takes two rounds: the headers (``(mode, count, bytes)`` per slice,
one message per peer over the transfer groups' point-to-point group; a fan-out's header goes to
each of its receivers), then the payloads (one packed message per peer; a fan-out as one
broadcast over its group). No overlap of buckets (``execute`` overlaps them): a delta is small.
A failure anywhere is the same ``TransferError`` on every rank, as in ``execute``; the caller
then forgets every shadow (``WeightSync`` does), so the next sync is dense.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshgroups.errors import TransferError, VersionError
from meshgroups.mesh import as_timedelta, default_timeout
from meshgroups.transfer._run.buckets import Buckets, Part
from meshgroups.transfer._run.delta_codec import (
    DENSE,
    MODES,
    SPARSE,
    DeltaPolicy,
    DeltaStats,
    Shadows,
    apply,
    digest,
    encode,
)
from meshgroups.transfer._run.execute import Progress, Report, take_local
from meshgroups.transfer._run.status import TAG_SPACE, Status, agree, check_pairing, claim_tags, next_tag
from meshgroups.transfer._run.steps import LocalTensors, as_bytes, parts_of_step

if TYPE_CHECKING:
    from meshgroups.transfer._plan.plan import TransferPlan
    from meshgroups.transfer._run.fanout_groups import TransferGroups

_EMPTY = torch.empty(0, dtype=torch.uint8)
_HEAD = 3  # int64s per slice in a header: mode, count, payload bytes (and in a base check: version, digest)


def _tag(first: int, k: int) -> int:
    return 1 + (first - 1 + k) % TAG_SPACE


def _order(p: Part) -> tuple[Any, ...]:
    return (p.w, p.box, p.src, p.dst)


def execute_delta(
    plan: TransferPlan,
    src_tensors: Mapping[str, Any],
    dst_buffers: Mapping[str, Any],
    shadows: Shadows,
    *,
    version: int,
    held: int | None,
    policy: DeltaPolicy | None = None,
    bucket_bytes: int,
    progress: Callable[[Progress], object] | None = None,
    timeout: timedelta | float | None = None,
    groups: TransferGroups | None = None,
) -> Report:
    """Move ``plan`` as deltas (collective over the default group; see the module docstring).

    Args:
        plan, src_tensors, dst_buffers, bucket_bytes, progress, timeout, groups: as for
            ``execute``.
        shadows: this rank's shadow; read for the bases, updated with what is sent.
        version: the version this sync makes (``Report.delta.version``).
        held: the version this rank's destination tensors hold (``None``: unknown).
        policy: ``block`` and ``on_mismatch`` (default ``DeltaPolicy()``).

    Returns:
        This rank's ``Report`` with ``delta`` filled in.

    Raises:
        TransferError: as ``execute``, on every rank alike; the shadows are then partly new.
        VersionError: a receiver refused and ``policy.on_mismatch == "raise"`` (every rank,
            before any byte moved).
    """
    policy = policy or DeltaPolicy()
    me = dist.get_rank()
    error: BaseException | None = None
    try:
        wait = as_timedelta(timeout, default_timeout())
    except Exception as exc:
        error, wait = exc, default_timeout()
    status = Status(dist.group.WORLD, wait)  # type: ignore[arg-type]
    pairs = plan.weights
    report = Report()
    stats = DeltaStats(version=version, base=shadows.version)
    parts: dict[int, list[Part]] = {}
    buckets = Buckets(0, (), (), ())
    local = LocalTensors(me, pairs, plan.src, plan.dst)
    try:
        buckets, parts = take_local(plan, me, local, groups, bucket_bytes, src_tensors, dst_buffers, report)
    except Exception as exc:
        error = error or exc
    text = repr(([(s, d) for s, d in pairs], plan.src.fingerprint(), plan.dst.fingerprint(), bucket_bytes,
                 None if groups is None else groups.sets, "delta", policy.block))  # fmt: skip
    check = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    done: list[str] = []
    first = agree(status, error, check, -1, "check", done, tag=next_tag())
    check_pairing(status, parts, me)
    claim_tags(first, 2 * buckets.count + 1)  # 4 tags per bucket, 2 for the base check
    run = _Run(me, local, shadows, groups, report, stats, policy, wait)
    error = None
    reason: str | None = None
    try:
        reason = run.base_check(parts, held, _tag(first, 0))
    except Exception as exc:
        error = exc
    agree(status, error, check, -1, "delta check", done)
    run.refused, stats.refused, stats.reasons = _refusals(status, reason, me)
    if stats.refused and policy.on_mismatch == "raise":
        raise VersionError(
            "delta sync refused by its receivers (DeltaPolicy(on_mismatch='raise')); nothing moved: "
            + "; ".join(stats.reasons)
        )
    for b in range(buckets.count):
        error = None
        try:
            for s in (0, 1):
                run.step(parts_of_step(parts, b, s), _tag(first, 1 + 4 * b + 2 * s))
        except Exception as exc:
            error = exc
        try:
            agree(status, error, check, b, "transfer", done, timeout=3 * wait)
        except TransferError:
            if groups is not None:
                groups.broken = f"a delta transfer failed in bucket {b} while they carried it"
            raise
        report.buckets += 1
        finished = tuple(d.name for w, (_, d) in enumerate(pairs) if buckets.last_bucket(w) == b)
        done += finished
        if progress is not None:
            error = None
            moved = report.bytes_sent + report.bytes_received + report.bytes_copied
            try:
                progress(Progress(b + 1, buckets.count, finished, moved, moved))
            except Exception as exc:
                error = exc
            agree(status, error, check, b, "progress", done)
    stats.total_dense, stats.total_sent, stats.total_header = status.sums(
        [stats.dense_bytes, stats.sent_bytes, stats.header_bytes]
    )
    report.delta = stats
    return report


def _refusals(
    status: Status, reason: str | None, me: int
) -> tuple[set[int], tuple[int, ...], tuple[str, ...]]:
    """Who refused (one small all-reduce), and why (gathered only when someone did)."""
    try:
        refused, _, _ = status.exchange(reason is not None)
        if not refused:
            return set(), (), ()
        reasons: list[Any] = [None] * status.size
        dist.all_gather_object(reasons, reason, group=status.group)
    except Exception as exc:
        raise TransferError(
            f"delta sync: rank {me} got no answer from every rank after the base check ({type(exc).__name__}: "
            f"{exc}); a rank is gone or stuck",
            (),
            -1,
            "check",
            (),
        ) from exc
    return set(refused), tuple(refused), tuple(r for r in reasons if r)


class _Run:
    """One ``execute_delta`` call on this rank: the base check and the steps."""

    def __init__(self, me: int, local: LocalTensors, shadows: Shadows, groups: TransferGroups | None,
                 report: Report, stats: DeltaStats, policy: DeltaPolicy, wait: timedelta) -> None:  # fmt: skip
        self.me, self.local, self.shadows, self.groups = me, local, shadows, groups
        self.report, self.stats, self.policy, self.wait = report, stats, policy, wait
        self.p2p = groups.p2p if groups is not None else None
        self.refused: set[int] = set()

    def _route(self, p: Part) -> tuple[int, ...] | None:
        return self.groups.routes.get(p.key) if self.groups is not None else None

    def _exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], tag: int,
                  broadcasts: Sequence[tuple[tuple[int, ...], int, torch.Tensor]] = ()) -> None:  # fmt: skip
        """Post every send, receive and broadcast of one round, then wait (one bound for all)."""
        ops = [dist.P2POp(dist.isend, as_bytes(t), peer, self.p2p, tag) for peer, t in sorted(sends.items())]
        ops += [dist.P2POp(dist.irecv, as_bytes(t), peer, self.p2p, tag) for peer, t in sorted(recvs.items())]
        works: list[Any] = list(dist.batch_isend_irecv(ops)) if ops else []
        for ranks, src, data in broadcasts:
            group = self.groups.group(ranks) if self.groups is not None else None
            works.append(dist.broadcast(data, src=src, group=group, async_op=True))
        self.report.p2p_messages += len(ops)
        self.report.broadcasts += len(broadcasts)
        deadline = time.monotonic() + self.wait.total_seconds()
        for work in works:
            left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            if work is not None and work.wait(left) is False:
                raise TimeoutError(f"a send or receive of rank {self.me} did not finish within {self.wait}")

    # ------------------------------------------------------------------ the base check
    def base_check(self, parts: Mapping[int, Sequence[Part]], held: int | None, tag: int) -> str | None:
        """Senders send each receiver ``(version, digest)`` of their shadow per slice; this
        rank, as a receiver, checks them against what it holds. Returns its refusal."""
        out: dict[int, list[int]] = {}
        expect: dict[int, list[Part]] = {}
        digests: dict[tuple[Any, ...], tuple[int, int]] = {}
        ordered = sorted(
            (p for b in sorted(parts) for p in parts[b]), key=lambda p: (p.key[3], p.w, p.box, p.src, p.dst)
        )
        for p in ordered:
            if p.src == p.dst:
                continue
            if p.src == self.me:
                old = self.shadows.base(p.key, p.box)
                if old is None or self.shadows.version is None:
                    triple = [-1, 0, 0]
                else:
                    if (p.key, p.box) not in digests:
                        digests[(p.key, p.box)] = digest(old)
                    triple = [self.shadows.version, *digests[(p.key, p.box)]]
                out.setdefault(p.dst, []).extend(triple)
                self.stats.header_bytes += 8 * _HEAD
                self.stats.sent_bytes += 8 * _HEAD
            if p.dst == self.me:
                expect.setdefault(p.src, []).append(p)
        sends = {peer: torch.tensor(v, dtype=torch.int64) for peer, v in out.items()}
        recvs = {peer: torch.empty(_HEAD * len(ps), dtype=torch.int64) for peer, ps in expect.items()}
        self._exchange(sends, recvs, tag)
        for peer in sorted(expect):
            got = recvs[peer].view(-1, _HEAD).tolist()
            for p, (version, a, b) in zip(expect[peer], got):
                if version < 0:
                    continue  # the sender has no base: it sends this slice dense
                name = self.local.pairs[p.w][1].name
                if held is None:
                    return (f"rank {self.me} holds no known version (its tensors are of unknown origin, e.g. just "
                            f"allocated or restored); rank {p.src}'s delta is against version {version}")  # fmt: skip
                if held != version:
                    return (f"rank {self.me} holds version {held}, but rank {p.src}'s delta is against version "
                            f"{version} (a missed or extra sync)")  # fmt: skip
                if digest(self.local.view("dst", p.w, p.box)) != (a, b):
                    return (f"rank {self.me}: {name!r} {list(p.box)} is not version {version} as rank {p.src} sent "
                            "it (digests differ: the values were changed since)")  # fmt: skip
        return None

    # ------------------------------------------------------------------ one step
    def step(self, parts: Sequence[Part], tag: int) -> None:
        """One step of one bucket: local copies, then headers, then payloads, then apply."""
        parts = sorted(parts, key=_order)
        variants: dict[tuple[int, Any], set[bool]] = {}
        for p in parts:
            if p.src == self.me and p.dst != self.me:
                ranks = self._route(p)
                receivers = ranks[1:] if ranks is not None else (p.dst,)
                variants.setdefault((p.w, p.box), set()).add(not any(r in self.refused for r in receivers))
        encoded: dict[tuple[int, Any, bool], tuple[int, int, torch.Tensor]] = {}
        with torch.no_grad():
            for p in parts:
                if p.src == p.dst == self.me:  # colocated: a copy (casting as .to() does), no bytes
                    self.local.view("dst", p.w, p.box).copy_(self.local.view("src", p.w, p.box))
                    self.report.bytes_copied += p.nbytes
                elif (
                    p.src == self.me
                    and (p.w, p.box, True) not in encoded
                    and (p.w, p.box, False) not in encoded
                ):
                    cur = _current(self.local, p)
                    for use in sorted(variants[(p.w, p.box)]):
                        old = self.shadows.base(p.key, p.box) if use else None
                        encoded[(p.w, p.box, use)] = (
                            (DENSE, 0, cur.reshape(-1).view(torch.uint8))
                            if old is None
                            else encode(cur, old, self.policy.block)
                        )
                    self.shadows.store(p.key, p.key[2], p.box, cur)
        heads: dict[int, list[int]] = {}
        payloads: dict[int, list[torch.Tensor]] = {}
        fanouts: dict[tuple[Any, ...], tuple[tuple[int, ...], int, torch.Tensor | None, Part]] = {}
        expect: dict[int, list[Part]] = {}
        for p in parts:
            if p.src == p.dst:
                continue
            ranks = self._route(p)
            if p.src == self.me:
                receivers = ranks[1:] if ranks is not None else (p.dst,)
                mode, count, payload = encoded[(p.w, p.box, not any(r in self.refused for r in receivers))]
                heads.setdefault(p.dst, []).extend([mode, count, payload.numel()])
                self._count(p, mode, count, payload.numel())
                if ranks is None:
                    payloads.setdefault(p.dst, []).append(payload)
                else:
                    fanouts[(ranks, p.w, p.box)] = (ranks, p.src, payload, p)
            elif p.dst == self.me:
                expect.setdefault(p.src, []).append(p)
                if ranks is not None:
                    fanouts[(ranks, p.w, p.box)] = (ranks, p.src, None, p)
        sends = {peer: torch.tensor(h, dtype=torch.int64) for peer, h in heads.items()}
        recvs = {peer: torch.empty(_HEAD * len(ps), dtype=torch.int64) for peer, ps in expect.items()}
        self._exchange(sends, recvs, tag)
        headers = {(peer, p): tuple(recvs[peer].view(-1, _HEAD)[i].tolist()) for peer, ps in expect.items()
                   for i, p in enumerate(ps)}  # fmt: skip
        # payloads: one packed message per peer (point to point), one broadcast per fan-out
        send_bufs = {peer: torch.cat(ts) if len(ts) > 1 else ts[0] for peer, ts in payloads.items() if ts}
        recv_bufs: dict[int, torch.Tensor] = {}
        for peer, ps in expect.items():
            n = sum(headers[(peer, p)][2] for p in ps if self._route(p) is None)
            if n:
                recv_bufs[peer] = torch.empty(n, dtype=torch.uint8)
        broadcasts: list[tuple[tuple[int, ...], int, torch.Tensor]] = []
        landed: dict[tuple[Any, ...], torch.Tensor] = {}
        for key in sorted(fanouts):
            ranks, src, sent, p = fanouts[key]
            if sent is None:  # a receiver: the size its header said
                sent = landed[key] = torch.empty(headers[(src, p)][2], dtype=torch.uint8)
            if sent.numel():
                broadcasts.append((ranks, src, sent))
        self._exchange(
            {k: v for k, v in send_bufs.items() if v.numel()}, recv_bufs, _tag_next(tag), broadcasts
        )
        for peer, ps in expect.items():
            at = 0
            for p in ps:
                mode, count, nbytes = headers[(peer, p)]
                ranks = self._route(p)
                if ranks is not None:
                    piece = landed[(ranks, p.w, p.box)]
                elif nbytes:
                    piece, at = recv_bufs[peer][at : at + nbytes], at + nbytes
                else:  # unchanged: nothing crossed (a peer with nothing at all sends no message)
                    piece = _EMPTY
                apply(self.local.view("dst", p.w, p.box), int(mode), int(count), piece, self.policy.block)
                self.report.bytes_received += int(nbytes)
        self.report.messages += len(parts)

    def _count(self, p: Part, mode: int, count: int, nbytes: int) -> None:
        stats = self.stats
        stats.dense_bytes += p.nbytes
        stats.sent_bytes += nbytes + 8 * _HEAD
        stats.header_bytes += 8 * _HEAD
        kind = "unchanged" if mode == SPARSE and count == 0 else MODES[mode]
        stats.modes[kind] = stats.modes.get(kind, 0) + 1
        self.report.bytes_sent += nbytes + 8 * _HEAD


def _current(local: LocalTensors, p: Part) -> torch.Tensor:
    """The wire values of ``p`` this rank sends now (contiguous): at step 0 its source slice
    cast to the wire dtype, at step 1 (a forward) the destination slice step 0 wrote."""
    if p.step == 0:
        view, wire = local.view("src", p.w, p.box), local.wire(p.w)
        return view.to(wire) if wire is not None else view.contiguous()
    return local.view("dst", p.w, p.box).contiguous()


def _tag_next(tag: int) -> int:
    return 1 + tag % TAG_SPACE


def fill_shadows(plan: TransferPlan, src_tensors: Mapping[str, Any], dst_buffers: Mapping[str, Any],
                 shadows: Shadows, version: int) -> None:  # fmt: skip
    """After a dense ``execute`` of ``plan``: keep what this rank sent as its shadow, at
    ``version`` (local; every message it sends, each box once).

    Raises:
        MeshConfigError: tensors that do not fit the plan (as ``execute`` checks them).
    """
    me = dist.get_rank()
    pairs = plan.weights
    local = LocalTensors(me, pairs, plan.src, plan.dst)
    index = {d.name: i for i, (_, d) in enumerate(pairs)}
    shadows.clear()
    with torch.no_grad():
        for m in plan.for_rank(me):
            if m.src != me or m.dst == me:
                continue
            key = (m.weight, m.src, m.box, m.step)
            if key in shadows.tensors:
                continue
            w = index[m.weight]
            side = "src" if m.step == 0 else "dst"
            if (side, w) not in local.tensors:
                local.take(side, w, src_tensors if side == "src" else dst_buffers)
            part = Part(w, m.src, m.dst, m.box, m.step, key, m.nbytes)
            shadows.store(key, m.box, m.box, _current(local, part))
    shadows.version = version


__all__ = ["execute_delta", "fill_shadows"]
