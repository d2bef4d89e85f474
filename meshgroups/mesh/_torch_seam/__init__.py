"""The one place that touches private ``torch.distributed`` internals (torch 2.13 to 2.15): this package,
``c10d`` (process-group internals), ``builders`` (which MeshGroups builds a mesh's groups),
``rooted_mesh`` (the DeviceMesh meshgroups hands out) and ``meshes`` (building them).


A torch upgrade that moves these names breaks this package only. Two helpers write torch state,
each for a reason the callers document
(``internals`` checks, once, that every private piece is there): ``advance_group_count`` (re-align sequential group
names after a failed build) and ``creation_store_prefix`` (give each ``init_mesh`` call its own
store namespace, so rebuilt groups never read a previous incarnation's connection keys).
"""

from __future__ import annotations

# First, before any private name below is imported: a torch that lacks one is a clear error
# naming its version and the missing piece (``internals``), not a half-built mesh later.
from meshgroups.errors import TorchInternalsError
from meshgroups.mesh._torch_seam.internals import TESTED_TORCH, check, check_overrides

check()

from meshgroups.mesh._torch_seam.behaviour import self_test  # noqa: E402
from meshgroups.mesh._torch_seam.builders import (  # noqa: E402
    BackendConfig,
    CallFactory,
    GroupBuilder,
    register_builder,
    unregister_builder,
    use_collective_calls,
)
from meshgroups.mesh._torch_seam.c10d import (  # noqa: E402
    SPLIT_GROUP_SORTS,
    advance_group_count,
    bound_device_id,
    creation_store_prefix,
    default_backend_name,
    default_store,
    default_timeout,
    group_count,
    group_is_live,
    group_sequence,
    held_group_count,
    is_backend_options,
    set_group_timeout,
    shrink_nccl_group,
    world_registered,
)
from meshgroups.mesh._torch_seam.meshes import (  # noqa: E402
    detach_builder,
    flatten_on_root,
    flattened_dim,
    forget_dtensor_caches,
    make_group_mesh,
    make_root,
)
from meshgroups.mesh._torch_seam.placements import StridedShard, local_shape_and_offset  # noqa: E402
from meshgroups.mesh._torch_seam.rooted_mesh import RootedMesh, flattened_layout, register_flattened  # noqa: E402

# torch calls RootedMesh's overrides itself, some positionally: their parameters must be torch's.
check_overrides(RootedMesh)

__all__ = [
    "SPLIT_GROUP_SORTS",
    "TESTED_TORCH",
    "BackendConfig",
    "CallFactory",
    "GroupBuilder",
    "RootedMesh",
    "StridedShard",
    "TorchInternalsError",
    "advance_group_count",
    "bound_device_id",
    "check",
    "creation_store_prefix",
    "default_backend_name",
    "default_store",
    "default_timeout",
    "detach_builder",
    "flatten_on_root",
    "flattened_dim",
    "flattened_layout",
    "forget_dtensor_caches",
    "group_count",
    "group_is_live",
    "group_sequence",
    "held_group_count",
    "is_backend_options",
    "local_shape_and_offset",
    "make_group_mesh",
    "make_root",
    "register_builder",
    "register_flattened",
    "self_test",
    "set_group_timeout",
    "shrink_nccl_group",
    "unregister_builder",
    "use_collective_calls",
    "world_registered",
]
