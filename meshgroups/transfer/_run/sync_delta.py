"""``WeightSync(delta=...)``'s move: the version agreed, then a dense sync that fills the
shadows, or a delta sync against them (``delta``).

Every rank offers the version it was asked for (``sync(version=n)``, or none), the version its
tensors hold and whether it has a shadow to send deltas from; one small all-reduce gives every
rank the same decision:

- the version: the one asked for (every rank the same, not older than any rank's), or one
  more than the newest any rank holds;
- dense when no sender has a base (the first sync, after a failure, after a re-plan) or every
  ``DeltaPolicy.dense_every`` versions: ``execute`` as without ``delta`` (overlapped, packed),
  then each sender keeps what it sent as its shadow (``fill_shadows``);
- else ``execute_delta``: each receiver's base checked, deltas where it holds the base, dense
  where it does not.

``WeightSync.sync()`` calls ``move(sync, src, dst, version=..., ...)``; its ``Report.delta``
says which it was and what it saved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from meshgroups.errors import VersionError
from meshgroups.mesh import as_timedelta, default_timeout
from meshgroups.transfer._run.delta import execute_delta, fill_shadows
from meshgroups.transfer._run.delta_codec import DeltaStats
from meshgroups.transfer._run.execute import Progress, Report, execute
from meshgroups.transfer._run.status import Status, no_status

if TYPE_CHECKING:
    from meshgroups.transfer._run.sync import WeightSync


def agree_version(
    proposal: int | None, held: int | None, has_base: bool, timeout: timedelta
) -> tuple[int, bool]:
    """``(version, any sender has a base)``, the same on every rank (one all-reduce over the
    default group).

    Raises:
        VersionError: ranks asked for different versions, or one older than what a rank holds
            (every rank alike, before anything moves).
        TransferError: a rank did not answer within ``timeout``, or exited or stopped
            responding before (named within seconds: ``ranks``).
    """
    if proposal is not None and (isinstance(proposal, bool) or not isinstance(proposal, int) or proposal < 1):
        bad = proposal
        proposal = -1  # every rank learns of it below
    else:
        bad = None
    p = 0 if proposal is None else proposal
    mine = torch.tensor([p, -p, (held if held is not None else 0) + 1, int(has_base)], dtype=torch.int64)
    # (watches the ranks' liveness while it waits; the default group exists: it is reduced over)
    status = Status(cast(dist.ProcessGroup, dist.group.WORLD), timeout)
    work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, async_op=True)
    if work is not None:
        try:
            status.wait(work, timeout, "the version agreement of a weight sync")
        except Exception as exc:
            raise no_status(status, exc, "agreeing the version", -1, "check", ()) from exc
    top, low, newest, any_base = (int(v) for v in mine.tolist())
    if top != -low:
        raise VersionError(
            f"ranks asked for different versions (sync(version=...) between {-low if low else None} and "
            f"{top or None}{'' if bad is None else f', {bad!r} here'}): every rank passes the same, an int >= 1, "
            "or none"
        )
    if top and top < newest - 1:  # the same again is allowed (a commit that failed after the bytes)
        raise VersionError(
            f"sync(version={top}) is older than version {newest - 1}, which a rank holds; versions never go "
            f"back: sync(version=n) with n >= {newest - 1}, or sync() for the next one"
        )
    return (top or newest), bool(any_base)


def move(
    sync: WeightSync,
    src: Mapping[str, torch.Tensor],
    dst: Mapping[str, torch.Tensor],
    *,
    version: int | None,
    progress: Callable[[Progress], object] | None,
    timeout: timedelta | float | None,
    wait: timedelta,
    packs: Any,
) -> Report:
    """One delta-mode move of ``sync`` (collective; see the module docstring). Updates
    ``sync.version`` and its shadows; on a failure forgets both (the next sync is dense).
    ``wait``: the sync's default bound; ``packs``: its kept packed buffers (``PackBuffers``).

    Raises:
        TransferError, VersionError: as ``WeightSync.sync``.
    """
    policy = sync.delta
    if policy is None:  # an invariant of WeightSync, not a check of user input
        raise RuntimeError("meshgroups internal error: a delta move without a DeltaPolicy")
    try:
        wait = as_timedelta(timeout, wait)
    except (TypeError, ValueError):  # execute refuses it next, on every rank alike
        wait = default_timeout()
    shadows = sync.shadows
    has_base = shadows.version is not None and len(shadows) > 0
    agreed, any_base = agree_version(version, sync.version, has_base, wait)
    dense = not any_base or (policy.dense_every is not None and agreed % policy.dense_every == 0)
    common: dict[str, Any] = dict(
        bucket_bytes=sync.bucket_bytes,
        progress=progress if progress is not None else sync.progress,
        timeout=timeout if timeout is not None else sync.timeout,
        groups=sync.groups,
    )
    try:
        if dense:
            report = execute(sync.plan, src, dst, buffers=packs, **common)  # type: ignore[arg-type]
            try:
                fill_shadows(sync.plan, src, dst, shadows, agreed)  # type: ignore[arg-type]
            except Exception:  # local: this rank then sends dense next time (its receivers see no base)
                shadows.clear()
            stats = DeltaStats(version=agreed, dense_bytes=report.bytes_sent, sent_bytes=report.bytes_sent)
            totals = torch.tensor([stats.dense_bytes, stats.sent_bytes], dtype=torch.int64)
            dist.all_reduce(totals)
            stats.total_dense, stats.total_sent = (int(v) for v in totals.tolist())
            report.delta = stats
        else:
            report = execute_delta(
                sync.plan,  # type: ignore[arg-type]
                src,
                dst,
                shadows,
                version=agreed,
                held=sync.version,
                policy=policy,
                **common,
            )
            shadows.version = agreed
    except BaseException:
        sync.forget()
        raise
    sync.version = agreed
    return report


def adopt(sync: WeightSync, other: WeightSync) -> bool:
    """Take ``other``'s shadows and version into ``sync`` (local) when both hold the same plan
    (the same pairs of weights on the same layouts): ``sync``'s next delta is then against what
    ``other`` last sent — checked by every receiver as always. Returns whether it did.

    >>> import torch
    >>> import torch.distributed as dist
    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import WeightSync, adopt
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> trainer, rollout = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    >>> with WeightSync(trainer, Layout(dp=1), rollout, Layout(dp=1), delta=True) as old:
    ...     old.sync().delta.version
    1
    >>> new = WeightSync(trainer, Layout(dp=1), rollout, Layout(dp=1), delta=True)
    >>> adopt(new, old), new.version  # new's next sync is version 2, a delta against old's shadows
    (True, 1)
    >>> new.close()
    0
    >>> dist.destroy_process_group()
    """
    if other.plan is None or sync.plan is None or other.plan.weights != sync.plan.weights:
        return False
    if (other.plan.src, other.plan.dst) != (sync.plan.src, sync.plan.dst):
        return False
    sync.shadows, sync.version = other.shadows, other.version
    return True


__all__ = ["adopt", "agree_version", "move"]
