"""How the ranks of a transfer agree: one small all-reduce per stage, and the p2p tags.

Between the stages of ``execute`` every rank contributes a failure flag, a digest of its
arguments and the next point-to-point tag it may use; one all-reduce (MAX) tells every rank who
failed, whether the digests agree, and the first tag of the call. A failure anywhere becomes
the same ``TransferError`` on every rank. Before the first bucket one more all-reduce checks
that the ranks' sends and receives pair up (:func:`check_pairing`).

**Liveness.** The exchange waits like every meshgroups wait (the liveness of ``meshgroups.mesh``): while
the all-reduce is pending, the other ranks' heartbeats are looked at every half second, so a
rank that exited or stopped responding ends the wait within seconds (the timeout stays the last
bound), and the ``TransferError`` names it (``ranks``, and how it went); a rank alive but late
is logged ("still waiting for ...") every ``report_every`` seconds.

**Tags.** Every execute call and every (bucket, step) of it sends and receives with its own
tag: ``first + 2 * bucket + step``, where ``first`` is the maximum over the ranks of their next
free tag, agreed at the check before the first bucket. Each rank then moves its next free tag
past the call's last one, so tags only grow across calls on every rank: a receive posted by a
failed call (its peer never sent) can never match a send of a later call or bucket, and a
retry cannot receive stale data. On gloo a tag is the matching key of a point-to-point
operation; NCCL ignores tags (see ``execute``'s notes on what to do after a failure there).
Tags wrap after 2^31 - 2 steps of one process (``TAG_SPACE``).

    >>> step_tag(5, bucket=0, step=1), step_tag(5, bucket=1, step=0)
    (6, 7)
    >>> step_tag(TAG_SPACE, bucket=0, step=1)  # wrapped
    1
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshgroups.errors import RanksGoneError, TransferError
from meshgroups.mesh import Liveness, Lookout, default_store, gone_error, world_liveness

if TYPE_CHECKING:
    from meshgroups.transfer._run.buckets import Part

#: Tags live in [1, TAG_SPACE]; gloo takes non-negative 32-bit ints.
TAG_SPACE = 2**31 - 2
# The next tag this process may use (monotone; agreed by MAX across ranks at each call). One
# number per process: tags must differ across *all* calls between a pair of ranks.
_next_tag = [1]
_PAIRING_MOD = 1 << 40  # per-rank sums below it: a world of 2^23 ranks sums within int64


def next_tag() -> int:
    """This process's next free point-to-point tag (what it proposes at a call's check)."""
    return _next_tag[0]


def claim_tags(first: int, buckets: int) -> None:
    """Move this process's next free tag past a call starting at ``first`` with ``buckets``
    buckets (two steps each)."""
    _next_tag[0] = max(_next_tag[0], step_tag(first, buckets, 0))


def step_tag(first: int, bucket: int, step: int) -> int:
    """The tag of ``(bucket, step)`` of a call whose first tag is ``first``."""
    return 1 + (first - 1 + 2 * bucket + step) % TAG_SPACE


class Status:
    """One small all-reduce (MAX) over the status group: who failed, whether all agree, the
    largest tag proposed."""

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        self.group, self.timeout = group, timeout
        self.ranks = dist.get_process_group_ranks(group)
        self.size = len(self.ranks)
        self.me = self.ranks.index(dist.get_rank())
        # NCCL reduces CUDA tensors only; everything else takes CPU ones
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.liveness: Liveness | None = None
        try:
            self.liveness = world_liveness(default_store())
        except (RuntimeError, ValueError, AttributeError):  # no store to look through (fake backend)
            pass

    def wait(self, work: dist.Work, bound: timedelta, what: str) -> None:
        """Wait for ``work`` up to ``bound``, looking at the other ranks' liveness meanwhile;
        raises ``RanksGoneError`` when one is gone, ``TimeoutError`` at the bound, and the
        work's own error."""
        started = time.monotonic()
        deadline, pause = started + bound.total_seconds(), 0.0005
        lookout = self._lookout(what, started, bound)
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"a rank did not reach {what} within {bound}")
            gone = lookout.gone() if lookout is not None else {}
            if gone:
                raise gone_error(dist.get_rank(), gone, f"never answered {what}")
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, 0.02)
        work.wait()  # its own error, if it failed (a peer's connection closed)

    def _lookout(self, what: str, started: float, bound: timedelta) -> Lookout | None:
        if self.liveness is None:
            return None
        liveness, me = self.liveness, dist.get_rank()
        others = [r for r in self.ranks if r != me]
        return Lookout(
            others,
            what,
            me,
            lambda ranks: liveness.gone(ranks),
            liveness.report_every,
            started,
            bound,
            liveness.unseen,
        )

    def gone(self) -> dict[int, str]:
        """The ranks of the status group that are gone, looked for up to a lease (after a
        failed exchange: a peer's closed connection is seen before its heartbeat stops)."""
        if self.liveness is None:
            return {}
        me = dist.get_rank()
        deadline = time.monotonic() + self.liveness.lease + 1.0
        while True:
            try:
                gone = self.liveness.gone([r for r in self.ranks if r != me])
            except dist.DistError:
                return {}  # the store is unreachable (its host ended): nothing more to learn
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.25)

    def exchange(
        self, failed: bool, digest: int = 0, tag: int = 0, timeout: timedelta | None = None
    ) -> tuple[list[int], bool, int]:
        """Failed ranks (global), whether every rank gave the same ``digest``, the largest
        ``tag``; waits at most ``timeout`` (default: the status timeout)."""
        t = torch.zeros(self.size + 3, dtype=torch.int64, device=self.device)
        t[self.me] = int(failed)
        t[self.size], t[self.size + 1], t[self.size + 2] = digest, -digest, tag
        bound = timeout if timeout is not None else self.timeout
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if work is not None:
            self.wait(work, bound, "the status exchange of a weight transfer")
        flags = t.tolist()
        failed_ranks = [self.ranks[i] for i in range(self.size) if flags[i]]
        return failed_ranks, flags[self.size] == -flags[self.size + 1], int(flags[self.size + 2])

    def sums(self, values: list[int]) -> list[int]:
        """Each of ``values`` summed over the status group (one small all-reduce)."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        if work is not None:
            self.wait(work, self.timeout, "the status exchange of a weight transfer")
        return [int(v) for v in t.tolist()]

    def reasons(self, error: BaseException | None) -> list[str | None]:
        mine = None if error is None else f"{type(error).__name__}: {error}"
        out: list[str | None] = [None] * self.size
        dist.all_gather_object(out, mine, group=self.group)
        return out


def agree(
    status: Status,
    error: BaseException | None,
    digest: int,
    bucket: int,
    stage: str,
    done: list[str],
    tag: int = 0,
    timeout: timedelta | None = None,
) -> int:
    """The status exchange: raise the same ``TransferError`` on every rank if any failed;
    otherwise return the largest ``tag`` proposed."""
    bound = timeout if timeout is not None else status.timeout
    try:
        failed, same, top = status.exchange(error is not None, digest, tag, bound)
    except Exception as exc:
        raise no_status(status, exc, f"in {where(bucket, stage)}", bucket, stage, tuple(done)) from (
            error or exc
        )
    if not failed and same:
        return top
    reasons = status.reasons(error)
    if failed:
        why = "; ".join(f"rank {r}: {reasons[status.ranks.index(r)]}" for r in failed)
    else:
        why = "ranks passed different plans, bucket sizes or transfer groups (their digests differ)"
    shown = f" ({', '.join(done[:4])}{', …' if len(done) > 4 else ''})" if done else ""
    raise TransferError(
        f"weight transfer failed in {where(bucket, stage)} — {why}. Complete on every rank: "
        f"{len(done)} weight(s){shown}; the others may be partly written",
        tuple(failed),
        bucket,
        stage,
        tuple(done),
    ) from error


def check_pairing(status: Status, parts: Mapping[int, Sequence[Part]], me: int) -> None:
    """Every send pairs with a receive: the hashes of the slices the ranks send and of those
    they receive sum to the same over the status group (one all-reduce; the same verdict on
    every rank). Parts of different plans — other ``plan_transfer`` options on some rank, which
    the digest cannot see — fail here, before any data moves, instead of pairing wrong data.

    Args:
        status: the agreements' group and wait.
        parts: this rank's parts by bucket.
        me: this rank.

    Raises:
        TransferError: (stage ``"check"``, on every rank) the sums differ, or a rank did not
            answer.
    """
    sent = received = 0
    for ps in parts.values():
        for p in ps:
            if p.src == p.dst:
                continue
            text = f"{p.key}|{p.dst}|{p.box}"
            h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % _PAIRING_MOD
            if p.src == me:
                sent = (sent + h) % _PAIRING_MOD
            if p.dst == me:
                received = (received + h) % _PAIRING_MOD
    try:
        total_sent, total_received = status.sums([sent, received])
    except Exception as exc:
        raise TransferError(
            f"weight transfer: rank {me} got no status from every rank in {where(-1, 'check')} "
            f"({type(exc).__name__}: {exc}); a rank is gone or stuck",
            (),
            -1,
            "check",
            (),
        ) from exc
    if (total_sent - total_received) % _PAIRING_MOD:
        raise TransferError(
            "weight transfer failed in the check before the first bucket — the ranks' plans do not pair "
            "up: the slices they plan to send are not the slices they plan to receive (parts of different "
            "plans, e.g. plan_transfer called with other options on some rank); nothing was moved",
            (),
            -1,
            "check",
            (),
        )


def no_status(
    status: Status, exc: BaseException, when: str, bucket: int, stage: str, done: tuple[str, ...]
) -> TransferError:
    """The ``TransferError`` of an exchange that did not complete: naming the ranks gone
    (``ranks``) when liveness knows them (a peer's closed connection is seen first: its
    heartbeat is looked for, up to a lease), else what the exchange raised (a timeout: the
    ranks were alive throughout the wait)."""
    if isinstance(exc, RanksGoneError):
        gone = exc.states
    elif isinstance(exc, TimeoutError):
        # the wait watched liveness throughout and saw nobody gone: the timeout is the news (a
        # rank that ends after it, its own call failed too, is a consequence, not the cause)
        gone = {}
    else:
        gone = status.gone()
    if gone:
        how = ", ".join(f"rank {r} {state}" for r, state in sorted(gone.items()))
        return TransferError(
            f"weight transfer: rank {dist.get_rank()} got no status from every rank {when}: {how}",
            tuple(sorted(gone)),
            bucket,
            stage,
            done,
        )
    return TransferError(
        f"weight transfer: rank {dist.get_rank()} got no status from every rank {when} "
        f"({type(exc).__name__}: {exc}); a rank is gone or stuck",
        (),
        bucket,
        stage,
        done,
    )


def where(bucket: int, stage: str) -> str:
    """How a ``TransferError`` names the place of a failure.

    Args:
        bucket: the bucket's index, or -1 for the check before the first bucket.
        stage: the stage within the bucket.

    Returns:
        The words, e.g. ``"bucket 2 (transfer)"``.
    """
    return "the check before the first bucket" if bucket < 0 else f"bucket {bucket} ({stage})"


__all__ = [
    "TAG_SPACE",
    "Status",
    "TransferError",
    "agree",
    "check_pairing",
    "claim_tags",
    "next_tag",
    "no_status",
    "step_tag",
    "where",
]
