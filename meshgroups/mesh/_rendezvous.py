"""One meeting of the ranks inside a collective call, through the default store.

A collective call (``meshgroups.mesh._collective``) has a number agreed by counting; its meetings
are numbered within it, and a meeting's keys live under ``meshgroups/rdzv/<call>/<meeting>/``.
A meeting has three phases, each a barrier whose outcome is decided exactly once, by
``compare_set`` on a state key (first writer wins):

1. *arrive* — rank 0 (a cohort's first member) publishes its argument digests, every rank raises
   torch's group counters to the common maximum, says whether its arguments differ from the
   first arrival's (a fingerprint, ``compare_set`` on one key), and counts itself in; the last
   arrival sets ``arrived``. A rank that gave up waiting sets ``abandoned`` instead, so a rank
   arriving later raises rather than passing alone; a rank that failed sets ``failed`` so the
   others stop waiting. Where no rank differs (the usual case) the meeting ends here.
2. *verify* (only where some rank differs) — every rank compares its digests with rank 0's and
   records what differs; the last sets ``verified``, and then every rank raises the same
   ``MismatchError`` naming the argument and the ranks, or goes on.
3. *built* — after creating its groups every rank reports (``ok``, or why it failed); the state
   is decided once every rank reported or when the wait ends, so every rank raises the same
   error: the first failure that was not merely waiting on a peer, else the first failure, else
   the ranks that never reported (dead or hung: a peer stuck in gloo's connect reports when its
   own timeout ends, so this wait lasts a grace period longer).

Every wait is bounded by the timeout *and* watches liveness (``meshgroups.mesh._liveness``):
the first ``WATCHERS`` ranks to arrive at a phase (every rank in a world of up to
``WATCH_ALL_UP_TO``) poll the state key, look at the ranks still absent every ``LOOK_EVERY``
seconds and log "still waiting for ..." every ``report_every`` seconds; when an absent rank has
exited or stopped responding, a watcher decides the phase (``abandoned`` with the gone ranks):
every rank raises the same ``RanksGoneError`` naming them. A timeout names the ranks that never
arrived (and their last words), a lost store is a ``StoreConnectionError``. O(1) store ops a rank.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshgroups.errors import MeshBuildError, RendezvousTimeoutError, StoreConnectionError
from meshgroups.mesh._failure_records import failure_record, from_record, shared, waiting_on_peer
from meshgroups.mesh._liveness import Liveness
from meshgroups.mesh._mismatch import mismatch_error
from meshgroups.mesh._options import DEFAULT_LEASE, DEFAULT_REPORT_EVERY
from meshgroups.mesh._waiting import Lookout, gone_error, poll_key

PREFIX = "meshgroups/rdzv"
PHASES = ("state", "verify", "built")
#: Worlds up to this size get the exact list of missing ranks in a timeout message.
NAME_MISSING_UP_TO = 4096
#: How many of a phase's first arrivals watch the others' liveness (the rest wait on the key).
WATCHERS = 2
#: Worlds (or cohorts) up to this size: every rank watches, so every rank logs who it waits for.
WATCH_ALL_UP_TO = 16


class Meeting:
    """One meeting of a collective call; see the module docstring."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        what: str,
        base: str,
        timeout: timedelta,
        last_words: Callable[[list[int]], str] = lambda ranks: "",
        members: Sequence[int] | None = None,
        watch: Callable[[], Callable[[Sequence[int]], Any]] | None = None,
        *,
        site: str = "",
        observer: Liveness | None = None,
        lease: float = DEFAULT_LEASE,
        report_every: float = DEFAULT_REPORT_EVERY,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.what = what  # e.g. "flatten call #7"
        self.base = base
        self.timeout = timeout
        self.last_words = last_words  # what the named ranks last published
        # The ranks that meet (a cohort of live ranks; default the whole world) and the one
        # that publishes the reference arguments.
        self.members: Sequence[int] = tuple(members) if members is not None else range(world_size)
        self.leader = self.members[0]
        # Liveness (``meshgroups.mesh._liveness``): a rank that died is not waited for until the
        # timeout. A cohort's own probe (``Cohort.watch``) wins over the process's observer.
        self.watch = watch
        self.site = f" ({site})" if site else ""
        self.observer, self.lease, self.report_every = observer, lease, report_every
        self.dead: dict[int, str] = {}  # the awaited ranks found gone in the last wait, and how
        self.arrival = 0  # this rank's place in the order of arrival at the current phase (1: first)
        # what this meeting set in the store, so a success deletes only keys that exist
        self.phases: list[str] = []  # the phases this rank counted itself in at
        self.counter_names: tuple[str, ...] = ()
        self.shown_set = self.differed = False

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def state_key(self, phase: str) -> str:
        """The key that holds ``phase``'s outcome once it is decided."""
        return self._key(phase)

    # ------------------------------------------------------------------ store access
    def lost(self, exc: BaseException, where: str = "during") -> StoreConnectionError:
        return shared(
            StoreConnectionError(
                f"rank {self.rank} lost the connection to the rendezvous store {where} {self.what} "
                f"(the store is hosted by rank 0 under torchrun/tcp://; did it die?): {exc}"
            )
        )

    def op(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)``, a lost connection reported as such."""
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, dist.DistError) as exc:  # DistStoreError is both
            raise self.lost(exc) from None

    def publish_failure(self, exc: BaseException, phases: tuple[str, ...] = PHASES) -> str:
        """Tell the other ranks this rank failed, so they stop waiting (first writer of each
        phase wins). Returns the failure that counts for the first phase. A store that is gone
        is a ``StoreConnectionError``."""
        mine = failure_record(self.rank, exc)
        first = ""
        for phase in phases:
            state = self.op("compare_set", self._key(phase), "", mine).decode()
            first = first or state
        return first if first.startswith("failed") else mine

    def _wait(self, key: str, seconds: float, where: str, phase: str) -> bool:
        """Wait for ``key``; False when the wait timed out, or (on a watching rank: one of the
        first ``WATCHERS`` to arrive, any in a small world) as soon as a rank that has not
        reached ``phase`` is gone (then named in ``self.dead``). The other ranks wait on the
        key, which the watcher that sees the death sets."""
        self.dead = {}
        watching = 0 < self.arrival <= WATCHERS or self.world_size <= WATCH_ALL_UP_TO
        if self._probe() is not None and self.world_size <= NAME_MISSING_UP_TO and watching:
            return self._watch(key, seconds, where, phase)
        try:
            self.store.wait([key], timedelta(seconds=max(seconds, 0.001)))
            return True
        except (RuntimeError, dist.DistError) as exc:
            if "timeout" not in str(exc).lower():
                raise self.lost(exc, f"at {where} of") from None
            return False

    def _probe(self) -> Callable[[Sequence[int]], Any] | None:
        """The liveness probe of one wait: ``ranks -> gone ranks`` (a dict saying how, or a list)."""
        if self.watch is not None:
            return self.watch()
        if self.observer is not None:
            observer, lease = self.observer, self.lease
            return lambda ranks: observer.gone(ranks, lease)
        return None

    def _watch(self, key: str, seconds: float, where: str, phase: str) -> bool:
        """``_wait`` by polling the key (``poll_key``), watching the ranks not at ``phase``."""
        probe = self._probe()
        if probe is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: no liveness probe")
        started = time.monotonic()
        lookout = Lookout(
            lambda: self._absent(phase),
            f"{where} of {self.what}{self.site}",
            self.rank,
            probe,
            self.report_every,
            started,
            self.timeout,
            self.observer.unseen if self.observer is not None else None,
        )
        found = poll_key(lambda: bool(self.op("check", [key])), started + seconds, lookout)
        self.dead = found or {}  # (None: the key is there)
        return found is None

    def _wait_state(self, phase: str, done: str, where: str, started: float, late: bool = False) -> None:
        """Wait for ``phase``'s state key; return if it says ``done``, raise otherwise."""
        key = self._key(phase)
        state = None
        if not late and not self._wait(
            key, self.timeout.total_seconds() - (time.monotonic() - started), where, phase
        ):
            elapsed = time.monotonic() - started
            record = f"abandoned\n{self.rank}\n{elapsed:.1f}\n{json.dumps(self.dead)}"
            state = self.op("compare_set", key, "", record).decode()
        if state is None:
            state = self.op("get", key).decode()
        if state == done:
            return  # (also when the last rank arrived just as this one gave up)
        if state.startswith("failed"):
            raise from_record(
                state,
                lambda r, cls, msg: (
                    f"rank {r} failed before {where} of {self.what} ({cls}: {msg}); this is rank {self.rank}"
                ),
            )
        _, who, after, dead_json = (state + "\n{}").split("\n")[:4]
        dead = _gone(dead_json)
        if dead:  # the probe saw them go: no point waiting the timeout out
            died = gone_error(
                self.rank,
                dead,
                f"never reached {where} of {self.what}{self.site}",
                f"{self.last_words(sorted(dead))}; seen by rank {who} after {after}s of waiting",
            )
            died._mg_gone = len(dead)  # type: ignore[attr-defined]  # not waited for at the close
            raise shared(died)
        if late:
            raise shared(
                RendezvousTimeoutError(
                    f"rank {self.rank} reached {where} of {self.what}{self.site} after rank {who} gave up waiting "
                    f"({after}s); every rank raises, none builds groups alone"
                )
            )
        raise shared(
            RendezvousTimeoutError(
                f"rank {self.rank}: {self._missing(phase)} at {where} of {self.what}{self.site} (rank {who} gave up "
                f"after {after}s; this rank waited {time.monotonic() - started:.1f}s, timeout "
                f"{self.timeout.total_seconds():g}s); is it called on every rank, with the same timeout?"
            )
        )

    def _absent(self, phase: str) -> list[int] | None:
        if self.world_size > NAME_MISSING_UP_TO:
            return None
        return [r for r in self.members if not self.op("check", [self._key(f"{phase}/here/{r}")])]

    def _missing(self, phase: str) -> str:
        arrived = int(self.op("add", self._key(f"{phase}/count"), 0))
        absent = self._absent(phase)
        if absent is None:
            return f"{self.world_size - arrived} of {self.world_size} ranks never arrived"
        if not absent:
            return "every rank arrived, but too late"
        return f"{_ranks(absent)} never arrived ({arrived} of {self.world_size} did{self.last_words(absent)})"

    def _barrier(self, phase: str, done: str, where: str, started: float) -> None:
        if self.op("check", [self._key(phase)]):
            self._wait_state(phase, done, where, started, late=True)  # decided without this rank
            return
        self.op("set", self._key(f"{phase}/here/{self.rank}"), "1")
        self.phases.append(phase)
        self.arrival = int(self.op("add", self._key(f"{phase}/count"), 1))
        if self.arrival == self.world_size:
            self.op("compare_set", self._key(phase), "", done)
        self._wait_state(phase, done, where, started)

    def _raise_up_to_max(self, name: str, value: int) -> None:
        key = self._key(f"max/{name}")
        current = self.op("compare_set", key, "", str(value)).decode()
        while int(current) < value:
            seen = current
            current = self.op("compare_set", key, seen, str(value)).decode()

    # ------------------------------------------------------------------ phases
    def agree(
        self, digests: Mapping[str, str], shown: Mapping[str, str], counters: Mapping[str, int]
    ) -> dict[str, int]:
        """Phases 1 and 2. Returns the maximum of each counter over all ranks; raises the same
        error on every rank if any argument differs from rank 0's (``shown`` is what the
        message prints for each argument; ``call_site`` is compared only between ranks that run
        the same ``program``)."""
        started = time.monotonic()
        self.counter_names = tuple(counters)
        if self.rank == self.leader:
            self.op("set", self._key("ref"), json.dumps(digests))
            self.op("set", self._key(f"mine/{self.leader}"), json.dumps(shown))
            self.shown_set = True
        for name, value in counters.items():
            self._raise_up_to_max(name, value)
        # A rank whose arguments differ from the first arrival's says so before it counts itself
        # in, so after the barrier every rank reads the same answer: where all agree (the usual
        # case) the meeting ends there, one barrier instead of two; else phase 2 runs as below.
        mine = _fingerprint(digests)
        if self.op("compare_set", self._key("digest"), "", mine).decode() != mine:
            self.op("set", self._key("differ"), "1")
        self._barrier("state", "arrived", "the cross-rank check", started)
        if self.op("check", [self._key("differ")]):
            self.differed = True
            self._verify(digests, shown, started)
        return {name: int(self.op("get", self._key(f"max/{name}"))) for name in counters}

    def _verify(self, digests: Mapping[str, str], shown: Mapping[str, str], started: float) -> None:
        """Phase 2: every rank records how its arguments differ from the leader's, then the same
        ``MismatchError`` everywhere (none: ranks of different programs at different lines)."""
        reference = json.loads(self.op("get", self._key("ref")))
        differing = [
            arg
            for arg, digest in digests.items()
            if reference.get(arg) != digest
            and arg != "program"
            and not (arg == "call_site" and reference.get("program") != digests.get("program"))
        ]
        if differing:
            entry = json.dumps([self.rank, {arg: digests[arg] for arg in differing}])
            self.op("append", self._key("bad"), entry + "\n")
            self.op("set", self._key(f"mine/{self.rank}"), json.dumps(shown))
            self.shown_set = True
        self._barrier("verify", "verified", "the comparison", started)
        if self.op("check", [self._key("bad")]):
            self._raise_mismatch(reference)

    def _raise_mismatch(self, reference: Mapping[str, str]) -> None:
        bad = self.op("get", self._key("bad")).decode()

        def shown_of(r: int) -> Mapping[str, str]:
            return dict(json.loads(self.op("get", self._key(f"mine/{r}"))))

        what, leader, size = self.what, self.leader, self.world_size
        error = mismatch_error(
            bad, shown_of, reference, leader=leader, world_size=size, what=what, rank=self.rank
        )
        raise shared(error)

    def finish(self, error: BaseException | None, grace: float) -> None:
        """Phase 3: report this rank's build (``None``: success) and wait for every rank's; the
        same ``MeshBuildError`` on every rank if any failed or never reported (the caller has
        already released what this rank created)."""
        started = time.monotonic()
        record = "ok" if error is None else failure_record(self.rank, error)
        if error is not None:
            # The first failure of its kind is kept; a peer's timeout is not the cause.
            kind = "second" if waiting_on_peer(error) else "first"
            self.op("compare_set", self._key(f"fail/{kind}"), "", record)
        if self.op("check", [self._key("built")]):
            self._decide_built(started)  # decided without this rank (it was too slow)
            return
        self.op("set", self._key(f"built/here/{self.rank}"), record)
        self.phases.append("built")
        self.arrival = int(self.op("add", self._key("built/count"), 1))
        if self.arrival == self.world_size:
            self.op("compare_set", self._key("built"), "", "reported")
        if not self._wait(
            self._key("built"), self.timeout.total_seconds() + grace, "the end of group creation", "built"
        ):
            absent = self._absent("built")
            count = int(self.op("add", self._key("built/count"), 0))
            dead = json.dumps({str(r): how for r, how in self.dead.items()})
            verdict = f"silent\n{json.dumps(absent)}\n{self.world_size - count}\n{dead}"
            self.op("compare_set", self._key("built"), "", verdict)
        self._decide_built(started)

    def _decide_built(self, started: float) -> None:
        # A failure of its own comes first, then ranks that never reported (a dead rank leaves its
        # peers timing out in gloo: their failures are the symptom), then a peer's timeout.
        state = self.op("get", self._key("built")).decode()
        if state.startswith("failed"):  # a rank failed outside group creation, after the check
            raise from_record(
                state,
                lambda r, cls, msg: f"{self.what} failed on rank {r} ({cls}: {msg}). {self._after_failure()}",
            )
        self._raise_recorded("first")
        if state.startswith("silent"):
            _, absent_json, n_absent, dead_json = (state + "\n{}").split("\n")[:4]
            absent = json.loads(absent_json)
            dead = _gone(dead_json)
            waited = f"this rank waited {time.monotonic() - started:.1f}s"
            error: MeshBuildError
            if dead:  # decided as soon as they went: ranks alive but not there yet are not named
                error = gone_error(
                    self.rank,
                    dead,
                    f"never reported the end of group creation of {self.what}{self.site}",
                    f"{self.last_words(sorted(dead))}; {waited}. {self._after_failure()}",
                )
                error._mg_gone = len(dead)  # type: ignore[attr-defined]  # not waited for at the close
                raise shared(error)
            who = _ranks(absent) if absent is not None else f"{n_absent} of {self.world_size} ranks"
            error = MeshBuildError(
                f"{who} never reported the end of group creation of {self.what}{self.site} (dead or hung"
                f"{self.last_words(absent or [])}; {waited}). " + self._after_failure()
            )
            error._mg_gone = int(n_absent)  # type: ignore[attr-defined]  # not waited for at the close
            raise shared(error)
        self._raise_recorded("second")

    def _raise_recorded(self, kind: str) -> None:
        if not self.op("check", [self._key(f"fail/{kind}")]):
            return
        _, failed_rank, path, message = self.op("get", self._key(f"fail/{kind}")).decode().split("\n", 3)
        raise shared(
            MeshBuildError(
                f"{self.what} failed on rank {failed_rank} while creating groups "
                f"({path.partition(':')[2]}: {message}). {self._after_failure()}"
            )
        )

    def _after_failure(self) -> str:
        return (
            f"This is rank {self.rank}: every group this call created here has been destroyed and "
            "torch's group counters are re-aligned by the next call, so making the same call again on "
            "every rank is safe"
        )

    def own_keys(self) -> list[str]:
        """This rank's keys in this meeting (each rank deletes its own): those it set."""
        mine = [f"mine/{self.rank}"] if self.shown_set else []
        return [self._key(n) for n in [f"{p}/here/{self.rank}" for p in self.phases] + mine]

    def shared_keys(self) -> list[str]:
        """The meeting's shared keys after it succeeded (deleted by the last rank out of the call):
        those the phases it went through set (a mismatch or a failure would have raised). Every
        rank went through the same phases, so any rank lists every rank's."""
        names = [f"{phase}{suffix}" for phase in self.phases for suffix in ("", "/count")]
        if "state" in self.phases:
            names += ["ref", "digest"] + (["differ", "bad"] if self.differed else [])
            names += [f"max/{c}" for c in self.counter_names]
        return [self._key(n) for n in names]


def _fingerprint(digests: Mapping[str, str]) -> str:
    """What phase 1 compares: every argument but ``program`` (equal fingerprints everywhere
    mean phase 2 would find nothing)."""
    compared = {arg: digest for arg, digest in digests.items() if arg != "program"}
    return hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).hexdigest()


def _gone(text: str) -> dict[int, str]:
    """The gone ranks of a record: ``{"3": "exited"}`` (or a list, from an older record)."""
    value = json.loads(text or "{}")
    if isinstance(value, list):
        return {int(r): "stopped responding" for r in value}
    return {int(r): str(how) for r, how in value.items()}


def _ranks(ranks: list[int]) -> str:
    names = ", ".join(map(str, ranks[:16])) + (", …" if len(ranks) > 16 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {names}"
