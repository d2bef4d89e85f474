"""The torch bridge: a ``Layout`` becomes ``torch.distributed`` process groups and one root
``DeviceMesh``, each distinct rank set created once.

Three steps, a private module each: a torch-free plan (``_plan``) → a creation strategy
(``_strategies``) → the ``MeshGroups`` result (``_mesh_groups``); every collective entry point
follows one protocol (``_collective``), over the live ranks (``_cohort``), watching their
liveness (``_liveness``: heartbeats in the store, one observer per process); private torch APIs
only in ``_torch_seam/``. Everything a user calls is imported from here, and loads torch on first
use, so ``import meshgroups.mesh`` is cheap::

    >>> import meshgroups.mesh
    >>> sorted(meshgroups.mesh.__all__)[:3]
    ['Cohort', 'GroupCache', 'MeshGroups']
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from meshgroups import _deprecated

if TYPE_CHECKING:
    from meshgroups.mesh._cohort import Cohort, current_cohort, set_cohort, use_cohort
    from meshgroups.mesh._collective import (
        Call,
        call_numbering,
        collective_call,
        collective_entry,
        publish_refusal,
        set_call_numbering,
    )
    from meshgroups.mesh._groups import GroupCache, GroupKey
    from meshgroups.mesh._liveness import (
        Heartbeat,
        Liveness,
        Staleness,
        heartbeat_key,
        start_heartbeat,
        world_liveness,
    )
    from meshgroups.mesh._mesh_groups import MeshGroups, init_mesh, layout_of, set_group_timeout
    from meshgroups.mesh._options import MeshOptions, merge_options
    from meshgroups.mesh._plan import SubsetSpec, as_timedelta
    from meshgroups.mesh._strategies import Strategy
    from meshgroups.mesh._torch_seam import (
        StridedShard,
        default_backend_name,
        default_store,
        default_timeout,
        group_sequence,
        local_shape_and_offset,
        shrink_nccl_group,
    )
    from meshgroups.mesh._torch_seam.worlds import (
        default_group_name,
        default_world,
        register_world,
        set_default_world,
        standalone_group,
        unconnected_world,
        unregister_world,
    )
    from meshgroups.mesh._waiting import Lookout, gone_error

# name -> its private module, imported on first use (the public names first, then the ones
# meshgroups' packages above this one take from here: the collective protocol's pieces, the
# torch seam's helpers; not in __all__).
_WHERE = {
    "Cohort": "_cohort",
    "current_cohort": "_cohort",
    "use_cohort": "_cohort",
    "collective_call": "_collective",
    "collective_entry": "_collective",
    "publish_refusal": "_collective",
    "GroupCache": "_groups",
    "MeshGroups": "_mesh_groups",
    "init_mesh": "_mesh_groups",
    "layout_of": "_mesh_groups",
    "set_group_timeout": "_mesh_groups",
    "MeshOptions": "_options",
    "Strategy": "_strategies",
    # internal
    "set_cohort": "_cohort",
    "merge_options": "_options",
    "Call": "_collective",
    "call_numbering": "_collective",
    "set_call_numbering": "_collective",
    "GroupKey": "_groups",
    "Heartbeat": "_liveness",
    "Liveness": "_liveness",
    "Lookout": "_waiting",
    "Staleness": "_liveness",
    "gone_error": "_waiting",
    "heartbeat_key": "_liveness",
    "start_heartbeat": "_liveness",
    "world_liveness": "_liveness",
    "SubsetSpec": "_plan",
    "as_timedelta": "_plan",
    "StridedShard": "_torch_seam",
    "default_backend_name": "_torch_seam",
    "default_store": "_torch_seam",
    "default_timeout": "_torch_seam",
    "group_sequence": "_torch_seam",
    "local_shape_and_offset": "_torch_seam",
    "shrink_nccl_group": "_torch_seam",
    "default_group_name": "_torch_seam.worlds",
    "default_world": "_torch_seam.worlds",
    "register_world": "_torch_seam.worlds",
    "set_default_world": "_torch_seam.worlds",
    "standalone_group": "_torch_seam.worlds",
    "unconnected_world": "_torch_seam.worlds",
    "unregister_world": "_torch_seam.worlds",
}
__all__ = [
    "Cohort",
    "GroupCache",
    "MeshGroups",
    "MeshOptions",
    "Strategy",
    "collective_call",
    "collective_entry",
    "current_cohort",
    "init_mesh",
    "layout_of",
    "publish_refusal",
    "set_group_timeout",
    "use_cohort",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"meshgroups.mesh.{_WHERE[name]}"), name)
    return _deprecated.old_name(__name__, name)
