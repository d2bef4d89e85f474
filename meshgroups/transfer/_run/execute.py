"""Move real tensors along a plan: the trainer's local shards into the rollout's local buffers.

``execute`` is collective over the default group (every rank calls it, a rank with no part
passes empty mappings; its docstring shows it).

Buckets are the same on every rank (``buckets.Buckets``: weights in plan order, big ones cut
into row blocks, packed by full size), so a rank stages about two buckets at a time. Before the
first bucket every rank checks its inputs against its boxes, and the ranks check that their
sends and receives pair up (``status.check_pairing``). A bucket moves in two steps: step 0
(sources send; colocated ranks copy locally), written into the buffers, then step 1 (forwards
inside a node, sent from the buffers just written). Bucket 0 is prepared (views and staging
buffers) and agreed ready (one small all-reduce). Then, per bucket ``b``: the next bucket is
prepared and its step 0 posted — its bytes travel while this rank waits for and unpacks ``b`` —
then ``b``'s step 0 is finished, its step 1 run, and one agreement says every rank finished
``b`` (and prepared ``b + 1``); then ``progress`` is called and agreed. ``overlap=False`` runs
one bucket at a time (prepare, agree, step 0, step 1, agree). With ``groups``
(``TransferGroups``), one-to-one slices go point-to-point over ``groups.p2p`` and a fan-out as
one broadcast over its group; without, every slice goes point-to-point on the default group.
The agreements always run on the default group (or ``group=``). Any failure on any rank — a bad
input, a failed or timed-out send, an exception from ``progress`` — becomes a
``TransferError`` on every rank, naming the rank and its reason; weights are reported done only
once every rank has them complete. The steps themselves (prepare, post, finish) are
``meshgroups.transfer._run.steps``.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from meshgroups.errors import MeshConfigError, TransferError
from meshgroups.layout import Layout
from meshgroups.mesh import as_timedelta, current_cohort, default_timeout
from meshgroups.transfer._run.buckets import Buckets, Part, parts_by_bucket
from meshgroups.transfer._run.status import Status, agree, check_pairing, claim_tags, next_tag, step_tag
from meshgroups.transfer._run.steps import (
    LocalTensors,
    PackBuffers,
    Posted,
    Step,
    finish,
    parts_of_step,
    post,
    prepare,
)
from meshgroups.transfer._spec import Weight

if TYPE_CHECKING:
    from meshgroups.transfer._plan.plan import TransferPlan
    from meshgroups.transfer._run.jobs import TransferGroups

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
    """What ``execute`` did on this rank (``WeightSync.sync()`` returns one too)::

        >>> from meshgroups.transfer import Report
        >>> report = Report(buckets=1, messages=1, bytes_copied=24, weights=("w",))
        >>> report.bytes_sent + report.bytes_received + report.bytes_copied
        24

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
        delta: a delta sync's figures (``delta_codec.DeltaStats``: dense and sent bytes, their
            ratio, the refusals); ``None`` for a sync without ``delta=``.
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
    delta: Any = None  # DeltaStats of a delta sync (WeightSync(delta=...)), else None


def _digest(pairs: Sequence[tuple[Weight, Weight]], src: Layout, dst: Layout, extra: object) -> int:
    text = repr(([(s, d) for s, d in pairs], src.fingerprint(), dst.fingerprint(), extra))
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def execute(
    plan: TransferPlan,
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
    overlap: bool = True,
) -> Report:
    """Copy every destination shard of ``plan`` from the source shards (collective).

    Args:
        plan: the whole plan or this rank's (``plan_transfer(..., rank=dist.get_rank())``).
        src_tensors: ``{weight name: this rank's source shard}`` (a tensor of its box's shape, or
            a DTensor whose local shard it is); only the weights this rank sends are needed.
        dst_buffers: ``{weight name: this rank's destination buffer}``, written in place.
        bucket_bytes: full-weight bytes per bucket (see ``Buckets``); the same on every rank.
        progress: called after each bucket with a ``Progress``; an exception it raises fails
            the transfer on every rank before the next bucket completes.
        timeout: bound on each wait (seconds or timedelta): each status exchange, each step's
            sends and receives (the exchange after a bucket's transfer waits three times as
            long: a peer may use the bound in each of its two steps); default: the default
            group's.
        groups: ``TransferGroups`` of this plan: fan-outs go as broadcasts over them; without,
            every slice goes point-to-point.
        group: the ranks that take part and exchange status (default: the whole world, or the
            live ranks' group of the current cohort after a loss, ``meshgroups.mesh.Cohort``).
        packed: the point-to-point slices of one step of a bucket go as one message per peer
            and direction (same bytes); ``False``: one per slice. The same on every rank.
        buffers: where packed buffers are kept across calls (a ``PackBuffers``; ``WeightSync``
            keeps one); default: new ones for this call. Emptied when the call fails (a failed
            call's operations may still hold them).
        overlap: the next bucket's first step is prepared and posted before this bucket's
            receives are waited for and unpacked (two buckets staged at a time, one status
            exchange per bucket); ``False``: one bucket at a time, with a status exchange
            before and after each. The same on every rank.

    Raises:
        TransferError: on every rank, when any rank failed (a bad input, a failed or timed-out
            transfer, ``progress``, ``broken`` transfer groups), naming the ranks and their
            reasons. After one in stage ``"transfer"`` an immediate retry is safe on gloo (new
            tags; rebuild ``groups``); on NCCL a timed-out send may leave the communicator
            unusable: rebuild ``groups`` before retrying.
        RuntimeError: no default process group.

    Returns:
        This rank's ``Report``.

    A trainer and a rollout colocated on a one-process world (a local copy; in a job, every
    rank calls it with its own shards and buffers)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import Weight, execute, plan_transfer
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> w = Weight("w", (2, 3))
        >>> plan = plan_transfer(Layout(dp=1), [w], Layout(dp=1), [w])
        >>> buffer = torch.zeros(2, 3)
        >>> execute(plan, {"w": torch.ones(2, 3)}, {"w": buffer})
        Report(buckets=1, messages=1, bytes_sent=0, bytes_received=0, bytes_copied=24, broadcasts=0, weights=('w',), p2p_messages=0, delta=None)
        >>> buffer.sum().item()
        6.0
        >>> dist.destroy_process_group()
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
    local = LocalTensors(me, pairs, src, dst)
    try:
        buckets, parts = take_local(plan, me, local, groups, bucket_bytes, src_tensors, dst_buffers, report)
    except Exception as exc:
        error = error or exc
    extra = (bucket_bytes, None if groups is None else groups.sets, bool(packed), bool(overlap))
    digest = _digest(pairs, src, dst, extra)
    total = sum(p.nbytes for ps in parts.values() for p in ps)
    done: list[str] = []
    # The check also agrees on this call's first p2p tag (the largest any rank proposes).
    first = agree(status, error, digest, -1, "check", done, tag=next_tag())
    check_pairing(status, parts, me)
    claim_tags(first, buckets.count)  # before any bucket: a failed call's tags stay used
    pack_bufs = (buffers if buffers is not None else PackBuffers()) if packed else None
    run = _BucketRunner(parts, local, groups, report, pack_bufs, first, wait)
    try:
        for b in range(buckets.count):
            if overlap:
                run.overlapped(b, buckets.count, status, digest, done)
            else:
                run.one_at_a_time(b, status, digest, done)
            report.buckets += 1
            finished = tuple(d.name for w, (_, d) in enumerate(pairs) if buckets.last_bucket(w) == b)
            done += finished
            if progress is not None:
                moved = report.bytes_sent + report.bytes_received + report.bytes_copied
                error = None
                try:
                    progress(Progress(b + 1, buckets.count, finished, moved, total))
                except Exception as exc:
                    error = exc
                agree(status, error, digest, b, "progress", done)
    except TransferError:
        if pack_bufs is not None:  # a failed call's pending operations may still use them
            pack_bufs.clear()
        raise
    return report


def take_local(
    plan: TransferPlan,
    me: int,
    local: LocalTensors,
    groups: TransferGroups | None,
    bucket_bytes: int,
    src_tensors: Mapping[str, Any],
    dst_buffers: Mapping[str, Any],
    report: Report,
) -> tuple[Buckets, dict[int, list[Part]]]:
    """This rank's part of a transfer (``execute``'s and the delta's): the buckets, this rank's
    slices by bucket, and the local tensors they read and write, checked (``local.take``)."""
    if groups is not None and groups.broken:
        raise MeshConfigError(
            f"these TransferGroups cannot be used: {groups.broken}; build new ones "
            "(groups.close(), then job.transfer_groups(plan) or TransferGroups(plan))"
        )
    pairs = plan.weights
    buckets = Buckets.of([d for _, d in pairs], bucket_bytes)
    index = {d.name: i for i, (_, d) in enumerate(pairs)}
    parts = parts_by_bucket(plan.for_rank(me), index, buckets)
    mine = [p for ps in parts.values() for p in ps]
    needs = {("src" if p.step == 0 and p.src == me else "dst", p.w) for p in mine}
    needs |= {("dst", p.w) for p in mine if p.src == p.dst == me}
    for side, w in sorted(needs):
        local.take(side, w, src_tensors if side == "src" else dst_buffers)
    report.weights = tuple(sorted({pairs[p.w][1].name for p in mine}))
    return buckets, parts


class _BucketRunner:
    """Runs the buckets of one ``execute`` call on this rank (prepare, post, finish, agree); which
    slice goes in which bucket is ``Buckets``' (``buckets.py``), the same on every rank."""

    def __init__(
        self,
        parts: Mapping[int, Sequence[Part]],
        local: LocalTensors,
        groups: TransferGroups | None,
        report: Report,
        buffers: PackBuffers | None,
        first: int,
        wait: timedelta,
    ) -> None:
        self.parts, self.local, self.groups, self.report = parts, local, groups, report
        self.buffers, self.first, self.wait = buffers, first, wait
        self.ahead: tuple[int, Step, Posted | None] | None = None  # the next bucket's step 1, step 0 posted

    def _prepare(self, b: int) -> tuple[Step, Step]:
        """Both steps of bucket ``b`` on this rank."""
        packed = self.buffers is not None
        step0, step1 = (
            prepare(parts_of_step(self.parts, b, s), self.local, self.groups, self.report, packed)
            for s in (0, 1)
        )
        return step0, step1

    def _post(self, b: int, s: int, step: Step) -> Posted:
        posted = post(step, self.groups, step_tag(self.first, b, s), self.buffers, (b, s))
        self.report.p2p_messages += step.messages
        return posted

    def _finish(self, posted: Posted) -> None:
        self.report.broadcasts += finish(posted, self.wait)

    def _agree_transfer(
        self, status: Status, error: BaseException | None, digest: int, b: int, done: list[str]
    ) -> None:
        try:
            # A peer may spend up to `wait` in each of its two steps before it reports.
            agree(status, error, digest, b, "transfer", done, timeout=3 * self.wait)
        except TransferError:
            if self.groups is not None:  # a timed-out p2p closes its group; broadcasts may be out of step
                self.groups.broken = f"a transfer failed in bucket {b} while they carried it"
            raise

    def one_at_a_time(self, b: int, status: Status, digest: int, done: list[str]) -> None:
        """Prepare both steps, agree, run step 0 then step 1, agree."""
        error: BaseException | None = None
        steps: list[Step] = []
        try:
            steps = list(self._prepare(b))
        except Exception as exc:
            error = exc
        agree(status, error, digest, b, "prepare", done)
        try:
            for s, step in enumerate(steps):
                self._finish(self._post(b, s, step))
        except Exception as exc:
            error = exc
        self._agree_transfer(status, error, digest, b, done)

    def overlapped(self, b: int, count: int, status: Status, digest: int, done: list[str]) -> None:
        """Bucket ``b`` with bucket ``b + 1``'s step 0 in flight while ``b`` is unpacked.

        Bucket 0 is prepared and agreed as in :meth:`one_at_a_time`. Then, in every bucket:
        prepare and post ``b + 1``'s step 0 (its receives land in buffers of their own), finish
        ``b``'s step 0 (wait, unpack), run ``b``'s step 1 (forwards of what step 0 wrote), and
        one status exchange — which also carries a failure to prepare or post ``b + 1``, so no
        rank waits on a peer that never posted its part."""
        error: BaseException | None = None
        if b == 0:
            try:
                step0, step1 = self._prepare(0)
            except Exception as exc:
                error = exc
            agree(status, error, digest, 0, "prepare", done)
            try:
                self.ahead = (0, step1, self._post(0, 0, step0))
            except Exception as exc:
                error, self.ahead = exc, (0, step1, None)
        if self.ahead is None or self.ahead[0] != b:  # b's step 0 failed to post on this rank
            raise RuntimeError(f"execute: bucket {b} was not prepared (a broken sequence of buckets)")
        _, step1, posted0 = self.ahead
        self.ahead = None
        if b + 1 < count and error is None:
            try:
                nxt0, nxt1 = self._prepare(b + 1)
                self.ahead = (b + 1, nxt1, self._post(b + 1, 0, nxt0))
            except Exception as exc:
                error = exc  # reported with bucket b's agreement, before any rank waits on b + 1
        try:
            if posted0 is not None:  # None: its post failed here (error says so); peers learn it below
                self._finish(posted0)
                self._finish(self._post(b, 1, step1))
        except Exception as exc:
            error = error or exc
        self._agree_transfer(status, error, digest, b, done)


__all__ = ["DEFAULT_BUCKET_BYTES", "Progress", "Report", "TransferError", "execute", "take_local"]
