"""Elastic meshes: when ranks die, the survivors' layout and groups, and the lost replica healed.

The recovery plans (``plan_shrink``, ``plan_substitute``, ``plan_grow``) are numpy only and load
with the package; the torch side (``Elastic``, ``rebuild``, ``fill_replicas``, the verdict) loads
on first use::

    >>> from meshgroups import Layout
    >>> from meshgroups.elastic import plan_shrink
    >>> plan_shrink(Layout(dp=4, tp=2), lost=[3]).new_layout
    Layout(dp=3, tp=2, grid=[0, 1, 4, 5, 6, 7])
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from meshgroups import _deprecated
from meshgroups.elastic._plans import (
    REPLICATE_DIMS,
    FamilyChange,
    RecoveryError,
    RecoveryPlan,
    family_label,
    plan_grow,
    plan_shrink,
    plan_substitute,
    replicate_dim,
)

if TYPE_CHECKING:
    from meshgroups.elastic._elastic_mesh import Elastic
    from meshgroups.elastic._heal import fill_replicas, init_optimizer_state, training_state
    from meshgroups.elastic._launch import start
    from meshgroups.elastic._recover import mesh_options, rebuild
    from meshgroups.elastic._verdict import Verdict, agree_lost

_TORCH_SIDE = {
    "Elastic": "_elastic_mesh",
    "fill_replicas": "_heal",
    "init_optimizer_state": "_heal",
    "training_state": "_heal",
    "start": "_launch",
    "mesh_options": "_recover",
    "rebuild": "_recover",
    "Verdict": "_verdict",
    "agree_lost": "_verdict",
}
__all__ = [
    "REPLICATE_DIMS",
    "Elastic",
    "FamilyChange",
    "RecoveryError",
    "RecoveryPlan",
    "Verdict",
    "agree_lost",
    "family_label",
    "fill_replicas",
    "init_optimizer_state",
    "mesh_options",
    "plan_grow",
    "plan_shrink",
    "plan_substitute",
    "rebuild",
    "replicate_dim",
    "start",
    "training_state",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        return getattr(import_module(f"meshgroups.elastic.{_TORCH_SIDE[name]}"), name)
    return _deprecated.old_name(__name__, name)
