"""The layout core (numpy only, no torch): ``Layout``, the value; the algebra, views and Megatron
order strings beside it; ``Topology`` and placement on a machine; JSON and ``repr``.

Every module here builds on ``Layout``'s public API only, and nothing here imports torch::

    >>> from meshgroups.layout import Layout
    >>> Layout(dp=2, tp=2).groups("tp").tolist()
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

from meshgroups.layout.core import Layout
from meshgroups.layout.layout_topology import Locality
from meshgroups.layout.order import megatron_order, parse_order
from meshgroups.layout.placement import infer, place
from meshgroups.layout.topology import Topology, node_locality

__all__ = [
    "Layout",
    "Locality",
    "Topology",
    "infer",
    "megatron_order",
    "node_locality",
    "parse_order",
    "place",
]
