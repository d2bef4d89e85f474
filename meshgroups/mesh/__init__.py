"""The torch bridge: a ``Layout`` becomes ``torch.distributed`` process groups and one root
``DeviceMesh``, each distinct rank set created once.

Three steps, a module each: a torch-free plan (``plan.py``) → a creation strategy
(``strategies.py``) → the ``MeshGroups`` result (``mesh_groups.py``); every collective entry point
follows one protocol (``collective.py``), over the live ranks (``cohort.py``); private torch APIs
only in ``torch_seam/``. The names load torch on first use, so ``import meshgroups.mesh`` is cheap::

    >>> import meshgroups.mesh
    >>> sorted(meshgroups.mesh.__all__)[:3]
    ['Cohort', 'GroupCache', 'GroupSpec']
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshgroups.mesh.cohort import Cohort, current_cohort, use_cohort
    from meshgroups.mesh.collective import collective_call, collective_entry, publish_refusal
    from meshgroups.mesh.groups import GroupCache
    from meshgroups.mesh.mesh_groups import MeshGroups, init_mesh, layout_of, set_group_timeout
    from meshgroups.mesh.options import MeshOptions
    from meshgroups.mesh.plan import GroupSpec
    from meshgroups.mesh.strategies import Strategy

_WHERE = {
    "Cohort": "cohort",
    "current_cohort": "cohort",
    "use_cohort": "cohort",
    "collective_call": "collective",
    "collective_entry": "collective",
    "publish_refusal": "collective",
    "GroupCache": "groups",
    "MeshGroups": "mesh_groups",
    "init_mesh": "mesh_groups",
    "layout_of": "mesh_groups",
    "set_group_timeout": "mesh_groups",
    "MeshOptions": "options",
    "GroupSpec": "plan",
    "Strategy": "strategies",
}
__all__ = [
    "Cohort",
    "GroupCache",
    "GroupSpec",
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
    raise AttributeError(f"module 'meshgroups.mesh' has no attribute {name!r}")
