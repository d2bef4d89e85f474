"""The protocol every collective entry point follows, so ranks never pair different calls.

Every call that creates groups (``init_mesh``, ``MeshGroups.flatten``, torch's ``_flatten`` and
``_unflatten`` on a meshgroups mesh, compat's ``initialize_model_parallel`` and the legacy
initializers' ``init_dist_group``) runs inside ``collective_call(operation)``:

1. It takes the process's next **call number** first, before validating anything, so ranks that
   made the same calls agree on the number even when one of them fails at once.
2. It records the **operation** and where it was called from. Every call meets the other ranks
   at least once (a meeting: ``rendezvous.Meeting``) and the first meeting compares the
   operation, the arguments given with ``call.agree`` / ``call.compare`` and the call site: a
   rank that makes another operation, or the same one from another line of the same program
   (it skipped a call, or made an extra one), is a ``MismatchError`` on every rank naming it
   and both calls. The call site is not compared between different programs (MPMD jobs), nor
   with ``MESHGROUPS_COMPARE_CALL_SITES=0``.
3. An exception on one rank is **published** under the call's number: every rank raises at
   once, the same class, naming the failing rank and the rule.
4. A failed call is **closed** before the next starts: each rank waits (bounded by the call's
   timeout) until every rank that entered it has left, and the last one out deletes the call's
   store keys. So the identical retry, right away, works.
5. Every wait watches **liveness** (heartbeats in the store): a rank gone ends it on every rank
   (``RanksGoneError``); one late but alive is logged ("still waiting for ...") now and then.

Calls nest: a ``collective_call`` opened while another is active on the same thread is part of
it (``initialize_model_parallel`` calls ``init_mesh``; the number is taken once). A second
thread is refused with ``ConcurrentInitError``. On torch's ``fake`` backend there is no store to
meet through and the protocol only numbers calls.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from meshgroups.errors import ConcurrentInitError, StoreConnectionError
from meshgroups.mesh._cohort import current_cohort
from meshgroups.mesh._failure_records import is_shared, shared
from meshgroups.mesh._rendezvous import NAME_MISSING_UP_TO, PREFIX, Meeting
from meshgroups.mesh._torch_seam import default_backend_name, default_store, default_timeout
from meshgroups.mesh._waiting import CallLiveness

F = TypeVar("F", bound=Callable[..., Any])
_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.dirname(os.path.abspath(dist.__file__))) + os.sep
_PLUMBING = {os.path.abspath(f.__code__.co_filename) for f in (contextmanager, functools.wraps)}
_lock = threading.Lock()
_state: dict[str, Any] = {"group": None, "n": 0, "active": None, "thread": None, "cohort": ""}


def call_numbering(fresh: bool = False) -> dict[str, Any]:
    """This process's collective-call numbering (the group it numbers on, the last number, the
    cohort's namespace), to set aside while another world is the default one
    (``meshgroups.engines._worlds``); ``fresh``: the numbering of a world that made no call yet."""
    if fresh:
        return {"group": None, "n": 0, "cohort": ""}
    return {key: _state[key] for key in ("group", "n", "cohort")}


def set_call_numbering(numbering: dict[str, Any]) -> None:
    """Continue the numbering ``call_numbering`` returned (no call may be in progress)."""
    _state.update({key: numbering[key] for key in ("group", "n", "cohort")})


def _call_site() -> tuple[str, str]:
    """Where the caller is: the first frame outside meshgroups, its compat, torch, contextlib.
    Returns (``function:line``, compared: file names may differ between ranks, e.g. per-rank
    temporary files; ``file:line``, shown)."""
    compat = sys.modules.get("meshgroups.compat")
    skip = (_OURS, _TORCH) + (
        (os.path.dirname(os.path.abspath(compat.__file__)) + os.sep,) if compat and compat.__file__ else ()
    )
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(skip) and name not in _PLUMBING:
            return f"{frame.f_code.co_name}:{frame.f_lineno}", f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?", "?"


class Call(CallLiveness):
    """One collective call on this rank: its number, operation, meetings and liveness.

    Args:
        operation: the operation's name (``"init_mesh"``, ``"flatten"``, ...).
        number: the call's number, the same on every rank.
        site: ``(key, text)`` of the line that made the call, compared across ranks.
        enabled: False on torch's ``fake`` backend (no store to meet through).
    """

    def __init__(self, operation: str, number: int, site: tuple[str, str], enabled: bool) -> None:
        self.operation = operation
        self.number = number
        self.site_key, self.site = site
        self.enabled = enabled
        self.what = f"{operation} call #{number}"
        self.rank = dist.get_rank()
        # Over a cohort (the live ranks after a loss) only its members meet, in a namespace of
        # the cohort's own: a dead rank's keys of an earlier epoch are never read.
        cohort = current_cohort()
        self.members = cohort.members if cohort is not None else None
        self.watch = cohort.watch if cohort is not None else None
        self.world_size = len(cohort.members) if cohort is not None else dist.get_world_size()
        self.base = f"{PREFIX}/{cohort.tag if cohort is not None else ''}{number}"
        self.groups_base = f"meshgroups/g{cohort.tag if cohort is not None else ''}{number}."
        self.store = default_store() if enabled else None
        self.timeout = default_timeout()
        self.meetings: list[Meeting] = []
        self.open: Meeting | None = None  # a meeting this rank is inside
        self.sweep_prefixes: list[str] = []
        self._compared: dict[str, str] = {}
        self.started = time.monotonic()
        self._init_liveness()

    # ------------------------------------------------------------------ for entry points
    def compare(self, **arguments: object) -> None:
        """Arguments that every rank must pass alike, compared at the call's first meeting."""
        self._compared.update({k: _short(v) for k, v in arguments.items()})

    def agree(
        self,
        digests: Mapping[str, str],
        shown: Mapping[str, str],
        counters: Mapping[str, int] | None = None,
        timeout: timedelta | None = None,
    ) -> dict[str, int]:
        """A meeting: every rank arrives, the arguments (``digests``, shown as ``shown``) are
        compared, and the maxima of ``counters`` over the ranks are returned. The first meeting
        of the call also compares the operation, ``compare``'s arguments and the call site."""
        counters = dict(counters or {})
        if timeout is not None:
            self.timeout = timeout
        if not self.enabled:
            return counters
        digests, shown = dict(digests), dict(shown)
        if not self.meetings:
            first = {"operation": self.operation, **self._compared}
            digests = {**first, **digests, "call_site": self.site_key, "program": _program()}
            shown = {**first, **shown, "call_site": f"{self.operation} at {self.site}", "program": _program()}
            if os.environ.get("MESHGROUPS_COMPARE_CALL_SITES", "1") == "0":
                digests["call_site"] = shown["call_site"] = "not compared"
        meeting = self._next_meeting()
        self.open = meeting
        maxima = meeting.agree(digests, shown, counters)
        self.progress(f"creating groups (meeting {len(self.meetings)})")
        return maxima

    def finish(self, error: BaseException | None) -> None:
        """Report the end of group creation of the current meeting; raises the same error on
        every rank if any rank failed or never reported."""
        if not self.enabled or self.open is None:
            if error is not None:
                raise error
            return
        grace = min(max(2.0, self.timeout.total_seconds() / 2), 60.0)
        meeting, self.open = self.open, None
        meeting.finish(error, grace)

    def creation_prefix(self) -> str:
        """A store namespace of the groups created at the current meeting."""
        return f"{self.groups_base}{len(self.meetings)}"

    # ------------------------------------------------------------------ bookkeeping
    def _next_meeting(self) -> Meeting:
        """The call's next meeting, recorded (its keys are swept when the call ends)."""
        meeting = Meeting(
            self.store,  # type: ignore[arg-type]
            self.rank,
            self.world_size,
            self.what,
            f"{self.base}/{len(self.meetings) + 1}",
            self.timeout,
            self.last_words,
            self.members,
            self.watch,
            site=self.site,
            observer=self.observer,
            lease=self.lease,
            report_every=self.report_every,
        )
        self.meetings.append(meeting)
        return meeting

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _op(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.store, method)(*args)
        except (RuntimeError, dist.DistError) as exc:
            raise shared(
                StoreConnectionError(
                    f"rank {self.rank} lost the connection to the rendezvous store during {self.what} "
                    f"(the store is hosted by rank 0 under torchrun/tcp://; did it die?): {exc}"
                )
            ) from None

    def enter(self) -> None:
        if self.enabled:
            self._enter_liveness()
            self.progress("entered")
            self._op("add", self._key("entered"), 1)

    def leave_ok(self) -> None:
        if not self.enabled:
            return
        self.progress("done")
        self._leave(failed=False)

    def settle(self) -> None:
        """A call that met nobody yet meets once, so that a failure on another rank reaches it."""
        if self.enabled and not self.meetings:
            self.agree({}, {})
        self.open = None

    def leave_failed(self, exc: BaseException) -> None:
        """Publish ``exc`` (unless every rank already raises it), then close the call."""
        if not self.enabled or isinstance(exc, StoreConnectionError):
            return
        if not is_shared(exc):
            if self.open is None:  # the others wait in the next meeting (or the closing one)
                self.open = self._next_meeting()
            self.open.publish_failure(exc)
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(rank {self.rank}, {self.what} at {self.site}: every rank raises this error)")
        self.progress(f"failed ({type(exc).__name__})")
        self._leave(failed=True, gone=int(getattr(exc, "_mg_gone", 0)))

    def _peek(self, name: str) -> int | None:
        """A counter's value, ``None`` once deleted; unlike ``add(key, 0)`` it never creates the key
        (``compare_set`` with a non-empty expected value returns it for a missing key)."""
        value = self._op("compare_set", self._key(name), "-1", "-1").decode()
        return None if value == "-1" else int(value)

    def _leave(self, failed: bool, gone: int = 0) -> None:
        """Leave the call; a failed one only once every rank that entered it has left, except
        ``gone`` ranks that never reported (dead or hung). The outcome is decided by now: a store
        lost meanwhile (its host, rank 0 under tcp://, left first and exited) is the next call's news."""
        with suppress(StoreConnectionError):
            self._leave_store(failed, gone)

    def _leave_store(self, failed: bool, gone: int) -> None:
        if not failed:  # (a failed call's keys may still be read by ranks building its error)
            for meeting in self.meetings:
                for key in meeting.own_keys():
                    self._op("delete_key", key)
        mine = int(self._op("add", self._key("left"), 1))
        if failed:
            # Closed before the next call starts: wait (bounded) for every rank that entered,
            # but not for ranks gone meanwhile (a rank that exited never leaves).
            deadline = time.monotonic() + self.timeout.total_seconds()
            pause = 0.002
            members = self.members if self.members is not None else range(self.world_size)
            lookout = self._close_lookout(list(members)) if self.world_size <= NAME_MISSING_UP_TO else None
            while time.monotonic() < deadline:
                entered, left = self._peek("entered"), self._peek("left")
                if entered is None or left is None or left >= entered - gone:
                    break  # every rank that entered has left (or the last one swept the keys)
                if lookout is not None:
                    gone = max(gone, len(lookout.gone()))
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        # The last rank out sweeps; when ranks are gone (dead: they never leave), the last survivor.
        if mine != self.world_size and not (failed and gone and mine == self.world_size - gone):
            return
        # The last rank out: nobody reads this call's keys any more.
        if failed or self.sweep_prefixes:
            prefixes = (f"{self.base}/", *self.sweep_prefixes)
            if failed:
                prefixes += (self.groups_base,)
            for key in self._op("list_keys"):
                if key.startswith(prefixes):
                    self._op("delete_key", key)
            return
        for meeting in self.meetings:
            for key in meeting.shared_keys():
                self._op("delete_key", key)
        for name in ("entered", "left"):
            self._op("delete_key", self._key(name))


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _program() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "?"


def _next_number() -> int:
    # Restarts with a new default group (destroy + init_process_group). A weak reference: a strong
    # one kept the destroyed group alive until exit, where its destructor could abort the process.
    known = _state["group"]() if _state["group"] is not None else None
    cohort = current_cohort()
    epoch = cohort.tag if cohort is not None else ""  # epoch 0 shares the world's numbering
    if known is not dist.group.WORLD or _state["cohort"] != epoch:
        # a new cohort numbers its calls from 1 again, in its own namespace
        _state["group"], _state["n"], _state["cohort"] = weakref.ref(dist.group.WORLD), 0, epoch
    _state["n"] += 1
    return int(_state["n"])


def active_call() -> Call | None:
    """The call this thread is inside, if any; ``None`` outside a collective call."""
    return _state["active"] if _state["thread"] == threading.get_ident() else None


@contextmanager
def collective_call(operation: str) -> Iterator[Call]:
    """Run one collective call of ``operation`` (see the module docstring); nested: the outer call.

    Args:
        operation: the operation's name, compared across ranks.

    Returns:
        A context manager yielding the ``Call`` (``call.compare(name=value)`` compares a value
        across ranks at the call's first meeting).

    Raises:
        RuntimeError: no initialised default process group.
        ConcurrentInitError: another thread of this process is inside a collective call.
        MismatchError: the ranks made different operations, or called from different lines.

    >>> import torch.distributed as dist
    >>> from meshgroups.mesh import collective_call
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> with collective_call("make_transfer_groups") as call:  # every rank; init_mesh inside joins it
    ...     call.compare(plan="9f2c")  # a rank with another plan: MismatchError on every rank
    >>> dist.destroy_process_group()
    """
    outer = active_call()
    if outer is not None:
        yield outer
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{operation} needs an initialised default process group: call dist.init_process_group first"
        )
    if not _lock.acquire(blocking=False):
        raise ConcurrentInitError(
            f"{operation} was called while {_state['active'].what if _state['active'] else 'a collective call'} "
            f"is running in another thread of this process (rank {dist.get_rank()}); these calls are "
            "collective: make them one at a time, from one thread"
        )
    try:
        cohort = current_cohort()
        if cohort is not None and dist.get_rank() not in cohort:
            raise RuntimeError(
                f"{operation} was called on rank {dist.get_rank()}, which is not in the cohort of live ranks "
                f"(epoch {cohort.epoch}: ranks {list(cohort.members)}); only members make collective calls"
            )
        call = Call(operation, _next_number(), _call_site(), default_backend_name() != "fake")
        _state["active"], _state["thread"] = call, threading.get_ident()
        call.enter()
        try:
            yield call
            call.settle()
        except BaseException as exc:
            try:
                call.leave_failed(exc)
            except StoreConnectionError as lost:
                raise lost from exc
            raise
        call.leave_ok()
    finally:
        _state["active"] = _state["thread"] = None
        _lock.release()


def publish_refusal(operation: str, exc: BaseException) -> None:
    """Publish ``exc``, raised by a local step that leads into the collective call ``operation``
    (a legacy initializer's constructor before its ``init_dist_group``), as that call's outcome:
    this rank takes the call's number and fails it, so the other ranks' ``operation`` raises the
    same class at once instead of waiting for a rank that is not coming. The caller then raises
    ``exc`` itself. Nothing happens without an initialised default group, or inside a call
    (the outer call publishes it)::

        >>> from meshgroups.mesh import publish_refusal
        >>> try:
        ...     raise ValueError("tp=3 does not divide world_size=4")  # a local check refused
        ... except ValueError as exc:
        ...     publish_refusal("TPGroupInitializer.init_dist_group", exc)  # no default group: no-op
        ...     raise
        Traceback (most recent call last):
        ValueError: tp=3 does not divide world_size=4
    """
    if not dist.is_available() or not dist.is_initialized() or active_call() is not None:
        return
    try:
        with collective_call(operation):
            raise exc
    except BaseException as raised:
        if raised is not exc and isinstance(raised, StoreConnectionError):
            raise  # the store is gone: that is the news, not the refused argument


def collective_entry(operation: str, method: bool = False) -> Callable[[F], F]:
    """Decorate a function so each call runs in ``collective_call(operation)``; with
    ``method=True`` the operation is named after the instance's class (``TPGroupInitializer.init_dist_group``).
    Without an initialised default group the function runs as is (it reports that itself).

    Args:
        operation: the operation's name.
        method: name the operation after the instance's class.

    Returns:
        The decorator.

    >>> from meshgroups.mesh import collective_entry
    >>> double = collective_entry("double")(lambda n: 2 * n)  # or @collective_entry("double")
    >>> double(3)  # no default group here: it runs as is
    6
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not dist.is_available() or not dist.is_initialized():
                return fn(*args, **kwargs)
            name = f"{type(args[0]).__name__}.{operation}" if method and args else operation
            with collective_call(name):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap


__all__ = [
    "Call",
    "active_call",
    "call_numbering",
    "collective_call",
    "collective_entry",
    "publish_refusal",
    "set_call_numbering",
]
