"""Node topology of groups: which groups stay on one node and how a dim splits across nodes.

A rank's node is ``rank // ranks_per_node`` (the torchrun convention: consecutive global ranks
share a node). Functions take group arrays as ``Layout.groups`` returns them.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from .checks import MAX_RANK, check_positive
from .errors import LayoutError


def _nodes(rows: np.ndarray, ranks_per_node: int) -> np.ndarray:
    return rows // check_positive(ranks_per_node, "ranks_per_node", MAX_RANK + 1)


def node_locality(rows: np.ndarray, ranks_per_node: int) -> Literal["intra", "inter", "mixed"]:
    """``"intra"``: every group on one node; ``"inter"``: every group has each rank on a
    distinct node; ``"mixed"``: anything else. Single-rank groups count as intra-node."""
    nodes = _nodes(rows, ranks_per_node)
    if (nodes == nodes[:, :1]).all():
        return "intra"
    ordered = np.sort(nodes, axis=1)
    if (ordered[:, 1:] != ordered[:, :-1]).all():
        return "inter"
    return "mixed"


def node_split_sizes(rows: np.ndarray, ranks_per_node: int, dim: str) -> tuple[int, int]:
    """``(inter, intra)`` sizes such that each group is ``inter`` blocks of ``intra``
    consecutive members, each block on one node and every block on a different node."""
    nodes = _nodes(rows, ranks_per_node)
    n_groups, size = nodes.shape
    intra = 1
    while intra < size and nodes[0, intra] == nodes[0, 0]:
        intra += 1
    blocks = nodes.reshape(n_groups, size // intra, intra) if size % intra == 0 else None
    ok = blocks is not None and (blocks == blocks[:, :, :1]).all()
    if ok:
        heads = np.sort(blocks[:, :, 0], axis=1)  # type: ignore[index]
        ok = bool((heads[:, 1:] != heads[:, :-1]).all())
    if not ok:
        raise LayoutError(
            f"the groups of dim {dim!r} do not split into an inter-node part and an intra-node part "
            f"with ranks_per_node={ranks_per_node}: group {rows[0].tolist()} lies on nodes "
            f"{nodes[0].tolist()}, and every group must be equal-sized runs of one node each"
        )
    return size // intra, intra
