"""What every mark of a drawing means, as data the figure and the HTML both draw: one entry per
colour used (which groups wear it), the red outline (the chosen rank's group), the chosen rank
itself, node boundaries, and each row's nodes (a re-placed layout's rows need not be whole
nodes)::

    >>> from meshgroups import Layout
    >>> keys = legend(Layout(dp=2, tp=4), "tp", highlight_rank=5, ranks_per_node=4)
    >>> [k["kind"] for k in keys]
    ['colour', 'colour', 'outline', 'rank', 'node boundary']
    >>> keys[2]["label"]
    "red outline: rank 5's tp group [4, 5, 6, 7]"
    >>> row_nodes([0, 1, 8, 9], 4)
    'nodes 0, 2'
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshgroups._checks import MAX_RANK
from meshgroups.layout import Layout
from meshgroups.render._window import (
    PALETTE,
    check_count,
    check_rank_arg,
    coloured_window,
    group_index,
    group_label,
    palette,
)

__all__ = ["HIGHLIGHT", "colour_index", "hex_colour", "legend", "legend_of", "row_nodes"]

#: The colour of the chosen rank's group outline and of the rank's own edge, in every drawing.
HIGHLIGHT = "#d62728"
#: Groups named per colour entry before "… and N more".
NAMED_PER_COLOUR = 2


def colour_index(group: int) -> int:
    """The palette entry of group ``group`` (groups beyond :data:`PALETTE` reuse colours)."""
    return group % PALETTE


def hex_colour(index: int) -> str:
    """Palette entry ``index`` as ``#rrggbb``."""
    red, green, blue = (round(255 * x) for x in palette(PALETTE)[index % PALETTE])
    return f"#{red:02x}{green:02x}{blue:02x}"


def _runs(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``, at most four runs."""
    runs: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        runs.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(runs[:4]) + (", …" if len(runs) > 4 else "")


def row_nodes(ranks: Sequence[int] | np.ndarray, ranks_per_node: int) -> str:
    """The nodes one row of a drawing lies on: ``"node 3"``, ``"nodes 0-1"``, ``"nodes 0, 2"``.

    Args:
        ranks: the row's ranks. ranks_per_node: consecutive ranks per node.

    Returns:
        the label.
    """
    nodes = sorted({int(r) // ranks_per_node for r in np.asarray(ranks).ravel().tolist()})
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {_runs(nodes)}"


def legend_of(
    layout: Layout,
    dims: tuple[str, ...],
    rows: np.ndarray,
    gids: np.ndarray,
    highlight_rank: int | None,
    ranks_per_node: int | None,
) -> list[dict[str, object]]:
    """The entries of :func:`legend` for a window already computed (``rows``: its ranks,
    ``gids``: each cell's group)."""
    what = "×".join(dims)
    rank_of: dict[int, int] = {}
    for g, r in zip(gids.ravel().tolist(), rows.ravel().tolist()):
        rank_of.setdefault(int(g), int(r))
    by_colour: dict[int, list[int]] = {}
    for g in sorted(rank_of):
        by_colour.setdefault(colour_index(g), []).append(g)
    entries: list[dict[str, object]] = []
    for index, groups in sorted(by_colour.items(), key=lambda item: item[1][0]):
        named = [f"group {g} {group_label(layout, dims, rank_of[g])}" for g in groups[:NAMED_PER_COLOUR]]
        more = len(groups) - len(named)
        label = f"{what} " + "; ".join(named) + (f"; … and {more} more" if more > 0 else "")
        entries.append({"kind": "colour", "colour": hex_colour(index), "groups": groups, "label": label})
    if highlight_rank is not None and highlight_rank in layout:
        group = group_label(layout, dims, highlight_rank)
        shown = bool(np.any(gids == group_index(layout, dims, highlight_rank)))
        where = "" if shown else " (outside the window shown)"
        entries.append(
            {
                "kind": "outline",
                "colour": HIGHLIGHT,
                "label": f"red outline: rank {highlight_rank}'s {what} group {group}{where}",
            }
        )
        coords = ", ".join(f"{d}={c}" for d, c in layout.coords(highlight_rank).items())
        node = f", node {highlight_rank // ranks_per_node}" if ranks_per_node else ""
        entries.append(
            {
                "kind": "rank",
                "colour": HIGHLIGHT,
                "label": f"thick red edge, bold: rank {highlight_rank} ({coords}{node})",
            }
        )
    if ranks_per_node:
        entries.append(
            {
                "kind": "node boundary",
                "colour": "#000000",
                "label": f"thick black lines: node boundaries ({ranks_per_node} consecutive ranks a node; "
                "each row's nodes named at its end)",
            }
        )
    return entries


def legend(
    layout: Layout,
    color_by: str | Sequence[str] | None = None,
    *,
    highlight_rank: int | None = None,
    ranks_per_node: int | None = None,
    max_cells: int = 1024,
) -> list[dict[str, object]]:
    """What each mark of :func:`meshgroups.render.plot` and :func:`meshgroups.render.html`
    means, for the same arguments: one entry per colour used (``"groups"``: the groups wearing
    it), then the red outline and the rank (with ``highlight_rank``) and node boundaries (with
    ``ranks_per_node``). Each entry has ``kind``, ``colour`` (``#rrggbb``) and ``label``.

    Args:
        layout: the layout drawn. color_by: the dim(s) whose groups colour the cells.
        highlight_rank: the rank outlined, or None. ranks_per_node: for node boundaries, or None.
        max_cells: the window drawn (as the drawings take it).

    Returns:
        the entries, in drawing order.

    Raises:
        TypeError / LayoutError: a bad argument, naming it.

    >>> from meshgroups import Layout
    >>> from meshgroups.render import legend
    >>> [k["label"] for k in legend(Layout(dp=2, tp=2), "dp")]
    ['dp group 0 [0, 2]', 'dp group 1 [1, 3]']
    """
    dims, rows, _, _, gids = coloured_window(layout, color_by, max_cells)
    check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    check_rank_arg(highlight_rank, "highlight_rank")
    return legend_of(layout, dims, rows, gids, highlight_rank, ranks_per_node)
