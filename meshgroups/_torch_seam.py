"""The one place that touches private ``torch.distributed`` internals (torch 2.13).

Everything here is read-only. A torch upgrade that moves these names breaks this module only.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d


def default_store() -> dist.Store:
    """The store the default process group was initialised with (TCPStore under torchrun)."""
    return _c10d._get_default_store()


def group_count_for_hashed_names() -> int:
    """How many groups this process belongs to. torch names groups created with
    ``use_local_synchronization=True`` by hashing their ranks *and this count*, so every member
    of such a group must have the same count when it is created (pytorch#173608)."""
    return len(_c10d._world.pg_names)


def default_backend_name() -> str:
    return str(dist.get_backend())


def bound_device_id() -> object | None:
    """The device the default group is bound to (``init_process_group(device_id=...)``)."""
    return _c10d._get_default_group().bound_device_id
