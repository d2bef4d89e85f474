"""Who is lost: one verdict, decided once through the store, the same on every live rank.

When a guarded step fails on a rank (``Elastic.step()``), the rank publishes the failure and
*checks in* for the current epoch. The verdict is decided once, atomically:

- every check-in appends the rank to one store key (``roll``) by ``compare_set``; deciding is a
  ``compare_set`` that marks the same key ``closed``, with the rule that decided (so every rank
  that sees the roll closed reads the same ``why``). Every change of that key is one
  compare-and-set, so a check-in either lands before the decision (the rank is a survivor) or
  finds the key closed (the rank was declared lost: ``ExcludedError``) — never both, on no rank;
- a rank decides once every member has checked in (nobody lost), or every member still missing
  is gone by the liveness every meshgroups wait uses (``meshgroups.mesh._liveness``: exited, or
  its heartbeat stopped for ``stale_after`` seconds — dead, or stopped with SIGSTOP), or the
  verdict's timeout passed (the missing ranks hung). The lost ranks are the members missing
  from the closed roll.

A merely slow rank is never lost by some and alive by others: there is one roll. A rank that is
slow past the timeout is lost everywhere, and learns it when it checks in (``ExcludedError``).

Heartbeats are the process's own (``meshgroups.mesh._liveness.start_heartbeat``), on a thread
with a connection of their own: a rank blocked inside a gloo collective still beats (gloo waits
release the GIL), so only dead (or frozen) processes go stale. Staleness is judged by each
observer's own clock (a value that did not change for ``stale_after`` seconds), so clocks need
not agree; a rank that exited cleanly, or whose process is gone on this machine, is lost at once.

Store keys live under ``meshgroups/elastic/``; O(members) store operations per look at the
rules (every ``poll`` seconds, growing), one per read of the open roll (every 20 ms or sooner).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from meshgroups.errors import ExcludedError, StepAbortedError
from meshgroups.mesh import Heartbeat, Liveness, Staleness, heartbeat_key

KEY = "meshgroups/elastic"
_CLOSED = "closed\n"
_ABSENT = "\x00"
#: Seconds between two reads of an open roll (doubling from the first to the last).
_GLANCE, _GLANCE_MAX = 0.002, 0.02


@dataclass(frozen=True)
class Verdict:
    """The decision of one epoch: ``survivors`` (checked in) and ``lost`` (members that did
    not), ``why`` the rule that decided it, ``cause`` the first failure a rank published.
    ``agree_lost`` returns it, the same on every survivor::

        >>> import torch.distributed as dist
        >>> from meshgroups.elastic import agree_lost
        >>> verdict = agree_lost(dist.HashStore(), epoch=1, members=[0], rank=0, timeout=5.0, stale_after=5.0)
        >>> verdict.survivors, verdict.lost, verdict.why
        ((0,), (), 'every member reported')
    """

    epoch: int
    survivors: tuple[int, ...]
    lost: tuple[int, ...]
    why: str
    cause: str


def _key(epoch: int, name: str) -> str:
    return f"{KEY}/e{epoch}/{name}"


def publish_failure(
    store: dist.Store, epoch: int, rank: int, exc: BaseException | None, step: int = 0
) -> str:
    """Record the first failure of ``epoch`` (first writer wins) and the earliest ``step`` of the
    epoch a failure was seen in (0: before any step); returns the failure that counts."""
    _lower_to(store, _key(epoch, "failed_step"), step)  # before "failed": a reader of one finds both
    mine = f"rank {rank}: " + (f"{type(exc).__name__}: {exc}" if exc is not None else "a peer failed")
    return str(store.compare_set(_key(epoch, "failed"), "", mine[:2000]).decode())


def failure_published(store: dist.Store, epoch: int) -> bool:
    """Whether some rank published a failure in ``epoch`` (one store round trip)."""
    return bool(store.check([_key(epoch, "failed")]))


def failed_step(store: dist.Store, epoch: int) -> int | None:
    """The earliest step of ``epoch`` in which a rank published a failure, ``None`` when none did
    (one store round trip without a failure, two with one)."""
    if not failure_published(store, epoch):
        return None
    step = _read(store, _key(epoch, "failed_step"))
    return 0 if step == _ABSENT else int(step)


def _lower_to(store: dist.Store, key: str, value: int) -> None:
    """Set the integer at ``key`` to ``value`` unless it already holds a smaller one."""
    expected = ""
    while True:
        got = str(store.compare_set(key, expected, str(value)).decode())
        if got == str(value) or int(got) <= value:
            return
        expected = got


def _read(store: dist.Store, key: str) -> str:
    # compare_set with a non-empty expected value returns it for a missing key, sets nothing
    return str(store.compare_set(key, _ABSENT, _ABSENT).decode())


def _parts(roll: str) -> tuple[str, str]:
    """``(why, ranks)`` of a roll: the rule that closed it ("" while it is open) and its check-ins."""
    if not roll.startswith(_CLOSED):
        return "", roll
    why, _, body = roll[len(_CLOSED) :].partition("\n")
    return why, body


def _closed_why(roll: str) -> str:
    return _parts(roll)[0]


def _ranks_of(roll: str) -> set[int]:
    return {int(r) for r in _parts(roll)[1].split(",") if r and r != _ABSENT}


def _check_in(store: dist.Store, key: str, rank: int) -> str:
    """Append ``rank`` to the roll unless it is closed; returns the roll as last seen."""
    expected = ""
    while True:
        new = f"{expected}{rank},"
        got = str(store.compare_set(key, expected, new).decode())
        if got == new or got.startswith(_CLOSED):
            return got
        expected = got


def _close(store: dist.Store, key: str, why: str) -> str:
    """Mark the roll closed with the rule that decided (once, whoever comes first: the rule goes
    in the same compare-and-set, so every rank that sees the roll closed reads the closer's
    rule); returns the closed roll."""
    expected = _read(store, key)
    while not expected.startswith(_CLOSED):
        current = "" if expected == _ABSENT else expected
        closed = f"{_CLOSED}{why.replace(chr(10), ' ')}\n{current}"
        got = str(store.compare_set(key, current, closed).decode())
        if got == closed:
            return got
        expected = got
    return expected


def agree_lost(
    store: dist.Store,
    epoch: int,
    members: Sequence[int],
    rank: int,
    *,
    timeout: float,
    stale_after: float,
    poll: float = 0.05,
    observer: Liveness | None = None,
) -> Verdict:
    """Check in for ``epoch`` and return its verdict over ``members``, decided once through
    ``store`` and the same on every live rank: the members that checked in before the decision
    survive. It is decided when every member checked in, or every missing one is gone (its
    process exited, or its heartbeat is older than ``stale_after`` seconds: stopped
    responding), or ``timeout`` seconds passed (hung); bounded by ``timeout`` plus a few store
    round trips. The rules are looked at every ``poll`` seconds (growing to 0.25 s), the roll
    read every 20 ms or sooner (a decision another rank made is seen that soon). ``observer``: the process's liveness observer
    (it remembers earlier looks); default a new one. A member that never beat (no meshgroups
    call yet) is not judged: it is waited for up to ``timeout``. Rank 1 beat once, then
    stopped (SIGKILL, SIGSTOP), and never checks in::

        >>> import torch.distributed as dist
        >>> from meshgroups.elastic import agree_lost
        >>> from meshgroups.mesh import heartbeat_key
        >>> store = dist.HashStore()
        >>> store.add(heartbeat_key(1), 1)
        1
        >>> v = agree_lost(store, epoch=1, members=[0, 1], rank=0, timeout=5.0, stale_after=0.1)
        >>> v.survivors, v.lost, v.why.split(" (")[0]
        ((0,), (1,), 'rank 1 stopped responding')

    Raises:
        ExcludedError: this rank checked in after the decision (it is among the lost).
        ValueError: ``rank`` is not a member.
    """
    if rank not in members:
        raise ValueError(f"rank {rank} is not a member of epoch {epoch} ({list(members)})")
    roll_key = _key(epoch, "roll")
    started = time.monotonic()
    roll = _check_in(store, roll_key, rank)
    if rank not in _ranks_of(roll):
        raise _excluded(epoch, rank, roll)
    watch = observer if observer is not None else Liveness(store, stale_after)
    why = ""
    pause, look, glance = poll, started, _GLANCE
    while not roll.startswith(_CLOSED):
        now = time.monotonic()
        if now >= look:  # the rules, every ``pause``; the roll itself more often, below
            here = _ranks_of(roll)
            missing = [r for r in members if r not in here]
            if not missing:
                why = "every member reported"
            else:
                gone = watch.gone(missing, stale_after)
                if len(gone) == len(missing):
                    why = _describe(gone)
                elif now - started >= timeout:
                    why = f"did not report within {timeout:g}s"
            if why:
                roll = _close(store, roll_key, why)
                break
            look = now + pause
            pause = min(pause * 1.5, max(poll, 0.25))
        # The last rank to check in usually decides at once; the others learn it from the roll,
        # read every few milliseconds (one round trip each) rather than after a sleep of up to
        # ``pause``, the liveness looks' interval, which at 16 processes made them 0.1 s late.
        time.sleep(min(glance, max(look - now, 0.0)))
        glance = min(glance * 2, _GLANCE_MAX)
        roll = _read(store, roll_key)
    survivors = tuple(sorted(_ranks_of(roll)))
    lost = tuple(r for r in members if r not in survivors)
    if rank not in survivors:  # unreachable: this rank checked in before the close
        raise _excluded(epoch, rank, roll)
    cause = _read(store, _key(epoch, "failed"))
    return Verdict(epoch, survivors, lost, _closed_why(roll), "" if cause == _ABSENT else cause)


def commit(
    store: dist.Store,
    epoch: int,
    number: int,
    members: Sequence[int],
    rank: int,
    *,
    timeout: float,
    stale_after: float,
    poll: float = 0.02,
    observer: Liveness | None = None,
) -> None:
    """Wait until every member reached commit ``number`` of ``epoch`` (then nobody failed the
    step's collectives, and each may apply it), or raise ``StepAbortedError`` as soon as a failure
    is published or a member is gone (exited, or stopped responding), or after ``timeout``
    seconds. One ``add`` per rank; the last arrival deletes the previous commit's keys.

    The wait blocks on the store (``wake``, set by the last arrival or by a failing rank:
    ``wake_commits``), so a commit costs a store round trip, not a polling interval; liveness is
    looked at between blocking waits of ``max(poll, 1)`` seconds (each wait that runs out logs
    a line in torch: rare, as a failure wakes the waiters)."""
    base = _key(epoch, f"commit/{number}")
    if int(store.add(f"{base}/count", 1)) == len(members):
        store.set(f"{base}/done", "1")
        store.set(f"{base}/wake", "1")
        if number > 0:
            for name in ("count", "done", "wake"):
                store.delete_key(_key(epoch, f"commit/{number - 1}/{name}"))
        return
    started, pause = time.monotonic(), max(poll, 1.0)
    watch = observer if observer is not None else Liveness(store, stale_after)
    while True:
        try:
            store.wait([f"{base}/wake"], timedelta(seconds=pause))
        except (RuntimeError, dist.DistError):
            pass  # not woken yet: look at failures and liveness
        if store.check([f"{base}/done"]):
            return
        # (done again after a failure: the last arrival sets it before anyone can go on and fail)
        if failure_published(store, epoch) and not store.check([f"{base}/done"]):
            raise StepAbortedError(f"rank {rank}: a peer failed in epoch {epoch} before commit {number}")
        gone = watch.gone([r for r in members if r != rank], stale_after)
        if gone:
            raise StepAbortedError(f"rank {rank}: {_describe(gone)} before commit {number}")
        if time.monotonic() - started > timeout:
            raise StepAbortedError(
                f"rank {rank}: not every member reached commit {number} within {timeout:g}s"
            )


def wake_commits(store: dist.Store, epoch: int, number: int) -> None:
    """Wake the ranks waiting in commit ``number`` (and the next) of ``epoch``: a failure was
    published (``commit`` then raises there)."""
    for n in (number, number + 1):
        store.set(_key(epoch, f"commit/{n}/wake"), "1")


def _describe(gone: dict[int, str]) -> str:
    """``{3: "exited"}`` as the verdict's words (one line: it is stored in the roll)."""
    return ", ".join(f"rank {r} {how}" for r, how in sorted(gone.items()))


def _excluded(epoch: int, rank: int, roll: str) -> ExcludedError:
    return ExcludedError(
        f"rank {rank} was declared lost in epoch {epoch} ({_closed_why(roll)}): it reported after "
        f"the survivors ({sorted(_ranks_of(roll))}) had decided; it must not join their collectives — exit, "
        "or wait to be re-admitted as a spare"
    )


__all__ = [
    "KEY",
    "Heartbeat",
    "Staleness",
    "StepAbortedError",
    "Verdict",
    "agree_lost",
    "commit",
    "failed_step",
    "failure_published",
    "heartbeat_key",
    "publish_failure",
    "wake_commits",
]
