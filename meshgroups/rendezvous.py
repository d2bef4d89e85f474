"""The cross-rank rendezvous of ``init_mesh``: a numbered meeting through the default store.

Every ``init_mesh`` call on a process takes the next *generation* number the moment it starts,
even if it fails before meeting anyone, so ranks that all called ``init_mesh`` N times agree on
N. Keys live under ``meshgroups/rdzv/<generation>/`` and the last rank to leave deletes them.

One meeting has three phases, each a barrier whose outcome is decided exactly once, by
``compare_set`` on a state key (first writer wins):

1. *arrive* — rank 0 publishes its argument digests, every rank raises torch's group counters to
   the common maximum and counts itself in; the last arrival sets ``arrived``. A rank that gave
   up waiting sets ``abandoned`` instead, so a rank arriving later raises rather than passing
   alone; a rank that failed before the meeting sets ``failed`` so the others stop waiting.
2. *verify* — every rank compares its digests with rank 0's and records what differs; the last
   sets ``verified``, and then every rank raises the same ``MismatchError`` naming the argument
   and the ranks, or goes on.
3. *built* — after creating its groups every rank counts itself in again (or records why it
   failed), so a failure anywhere is an error everywhere, never a half-built mesh.

Every wait is bounded by the call's timeout; a timeout names the ranks that never arrived and
the real time waited; a lost store connection is a ``StoreConnectionError``. O(1) store
operations per rank on the success path.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import errors
from .errors import MeshBuildError, MismatchError, RendezvousTimeout, StoreConnectionError

PREFIX = "meshgroups/rdzv"
PHASES = ("state", "verify", "built")
#: Worlds up to this size get the exact list of missing ranks in a timeout message.
NAME_MISSING_UP_TO = 4096

_generation_lock = threading.Lock()
_generation: dict[str, Any] = {"group": None, "n": 0}


def next_generation(default_group: object) -> int:
    """The number of this ``init_mesh`` call on this process (restarts with a new default group)."""
    with _generation_lock:
        if _generation["group"] is not default_group:
            _generation["group"] = default_group
            _generation["n"] = 0
        _generation["n"] += 1
        return int(_generation["n"])


class _Failed(Exception):
    def __init__(self, record: str) -> None:
        super().__init__(record)
        self.record = record


def _error_class(name: str) -> type[Exception]:
    ours = getattr(errors, name, None)
    if isinstance(ours, type) and issubclass(ours, Exception):
        return ours
    return {"ValueError": ValueError, "TypeError": TypeError, "TimeoutError": TimeoutError}.get(
        name, RuntimeError
    )


def failure_record(rank: int, exc: BaseException) -> str:
    return f"failed\n{rank}\n{type(exc).__name__}\n{exc}"


def raise_failure(record: str, rank: int, generation: int, phase: str) -> None:
    """Raise, on a rank that did not fail itself, the error another rank recorded."""
    _, failed_rank, cls_name, message = record.split("\n", 3)
    cls = _error_class(cls_name)
    text = f"rank {failed_rank} failed {phase} of init_mesh call #{generation} ({cls_name}: {message}); this is rank {rank}"
    if issubclass(cls, MismatchError):
        raise cls(text, argument=message)
    raise cls(text)


class Rendezvous:
    """One ``init_mesh`` call's meeting; see the module docstring."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, generation: int, timeout: timedelta
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.timeout = timeout
        self.base = f"{PREFIX}/{generation}"

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}"

    # ------------------------------------------------------------------ store access
    def _lost(self, exc: BaseException, where: str = "during") -> StoreConnectionError:
        return StoreConnectionError(
            f"rank {self.rank} lost the connection to the rendezvous store {where} init_mesh call "
            f"#{self.generation} (the store is hosted by rank 0 under torchrun/tcp://; did it die?): {exc}"
        )

    def _op(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)``, a lost connection reported as such."""
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, dist.DistError) as exc:  # DistStoreError is both
            raise self._lost(exc) from None

    def publish_failure(self, exc: BaseException, phase: str = "state") -> str:
        """Best effort: tell the other ranks this rank failed, so they stop waiting. Returns the
        failure that counts: the first one recorded for ``phase`` (this rank's if the store is gone)."""
        mine = failure_record(self.rank, exc)
        try:
            first = self.store.compare_set(self._key(phase), "", mine).decode()
        except Exception:
            return mine  # the store itself is gone; the others will time out or lose it too
        return first if first.startswith("failed") else mine

    def _wait_state(self, phase: str, done: str, what: str, started: float, late: bool = False) -> None:
        """Wait for ``phase``'s state key; return if it says ``done``, raise otherwise."""
        key = self._key(phase)
        remaining = self.timeout.total_seconds() - (time.monotonic() - started)
        state = None
        if not late:
            try:
                self.store.wait([key], timedelta(seconds=max(remaining, 0.001)))
            except (RuntimeError, dist.DistError) as exc:
                if "timeout" not in str(exc).lower():
                    raise self._lost(exc, f"at {what} of") from None
                elapsed = time.monotonic() - started
                abandon = f"abandoned\n{self.rank}\n{elapsed:.1f}"
                state = self._op("compare_set", key, "", abandon).decode()
        if state is None:
            state = self._op("get", key).decode()
        if state == done:
            return  # (also when the last rank arrived just as this one gave up)
        if state.startswith("failed"):
            raise _Failed(state)
        _, who, after = state.split("\n")
        elapsed = time.monotonic() - started
        if late:
            raise RendezvousTimeout(
                f"rank {self.rank} reached {what} of init_mesh call #{self.generation} after rank {who} "
                f"gave up waiting ({after}s); every rank raises, none builds groups alone"
            )
        raise RendezvousTimeout(
            f"rank {self.rank}: {self._missing(phase)} at {what} of init_mesh call #{self.generation} "
            f"(rank {who} gave up after {after}s; this rank waited {elapsed:.1f}s, timeout "
            f"{self.timeout.total_seconds():g}s); is init_mesh called on every rank, with the same timeout?"
        )

    def _missing(self, phase: str) -> str:
        arrived = int(self._op("add", self._key(f"{phase}/count"), 0))
        if self.world_size > NAME_MISSING_UP_TO:
            return f"{self.world_size - arrived} of {self.world_size} ranks never arrived"
        absent = [
            r for r in range(self.world_size) if not self._op("check", [self._key(f"{phase}/here/{r}")])
        ]
        if not absent:
            return "every rank arrived, but too late"
        names = ", ".join(map(str, absent[:16])) + (", …" if len(absent) > 16 else "")
        return (
            f"rank{'s' if len(absent) > 1 else ''} {names} never arrived ({arrived} of {self.world_size} did)"
        )

    def _barrier(self, phase: str, done: str, what: str, started: float) -> None:
        if self._op("check", [self._key(phase)]):
            self._wait_state(phase, done, what, started, late=True)  # decided without this rank
            return
        self._op("set", self._key(f"{phase}/here/{self.rank}"), "1")
        if self._op("add", self._key(f"{phase}/count"), 1) == self.world_size:
            self._op("compare_set", self._key(phase), "", done)
        self._wait_state(phase, done, what, started)

    def _raise_up_to_max(self, name: str, value: int) -> None:
        key = self._key(f"max/{name}")
        current = self._op("compare_set", key, "", str(value)).decode()
        while int(current) < value:
            seen = current
            current = self._op("compare_set", key, seen, str(value)).decode()

    # ------------------------------------------------------------------ phases
    def agree(
        self, digests: Mapping[str, str], shown: Mapping[str, str], counters: Mapping[str, int]
    ) -> dict[str, int]:
        """Phases 1 and 2. Returns the maximum of each counter over all ranks; raises the same
        error on every rank if any argument differs from rank 0's (``shown`` is what the
        message prints for each argument)."""
        started = time.monotonic()
        try:
            if self.rank == 0:
                self._op("set", self._key("ref"), json.dumps(digests))
                self._op("set", self._key("mine/0"), json.dumps(shown))
            for name, value in counters.items():
                self._raise_up_to_max(name, value)
            self._barrier("state", "arrived", "the cross-rank check", started)
            reference = json.loads(self._op("get", self._key("ref")))
            differing = [arg for arg, digest in digests.items() if reference.get(arg) != digest]
            if differing:
                entry = ",".join(f"{arg}={digests[arg]}" for arg in differing)
                self._op("append", self._key("bad"), f"{self.rank}:{entry};")
                self._op("set", self._key(f"mine/{self.rank}"), json.dumps(shown))
            self._barrier("verify", "verified", "the comparison", started)
            if self._op("check", [self._key("bad")]):
                self._raise_mismatch(digests, reference)
            return {name: int(self._op("get", self._key(f"max/{name}"))) for name in counters}
        except _Failed as failed:
            raise_failure(failed.record, self.rank, self.generation, "before the cross-rank check")
            raise  # unreachable

    def _raise_mismatch(self, digests: Mapping[str, str], reference: Mapping[str, str]) -> None:
        entries = self._op("get", self._key("bad")).decode().strip(";").split(";")
        by_arg: dict[str, dict[int, str]] = {}
        for entry in entries:
            r, args = entry.split(":", 1)
            for pair in args.split(","):
                arg, digest = pair.split("=", 1)
                by_arg.setdefault(arg, {})[int(r)] = digest
        order = list(reference)
        first = min(by_arg, key=lambda a: order.index(a) if a in order else len(order))
        ranks = sorted(by_arg[first])
        odd, usual = ranks[0], 0
        if len(ranks) > self.world_size // 2 and len(set(by_arg[first].values())) == 1:
            # Most ranks agree with each other, not with rank 0: rank 0 is the odd one out.
            odd, usual, ranks = 0, ranks[0], [0]
        odd_shown = json.loads(self._op("get", self._key(f"mine/{odd}")))
        usual_shown = json.loads(self._op("get", self._key(f"mine/{usual}")))
        others = [a for a in by_arg if a != first]
        raise MismatchError(
            f"init_mesh call #{self.generation} was made with a different {first!r} on rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:16]))}"
            f"{', …' if len(ranks) > 16 else ''}: rank {odd} has {first}={odd_shown.get(first)} but rank "
            f"{usual} has {first}={usual_shown.get(first)}"
            + (f" (also differing: {', '.join(others)})" if others else "")
            + f"; this is rank {self.rank}. Every rank must call init_mesh with the same arguments",
            argument=first,
            ranks=tuple(ranks),
        )

    def finish(self, error: BaseException | None) -> None:
        """Phase 3: every rank reports its build; ``MeshBuildError`` on every rank if any failed
        (the caller has already released what this rank created)."""
        started = time.monotonic()
        if error is not None:
            self._raise_build_failure(self.publish_failure(error, "built"))
        try:
            self._barrier("built", "built", "the end of group creation", started)
        except _Failed as failed:
            self._raise_build_failure(failed.record)

    def _raise_build_failure(self, record: str) -> None:
        _, failed_rank, cls_name, message = record.split("\n", 3)
        raise MeshBuildError(
            f"init_mesh call #{self.generation} failed on rank {failed_rank} while creating groups "
            f"({cls_name}: {message}). This is rank {self.rank}: every group this call created here has "
            "been destroyed and torch's group counters are re-aligned by the next call, so calling "
            "init_mesh again on every rank is safe"
        )

    def leave(self, counters: tuple[str, ...], extra_prefixes: tuple[str, ...] = ()) -> None:
        """Delete this meeting's keys: each rank its own, the last rank out the shared ones (and,
        with ``extra_prefixes``, every key under them: one ``list_keys`` call)."""
        mine = [f"{phase}/here/{self.rank}" for phase in PHASES] + [f"mine/{self.rank}"]
        for name in mine:
            self._op("delete_key", self._key(name))
        if self._op("add", self._key("left"), 1) != self.world_size:
            return
        shared = ["ref", "bad", "left"] + [f"max/{c}" for c in counters]
        shared += [f"{phase}{suffix}" for phase in PHASES for suffix in ("", "/count")]
        for name in shared:
            self._op("delete_key", self._key(name))
        if extra_prefixes:
            for key in self._op("list_keys"):
                if key.startswith(extra_prefixes):
                    self.store.delete_key(key)
