"""meshgroups: distributed-training rank layouts as named n-D numpy grids.

``Layout`` (pure numpy, no torch) describes which ranks form which groups; ``init_mesh`` turns a
layout into a real ``torch.distributed`` ``DeviceMesh`` and process groups, each created once.
``import meshgroups`` does not import torch; the torch names load on first use.

One folder per subsystem: ``layout/`` (the numpy core), ``mesh/`` (the torch bridge),
``elastic/`` (lost ranks, recovery, healing), ``transfer/`` (RL weight transfer), ``render/``
and ``cli/``; ``meshgroups.compat`` holds the legacy APIs.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from meshgroups.errors import (
    ConcurrentInitError,
    Excluded,
    ExcludedError,
    LayoutError,
    MeshBuildError,
    MeshConfigError,
    MismatchError,
    RanksLost,
    RanksLostError,
    RendezvousTimeout,
    StepFailed,
    StepFailedError,
    StoreConnectionError,
)
from meshgroups.layout import Layout, Locality, Topology

if TYPE_CHECKING:
    from meshgroups.elastic.elastic_mesh import Elastic
    from meshgroups.mesh.groups import GroupCache
    from meshgroups.mesh.mesh_groups import MeshGroups, init_mesh, layout_of
    from meshgroups.mesh.options import MeshOptions
    from meshgroups.mesh.strategies import Strategy

__all__ = [
    "ConcurrentInitError",
    "Elastic",
    "ExcludedError",
    "GroupCache",
    "Layout",
    "LayoutError",
    "Locality",
    "MeshBuildError",
    "MeshConfigError",
    "MeshGroups",
    "MeshOptions",
    "MismatchError",
    "RanksLostError",
    "RendezvousTimeout",
    "StepFailedError",
    "StoreConnectionError",
    "Strategy",
    "Topology",
    "init_mesh",
    "layout_of",
]
__version__ = "0.1.0"

# torch-side names, loaded on first use; GroupSpec stays importable from here (0.1 showed it)
# but is a detail of the bridge's plan, so it left __all__.
_TORCH_NAMES = {
    "Elastic": "meshgroups.elastic.elastic_mesh",
    "init_mesh": "meshgroups.mesh.mesh_groups",
    "layout_of": "meshgroups.mesh.mesh_groups",
    "MeshGroups": "meshgroups.mesh.mesh_groups",
    "MeshOptions": "meshgroups.mesh.options",
    "GroupCache": "meshgroups.mesh.groups",
    "GroupSpec": "meshgroups.mesh.plan",
    "Strategy": "meshgroups.mesh.strategies",
}
# Kept importable for code written against 0.4.0 and earlier; the ``Error`` names are canonical.
_OLD_NAMES = (Excluded, RanksLost, StepFailed)


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'meshgroups' has no attribute {name!r}")
