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

from meshgroups import _deprecated
from meshgroups._version import __version__
from meshgroups.errors import (
    ClosedError,
    ConcurrentInitError,
    ExcludedError,
    LayoutError,
    MeshBuildError,
    MeshConfigError,
    MismatchError,
    RanksGoneError,
    RanksLostError,
    RendezvousTimeoutError,
    StepFailedError,
    StoreConnectionError,
)
from meshgroups.layout import Layout, Locality, Topology, register_html_renderer

if TYPE_CHECKING:
    from meshgroups.elastic import Elastic
    from meshgroups.mesh import GroupCache, MeshGroups, MeshOptions, Strategy, init_mesh, layout_of

__all__ = [
    "ClosedError",
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
    "RanksGoneError",
    "RanksLostError",
    "RendezvousTimeoutError",
    "StepFailedError",
    "StoreConnectionError",
    "Strategy",
    "Topology",
    "init_mesh",
    "layout_of",
]
# torch-side names, loaded on first use from the package that holds them
_TORCH_NAMES = {
    "Elastic": "meshgroups.elastic",
    "init_mesh": "meshgroups.mesh",
    "layout_of": "meshgroups.mesh",
    "MeshGroups": "meshgroups.mesh",
    "MeshOptions": "meshgroups.mesh",
    "GroupCache": "meshgroups.mesh",
    "Strategy": "meshgroups.mesh",
}
# Every old import path (meshgroups.heal, meshgroups.mesh.mesh_groups, ...) answers through the
# deprecation table, with a warning naming its new home.
_deprecated.install()


def _draw_html(layout: Layout) -> str:
    """``Layout._repr_html_``: the layout core sits below every renderer and imports none; the
    renderer loads when a notebook first shows a layout."""
    from meshgroups.render import html

    return html(layout)


register_html_renderer(_draw_html)


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(import_module(_TORCH_NAMES[name]), name)
    return _deprecated.old_name(__name__, name)
