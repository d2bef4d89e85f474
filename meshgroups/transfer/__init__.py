"""Weight transfer for RL: where each weight lives on a layout, and a plan to move it (numpy only).

``import meshgroups.transfer`` imports no torch; the torch side (execution, reading DTensor
placements) lives in its own modules, imported explicitly::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight, plan_transfer
    >>> w = Weight("w", (4, 4), placements={"tp": Shard(0)})
    >>> plan_transfer(Layout(tp=2), [w], Layout(tp=4, rank_offset=2), [w]).n_messages
    4
"""

from __future__ import annotations

from .assign import PlanError
from .expand import map_weights
from .mapped import Link, Mapped, Move, SegmentWeight
from .names import NameMap, Rule, Segment
from .plan import Message, Plan, plan_transfer
from .spec import Box, Placement, Replicate, Shard, Weight

__all__ = [
    "Box",
    "Link",
    "Mapped",
    "Message",
    "Move",
    "NameMap",
    "Placement",
    "Plan",
    "PlanError",
    "Replicate",
    "Rule",
    "Segment",
    "SegmentWeight",
    "Shard",
    "Weight",
    "map_weights",
    "plan_transfer",
]
