"""meshgroups: distributed-training rank layouts as named n-D numpy grids.

``Layout`` (pure numpy, no torch) describes which ranks form which groups; ``init_mesh`` turns a
layout into a real ``torch.distributed`` ``DeviceMesh`` and process groups, each created once.
``import meshgroups`` does not import torch; the torch names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._layout_topology import Locality
from .errors import (
    ConcurrentInitError,
    Excluded,
    LayoutError,
    MeshBuildError,
    MeshConfigError,
    MismatchError,
    RanksLost,
    RendezvousTimeout,
    StepFailed,
    StoreConnectionError,
)
from .layout import Layout
from .topology import Topology

if TYPE_CHECKING:
    from .elastic_mesh import Elastic
    from .groups import GroupCache
    from .mesh import MeshGroups, init_mesh, layout_of
    from .plan import GroupSpec
    from .strategies import Strategy

__all__ = [
    "ConcurrentInitError",
    "Elastic",
    "Excluded",
    "GroupCache",
    "GroupSpec",
    "Layout",
    "LayoutError",
    "Locality",
    "MeshBuildError",
    "MeshConfigError",
    "MeshGroups",
    "MismatchError",
    "RanksLost",
    "RendezvousTimeout",
    "StepFailed",
    "StoreConnectionError",
    "Strategy",
    "Topology",
    "init_mesh",
    "layout_of",
]
__version__ = "0.1.0"

_TORCH_NAMES = {
    "Elastic": "elastic_mesh",
    "init_mesh": "mesh",
    "layout_of": "mesh",
    "MeshGroups": "mesh",
    "GroupCache": "groups",
    "GroupSpec": "plan",
    "Strategy": "strategies",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from importlib import import_module

        return getattr(import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'meshgroups' has no attribute {name!r}")
