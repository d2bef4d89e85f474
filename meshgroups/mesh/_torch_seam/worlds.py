"""A process group outside the process's default world, and swapping which world is the default:
the private c10d pieces a transfer world (``meshgroups.engines._worlds``) needs, here so that a torch
upgrade touches one place.

A transfer world's group is built directly over a store (never ``init_process_group``, which
would replace the process's own default group), registered in torch's tables the way a default
group is, and made the default only inside ``TransferWorld.active()``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def standalone_group(
    store: dist.Store, rank: int, size: int, timeout: timedelta, name: str, device_type: str
) -> dist.ProcessGroup:
    """A process group over ``store``: gloo for CPU tensors, NCCL too for ``"cuda"`` (untested
    here: no GPU in CI)."""
    pg = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout=timeout)
    gloo._set_sequence_number_for_group()
    kind = dist.ProcessGroup.BackendType
    pg._register_backend(torch.device("cpu"), kind.GLOO, gloo)
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
        pg._register_backend(torch.device("cuda"), kind.NCCL, nccl)
        pg._set_default_backend(kind.NCCL)
    else:
        pg._set_default_backend(kind.GLOO)
    pg._set_group_name(c10d.GroupName(name))
    pg._set_group_desc("meshgroups transfer world")
    return pg


def unconnected_world(
    store: dist.Store, rank: int, size: int, name: str, timeout: timedelta
) -> dist.ProcessGroup:
    """A gloo default group for a process that joins a running world in a lost rank's place
    (``meshgroups.elastic``): gloo's lazy initialisation, so it connects to nobody unless used,
    and the rest of the world never is."""
    gloo_cls = dist.ProcessGroupGloo
    opts: Any = gloo_cls._Options() if hasattr(gloo_cls, "_Options") else gloo_cls.Options()
    opts._devices = [gloo_cls.create_default_device(lazy_init=True)]
    opts._timeout = timeout
    pg = dist.ProcessGroup(store, rank, size)
    gloo = gloo_cls(dist.PrefixStore("cpu/", store), rank, size, opts)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._set_group_name(c10d.GroupName(name))
    pg._set_group_desc("default_pg")
    return pg


def default_group_name() -> str:
    """The default group's name (its store prefix is ``"<name>/"`` over the store it was given)."""
    return str(c10d._world.pg_names[c10d._get_default_group()])


def register_world(group: dist.ProcessGroup, store: dist.Store, name: str, device_type: str) -> None:
    """torch's registry entries for ``group`` as ``init_process_group`` makes for a default group
    (store, name, global ranks = its own ranks)."""
    cuda = device_type == "cuda"
    c10d._world.pg_map[group] = ("nccl" if cuda else "gloo", store)
    c10d._world.pg_names[group] = c10d.GroupName(name)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(group.size())}
    c10d._world.pg_backend_config[group] = "cpu:gloo" + (",cuda:nccl" if cuda else "")


def unregister_world(group: dist.ProcessGroup) -> None:
    """Drop ``group``'s registry entries (its connections close with its last reference)."""
    for table in (
        c10d._world.pg_map,
        c10d._world.pg_names,
        c10d._world.pg_group_ranks,
        c10d._world.pg_backend_config,
    ):
        table.pop(group, None)


def default_world() -> tuple[dist.ProcessGroup | None, int]:
    """The process's default group and torch's group-name counter, to restore later."""
    return c10d._world.default_pg, c10d._world.group_count


def set_default_world(group: dist.ProcessGroup | None, group_count: int) -> None:
    """Make ``group`` the default group, with torch's group-name counter at ``group_count``."""
    c10d._world.group_count = group_count
    c10d._update_default_pg(group)


__all__ = [
    "default_group_name",
    "default_world",
    "register_world",
    "set_default_world",
    "standalone_group",
    "unconnected_world",
    "unregister_world",
]
