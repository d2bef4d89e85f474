"""The store torch's group creation waits on, inside a meshgroups call: its waits watch liveness.

Creating a gloo group connects every pair of its members through the store: each member
publishes its address and waits for the others'. A member that died waits no more, and torch
would leave the rest in that wait until the group's timeout (30 minutes by default). While a
collective call creates groups, the default store's entry is a ``WatchedStore`` (through
``creation_store_prefix``): its ``wait`` and ``get`` poll the key and, every ``LOOK_EVERY``
seconds, the liveness of the group being created (``watching(ranks)`` names it), and raise
``RanksGoneError`` — a ``TimeoutError``, so the build takes it for waiting on a peer, not a
failure of its own — as soon as a member has exited or stopped responding, or a
``RendezvousTimeoutError`` once another rank decided the call (a member of a group this rank
is not in went away). torch passes the exception through unchanged; the call then ends on
every rank naming the dead rank.

Only used where creation connects eagerly (gloo): groups that connect later (NCCL, lazy gloo)
would call this store after the call, and a group keeps its store for its lifetime; each group
made here keeps its ``WatchedStore`` alive as long as it lives (``keep``) for the same reason.

    >>> WatchedStore.__mro__[1].__name__
    'Store'
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from meshgroups.errors import RendezvousTimeoutError
from meshgroups.mesh._liveness import Liveness
from meshgroups.mesh._waiting import Lookout, gone_error

if TYPE_CHECKING:
    from meshgroups.mesh._collective import Call

_current: list[WatchedStore | None] = [None]
# each group made through a WatchedStore keeps it alive (torch holds only its C++ half)
_kept: weakref.WeakKeyDictionary[Any, WatchedStore] = weakref.WeakKeyDictionary()


class WatchedStore(dist.Store):
    """``inner`` with waits that give up when a rank of the group being created is gone.

    Args:
        inner: the default store.
        rank: this rank. members: the ranks of the call (watched when no group is named).
        what: the call, for messages (``"init_mesh call #3 (train.py:40)"``).
        observer: the liveness observer; lease, report_every: its settings for these waits.
        timeout: the bound of a wait given without one.
        ended: a store key set once the call's outcome is decided elsewhere (its meeting's
            ``built`` state): a wait stops when it appears.
    """

    def __init__(
        self,
        inner: dist.Store,
        rank: int,
        members: Sequence[int],
        what: str,
        observer: Liveness,
        lease: float,
        report_every: float,
        timeout: timedelta,
        ended: str | None = None,
    ) -> None:
        super().__init__()
        self.inner, self.rank, self.members, self.what = inner, rank, members, what
        self.observer, self.lease, self.report_every = observer, lease, report_every
        self.bound = timeout
        self.ended = ended  # a key set once the call's outcome is decided (then stop waiting)
        self.ranks: tuple[int, ...] = ()  # the group being created

    @classmethod
    def for_call(cls, call: Call) -> WatchedStore | None:
        """The store the group creation of ``call`` waits on, or ``None`` (no store, no observer)."""
        if not call.enabled or call.observer is None:
            return None
        return cls(
            call.store,  # type: ignore[arg-type]
            call.rank,
            call.members if call.members is not None else range(call.world_size),
            f"{call.what} ({call.site})",
            call.observer,
            call.lease,
            call.report_every,
            call.timeout,
            call.open.state_key("built") if call.open is not None else None,
        )

    # ------------------------------------------------------------------ waits
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self.inner.check(keys):
            return
        bound = timeout if timeout is not None and timeout > timedelta(0) else self.bound
        started = time.monotonic()
        ranks = self.ranks or tuple(self.members)
        where = f"the creation of group {list(ranks)[:16]} in {self.what}"
        lookout = Lookout(
            ranks,
            where,
            self.rank,
            lambda rs: self.observer.gone(rs, self.lease),
            self.report_every,
            started,
            bound,
            self.observer.unseen,
        )
        deadline, pause = started + bound.total_seconds(), 0.0005
        while not self.inner.check(keys):
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(f"wait timeout after {bound}, keys: {keys}")
            gone = lookout.gone()
            if gone:
                raise gone_error(self.rank, gone, f"went away during {where}")
            if self.ended is not None and self.inner.check([self.ended]):
                # another rank ended the call (a member of another group is gone): the peers
                # this wait needs have left it
                raise RendezvousTimeoutError(
                    f"rank {self.rank}: {self.what} ended on another rank during {where}"
                )
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.02)

    def get(self, key: str) -> bytes:
        self.wait([key])  # (a get of a missing key blocks in the store: NCCL's unique id)
        return bytes(self.inner.get(key))

    # ------------------------------------------------------------------ the rest, as the store
    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def append(self, key: str, value: Any) -> None:
        self.inner.append(key, value)  # type: ignore[attr-defined]

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return list(self.inner.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]

    def list_keys(self) -> list[str]:
        return list(self.inner.list_keys())

    def has_extended_api(self) -> bool:
        return True

    def set_timeout(self, timeout: timedelta) -> None:
        self.bound = timeout

    def clone(self) -> dist.Store:
        return self.inner.clone()  # type: ignore[attr-defined]


@contextmanager
def watching(ranks: Sequence[int]) -> Iterator[None]:
    """Inside: the current ``WatchedStore`` (if any) watches ``ranks``, the group being created."""
    store = _current[0]
    if store is None:
        yield
        return
    previous, store.ranks = store.ranks, tuple(int(r) for r in ranks)
    try:
        yield
    finally:
        store.ranks = previous


@contextmanager
def use_watched(store: WatchedStore | None) -> Iterator[WatchedStore | None]:
    """Make ``store`` the one ``watching`` and ``keep`` refer to while a call creates groups."""
    previous, _current[0] = _current[0], store
    try:
        yield store
    finally:
        _current[0] = previous


def keep(group: object) -> None:
    """Keep the current ``WatchedStore`` alive as long as ``group`` (which holds its C++ half)."""
    if _current[0] is not None and group is not None:
        try:
            _kept[group] = _current[0]
        except TypeError:  # not weakly referenceable (NON_GROUP_MEMBER): nothing to keep
            pass


__all__ = ["WatchedStore", "keep", "use_watched", "watching"]
