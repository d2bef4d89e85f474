"""Move real tensors along a plan: the trainer's local shards into the rollout's local buffers.

``execute`` is collective over the default group (every rank calls it, a rank with no part
passes empty mappings)::

    >>> plan = plan_transfer(trainer, weights, rollout, rollout_weights)  # doctest: +SKIP
    >>> execute(plan, {"wq": trainer_shard}, {"wq": rollout_buffer}, bucket_bytes=64 << 20)  # doctest: +SKIP

Buckets are the same on every rank (``buckets.Buckets``: weights in plan order, big ones cut
into row blocks, packed by full size), so a rank stages about one bucket at a time. Before the
first bucket every rank checks its inputs against its boxes, and the ranks check that their
sends and receives pair up (``pairing.check_pairing``). Per bucket: prepare (views and
staging buffers of both steps), agree that every rank is ready (one small all-reduce), step 0
(sources send; colocated ranks copy locally), write into the buffers, step 1 (forwards inside a
node, sent from the buffers just written), agree that every rank finished, call ``progress``
and agree that it returned everywhere. With ``groups`` (``TransferGroups``), one-to-one slices
go point-to-point over ``groups.p2p`` and a fan-out as one broadcast over its group; without,
every slice goes point-to-point on the default group. The agreements always run on the default
group (or ``group=``). Any failure on any rank — a bad input, a failed or timed-out send, an
exception from ``progress`` — becomes a ``TransferError`` on every rank, naming the rank and its
reason; weights are reported done only once every rank has them complete.

**Casting.** When a plan pairs a source weight with a destination of another dtype (a mapped
plan with ``cast=``, see ``plan_transfer``), the sender casts each slice to the destination's
dtype once, into its staging buffer, before it is sent (fp32 → bf16: half the bytes on the
link); forwards inside a node resend the cast bytes; a local copy casts as it copies. Every
element equals ``tensor.to(dtype)`` bit for bit (tested).

**Retrying after a failure in the transfer stage.** A rank may fail while its peers' sends and
receives are posted (a rank that never posted its part, a timeout). Those operations stay
pending, and a send or receive that times out takes its communicator down (gloo closes every
connection of the group's context; NCCL aborts). Hence: point-to-point operations carry a tag
of their own per call and per (bucket, step) (``status``: tags only grow), so on gloo a pending
operation of a failed call never matches one of a later bucket or of a retry (tested); the
``TransferGroups`` of a failed transfer are marked ``broken`` and refused by later calls —
build new ones (``groups.close()``, then ``job.transfer_groups(plan)``: fresh communicators)
and retry at once (tested); the default group, which carried only the agreements, still
works. Without ``groups`` the point-to-point messages share the default group, and a timeout
there leaves it unusable. NCCL ignores tags: after a ``TransferError`` whose ``stage`` is
``"transfer"`` on NCCL, destroy the transfer groups and never reuse them; if the default group
carried point-to-point messages (no ``groups``), abort its communicator
(``TORCH_NCCL_ASYNC_ERROR_HANDLING`` does so) and re-initialise, or restart the processes.

The code only uses tensors' own devices (staging lives where the tensor lives) and torch's
backend-neutral calls, so NCCL with CUDA tensors takes the same path; CI here runs gloo only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshgroups.errors import MeshConfigError
from meshgroups.layout.core import Layout
from meshgroups.mesh.cohort import current_cohort
from meshgroups.mesh.plan import as_timedelta
from meshgroups.mesh.torch_seam import default_timeout
from meshgroups.transfer.buckets import Buckets, Part, parts_by_bucket
from meshgroups.transfer.packing import PackBuffers, land, pack
from meshgroups.transfer.pairing import check_pairing
from meshgroups.transfer.spec import Box, Weight
from meshgroups.transfer.status import Status, TransferError, agree, claim_tags, next_tag, step_tag

if TYPE_CHECKING:
    from meshgroups.transfer.jobs import TransferGroups
    from meshgroups.transfer.plan import Plan

#: Default bucket: 64 MiB of full weight size.
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Progress:
    """Handed to ``progress`` after each bucket, once every rank has finished it.

    Attributes:
        bucket: buckets finished so far (1-based).
        buckets: the number of buckets.
        weights_done: the weights now complete on every rank (this bucket's).
        bytes_done: this rank's bytes sent, received or copied so far.
        bytes_total: this rank's bytes in all.
    """

    bucket: int  # buckets finished so far (1-based)
    buckets: int
    weights_done: tuple[str, ...]  # weights now complete on every rank (this bucket's)
    bytes_done: int  # this rank's bytes sent, received or copied so far
    bytes_total: int


@dataclass
class Report:
    """What ``execute`` did on this rank.

    Attributes:
        buckets: the number of buckets.
        messages: this rank's sends, receives and local copies (after bucketing).
        bytes_sent: bytes this rank sent.
        bytes_received: bytes this rank received.
        bytes_copied: bytes this rank copied locally.
        broadcasts: the broadcasts this rank took part in.
        weights: the weights written on this rank.
        p2p_messages: the point-to-point messages this rank posted (sends and receives): with
            packing one per peer, direction and step of a bucket, else one per slice.
    """

    buckets: int = 0
    messages: int = 0  # this rank's sends, receives and local copies (after bucketing)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    broadcasts: int = 0
    weights: tuple[str, ...] = field(default_factory=tuple)
    p2p_messages: int = (
        0  # point-to-point messages posted (sends and receives; one per peer and step when packed)
    )


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


class _Local:
    """This rank's tensors, checked against its boxes; views by global box."""

    def __init__(self, me: int, pairs: Sequence[tuple[Weight, Weight]], src: Layout, dst: Layout) -> None:
        self.me, self.pairs, self.src, self.dst = me, pairs, src, dst
        self.tensors: dict[tuple[str, int], tuple[torch.Tensor, Box]] = {}

    def take(self, side: str, w: int, tensors: Mapping[str, Any]) -> None:
        weight = self.pairs[w][0 if side == "src" else 1]
        what = "src_tensors" if side == "src" else "dst_buffers"
        box = weight.box(self.src if side == "src" else self.dst, self.me)
        if box is None:  # the plan never asks this; a mismatched plan would
            raise MeshConfigError(
                f"rank {self.me} holds no {side} shard of {weight.name!r} but the plan uses one"
            )
        if weight.name not in tensors:
            raise MeshConfigError(f"{what} has no {weight.name!r}; rank {self.me} holds its box {box}")
        t = tensors[weight.name]
        if hasattr(t, "to_local"):  # a DTensor: its local shard
            t = t.to_local()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{weight.name!r}] must be a torch.Tensor, got {type(t).__name__}")
        need = tuple(b - a for a, b in box)
        if tuple(t.shape) != need:
            raise MeshConfigError(
                f"{what}[{weight.name!r}] on rank {self.me} has shape {tuple(t.shape)}, but its box {box} "
                f"needs {need}"
            )
        wire = self.pairs[w][1].dtype
        # A source may come already in the wire dtype (block fp8: quantized by the caller).
        if _dtype_name(t) != weight.dtype and not (side == "src" and _dtype_name(t) == wire):
            raise MeshConfigError(
                f"{what}[{weight.name!r}] on rank {self.me} is {_dtype_name(t)}, the plan says {weight.dtype}"
            )
        self.tensors[(side, w)] = (t, box)

    def view(self, side: str, w: int, box: Box) -> torch.Tensor:
        t, own = self.tensors[(side, w)]
        return t[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(box, own))]

    def wire(self, w: int) -> torch.dtype | None:
        """The dtype weight ``w`` crosses links in when it differs from the source's (the
        destination's: a mapped plan with a cast), else ``None``."""
        src, dst = self.pairs[w]
        given = self.tensors.get(("src", w))
        if src.dtype == dst.dtype or (given is not None and _dtype_name(given[0]) == dst.dtype):
            return None
        return getattr(torch, dst.dtype)


def _digest(pairs: Sequence[tuple[Weight, Weight]], src: Layout, dst: Layout, extra: object) -> int:
    text = repr(([(s, d) for s, d in pairs], src.fingerprint(), dst.fingerprint(), extra))
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


@dataclass
class _Step:
    """One step of one bucket on this rank, prepared: every view taken and staging buffer
    allocated, so what can fail locally fails before any rank moves data."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src) local
    fills: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, view) to send
    p2p: list[tuple[bool, torch.Tensor, int]] = field(default_factory=list)  # (is send, tensor, peer)
    casts: list[tuple[tuple[int, ...], int, Box, int, torch.Tensor]] = field(default_factory=list)
    landing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, dst view)
    messages: int = 0  # point-to-point messages posted (after packing)


def _staged(
    view: torch.Tensor, fills: list[tuple[torch.Tensor, torch.Tensor]], wire: torch.dtype | None = None
) -> torch.Tensor:
    """``view`` itself when contiguous and already in the ``wire`` dtype, else a staging buffer
    filled from it when the step runs (a forward's view is written at step 0, after this is
    prepared). A cast happens here, once, at the sender: ``copy_`` into a ``wire`` buffer is
    ``view.to(wire)`` bit for bit, and only the cast bytes cross the link."""
    if view.is_contiguous() and (wire is None or wire == view.dtype):
        return view
    staging = torch.empty(view.shape, dtype=wire or view.dtype, device=view.device)
    fills.append((staging, view))
    return staging


def _prepare(
    parts: Sequence[Part], local: _Local, groups: TransferGroups | None, report: Report, packed: bool = False
) -> _Step:
    """Sends and receives are ordered by (weight, box, sender, receiver) on both sides, so the
    point-to-point pairs match; a fan-out is one broadcast for its sender and each receiver.
    ``packed``: a point-to-point receive lands straight in its view (unpacked from the
    peer's one message, ``packing``), with no staging buffer of its own."""
    me, step = local.me, _Step()
    staged: dict[tuple[int, Box], torch.Tensor] = {}
    cast_seen: set[tuple[tuple[int, ...], int, Box]] = set()
    for p in sorted(parts, key=lambda p: (p.w, p.box, p.src, p.dst)):
        ranks = groups.routes.get(p.key) if groups is not None else None
        if ranks is not None and groups is not None and groups.group(ranks) is None:
            raise MeshConfigError(
                f"rank {me} has no transfer group over ranks {ranks}; rebuild TransferGroups"
            )
        if ranks is None and p.src != p.dst and groups is not None and groups.p2p is None:
            raise MeshConfigError(f"rank {me} is outside the TransferGroups' point-to-point group")
        if p.src == me and p.dst == me:
            # copy_ casts as .to() does when the plan's dtypes differ (colocated: no link)
            step.copies.append((local.view("dst", p.w, p.box), local.view("src", p.w, p.box)))
            report.bytes_copied += p.nbytes
        elif p.src == me:
            if (p.w, p.box) not in staged:  # a forward (step 1) re-sends what step 0 wrote
                if p.step == 0:  # from the source shard, cast to the wire dtype here
                    view, wire = local.view("src", p.w, p.box), local.wire(p.w)
                else:  # from the destination buffer, already in the wire dtype
                    view, wire = local.view("dst", p.w, p.box), None
                staged[(p.w, p.box)] = _staged(view, step.fills, wire)
            report.bytes_sent += p.nbytes
            if ranks is None:
                step.p2p.append((True, staged[(p.w, p.box)], p.dst))
            elif (ranks, p.w, p.box) not in cast_seen:
                cast_seen.add((ranks, p.w, p.box))
                step.casts.append((ranks, p.w, p.box, p.src, staged[(p.w, p.box)]))
        elif packed and ranks is None:
            step.p2p.append((False, local.view("dst", p.w, p.box), p.src))
            report.bytes_received += p.nbytes
        else:
            view = local.view("dst", p.w, p.box)
            buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            step.landing.append((buf, view))
            report.bytes_received += p.nbytes
            if ranks is None:
                step.p2p.append((False, buf, p.src))
            else:
                step.casts.append((ranks, p.w, p.box, p.src, buf))
    report.messages += len(parts)
    return step


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (same storage): gloo's collectives know no float8 dtype."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def _run(
    step: _Step,
    groups: TransferGroups | None,
    timeout: timedelta,
    tag: int,
    buffers: PackBuffers | None = None,
    key: object = None,
) -> int:
    """Post every send, receive and broadcast of a prepared step, wait (``timeout`` for the
    whole step), write the buffers. Point-to-point operations carry the step's ``tag``;
    broadcasts go in one order on every rank (by group, weight, box). With ``buffers``, the
    point-to-point slices go packed, one message per peer and direction (``packing``).
    Returns broadcasts made."""
    with torch.no_grad():  # buffers may be parameters (leaves that require grad)
        for dst_view, src_view in step.copies:
            dst_view.copy_(src_view)
        for staging, view in step.fills:
            staging.copy_(view)
    p2p = groups.p2p if groups is not None else None  # None: the default group
    messages: list[tuple[bool, torch.Tensor, int]] = step.p2p
    unpack: list[tuple[torch.Tensor, torch.Tensor]] = []
    if buffers is not None:
        with torch.no_grad():
            messages, unpack = pack(step.p2p, buffers, key)
    step.messages = len(messages)
    ops = [
        dist.P2POp(dist.isend if send else dist.irecv, _bytes(t), peer, p2p, tag)
        for send, t, peer in messages
    ]
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    for ranks, _, _, src, data in sorted(step.casts, key=lambda c: (c[0], c[1], c[2])):
        group = groups.group(ranks) if groups is not None else None
        works.append(dist.broadcast(_bytes(data), src=src, group=group, async_op=True))
    deadline = time.monotonic() + timeout.total_seconds()
    for work in works:
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        if work is not None and work.wait(left) is False:
            raise TimeoutError(f"a send or receive of rank {dist.get_rank()} did not finish within {timeout}")
    with torch.no_grad():
        for buf, view in step.landing:
            view.copy_(buf)
        for piece, view in unpack:
            land(piece, view)
    return len(step.casts)


def execute(
    plan: Plan,
    src_tensors: Mapping[str, Any],
    dst_buffers: Mapping[str, Any],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    progress: Callable[[Progress], object] | None = None,
    timeout: timedelta | float | None = None,
    groups: TransferGroups | None = None,
    group: dist.ProcessGroup | None = None,
    packed: bool = True,
    buffers: PackBuffers | None = None,
) -> Report:
    """Copy every destination shard of ``plan`` from the source shards (collective).

    Args:
        plan: the whole plan or this rank's (``plan_transfer(..., rank=dist.get_rank())``).
        src_tensors: ``{weight name: this rank's source shard}`` (a tensor of its box's shape, or
            a DTensor whose local shard it is); only the weights this rank sends are needed.
        dst_buffers: ``{weight name: this rank's destination buffer}``, written in place.
        bucket_bytes: full-weight bytes per bucket (see ``Buckets``); the same on every rank.
        progress: called after each bucket with a ``Progress``; an exception it raises fails
            the transfer on every rank before the next bucket.
        timeout: bound on each wait (seconds or timedelta): each status exchange, each step's
            sends and receives (the exchange after a bucket's transfer waits three times as
            long: a peer may use the bound in each of its two steps); default: the default
            group's.
        groups: ``TransferGroups`` of this plan: fan-outs go as broadcasts over them; without,
            every slice goes point-to-point.
        group: the ranks that take part and exchange status (default: the whole world, or the
            live ranks' group of the current cohort after a loss, ``meshgroups.mesh.cohort``).
        packed: the point-to-point slices of one step of a bucket go as one message per peer
            and direction (``meshgroups.transfer.packing``; same bytes); ``False``: one per
            slice. The same on every rank.
        buffers: where packed buffers are kept across calls (a ``PackBuffers``; ``WeightSync``
            keeps one); default: new ones for this call.

    Raises:
        TransferError: on every rank, when any rank failed (a bad input, a failed or timed-out
            transfer, ``progress``, ``broken`` transfer groups), naming the ranks and their
            reasons. After one in stage ``"transfer"`` an immediate retry is safe on gloo (new
            tags; rebuild ``groups``); on NCCL see the module docstring.
        RuntimeError: no default process group.

    Returns:
        This rank's ``Report``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("execute needs an initialised default process group (dist.init_process_group)")
    me = dist.get_rank()
    error: BaseException | None = None
    try:  # a bad argument on one rank is a TransferError on every rank, at the check
        wait = as_timedelta(timeout, default_timeout())
    except Exception as exc:
        error, wait = exc, default_timeout()
    if group is None:  # over a cohort of live ranks (after a loss): its group, not the world
        cohort = current_cohort()
        group = cohort.group if cohort is not None and cohort.group is not None else dist.group.WORLD
    status = Status(group, wait)  # type: ignore[arg-type]
    src, dst, pairs = plan.src, plan.dst, plan.weights
    report = Report()
    parts: dict[int, list[Part]] = {}
    buckets = Buckets(0, (), (), ())
    local = _Local(me, pairs, src, dst)
    try:
        if groups is not None and groups.broken:
            raise MeshConfigError(
                f"these TransferGroups cannot be used: {groups.broken}; build new ones "
                "(groups.close(), then job.transfer_groups(plan) or TransferGroups(plan))"
            )
        buckets = Buckets.of([d for _, d in pairs], bucket_bytes)
        index = {d.name: i for i, (_, d) in enumerate(pairs)}
        parts = parts_by_bucket(plan.for_rank(me), index, buckets)
        mine = [p for ps in parts.values() for p in ps]
        needs = {("src" if p.step == 0 and p.src == me else "dst", p.w) for p in mine}
        needs |= {("dst", p.w) for p in mine if p.src == p.dst == me}
        for side, w in sorted(needs):
            local.take(side, w, src_tensors if side == "src" else dst_buffers)
        report.weights = tuple(sorted({pairs[p.w][1].name for p in mine}))
    except Exception as exc:
        error = error or exc
    digest = _digest(pairs, src, dst, (bucket_bytes, None if groups is None else groups.sets, bool(packed)))
    total = sum(p.nbytes for ps in parts.values() for p in ps)
    done: list[str] = []
    # The check also agrees on this call's first p2p tag (the largest any rank proposes).
    first = agree(status, error, digest, -1, "check", done, tag=next_tag())
    check_pairing(status, parts, me)
    claim_tags(first, buckets.count)  # before any bucket: a failed call's tags stay used
    pack_bufs = (buffers if buffers is not None else PackBuffers()) if packed else None
    for b in range(buckets.count):
        steps: list[_Step] = []
        error = None
        try:
            for s in (0, 1):
                steps.append(
                    _prepare([p for p in parts.get(b, ()) if p.step == s], local, groups, report, packed)
                )
        except Exception as exc:
            error = exc
        agree(status, error, digest, b, "prepare", done)
        try:
            for s, step in enumerate(steps):
                report.broadcasts += _run(step, groups, wait, step_tag(first, b, s), pack_bufs, (b, s))
                report.p2p_messages += step.messages
        except Exception as exc:
            error = exc
        try:
            # A peer may spend up to `wait` in each of its two steps before it reports.
            agree(status, error, digest, b, "transfer", done, timeout=3 * wait)
        except TransferError:
            if groups is not None:  # a timed-out p2p closes its group; broadcasts may be out of step
                groups.broken = f"a transfer failed in bucket {b} while they carried it"
            raise
        report.buckets += 1
        finished = tuple(d.name for w, (_, d) in enumerate(pairs) if buckets.last_bucket(w) == b)
        done += finished
        if progress is not None:
            moved = report.bytes_sent + report.bytes_received + report.bytes_copied
            try:
                progress(Progress(b + 1, buckets.count, finished, moved, total))
            except Exception as exc:
                error = exc
            agree(status, error, digest, b, "progress", done)
    return report


__all__ = ["DEFAULT_BUCKET_BYTES", "Progress", "Report", "TransferError", "execute"]
