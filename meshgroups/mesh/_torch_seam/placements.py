"""DTensor placement internals: ``_StridedShard`` (FSDP2's placement for a dim that shards an
axis already sharded by a later mesh dim), read by the transfer code from a DTensor's
placements."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = ["StridedShard"]
