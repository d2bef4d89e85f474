"""DTensor placement internals: ``_StridedShard`` (FSDP2's placement for a dim that shards an
axis already sharded by a later mesh dim), read by the transfer code from a DTensor's
placements, and where a DTensor's local shard sits in the whole tensor."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard


def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of a DTensor: its shape and the offset of its first element in the
    whole tensor, as DTensor itself places it (plain and uneven shards alike)."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


__all__ = ["StridedShard", "local_shape_and_offset"]
