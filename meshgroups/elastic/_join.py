"""Fresh processes join a running ``Elastic`` job: started after the job (by hand, a scheduler,
a restarted worker) with the job's store, they announce themselves and take the ranks of lost
processes.

torch's default group has a fixed world: a new process cannot enter the survivors' default
group. What it can do is take a *free rank* of that world — a rank whose process was lost — and
build a default group of its own of the same size, with that rank, over the job's store.
meshgroups never sends anything over the default group after ``Elastic`` started (every
collective runs over the cohort's groups), so the newcomer's default group never connects
(gloo's lazy initialisation): it is what ``new_group`` needs (the world's size, this rank, the
store) and nothing more. Every group the newcomer is in is then created as any other, with
local synchronisation, by the rebuild that admits it; the survivors' groups without it stay the
same objects.

1. ``Elastic(...)`` publishes the job (world size, default group's name, the settings every
   mesh is built with) under ``meshgroups/elastic/job``.
2. A new process calls ``Elastic.join(store)``: it appends a token to
   ``meshgroups/elastic/join/waiting`` and waits.
3. The survivors call ``el.admit_newcomers()`` (collective over the members): the first member
   gives each waiting token a free rank (lost, neither a member nor a spare); the newcomer builds
   its default group, clears its rank's heartbeat of the lost process, starts beating and says
   it is ready; the survivors forget what they knew of the lost process at that rank and take
   the newcomers as spares. ``el.grow(...)`` or ``el.substitute(...)`` then admits them, and the
   newcomers' ``el.standby()`` returns their mesh, as a spare's does.

A job grows back to its starting world size, not beyond: the survivors' default group cannot
grow (a larger world would mean a new default group on every rank, and every group built in
the old one would have to be rebuilt).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.mesh import (
    MeshGroups,
    MeshOptions,
    as_timedelta,
    default_group_name,
    default_store,
    default_timeout,
    heartbeat_key,
    register_world,
    set_default_world,
    unconnected_world,
)

logger = logging.getLogger("meshgroups")

KEY = "meshgroups/elastic"
JOB = f"{KEY}/job"
WAITING = f"{KEY}/join/waiting"


def publish_job(store: dist.Store, settings: dict[str, Any]) -> None:
    """What a newcomer needs to build its world and its ``Elastic`` (first member only)."""
    record = {
        "world": dist.get_world_size(),
        "name": default_group_name(),
        "world_timeout": default_timeout().total_seconds(),  # the default group's: calls compare it
        **settings,
    }
    store.set(JOB, json.dumps(record))


def _append(store: dist.Store, key: str, item: str) -> int:
    """Append ``item,`` to ``key``; returns the item's index (compare-and-set: concurrent safe)."""
    expected = ""
    while True:
        new = f"{expected}{item},"
        got = str(store.compare_set(key, expected, new).decode())
        if got == new:
            return expected.count(",")
        expected = got


def _items(store: dist.Store, key: str) -> list[str]:
    raw = str(store.compare_set(key, "\x00", "\x00").decode())  # (missing key: returns "\x00")
    return [] if raw == "\x00" else [t for t in raw.split(",") if t]


def waiting(store: dist.Store) -> list[str]:
    """Tokens of the processes that announced themselves and were not given a rank yet."""
    taken = int(store.add(f"{KEY}/join/taken", 0))
    return _items(store, WAITING)[taken:]


def _pair(store: dist.Store, tokens: list[str], free: list[int]) -> list[tuple[str, int]]:
    """Give each token (at most ``len(free)``) a free rank: the rank it prefers (``join(prefer=)``:
    a restarted worker's own) when free and not yet given, else the lowest left."""
    prefers = {}
    for token in tokens:
        key = f"{KEY}/join/{token}/prefers"
        if store.check([key]):
            prefers[token] = int(store.get(key))
    left, given = sorted(free), {}
    for token in tokens:
        if prefers.get(token) in left:
            given[token] = prefers[token]
            left.remove(given[token])
    for token in tokens:
        if token not in given:
            given[token] = left.pop(0)
    return [(token, given[token]) for token in tokens]


def assign(
    store: dist.Store,
    epoch: int,
    number: int,
    leader: bool,
    vacant: Callable[[], tuple[list[int], list[int]]],
    count: int,
    timeout: float,
) -> tuple[list[int], list[int]]:
    """Collective over the members: the leader waits (up to ``timeout`` seconds) until ``count``
    newcomers are waiting and ``count`` ranks are free (``vacant()``: the free ranks and the
    spares whose process is gone, whose ranks are free too), gives waiting tokens free ranks and
    publishes them; every member returns ``(ranks given, spares gone)`` once each newcomer is
    ready."""
    record_key = f"{KEY}/e{epoch}/admit-newcomers/{number}"
    if leader:
        started = time.monotonic()
        while True:
            free, gone = vacant()
            if len(waiting(store)) >= count and len(free) >= count:
                break
            if time.monotonic() - started >= timeout:
                break
            time.sleep(0.1)
        pairs = _pair(store, waiting(store)[: len(free)], free)
        for token, rank in pairs:
            store.set(f"{KEY}/join/{token}", str(rank))
        store.add(f"{KEY}/join/taken", len(pairs))
        store.set(record_key, json.dumps({"pairs": pairs, "gone": gone}))
    else:
        store.wait([record_key], timedelta(seconds=timeout))
    record = json.loads(store.get(record_key))
    pairs = record["pairs"]
    if pairs:
        ready = [f"{KEY}/join/{token}/ready" for token, _ in pairs]
        try:
            store.wait(ready, timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise MeshConfigError(
                f"newcomers {[t for t, _ in pairs]} were given ranks {[r for _, r in pairs]} but did not get "
                f"ready within {timeout:g}s ({exc})"
            ) from None
    return [int(r) for _, r in pairs], [int(r) for r in record["gone"]]


def announce(store: dist.Store, timeout: float, prefer: int | None = None) -> tuple[str, int, dict[str, Any]]:
    """On a new process: wait for the job's record, announce (asking for rank ``prefer`` if it
    is free), wait for a rank; returns ``(token, rank, job)``. ``store`` is the store the job's
    default group was given."""
    wait = timedelta(seconds=timeout)
    probe = dist.PrefixStore("0/", store)  # the default group's name is "0" unless told otherwise
    try:
        probe.wait([JOB], wait)
    except (RuntimeError, dist.DistError) as exc:
        raise MeshConfigError(
            f"no Elastic job found in this store within {timeout:g}s ({exc}): pass the store the job's "
            "init_process_group was given (torch's tcp:// and env:// rendezvous wrap it in "
            "PrefixStore('default_pg', store))"
        ) from None
    job = json.loads(probe.get(JOB))
    token = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    if prefer is not None:
        probe.set(f"{KEY}/join/{token}/prefers", str(int(prefer)))  # before the token is seen
    _append(probe, WAITING, token)
    try:
        probe.wait([f"{KEY}/join/{token}"], wait)
    except (RuntimeError, dist.DistError) as exc:
        raise TimeoutError(
            f"this process ({token}) was not given a rank within {timeout:g}s ({exc})"
        ) from None
    return token, int(probe.get(f"{KEY}/join/{token}")), job


def build_world(store: dist.Store, rank: int, job: dict[str, Any]) -> dist.Store:
    """Make this process's default group: rank ``rank`` of the job's world, over the job's store
    under the default group's name, never connected (see the module docstring). Returns the
    default store."""
    if dist.is_initialized():
        raise MeshConfigError(
            "Elastic.join() makes this process's default group: call it instead of init_process_group"
        )
    prefixed = dist.PrefixStore(f"{job['name']}/", store)
    timeout = timedelta(seconds=float(job["world_timeout"]))
    pg = unconnected_world(prefixed, rank, int(job["world"]), job["name"], timeout)
    register_world(pg, prefixed, job["name"], "cpu")
    set_default_world(pg, 1)
    return default_store()


def clear_heartbeat(store: dist.Store, rank: int) -> None:
    """Before the newcomer beats: its rank's counter starts over (the lost process's counter,
    possibly marked exited, is not this process's)."""
    store.set(heartbeat_key(rank), "0")


def ready(store: dist.Store, token: str) -> None:
    """The newcomer beats and holds its ``Elastic``: the survivors may go on."""
    store.set(f"{KEY}/join/{token}/ready", "1")


class Newcomers:
    """``Elastic``'s admissions: spares (``standby`` on the spare, ``grow``/``substitute`` on the
    members), and fresh processes (see the module docstring): ``Elastic.join`` on the new
    process, ``admit_newcomers`` on the members."""

    def _forget_ranks(self: Any, ranks: Sequence[int]) -> None:
        """New processes took ``ranks``: neither this rank's liveness nor its step watcher (which
        keeps its own, on its own connection) may judge them by the lost processes."""
        self.liveness.forget(ranks)
        if getattr(self, "_watcher", None) is not None:
            self._watcher.forget(ranks)

    def _admit_spares(self: Any, layout: Layout, admitted: Sequence[int]) -> MeshGroups | None:
        """Tell the admitted spares (in ``standby()``) the new layout, then rebuild over it."""
        self._enter_epoch(self.epoch + 1)
        if self.rank == self.members[0]:
            spares = sorted((set(self.spares) | set(self.members)) - set(layout.grid.ravel().tolist()))
            record = json.dumps(
                {
                    "epoch": self.epoch,
                    "layout": layout.to_dict(),
                    "spares": spares,
                    "grown": self.grown,
                    "admitted": list(admitted),
                }
            )
            for r in admitted:
                self.store.set(f"{KEY}/admit/{r}", record)
        return self.rebuild(layout, site="Elastic.grow / Elastic.standby")

    def standby(self: Any, timeout: float | None = None) -> MeshGroups:
        """On a spare: wait (``timeout`` seconds, default forever) until ``grow`` admits this
        rank; returns the new mesh. Raises ``TimeoutError`` when not admitted in time."""
        self._check_open("standby()")
        key = f"{KEY}/admit/{self.rank}"
        wait = timedelta(seconds=timeout) if timeout is not None else timedelta(days=365)
        try:
            self.store.wait([key], wait)
        except (RuntimeError, dist.DistError) as exc:
            raise TimeoutError(f"spare rank {self.rank} was not admitted within {timeout}s ({exc})") from None
        record = json.loads(self.store.get(key))
        self.store.delete_key(key)
        self._enter_epoch(int(record["epoch"]))
        self.spares = tuple(record["spares"])
        self.grown = tuple(record["grown"])
        # A newcomer may have taken a lost rank since this spare last looked: what it saw of the
        # lost process there (its pid, its counter) says nothing of the new one.
        self._forget_ranks(record.get("admitted", ()))
        layout = Layout.from_dict(record["layout"])
        self.members = tuple(r for r in sorted(layout.grid.ravel().tolist()) if r != self.rank)
        mg = self.rebuild(layout, site="Elastic.grow / Elastic.standby")
        if mg is None:
            raise MeshConfigError(f"spare rank {self.rank} was admitted but is not in the layout {layout!r}")
        return mg

    def _job(self: Any) -> dict[str, object]:
        """The settings a newcomer's ``Elastic`` is made with (``meshgroups.elastic._join``)."""
        o = self.options
        return {
            "layout": self.layout.to_dict(),
            "dim": self.dim,
            "flatten": self.flatten,
            "timeout": as_timedelta(o.timeout, default_timeout()).total_seconds(),
            "verdict_timeout": self.verdict_timeout,
            "heartbeat": o.heartbeat,
            "stale_after": self.stale_after,
            "device_type": o.device_type,
            "backend": o.backend,
        }

    @classmethod
    def join(cls, store: dist.Store, *, timeout: float | None = None, prefer: int | None = None) -> Any:
        """On a process started after the job, instead of ``init_process_group``: announce this
        process in the job's ``store`` (the store the job's default group was given), wait
        (``timeout`` seconds, default forever) until the survivors' ``admit_newcomers()`` gives it
        the rank of a lost process (``prefer``, when that rank is free: a restarted worker asks
        for its own), and return its ``Elastic``, a spare: call ``standby()``.

        Raises:
            MeshConfigError: no job in the store in time, or torch.distributed already initialised.
            TimeoutError: no rank was given in time.
        """
        wait = timeout if timeout is not None else 365 * 86400.0
        token, rank, job = announce(store, wait, prefer)
        default = build_world(store, rank, job)
        clear_heartbeat(default, rank)
        el: Any = cls.__new__(cls)
        el.rank = rank
        given = MeshOptions(device_type=job["device_type"], backend=job["backend"], timeout=job["timeout"])
        layout = Layout.from_dict(job["layout"])
        el._settle(
            layout,
            (),
            job["flatten"],
            job["dim"],
            given,
            job["verdict_timeout"],
            job["heartbeat"],
            job["stale_after"],
        )
        el.members = ()
        el.mg = el._world = None
        el.cohort = el._cohort((rank,), 0)  # (not made current: a spare makes no calls)
        ready(default, token)
        return el

    def admit_newcomers(self: Any, count: int = 0, timeout: float | None = None) -> tuple[int, ...]:
        """Collective over the members: give every process waiting in ``Elastic.join`` a free rank
        (lost: neither a member nor a spare; a rank it asked for when free, else the lowest
        first) and return those ranks (sorted), now spares: admit them with ``grow()`` or
        ``substitute()``. A spare whose process is gone (exited, or no heartbeat for
        ``stale_after``: a node whose launcher restarted its workers) is dropped and its rank is
        free too. With ``count``, first wait (up to ``timeout`` seconds, default
        ``verdict_timeout``) until that many are waiting and that many ranks are free.
        Processes beyond the free ranks keep waiting."""
        world = dist.get_world_size()

        def vacant() -> tuple[list[int], list[int]]:
            gone = sorted(self.liveness.gone(self.spares, self.stale_after)) if self.spares else []
            used = {*self.members, *self.spares} - set(gone)
            return [r for r in range(world) if r not in used], gone

        self._newcomer_calls = getattr(self, "_newcomer_calls", 0) + 1
        ranks, gone = assign(
            self.store,
            self.epoch,
            self._newcomer_calls,
            self.rank == self.members[0],
            vacant,
            min(count, world - len(self.members)),
            timeout if timeout is not None else self.verdict_timeout,
        )
        if gone:
            logger.warning(
                "meshgroups: spares %s are gone (their processes ended); their ranks are free", gone
            )
        self._forget_ranks([*ranks, *gone])
        self.spares = tuple(sorted((set(self.spares) - set(gone)) | set(ranks)))
        return tuple(sorted(ranks))


__all__ = [
    "Newcomers",
    "announce",
    "assign",
    "build_world",
    "clear_heartbeat",
    "publish_job",
    "ready",
    "waiting",
]
