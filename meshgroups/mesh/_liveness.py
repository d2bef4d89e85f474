"""Liveness: which of the ranks a wait is for have exited or stopped responding, told through
the store in seconds, not by a timer.

Every rank that makes a meshgroups collective call keeps a **heartbeat**: a daemon thread that
raises the counter ``meshgroups/live/<rank>`` every ``heartbeat`` seconds over a store
connection of its own, and on a clean exit (``sys.exit``, the end of the script, an exception
that ends the process) adds ``EXITED`` to it. A rank waiting for others (a meeting of a
collective call, group creation, a weight transfer's status exchange, the elastic verdict) asks
a ``Liveness`` observer about the ranks it still awaits, and a rank is

- **exited**: its counter holds ``EXITED``, or (same host) its process is gone — seen at once;
- **stopped responding**: its counter did not change for ``lease`` seconds of the observer's
  own clock (SIGKILL on another host, SIGSTOP, a frozen machine) — seen after ``lease``;
- **not yet seen**: it never made a meshgroups call, so it has no counter; under ``torchrun``, a
  rank of the observer's own host whose worker process is gone is **exited** all the same (the
  launcher tells it: ``meshgroups.mesh._launcher``); otherwise it is waited for (the timeout
  stays the last bound) and named in the "still waiting" lines.

Staleness is judged by each observer's own clock (a value that did not change), so clocks need
not agree; an observer remembers what it saw across waits, so a rank that died long ago is
judged at the first look of the next wait. The thread beats while the main thread is blocked
in gloo or the store (both release the GIL); a rank holding the GIL for longer than ``lease``
(a huge ``pickle``) would look stopped: raise the lease for such jobs.

    >>> Liveness.__name__, heartbeat_key(3)
    ('Liveness', 'meshgroups/live/3')

A wait uses a ``Lookout`` (``meshgroups.mesh._waiting``: rate-limited looks, the "still waiting"
log line every ``report_every`` seconds) and raises ``gone_error(...)``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshgroups.mesh._launcher import exited_before_first_call
from meshgroups.mesh._options import DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_REPORT_EVERY
from meshgroups.mesh._torch_seam import world_registered

logger = logging.getLogger("meshgroups")

KEY = "meshgroups/live"
#: Added to a heartbeat counter when its process exits cleanly (no process beats 2**50 times).
EXITED = 1 << 50


def heartbeat_key(rank: int) -> str:
    """The store key whose counter ``rank``'s heartbeat raises."""
    return f"{KEY}/{rank}"


def _info_key(rank: int) -> str:
    return f"{KEY}/{rank}/info"


# ---------------------------------------------------------------------------------------- identity
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), "" if
    there is no such process; with the pid it names one process, never a successor."""
    stat = _read(f"/proc/{pid}/stat")
    return stat[stat.rfind(")") + 2 :].split()[19] if stat else ""


def _identity() -> dict[str, Any]:
    """What lets an observer on the same machine look at this process directly."""
    ns = ""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": ns,
        "pid": os.getpid(),
        "start": _process_start(os.getpid()),
    }


def _process_state(info: Mapping[str, Any], here: Mapping[str, Any]) -> str:
    """``"gone"``, ``"stopped"`` or ``""`` (running, or not visible from here) for the process
    ``info`` describes, looked at directly when it runs on this machine, in this pid namespace."""
    if not here["boot"] or any(info.get(k) != here[k] for k in ("host", "boot", "pidns")):
        return ""
    stat = _read(f"/proc/{info['pid']}/stat")
    if not stat:
        return "gone"
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[19] != info.get("start"):
        return "gone"  # the pid was reused: the process we knew has ended
    if fields[0] in ("Z", "X"):
        return "gone"  # a zombie: ended, not yet reaped by its parent
    return "stopped" if fields[0] in ("T", "t") else ""


# ---------------------------------------------------------------------------------------- heartbeat
def _clone(store: dist.Store) -> dist.Store:
    """A connection of the heartbeat's own (a blocked ``wait`` on the main thread's connection
    must not hold its beats back)."""
    try:
        return store.clone()  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


class Heartbeat:
    """A daemon thread that raises ``heartbeat_key(rank)`` every ``interval`` seconds through its
    own store connection; ``stop()`` ends it (observers then see the rank stop responding),
    ``stop(exited=True)`` also marks the rank exited (seen at once)::

        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> beat = Heartbeat(store, rank=3, interval=0.05)
        >>> beat.stop(exited=True)
        >>> int(store.get(heartbeat_key(3))) >= EXITED
        True

    Args:
        store: the store the ranks share, as the calling thread uses it (the beating thread
            clones it where the store can be).
        rank: the rank whose counter this is.
        interval: seconds between beats (positive).
        identity: also publish this process's identity, so observers on the same machine can
            look at the process directly.
        while_: beat while this says True (the world still exists); then the thread ends.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        interval: float,
        identity: bool = False,
        while_: Callable[[], bool] | None = None,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"heartbeat interval must be positive seconds, got {interval!r}")
        self.rank, self.interval = rank, float(interval)
        # The caller's connection for the caller's thread (this first beat, the identity, the
        # exit mark); the thread opens one of its own (a new connection waits for the store up
        # to its timeout: never on the caller's thread, whose store may be gone by then).
        self._origin = store
        self._stop = threading.Event()
        self._identity = _identity() if identity else None
        self._while = while_
        store.add(heartbeat_key(rank), 1)  # exists before anyone reads it
        self._publish()
        self._thread = threading.Thread(target=self._run, name=f"meshgroups-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        if self._identity is not None:
            self._origin.set(_info_key(self.rank), json.dumps({**self._identity, "interval": self.interval}))

    def retune(self, interval: float) -> None:
        """Beat every ``interval`` seconds from the next beat on."""
        if float(interval) != self.interval:
            self.interval = float(interval)
            self._publish()

    def _run(self) -> None:
        try:
            own = _clone(self._origin)
        except Exception:
            return  # the store is gone: nothing to beat into (the caller's calls fail and say so)
        while not self._stop.wait(self.interval):
            if self._while is not None and not self._while():
                return  # its world was destroyed: nobody waits for this rank there any more
            try:
                own.add(heartbeat_key(self.rank), 1)
            except dist.DistNetworkError:
                return  # the connection is closed (the store's host ended): it never comes back
            except Exception:
                # Keep beating: one failed ``add`` (a store slow to answer on a loaded host) must
                # not make a live rank look dead forever. A store that is gone is the main
                # thread's news (its own store calls fail).
                continue

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, exited: bool = False) -> None:
        """Stop beating; ``exited``: mark this rank exited too (at the end of the process,
        unless its world ended first)."""
        beating = self.alive and (self._while is None or self._while())
        self._stop.set()
        self._thread.join(timeout=self.interval * 2 + 1)
        if exited and beating:
            try:
                self._origin.add(heartbeat_key(self.rank), EXITED)
            except Exception:
                pass  # the store (rank 0's process) may be gone already: observers see it stop


# ---------------------------------------------------------------------------------------- observer
class Liveness:
    """What this observer knows of the ranks' heartbeats (see the module docstring).

    Args:
        store: the store the heartbeats go to (the caller's connection; looks are short).
        lease: seconds without a changed heartbeat after which a rank stopped responding.
    """

    def __init__(self, store: dist.Store, lease: float = DEFAULT_LEASE) -> None:
        self.store, self.lease = store, float(lease)
        # the settings of the last mesh built (``start_heartbeat``), for waits given none
        self.heartbeat, self.report_every = DEFAULT_HEARTBEAT, DEFAULT_REPORT_EVERY
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (value, when it last changed here)
        self.beating: set[int] = set()  # ranks whose heartbeat key exists
        self.info: dict[int, dict[str, Any]] = {}
        self._here = _identity()

    def _lease_for(self, rank: int, lease: float) -> float:
        # never shorter than two and a half beats of that rank (it may beat slower than we think)
        return max(lease, 2.5 * float(self.info.get(rank, {}).get("interval", 0.0)))

    def _read_info(self, rank: int) -> None:
        if self.store.check([_info_key(rank)]):
            self.info[rank] = json.loads(self.store.get(_info_key(rank)))

    def gone(self, ranks: Iterable[int], lease: float | None = None) -> dict[int, str]:
        """Which of ``ranks`` have exited or stopped responding, each with how
        (``{3: "exited", 5: "stopped responding (no heartbeat for 5.1s)"}``). O(len(ranks))
        store round trips for ranks not yet seen beating, one ``multi_get`` for the others."""
        lease = self.lease if lease is None else float(lease)
        ranks = list(ranks)
        now = time.monotonic()
        # (multi_get would block on a rank that never beat: such a rank is not judged)
        new = [r for r in ranks if r not in self.beating and self.store.check([heartbeat_key(r)])]
        for r in new:
            self.beating.add(r)
            self._read_info(r)
        beating = [r for r in ranks if r in self.beating]
        values = self.store.multi_get([heartbeat_key(r) for r in beating]) if beating else []
        out: dict[int, str] = {}
        for r, raw in zip(beating, values):
            value = int(raw.decode() or 0)
            state = _process_state(self.info[r], self._here) if r in self.info else ""
            if value >= EXITED or state == "gone":
                out[r] = "exited"
                continue
            if r not in self.seen or self.seen[r][0] != value:
                self.seen[r] = (value, now)
                continue
            quiet = now - self.seen[r][1]
            if quiet >= self._lease_for(r, lease):
                self._read_info(r)  # (its interval may have changed)
                if quiet >= self._lease_for(r, lease):
                    why = "; its process is stopped" if state == "stopped" else ""
                    out[r] = f"stopped responding (no heartbeat for {quiet:.1f}s{why})"
        for r in exited_before_first_call(r for r in ranks if r not in self.beating):
            out[r] = "exited before its first meshgroups call (torchrun's worker of that rank has no process)"
        return out

    def forget(self, ranks: Iterable[int]) -> None:
        """Forget what this observer saw of ``ranks``: a new process took each of these ranks
        (an elastic job's newcomer), and the lost one's counter or process says nothing of it."""
        for r in ranks:
            self.seen.pop(r, None)
            self.info.pop(r, None)
            self.beating.discard(r)

    def unseen(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` this observer has never seen beating (no meshgroups call yet)."""
        return [r for r in ranks if r not in self.beating]


class Staleness(Liveness):
    """``Liveness`` with the elastic verdict's former interface: ``stale(ranks)`` lists the
    ranks gone (exited or stopped responding) after ``stale_after`` seconds — counting a rank
    that never beat as gone ``stale_after`` seconds after the first look (where every rank
    is known to have started beating, as an ``Elastic`` job's members)."""

    def __init__(self, store: dist.Store, stale_after: float) -> None:
        super().__init__(store, stale_after)
        self.stale_after = stale_after
        self.first_look: dict[int, float] = {}

    def stale(self, ranks: Sequence[int]) -> list[int]:
        gone = self.gone(ranks)
        now = time.monotonic()
        for r in self.unseen(ranks):
            if now - self.first_look.setdefault(r, now) >= self.stale_after:
                gone[r] = "stopped responding"
        return sorted(gone)


# ---------------------------------------------------------------------------------------- per world
@dataclass
class _World:
    beat: Heartbeat | None
    observer: Liveness


_worlds: weakref.WeakKeyDictionary[Any, _World] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def start_heartbeat(
    store: dist.Store,
    interval: float | None = None,
    lease: float | None = None,
    report_every: float | None = None,
) -> Liveness:
    """Make sure this process beats in the current default world (one thread per world, until
    the process exits or the world is destroyed; ``interval`` retunes it), and return the
    world's observer.

    Args:
        store: the default group's store.
        interval: seconds between beats (``None``: as before, at first ``DEFAULT_HEARTBEAT``).
        lease, report_every: the observer's settings for waits given none (a weight
            transfer's status exchanges, a call that builds no mesh); ``None`` keeps them.

    Returns:
        The ``Liveness`` observer this process keeps for the world.
    """
    world = dist.group.WORLD
    with _lock:
        _register_exit()
        entry = _worlds.get(world)
        if entry is None:
            entry = _World(None, Liveness(store))
            _worlds[world] = entry
        if entry.beat is None or not entry.beat.alive:
            ref = weakref.ref(world)
            registered = lambda: (w := ref()) is not None and world_registered(w)  # noqa: E731
            every = interval if interval is not None else entry.observer.heartbeat
            entry.beat = Heartbeat(store, dist.get_rank(), every, identity=True, while_=registered)
        elif interval is not None:
            entry.beat.retune(interval)
        entry.observer.heartbeat = entry.beat.interval
        if lease is not None:
            entry.observer.lease = float(lease)
        if report_every is not None:
            entry.observer.report_every = float(report_every)
    return entry.observer


def world_liveness(store: dist.Store) -> Liveness:
    """This process's observer of the current default world (made on first use; the process
    beats only once it made a meshgroups call: ``start_heartbeat``).

    Args:
        store: the default group's store.

    Returns:
        The world's ``Liveness``.
    """
    with _lock:
        entry = _worlds.get(dist.group.WORLD)
        if entry is None:
            entry = _World(None, Liveness(store))
            _worlds[dist.group.WORLD] = entry
    return entry.observer


def _stop_entry(entry: _World, exited: bool = False) -> None:
    if entry.beat is not None:
        entry.beat.stop(exited=exited)
        entry.beat = None


def _at_exit() -> None:
    """At a clean exit: every heartbeat of this process marks its rank exited (observers see
    it at their next look instead of after the lease)."""
    for entry in list(_worlds.values()):
        _stop_entry(entry, exited=True)


_registered = [0]  # the pid whose exit hook is registered


def _register_exit() -> None:
    # multiprocessing's exit hook runs at a normal exit of a main process (atexit) and of a
    # multiprocessing child (which skips atexit). A finalizer runs only in the process that
    # registered it, so a fork of this process (a worker pool) never marks this rank exited.
    if _registered[0] != os.getpid():
        multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)
        _registered[0] = os.getpid()


__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_LEASE",
    "DEFAULT_REPORT_EVERY",
    "EXITED",
    "KEY",
    "Heartbeat",
    "Liveness",
    "Staleness",
    "heartbeat_key",
    "start_heartbeat",
    "world_liveness",
]
