"""Failures that cross ranks: a rank's exception written to the store as a record, raised again
from that record on every other rank, and marked *shared* so no rank publishes it a second time.

A record names the exception's class by module and qualified name; a reader rebuilds the class
only from modules its own process has already imported (builtins, torch, meshgroups, compat),
never importing anything on another rank's word, and falls back to ``RuntimeError``.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from meshgroups.errors import MismatchError

#: Words of torch's errors that mean "waited on a peer" rather than "went wrong here".
_WAITING_WORDS = ("timeout", "timed out", "connection", "connect", "broken pipe", "recv", "send")

E = TypeVar("E", bound=BaseException)


def shared(exc: E) -> E:
    """Mark ``exc`` as an outcome every rank of the call raises (nothing left to publish)."""
    exc._mg_shared = True  # type: ignore[attr-defined]
    return exc


def is_shared(exc: BaseException) -> bool:
    """Whether ``exc`` was raised for another rank's failure (published, not this rank's own).

    Args:
        exc: an exception raised in a collective call.

    Returns:
        True for an error re-raised from another rank's record.
    """
    return bool(getattr(exc, "_mg_shared", False))


def waiting_on_peer(exc: BaseException) -> bool:
    """Whether a failure in group creation looks like waiting on another rank (a timeout or a
    lost connection inside torch) rather than a cause of its own."""
    if isinstance(exc, (dist.DistStoreError, dist.DistNetworkError, TimeoutError)):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _WAITING_WORDS)


def failure_record(rank: int, exc: BaseException) -> str:
    """The store record publishing ``rank``'s failure ``exc`` to the other ranks.

    Args:
        rank: the failing rank.
        exc: its exception (class and message are recorded).

    Returns:
        The record's text.
    """
    cls = type(exc)
    return f"failed\n{rank}\n{cls.__module__}:{cls.__qualname__}\n{exc}"


def _error_class(path: str) -> type[Exception]:
    """The class a failure record names, from a module this process has already imported
    (builtins, torch, meshgroups, compat: never an import on another rank's word);
    ``RuntimeError`` otherwise."""
    module, _, qualname = path.partition(":")
    owner: Any = builtins if module == "builtins" else sys.modules.get(module)
    cls = owner
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError


def from_record(record: str, text: Callable[[str, str, str], str]) -> Exception:
    """The exception a failure record describes, ``text(rank, class name, message)`` its message."""
    _, failed_rank, path, message = record.split("\n", 3)
    cls = _error_class(path)
    message_out = text(failed_rank, path.partition(":")[2], message)
    try:
        exc = cls(message_out, argument=message) if issubclass(cls, MismatchError) else cls(message_out)
    except Exception:  # a class that wants other arguments
        exc = RuntimeError(message_out)
    return shared(exc)


__all__ = ["failure_record", "from_record", "is_shared", "shared", "waiting_on_peer"]
