"""Process-group internals of ``torch.distributed.distributed_c10d``: the default store, group
counts and names, whether a group is still alive, default timeout and backend, the bound device,
a live group's timeout."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.distributed import distributed_c10d as _c10d


def default_store() -> dist.Store:
    """The store the default process group was initialised with (TCPStore under torchrun)."""
    return _c10d._get_default_store()


def world_registered(group: object) -> bool:
    """Whether ``group`` is still a live world of this process (``destroy_process_group`` or a
    transfer world's ``unregister_world`` removes it from torch's table)."""
    return group in _c10d._world.pg_map


def held_group_count() -> int:
    """How many groups this process belongs to. torch names groups created with
    ``use_local_synchronization=True`` by hashing their ranks *and this count*, so every member
    of such a group must have the same count when it is created (pytorch#173608)."""
    return len(_c10d._world.pg_names)


def group_is_live(group: dist.ProcessGroup) -> bool:
    """Whether torch still holds ``group``. Others can destroy a group meshgroups created: the
    user's ``dist.destroy_process_group(group)``, torch >= 2.15's ``DeviceMesh.abort()`` (every
    group of the mesh and its flattened dims), or the default group's destruction (which takes
    every group with it); ``destroy_process_group`` on such a group raises ``ValueError``."""
    return _c10d._world.pg_map.get(group) is not None


def group_count() -> int:
    """torch's counter behind sequential group names (``new_group`` without local sync):
    incremented by every such call, member or not, so it must agree on every rank."""
    return int(_c10d._world.group_count)


def advance_group_count(value: int) -> None:
    """Move the sequential-name counter forward to ``value`` (never back: names stay unique)."""
    if value > _c10d._world.group_count:
        _c10d._world.group_count = value


@contextmanager
def creation_store_prefix(prefix: str, wrap: dist.Store | None = None) -> Iterator[None]:
    """Groups created inside get their connection keys under ``prefix`` in the default store.

    torch derives a new group's store as ``PrefixStore(name, default store)``; hashed names
    repeat once a group is destroyed and rebuilt, and gloo would then read the old group's
    addresses. Swapping the default store's entry for a prefixed one while creating gives each
    call a namespace of its own; the groups keep a reference to their own store afterwards.

    Hashed group names (``use_local_synchronization``, ``split_group``) are ours inside: the
    prefix, the ranks and how many groups over those ranks this rank has made in the call. So a
    group rebuilt after ``close()`` never takes the name of a destroyed one (an old DeviceMesh
    slice holding that name then fails to resolve instead of silently resolving to the new
    mesh's group), and every member computes the same name whatever else it created: torch's
    own salt is rank-local state — the number of groups this rank holds in 2.13, its group
    counter in 2.14, which moves on every ``new_group`` call a rank makes — and after an elastic
    loss the survivors have made different numbers of calls (kept groups are not re-created).
    The prefix is the same on every rank of the call. ``wrap``: a store over the default store
    (``meshgroups.mesh._watched_store``) that the new groups see instead of it."""
    default_pg = _c10d._get_default_group()
    backend, store = _c10d._world.pg_map[default_pg]
    hash_ranks = _c10d._hash_ranks_to_str
    made: dict[tuple[int, ...], int] = {}

    def call_hash(ranks: Sequence[int]) -> str:
        key = tuple(int(r) for r in ranks)
        made[key] = made.get(key, 0) + 1
        text = f"{prefix}|{','.join(map(str, key))}|{made[key]}"
        return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    _c10d._world.pg_map[default_pg] = (backend, dist.PrefixStore(prefix, wrap if wrap is not None else store))
    _c10d._hash_ranks_to_str = call_hash
    try:
        yield
    finally:
        _c10d._world.pg_map[default_pg] = (backend, store)
        _c10d._hash_ranks_to_str = hash_ranks


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


def is_backend_options(value: object) -> bool:
    """Whether ``value`` is a c10d backend options object (``ProcessGroupGloo._Options``, ...)."""
    return isinstance(value, _C10dBackend.Options)


def set_group_timeout(group: dist.ProcessGroup | None, timeout: timedelta) -> None:
    """Change the timeout of ``group`` (None: the default group) after creation, what
    megatron-core's ``update_pg_timeout`` does: torch 2.15's public ``dist.set_timeout``, the
    private ``_set_pg_timeout`` before it (2.15 deprecates that one with a ``FutureWarning``)::

        >>> from datetime import timedelta
        >>> import torch.distributed as dist
        >>> from meshgroups.mesh import set_group_timeout
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> set_group_timeout(None, timedelta(minutes=5))  # the default group's, from now on
        >>> dist.destroy_process_group()
    """
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
    else:
        _c10d._set_pg_timeout(timeout, group)


#: Whether ``dist.split_group`` sorts each group's ranks (torch 2.13); from 2.14 a rank's
#: position in the list is its group rank, so any row order can be split.
SPLIT_GROUP_SORTS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


def group_sequence(group: dist.ProcessGroup) -> int:
    """How many collectives ``group`` has issued on this rank (torch's per-group sequence
    number): members that disagree are out of step (one posted an operation the others never
    did, e.g. when a step failed part-way), and the group cannot be reused."""
    return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]


def shrink_nccl_group(group: dist.ProcessGroup, exclude: list[int]) -> dist.ProcessGroup | None:
    """``dist.shrink_group`` of ``group`` without the global ranks ``exclude`` (ncclCommShrink:
    no new bootstrap), or ``None`` where it does not apply (not NCCL, or torch/NCCL cannot
    shrink). Never the default group: shrinking it destroys every other group."""
    if group is _c10d._get_default_group() or "nccl" not in str(dist.get_backend(group)).lower():
        return None
    shrink = getattr(dist, "shrink_group", None)
    if shrink is None:
        return None
    ranks = dist.get_process_group_ranks(group)
    try:
        return shrink([ranks.index(r) for r in exclude if r in ranks], group=group)
    except (RuntimeError, ValueError, NotImplementedError):
        return None
