"""Wake a rank blocked in a collective that can never complete, in a fraction of a second.

When a rank dies, its direct peers learn it at once (gloo: ``Connection closed by peer``, the
kernel closed the dead process's sockets). A rank blocked in a collective with a *survivor* that
already left the failed step learns nothing: gloo waits for the group's timeout, and neither
``ProcessGroup.abort()``, ``shutdown()`` nor ``destroy_process_group`` of the peer's group closes
its connections while torch objects (FSDP, DeviceMesh) still hold the group. This module lets
the blocked rank wake itself:

- A rank whose step fails publishes, before it checks in for the verdict, how many collectives
  it issued on each of its groups (torch's per-group sequence number) and the endpoints of its
  connected TCP sockets (``publish_state``).
- A ``StepWatcher`` thread runs beside every guarded step, blocked on the store (no cost to a
  step) until the first failure of the epoch wakes it (``wake_watchers``). It then compares this
  rank's sequence numbers with those of every peer that published: a group where this rank issued
  more than a failed peer holds an operation that peer will never post (it left the step), so this
  rank is, or will be, stuck there. So is a rank level with a failed peer in a group this step
  used whose current collective can never complete (it holds a rank known gone: exited, or silent
  past the lease; or a failed member behind this rank's count): in a ring over more than two
  ranks, the neighbour of the rank that will never post fails inside the collective and the next
  one waits on that neighbour at the same count (a 16-rank HSDP's replicate all-reduce waited out
  the collective timeout without this). The watcher records the pair (``this rank, peer``) in the
  store, then shuts down this process's sockets whose remote endpoint is one of that peer's: gloo
  sees ``Connection closed`` and the blocked collective raises on the main thread, which goes to
  the verdict like any failure.
- Shutting a connection down breaks every group the two ranks share, not only the stuck one;
  ``Elastic`` reads the recorded pairs after the verdict and the rebuild replaces every group
  holding both ends of one (on each member alike: they read the same record). The stuck group
  was out of step, hence replaced anyway.

Never severed: a connection to the store's port (the store may live in a worker's process).
Linux only (``/proc``); elsewhere the watcher does nothing and the collective timeout bounds the
wait, as before. A rank blocked on a *dead host's* connection (no FIN ever arrives) is not woken
here either: its collective times out.

    >>> sorted(connected_endpoints()) == sorted(set(connected_endpoints()))
    True
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from meshgroups.mesh import GroupCache, Liveness, group_sequence

KEY = "meshgroups/elastic"


def _key(epoch: int, name: str) -> str:
    return f"{KEY}/e{epoch}/{name}"


def _socket_fds() -> list[int]:
    """This process's file descriptors that are sockets (``/proc/self/fd``)."""
    out: list[int] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.append(int(name))
        except OSError:
            continue
    return out


def _ends(fd: int) -> tuple[str, str] | None:
    """``(local, remote)`` endpoints (``"ip:port"``) of a connected TCP socket, else ``None``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local, remote = sock.getsockname(), sock.getpeername()
        return f"{local[0]}:{local[1]}", f"{remote[0]}:{remote[1]}"
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor is torch's: never closed here


def connected_endpoints() -> list[str]:
    """The local endpoints (``"ip:port"``) of this process's connected TCP sockets."""
    return sorted({ends[0] for fd in _socket_fds() if (ends := _ends(fd)) is not None})


def sequences(cache: GroupCache) -> dict[str, int]:
    """This rank's torch sequence number of every group in ``cache`` (by group name)."""
    out: dict[str, int] = {}
    for _, group in cache.items():
        if group is not None and group is not dist.group.WORLD:
            try:
                out[str(group.group_name)] = group_sequence(group)
            except Exception:
                continue  # a group torch already tore down: nothing to compare
    return out


def publish_state(store: dist.Store, epoch: int, rank: int, cache: GroupCache) -> None:
    """What a failed rank tells the blocked ones (see the module docstring); its rank then goes
    on the epoch's index of records, so a watcher finds every new record in one read."""
    record = {"seq": sequences(cache), "ends": connected_endpoints()}
    store.set(_key(epoch, f"state/{rank}"), json.dumps(record))
    store.append(_key(epoch, "state-index"), f"{rank},")  # type: ignore[attr-defined]


def published(store: dist.Store, epoch: int) -> set[int]:
    """The ranks whose record of ``epoch`` is in the store (one round trip)."""
    # compare_set with a non-empty expected value returns it for a missing key, sets nothing
    raw = str(store.compare_set(_key(epoch, "state-index"), "\x00", "\x00").decode())
    return {int(r) for r in raw.split(",") if r and r != "\x00"}


def store_port(store: dist.Store) -> int | None:
    """The port of the TCPStore under ``store`` (through prefix stores), ``None`` if unknown."""
    current: object = store
    while current is not None:
        port = getattr(current, "port", None)
        if isinstance(port, int):
            return port
        current = getattr(current, "underlying_store", None)
    return None


def sever(peer_ends: Iterable[str], keep_port: int | None) -> int:
    """Shut down this process's TCP connections whose remote endpoint is in ``peer_ends``
    (never one to ``keep_port``); returns how many."""
    wanted, n = set(peer_ends), 0
    for fd in _socket_fds():
        ends = _ends(fd)
        if ends is None or ends[1] not in wanted or ends[1].rsplit(":", 1)[1] == str(keep_port):
            continue
        try:
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            finally:
                sock.detach()
        except OSError:
            continue
    return n


def watch_key(epoch: int, rank: int) -> str:
    """The key ``rank``'s watcher blocks on during ``epoch``."""
    return _key(epoch, f"watch/{rank}")


def wake_watchers(store: dist.Store, epoch: int, members: Sequence[int]) -> None:
    """The first failing rank of ``epoch`` wakes every member's watcher (one ``multi_set``)."""
    if int(store.add(_key(epoch, "watch-sent"), 1)) == 1:
        keys = [watch_key(epoch, r) for r in members]
        store.multi_set(keys, ["1"] * len(keys))  # type: ignore[attr-defined]


def _append(store: dist.Store, key: str, item: str) -> None:
    """Append ``item,`` to the string at ``key`` (compare-and-set, safe against other ranks)."""
    expected = ""
    while True:
        new = f"{expected}{item},"
        got = str(store.compare_set(key, expected, new).decode())
        if got == new:
            return
        expected = got


def severed_pairs(store: dist.Store, epoch: int) -> set[tuple[int, int]]:
    """The rank pairs whose connections a watcher shut down in ``epoch`` (each sorted)."""
    key = _key(epoch, "severed")
    if not store.check([key]):
        return set()
    raw = store.get(key).decode()
    pairs = set()
    for item in raw.split(","):
        if item:
            a, b = (int(x) for x in item.split("-"))
            pairs.add((min(a, b), max(a, b)))
    return pairs


def holds_pair(ranks: Sequence[int], pairs: set[tuple[int, int]]) -> bool:
    """Whether a group over ``ranks`` holds both ends of one of ``pairs``."""
    members = set(ranks)
    return any(a in members and b in members for a, b in pairs)


class StepWatcher:
    """A thread that watches every guarded step of one ``Elastic`` (see the module docstring):
    ``arm(epoch, members)`` as a step starts, ``disarm()`` before this rank checks in for a
    verdict and after the step; a disarmed watcher severs nothing (a pair recorded after this
    rank's check-in could miss the survivors' reading of the record).

    Args:
        store: a store connection of the thread's own (the main thread may block in its own).
        rank: this rank.
        cache: this rank's groups.
        poll: seconds between looks for a published failure while armed.
        keep_port: the store's port (never severed).
        main: the main thread's connection (``release`` sets its key there).
        lease: seconds of silence after which a rank counts as gone (exited ranks at once);
            ``None``: no rank is judged gone, so only a failed member behind makes a group's
            collective one that can never complete.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        cache: GroupCache,
        poll: float,
        keep_port: int | None,
        main: dist.Store | None = None,
        lease: float | None = None,
    ) -> None:
        self.store, self.rank, self.cache, self.poll, self.keep_port = store, rank, cache, poll, keep_port
        # Ranks gone (exited, or silent past ``lease``), looked up on the watcher's own
        # connection: the main thread may hold its own in a blocking store wait.
        self.liveness = Liveness(store, lease) if lease is not None else None
        self._met: tuple[int, ...] = ()  # the members the observer has looked at (``_meet``)
        self._at_arm: dict[str, int] = {}  # the groups' counts as the step started
        self.main = main if main is not None else store  # the main thread's connection
        self.lock = threading.Lock()
        self.armed: tuple[int, tuple[int, ...]] | None = None
        self._wake = threading.Event()
        self._closed = False
        self.severed: dict[tuple[int, int], int] = {}  # (epoch, peer) -> connections shut down
        self.records: dict[tuple[int, int], dict] = {}  # (epoch, peer) -> its published state
        self._thread = threading.Thread(target=self._run, name=f"meshgroups-step-watch-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def over(
        cls,
        store: dist.Store,
        rank: int,
        cache: GroupCache,
        poll: float,
        lease: float | None = None,
    ) -> StepWatcher:
        """A watcher on a connection of its own to ``store`` (``store`` stays the main thread's)."""
        return cls(own_store(store), rank, cache, poll, store_port(store), main=store, lease=lease)

    def arm(self, epoch: int, members: Sequence[int]) -> None:
        at_arm = sequences(self.cache)
        with self.lock:
            self.armed, self._at_arm = (epoch, tuple(members)), at_arm
            if any(e != epoch for e, _ in self.records):
                self.records = {key: record for key, record in self.records.items() if key[0] == epoch}
        self._wake.set()

    def disarm(self) -> None:
        with self.lock:
            self.armed = None

    def forget(self, ranks: Sequence[int]) -> None:
        """On the main thread, between steps: new processes took ``ranks`` (newcomers in lost
        ranks' places), so what the watcher saw of the lost ones (a pid, a stalled counter) must
        not judge them; the next arm looks at them afresh."""
        with self.lock:
            if self.liveness is not None:
                self.liveness.forget(ranks)
            self._met = ()

    def release(self, epoch: int) -> None:
        """On the main thread, as this rank leaves ``epoch``: the watcher stops waiting on it."""
        self.main.set(watch_key(epoch, self.rank), "1")

    def close(self, epoch: int) -> None:
        self.disarm()
        self._closed = True
        self._wake.set()
        self.release(epoch)

    def _run(self) -> None:
        # Blocks on the store while steps run (no polling, no GIL taken from the training
        # thread but for one look at each new set of members: ``_meet``): woken by the first
        # failure of the epoch (``wake_watchers``) or by this rank leaving the epoch
        # (``release``); then looks every ``poll`` seconds while armed.
        try:
            while not self._closed:
                armed = self.armed
                if armed is None:
                    self._wake.wait()  # (set by arm and close)
                    self._wake.clear()
                    continue
                self._meet(armed[1])
                self.store.wait([watch_key(armed[0], self.rank)], timedelta(days=1))
                if self._closed:
                    return
                if not self.store.check([_key(armed[0], "failed")]):
                    self._wake.wait(self.poll)  # released: the rank left the epoch
                    continue
                self._wake.clear()  # (set by this step's arm: would make the looks below spin)
                while self.armed == armed and not self._closed:
                    self._look(*armed)
                    self._wake.wait(self.poll)
                self._wake.clear()
        except Exception:
            return  # the store is gone: the main thread's own calls fail and say so

    def _meet(self, members: tuple[int, ...]) -> None:
        """Look at new members' heartbeats once, before any failure: an observer's first look
        at a rank takes three round trips (its heartbeat key, its identity), which made the
        first look after a failure last 70–180 ms at 16 processes; later looks take one."""
        if self.liveness is not None and members != self._met:
            self._met = members
            self.liveness.gone(members)

    def _look(self, epoch: int, members: tuple[int, ...]) -> None:
        # A failed peer's record never changes: each is read once, and every look judges them
        # all (a peer severed already still tells that a group's collective cannot complete).
        # Two round trips whatever the number of members: this thread takes the GIL back after
        # each one, which takes up to a switch interval while the main thread runs the step.
        index = published(self.store, epoch)
        new = [r for r in members if r != self.rank and r in index and (epoch, r) not in self.records]
        if new:
            for r, raw in zip(new, self.store.multi_get([_key(epoch, f"state/{r}") for r in new])):
                record = json.loads(raw)
                record["seq"] = {name: int(n) for name, n in record["seq"].items()}
                self.records[(epoch, r)] = record
        counts = {r: record["seq"] for (e, r), record in self.records.items() if e == epoch}
        if not counts:
            return
        mine = sequences(self.cache)
        used = {name for name, n in mine.items() if n > self._at_arm.get(name, n)}
        ranks = {
            str(g.group_name): set(dist.get_process_group_ranks(g))
            for _, g in self.cache.items()
            if g is not None and str(g.group_name) in used
        }
        dead = set(self.liveness.gone(members)) if used and self.liveness is not None else set()
        for r in stuck_on(mine, counts, ranks, dead):
            if (epoch, r) in self.severed:
                continue
            with self.lock:
                if self.armed != (epoch, members):
                    return
                _append(self.store, _key(epoch, "severed"), f"{self.rank}-{r}")
                self.severed[(epoch, r)] = sever(self.records[(epoch, r)]["ends"], self.keep_port)


def stuck_on(
    mine: dict[str, int],
    counts: dict[int, dict[str, int]],
    used: dict[str, set[int]],
    dead: set[int],
) -> list[int]:
    """The failed peers this rank is, or will be, stuck with in a collective, from group counts.

    ``mine``: this rank's count per group (by name); ``counts``: each failed peer's (as it
    published them); ``used``: the groups this step used (their count moved), with their
    ranks; ``dead``: ranks known gone. A peer behind this rank's count in a shared group never
    posts the collective this rank is in. A peer level with it is stuck-making only where that
    collective can never complete: the group holds a rank gone, or a failed member behind::

        >>> ring = {"rep": {1, 5, 9, 13}}  # 5 died; 9 failed inside the all-reduce, 13 waits on 9
        >>> stuck_on({"rep": 16, "tp": 40}, {9: {"rep": 16}, 12: {"tp": 40}}, ring, {5})
        [9]
    """
    doomed = {
        name
        for name, ranks in used.items()
        if dead & ranks or any(r in ranks and counts[r].get(name, mine[name]) < mine[name] for r in counts)
    }
    return [
        r
        for r, theirs in counts.items()
        if any(
            name in theirs and (n > theirs[name] or (n == theirs[name] and name in doomed))
            for name, n in mine.items()
        )
    ]


def own_store(store: dist.Store) -> dist.Store:
    """A connection of the watcher's own where the store can be cloned."""
    clone: Callable[[], dist.Store] | None = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except (RuntimeError, NotImplementedError):
        return store


__all__ = [
    "StepWatcher",
    "connected_endpoints",
    "holds_pair",
    "own_store",
    "publish_state",
    "published",
    "sequences",
    "sever",
    "severed_pairs",
    "store_port",
    "stuck_on",
    "wake_watchers",
    "watch_key",
]
