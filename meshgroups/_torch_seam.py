"""The one place that touches private ``torch.distributed`` internals (torch 2.13).

A torch upgrade that moves these names breaks this module only. Two helpers write torch state,
each for a reason the callers document: ``advance_group_count`` (re-align sequential group
names after a failed build) and ``creation_store_prefix`` (give each ``init_mesh`` call its own
store namespace, so rebuilt groups never read a previous incarnation's connection keys).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d


def default_store() -> dist.Store:
    """The store the default process group was initialised with (TCPStore under torchrun)."""
    return _c10d._get_default_store()


def held_group_count() -> int:
    """How many groups this process belongs to. torch names groups created with
    ``use_local_synchronization=True`` by hashing their ranks *and this count*, so every member
    of such a group must have the same count when it is created (pytorch#173608)."""
    return len(_c10d._world.pg_names)


def group_count() -> int:
    """torch's counter behind sequential group names (``new_group`` without local sync):
    incremented by every such call, member or not, so it must agree on every rank."""
    return int(_c10d._world.group_count)


def advance_group_count(value: int) -> None:
    """Move the sequential-name counter forward to ``value`` (never back: names stay unique)."""
    if value > _c10d._world.group_count:
        _c10d._world.group_count = value


@contextmanager
def creation_store_prefix(prefix: str) -> Iterator[None]:
    """Groups created inside get their connection keys under ``prefix`` in the default store.

    torch derives a new group's store as ``PrefixStore(name, default store)``; hashed names
    repeat once a group is destroyed and rebuilt, and gloo would then read the old group's
    addresses. Swapping the default store's entry for a prefixed one while creating gives each
    call a namespace of its own; the groups keep a reference to their own store afterwards."""
    default_pg = _c10d._get_default_group()
    backend, store = _c10d._world.pg_map[default_pg]
    _c10d._world.pg_map[default_pg] = (backend, dist.PrefixStore(prefix, store))
    try:
        yield
    finally:
        _c10d._world.pg_map[default_pg] = (backend, store)


def default_timeout() -> timedelta:
    """The default group's timeout (``init_process_group(timeout=...)``)."""
    group = _c10d._get_default_group()
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            timeout = group._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return timeout
    return dist.default_pg_timeout


def default_backend_name() -> str:
    return str(dist.get_backend())


def bound_device_id() -> object | None:
    """The device the default group is bound to (``init_process_group(device_id=...)``)."""
    return _c10d._get_default_group().bound_device_id


def group_name(group: dist.ProcessGroup) -> str:
    """torch's name of ``group`` (the prefix of its connection keys in the store)."""
    return str(_c10d._get_process_group_name(group))
