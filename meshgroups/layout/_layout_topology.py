"""The topology questions a ``Layout`` answers: which groups stay inside a node or a domain,
and the two constructors that start from a machine or from a running job's groups.

A mixin of ``Layout`` built on its public API only (``groups``, ``split``, the constructors):
the value itself lives in ``layout.py``; the machine model in ``topology.py``; the placement
and inference algorithms in ``placement.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, cast

import numpy as np

from meshgroups.layout import _topology as topology
from meshgroups.layout._topology import Topology

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout

Locality = Literal["intra", "inter", "mixed"]


class LayoutTopology:
    """Topology methods of ``Layout`` (see the module docstring)."""

    if TYPE_CHECKING:

        def groups(self, *dims: str) -> np.ndarray: ...

        def split(self, dim: str, /, **subdims: int) -> Layout: ...

    def node_locality(self, *dims: str, ranks_per_node: int) -> Locality:
        """``"intra"`` if every group of ``dims`` stays within one node, ``"inter"`` if every
        group has each rank on a different node, else ``"mixed"``. Node = rank // ranks_per_node."""
        return topology.node_locality(self.groups(*dims), ranks_per_node)

    def split_by_node(self, dim: str, ranks_per_node: int) -> Layout:
        """Split ``dim`` into ``{dim}_inter`` (across nodes) and ``{dim}_intra`` (within a node)."""
        inter, intra = topology.node_split_sizes(self.groups(dim), ranks_per_node, dim)
        return self.split(dim, **{f"{dim}_inter": inter, f"{dim}_intra": intra})

    def span(self, *dims: str, topology: Topology) -> str:
        """The smallest level of ``topology`` whose units each hold a whole group of ``dims``
        (``"node"``, ``"domain"``, ...), or ``"world"``::

            >>> from meshgroups import Layout, Topology
            >>> Layout(pp=4, dp=2, tp=8).span("tp", topology=Topology(node=8, domain=32))
            'node'
        """
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a meshgroups.Topology, got {type(topology).__name__}")
        return topology.span(self.groups(*dims))

    @classmethod
    def place(
        cls,
        sizes: Mapping[str, int],
        topology: Topology,
        /,
        *,
        fast_first: Sequence[str] = (),
        require: Mapping[str, str] | None = None,
    ) -> Layout:
        """A layout with exactly these dims (outermost first as given) over ranks 0..W-1 that
        keeps the dims of ``fast_first`` (most bandwidth-hungry first) on the fastest levels of
        ``topology`` it can; a dim that does not fit in a level keeps its inner factor there and
        puts its outer factor across the next level (JAX's hybrid mesh). ``require={"tp":
        "node"}`` makes a wish a constraint (``LayoutError`` naming dim, size and level)::

            >>> from meshgroups import Layout, Topology
            >>> lay = Layout.place({"pp": 2, "dp": 4, "tp": 8}, Topology(node=8), fast_first=["tp"])
            >>> lay.span("tp", topology=Topology(node=8))
            'node'
        """
        from meshgroups.layout._placement import place

        return place(cast("type[Layout]", cls), sizes, topology, fast_first, require)

    @classmethod
    def infer(cls, groups: Mapping[str, Sequence[Sequence[int]]], /) -> Layout:
        """The layout whose ``groups(name)`` equal ``groups[name]`` as sets of ranks, for every
        family — e.g. the tp/cp/dp/pp groups a running Megatron job printed. Size-1 families
        (every rank alone) are allowed. ``LayoutError`` names a family that is not a factor of
        the others::

            >>> from meshgroups import Layout
            >>> Layout.infer({"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]})
            Layout(dp=2, tp=2)
        """
        from meshgroups.layout._placement import infer

        return infer(cast("type[Layout]", cls), groups)
