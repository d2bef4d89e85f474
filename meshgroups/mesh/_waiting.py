"""The waiting side of liveness: what one wait does with the observer (``meshgroups.mesh._liveness``).

A wait on other ranks (a meeting of a collective call, group creation, a weight transfer's
status exchange, a failed call's close) calls ``lookout.gone()`` in its loop: the ``Lookout``
looks at the ranks still awaited at most every ``LOOK_EVERY`` seconds, logs "still waiting for
..." every ``report_every`` seconds while they are late but alive, and returns the ones gone;
the wait then raises ``gone_error(...)``, the same on every waiting rank::

    >>> describe({3: "exited", 5: "stopped responding (no heartbeat for 5.2s)"})
    'rank 3 exited, rank 5 stopped responding (no heartbeat for 5.2s)'
    >>> rank_list([4, 5, 6, 7])
    'ranks 4, 5, 6, 7'
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshgroups.errors import RanksGoneError, StoreConnectionError
from meshgroups.mesh._failure_records import shared
from meshgroups.mesh._liveness import Liveness, start_heartbeat
from meshgroups.mesh._options import DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY

logger = logging.getLogger("meshgroups")

#: Seconds between two looks at the awaited ranks (for up to 512 of them; longer for more).
LOOK_EVERY = 0.5
#: Seconds into a wait before its first look.
FIRST_LOOK = 0.1


def describe(gone: Mapping[int, str]) -> str:
    """``{rank: how}`` as words: ``"rank 3 exited, rank 5 stopped responding (...)"``."""
    return ", ".join(f"rank {r} {how}" for r, how in sorted(gone.items()))


def rank_list(ranks: Sequence[int], limit: int = 16) -> str:
    """``"rank 3"`` / ``"ranks 4, 5, 6"`` (the first ``limit``, then ``…``)."""
    names = ", ".join(map(str, ranks[:limit])) + (", …" if len(ranks) > limit else "")
    return f"rank{'s' if len(ranks) != 1 else ''} {names}"


def gone_error(rank: int, gone: Mapping[int, str], where: str, extra: str = "") -> RanksGoneError:
    """The error every waiting rank raises: ``rank 0: rank 3 <where> (rank 3 exited<extra>)``.

    Args:
        rank: the rank raising it.
        gone: ``{rank: how}`` of the ranks gone.
        where: what was waited for, e.g. ``"before the cross-rank check of init_mesh call #3"``.
        extra: more words (what the ranks last published).

    Returns:
        A ``RanksGoneError`` (``ranks``: the gone ranks, ``states``: how each went).
    """
    message = f"rank {rank}: {rank_list(sorted(gone))} {where} ({describe(gone)}{extra})"
    return RanksGoneError(message, tuple(sorted(gone)), dict(gone))


class Lookout:
    """The liveness side of one wait, called from its loop: ``gone()`` looks at the ranks still
    awaited at most every ``LOOK_EVERY`` seconds (scaled up past 512 ranks) and logs
    ``"still waiting for ..."`` every ``report_every`` seconds while some are late but alive.

    Args:
        awaited: the ranks this wait still needs, or a function giving them (``None``: unknown).
        where: what is waited for, for the log line (``"the cross-rank check of init_mesh call
            #3 (train.py:40)"``).
        rank: this rank. probe: ``ranks -> {rank: how}`` (a ``Liveness.gone`` with the wait's
            lease, or a cohort's probe).
        report_every: seconds between two "still waiting" lines.
        started: when the wait began (``time.monotonic()``), timeout: its bound, for the log.
    """

    def __init__(
        self,
        awaited: Sequence[int] | Callable[[], Sequence[int] | None],
        where: str,
        rank: int,
        probe: Callable[[Sequence[int]], Mapping[int, str] | Sequence[int]],
        report_every: float = DEFAULT_REPORT_EVERY,
        started: float | None = None,
        timeout: timedelta | None = None,
        unseen: Callable[[Sequence[int]], list[int]] | None = None,
    ) -> None:
        self.awaited, self.where, self.rank, self.probe = awaited, where, rank, probe
        self.report_every, self.unseen = report_every, unseen
        self.started = time.monotonic() if started is None else started
        self.timeout = timeout
        # the first look after a moment: a wait that ends at once (the usual case) costs no look
        self.next_look = self.started + FIRST_LOOK
        self.next_report = self.started + report_every
        self.reports = 0

    def _ranks(self) -> Sequence[int] | None:
        return self.awaited() if callable(self.awaited) else self.awaited

    def gone(self) -> dict[int, str]:
        """The awaited ranks that are gone (empty: keep waiting); looks only when due."""
        now = time.monotonic()
        if now < self.next_look:
            return {}
        ranks = self._ranks()
        self.next_look = now + LOOK_EVERY * max(1.0, len(ranks or ()) / 512)
        if not ranks:
            return {}
        try:
            found = self.probe([r for r in ranks if r != self.rank])
        except dist.DistError:
            # the store is unreachable (its host ended): liveness can tell nothing more; the
            # wait's own store calls or collective say what happened
            return {}
        gone = dict(found) if isinstance(found, Mapping) else {r: "stopped responding" for r in found}
        if not gone and now >= self.next_report:
            self.report(ranks, now)
        return gone

    def report(self, ranks: Sequence[int], now: float) -> None:
        """One "still waiting" line (who, where, for how long, who has not started yet)."""
        self.next_report = now + self.report_every
        self.reports += 1
        bound = f" of {self.timeout.total_seconds():g}s" if self.timeout is not None else ""
        never = self.unseen(ranks) if self.unseen is not None else []
        note = f"; {rank_list(never)} made no meshgroups call yet (no heartbeat)" if never else ""
        logger.warning(
            "rank %d: still waiting for %s at %s (%.0fs%s; alive, not there yet%s)",
            self.rank,
            rank_list(list(ranks)),
            self.where,
            now - self.started,
            bound,
            note,
        )


def poll_key(present: Callable[[], bool], deadline: float, lookout: Lookout) -> dict[int, str] | None:
    """Poll ``present()`` (a store key's ``check``; a short ``store.wait`` that times out logs
    a warning in torch each time) until ``deadline`` (``time.monotonic()``), looking through
    ``lookout`` meanwhile (O(members) store checks per look, and the "still waiting" line).

    Returns:
        ``None``: the key is there; ``{}``: the deadline passed; else the ranks gone (how each).
    """
    pause = 0.001
    while True:
        if present():
            return None
        now = time.monotonic()
        if now >= deadline:
            return {}
        gone = lookout.gone()
        if gone:
            return gone
        time.sleep(min(pause, max(deadline - now, 0.0)))
        pause = min(pause * 2, 0.02)


def members_lookout(
    observer: Liveness | None, lease: float, members: Sequence[int], rank: int, where: str
) -> Lookout | None:
    """A silent ``Lookout`` over ``members`` (a failed call's close counts who has left, it
    does not name them), ``None`` without an observer."""
    if observer is None:
        return None
    return Lookout(list(members), where, rank, lambda ranks: observer.gone(ranks, lease), float("inf"))


class CallLiveness:
    """The liveness side of a collective call (``meshgroups.mesh.collective_call``'s ``Call``):
    entering starts this process's heartbeat and takes the world's settings; ``use_liveness``
    sets the call's own (the options of the mesh being built); the waits read ``observer``,
    ``lease`` and ``report_every``; ``progress`` publishes what this rank does, so a rank that
    dies is named with its last words."""

    rank: int
    what: str
    site: str
    enabled: bool
    store: dist.Store | None
    _op: Callable[..., Any]  # a store operation, the connection's loss a StoreConnectionError

    def _init_liveness(self) -> None:
        self.observer: Liveness | None = None  # this process's observer of the world (on entering)
        self.heartbeat, self.lease, self.report_every = DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY

    def use_liveness(self, heartbeat: float, lease: float, report_every: float) -> None:
        """The liveness settings of this call's waits from now on (``MeshOptions``' fields,
        checked by the caller); the process's heartbeat beats every ``heartbeat`` seconds."""
        self.heartbeat, self.lease, self.report_every = heartbeat, lease, report_every
        if self.enabled and self.observer is not None:
            start_heartbeat(self.store, heartbeat, lease, report_every)  # type: ignore[arg-type]

    def _enter_liveness(self) -> None:
        # until the call names its own (``use_liveness``), the last settings of this world
        try:
            self.observer = start_heartbeat(self.store)  # type: ignore[arg-type]
        except (RuntimeError, dist.DistError) as exc:
            raise shared(
                StoreConnectionError(
                    f"rank {self.rank} lost the connection to the rendezvous store entering {self.what} "
                    f"(the store is hosted by rank 0 under torchrun/tcp://; did it die?): {exc}"
                )
            ) from None
        self.heartbeat, self.lease = self.observer.heartbeat, self.observer.lease
        self.report_every = self.observer.report_every

    def progress(self, text: str) -> None:
        """Publish what this rank is doing, so a rank that dies is named with its last words."""
        if self.enabled:
            self._op("set", f"meshgroups/last/{self.rank}", f"{self.what} ({self.site}): {text}")

    def last_words(self, ranks: list[int]) -> str:
        """What the first of ``ranks`` published last (``progress``), for an error naming them."""
        words = []
        for r in ranks[:4]:
            key = f"meshgroups/last/{r}"
            if self._op("check", [key]):
                words.append(f"; rank {r} last published: {self._op('get', key).decode()}")
        return "".join(words)

    def _close_lookout(self, members: Sequence[int]) -> Lookout | None:
        """A failed call's close: counts who has left meanwhile (names nobody)."""
        return members_lookout(self.observer, self.lease, members, self.rank, f"the close of {self.what}")


__all__ = [
    "LOOK_EVERY",
    "CallLiveness",
    "Lookout",
    "describe",
    "gone_error",
    "members_lookout",
    "poll_key",
    "rank_list",
]
