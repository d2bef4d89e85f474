"""Weight transfer for RL: where each weight lives on a layout, a plan to move it, and the
objects an RL loop holds to move it.

The plan side is numpy only and loads with the package (``plan_transfer``, ``Weight``,
``Shard``, ``NameMap``, ...); the torch side (``WeightSync``, ``init_job``, ``execute``,
``module_weights``) loads on first use, so ``import meshgroups.transfer`` imports no torch::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight, plan_transfer
    >>> w = Weight("w", (4, 4), placements={"tp": Shard(0)})
    >>> plan_transfer(Layout(tp=2), [w], Layout(tp=4, rank_offset=2), [w]).n_messages
    4
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING, Any

from meshgroups.transfer.assign import PlanError
from meshgroups.transfer.expand import map_weights
from meshgroups.transfer.families import hf_to_vllm
from meshgroups.transfer.families_megatron import hf_to_megatron_family, megatron_to_hf_family

# Planner internals that 0.3/0.4 exported here: still importable, no longer the public surface.
from meshgroups.transfer.mapped import Link as Link
from meshgroups.transfer.mapped import Mapped as Mapped
from meshgroups.transfer.mapped import Move as Move
from meshgroups.transfer.mapped import SegmentWeight as SegmentWeight
from meshgroups.transfer.names import NameMap
from meshgroups.transfer.names import Rule as Rule
from meshgroups.transfer.names import Segment as Segment
from meshgroups.transfer.plan import Message, Plan, TransferPlan, plan_transfer
from meshgroups.transfer.presets import model_weights
from meshgroups.transfer.quant import BlockFP8
from meshgroups.transfer.spec import Box, Placement, Replicate, Shard, Weight
from meshgroups.transfer.stacking import Stack, expert_order

if TYPE_CHECKING:
    from meshgroups.transfer.execute import Report, TransferError, execute
    from meshgroups.transfer.fanout_groups import TransferGroups
    from meshgroups.transfer.jobs import Job, init_job
    from meshgroups.transfer.sync import WeightSync
    from meshgroups.transfer.torch_io import local_weights, module_weights

_TORCH_SIDE = {
    "Report": "execute",
    "TransferError": "execute",
    "execute": "execute",
    "TransferGroups": "fanout_groups",
    "Job": "jobs",
    "init_job": "jobs",
    "WeightSync": "sync",
    "local_weights": "torch_io",
    "module_weights": "torch_io",
}

__all__ = [
    "BlockFP8",
    "Box",
    "Job",
    "Message",
    "NameMap",
    "Placement",
    "Plan",
    "PlanError",
    "Replicate",
    "Report",
    "Shard",
    "Stack",
    "TransferError",
    "TransferGroups",
    "TransferPlan",
    "Weight",
    "WeightSync",
    "execute",
    "expert_order",
    "hf_to_megatron_family",
    "hf_to_vllm",
    "init_job",
    "local_weights",
    "map_weights",
    "megatron_to_hf_family",
    "model_weights",
    "module_weights",
    "plan_transfer",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_SIDE:
        return getattr(import_module(f"meshgroups.transfer.{_TORCH_SIDE[name]}"), name)
    raise AttributeError(f"module 'meshgroups.transfer' has no attribute {name!r}")


class _Package(types.ModuleType):
    """``execute`` is both the function this package exports and the module it lives in (a path
    the docs showed, ``from meshgroups.transfer.execute import Report``): importing the module
    must not replace the package's ``execute`` with it, as Python's import system otherwise does."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "execute" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
