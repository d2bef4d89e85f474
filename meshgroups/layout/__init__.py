"""The layout core (numpy only, no torch): ``Layout``, the value; the algebra, views and Megatron
order strings beside it; ``Topology`` and placement on a machine; JSON and ``repr``.

Every module here builds on ``Layout``'s public API only, nothing here imports torch, and
nothing here imports a package above it (the HTML a notebook shows is drawn by
``meshgroups.render``, registered by the package front through ``register_html_renderer``). The bounds and checks
every layout goes through (``MAX_WORLD_SIZE``, ``check_int``, ``short_repr``, ``formula``)
are here too, for code that wraps meshgroups and words its errors alike (``meshgroups.compat``)::

    >>> from meshgroups.layout import Layout
    >>> Layout(dp=2, tp=2).groups("tp").tolist()
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

from meshgroups._checks import MAX_RANK, MAX_WORLD_SIZE, check_int, formula, product, short_repr
from meshgroups.layout._algebra import keep
from meshgroups.layout._core import Layout
from meshgroups.layout._identity import register_html_renderer
from meshgroups.layout._layout_topology import Locality
from meshgroups.layout._order import megatron_order, parse_order
from meshgroups.layout._placement import infer, place
from meshgroups.layout._topology import WORLD, Topology, node_locality

# Not in __all__: for the packages above this one (the topology level that holds everything,
# the hook through which meshgroups.render draws a layout in Jupyter, select's trusted kernel).

__all__ = [
    "MAX_RANK",
    "MAX_WORLD_SIZE",
    "Layout",
    "Locality",
    "Topology",
    "check_int",
    "formula",
    "infer",
    "megatron_order",
    "node_locality",
    "parse_order",
    "place",
    "product",
    "short_repr",
]
