"""Seeing a layout: a text table (terminal), HTML (Jupyter) and a matplotlib figure.

Every view arranges the grid in 2-D: one row per combination of the outer dims, one column per
index of the innermost dim. Colours mark the groups of a chosen dim (or dim set). Big worlds
show a window: the first rows and at most ``MAX_COLUMNS`` columns, ``max_cells`` cells in all,
said so in the caption. Every argument is checked (``TypeError``/``LayoutError``). matplotlib is
an optional extra (``pip install meshgroups[plot]``), imported only by :func:`plot`.
"""

from __future__ import annotations

import html as html_lib
from collections.abc import Sequence

from meshgroups._checks import MAX_RANK, MAX_WORLD_SIZE
from meshgroups.layout import Layout
from meshgroups.render._figure import plot
from meshgroups.render._legend import HIGHLIGHT, colour_index, hex_colour, legend, legend_of, row_nodes
from meshgroups.render._spans import span_table
from meshgroups.render._window import (
    MAX_CELLS,
    MAX_COLUMNS,
    MAX_DPI,
    PALETTE,
    check_count,
    check_layout,
    check_rank_arg,
    coloured_window,
    grid_2d,
    group_ids,
    group_index,
    row_label,
    short_list,
    window_note,
)

__all__ = [
    "MAX_CELLS",
    "MAX_COLUMNS",
    "MAX_DPI",
    "PALETTE",
    "group_ids",
    "html",
    "legend",
    "plot",
    "short_list",
    "span_table",
    "text",
]


def _first_groups(owner: Layout, dim: str, count: int, members: int | None) -> str:
    """The first ``count`` groups of ``dim`` as ``short_list`` strings, each built from at most
    ``members`` ranks (O(count × members × ndim), whatever the world size)."""
    size = owner.size(dim)
    n_groups = owner.world_size // size
    others = [(n, s) for n, s in zip(owner.names, owner.shape) if n != dim]
    shown = []
    for k in range(min(count, n_groups)):
        coords: dict[str, int] = {}
        rest = k
        for name, extent in reversed(others):  # row k: the other dims' coordinates, row-major
            rest, coords[name] = divmod(rest, extent)
        if members is None or size <= members:
            picks = list(range(size))
        else:
            picks = [*range(max(members - 1, 1)), size - 1]
        ranks = [owner.rank_at(**coords, **{dim: i}) for i in picks]
        if members is None or size <= members:
            shown.append(str(ranks))
        else:
            shown.append(f"[{', '.join(map(str, ranks[:-1]))}, …, {ranks[-1]}] ({size} ranks)")
    return ", ".join(shown) + (", …" if n_groups > count else "")


def text(
    layout: Layout,
    *,
    ranks_per_node: int | None = None,
    max_groups: int = 3,
    max_grid: int = 256,
    max_members: int | None = 16,
) -> str:
    """A terminal table: the grid (when it has at most ``max_grid`` ranks) and, for every dim
    of the layout and its views, group size, number of groups, the first ``max_groups``
    groups (each cut to ``max_members`` ranks, saying how many it has; ``None`` for all), and
    intra/inter-node status when ``ranks_per_node`` is given.

    Args:
        layout: the layout printed.
        ranks_per_node: adds the intra/inter-node status per dim, or None.
        max_groups: groups listed per dim.
        max_grid: the largest world whose grid is printed.
        max_members: members listed per group, or None for all.

    Returns:
        The text (``print`` it).

    >>> from meshgroups import Layout
    >>> from meshgroups.render import text
    >>> print(text(Layout(dp=2, tp=4), ranks_per_node=4))
    Layout(dp=2, tp=4)
    world: 8 ranks (ranks 0..7)
    <BLANKLINE>
         | tp=0 tp=1 tp=2 tp=3
    --------------------------
    dp=0 |    0    1    2    3
    dp=1 |    4    5    6    7
    <BLANKLINE>
    dim  size  groups  first groups                nodes
    ---  ----  ------  --------------------------  -----
    dp   2     4       [0, 4], [1, 5], [2, 6], …   inter
    tp   4     2       [0, 1, 2, 3], [4, 5, 6, 7]  intra
    """
    check_layout(layout)
    check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    check_count(max_groups, "max_groups", MAX_WORLD_SIZE)
    check_count(max_grid, "max_grid", MAX_WORLD_SIZE)
    check_count(max_members, "max_members", MAX_WORLD_SIZE, allow_none=True)
    lines = [repr(layout), f"world: {layout.world_size} ranks ({layout.describe_ranks()})"]
    if layout.world_size <= max_grid:
        rows, cols, _ = grid_2d(layout, max_grid)
        label_width = max(len(row_label(layout, r)) for r in range(len(rows)))
        width = max(len(str(layout.max_rank)), len(layout.names[-1]) + 2)
        header = (
            " " * label_width + " | " + " ".join(f"{layout.names[-1]}={c}".rjust(width) for c in range(cols))
        )
        lines += ["", header, "-" * len(header)]
        for r, row in enumerate(rows):
            cells = " ".join(str(v).rjust(width) for v in row.tolist())
            lines.append(f"{row_label(layout, r).ljust(label_width)} | {cells}")
    table: list[tuple[str, ...]] = [
        ("dim", "size", "groups", "first groups") + (("nodes",) if ranks_per_node else ())
    ]
    factorisations = [("", layout)] + [(f"{k}.", v) for k, v in layout.views.items()]
    for prefix, owner in factorisations:
        for dim in owner.names:
            if prefix and dim in layout.names:
                continue  # a shared dim: identical groups, shown once
            first = _first_groups(owner, dim, max_groups, max_members)
            n_groups = owner.world_size // owner.size(dim)
            entry: tuple[str, ...] = (f"{prefix}{dim}", str(owner.size(dim)), str(n_groups), first)
            if ranks_per_node:
                entry += (owner.node_locality(dim, ranks_per_node=ranks_per_node),)
            table.append(entry)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines.append("")
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def html(
    layout: Layout,
    color_by: str | Sequence[str] | None = None,
    *,
    highlight_rank: int | None = None,
    ranks_per_node: int | None = None,
    max_cells: int = 1024,
) -> str:
    """An HTML table of the grid, cells coloured by the groups of ``color_by`` (default: the
    innermost dim); ``highlight_rank``'s group is outlined in red and the rank itself named (bold,
    red); node changes get a thick edge and each row's nodes a last column; a legend under the
    table says what every colour and mark is (:func:`meshgroups.render.legend`).

    Args:
        layout: the layout drawn.
        color_by: a dim or dims whose groups colour the cells.
        highlight_rank: a rank whose group is outlined, or None.
        ranks_per_node: draw node boundaries every that many ranks, or None.
        max_cells: a bigger grid shows a window of its first ranks (the caption says so).

    Returns:
        The HTML text (a ``<table>`` with a legend of the colours).

    Raises:
        TypeError / LayoutError: a bad argument, naming it.

    >>> from meshgroups import Layout
    >>> from meshgroups.render import html
    >>> page = html(Layout(dp=2, tp=2), highlight_rank=3)  # what a notebook shows for a Layout
    >>> page.startswith("<table"), page.count("<td")
    (True, 4)
    """
    dims, rows, cols, clipped, gids = coloured_window(layout, color_by, max_cells)
    check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    check_rank_arg(highlight_rank, "highlight_rank")
    mine = None
    if highlight_rank is not None and highlight_rank in layout:
        mine = group_index(layout, dims, highlight_rank)
    caption = f"{html_lib.escape(repr(layout))} — coloured by {'×'.join(dims)}"
    if mine is not None:
        caption += f"; rank {highlight_rank} in red"
    if clipped:
        caption += f" ({window_note(layout, rows)})"
    out = [f"<table style='border-collapse:collapse;font-family:monospace'><caption>{caption}</caption>"]
    node_head = "<th>nodes</th>" if ranks_per_node else ""
    out.append(
        "<tr><th></th>"
        + "".join(f"<th>{layout.names[-1]}={c}</th>" for c in range(cols))
        + node_head
        + "</tr>"
    )
    for r, row in enumerate(rows.tolist()):
        cells = []
        for c, rank in enumerate(row):
            style = f"background:{hex_colour(colour_index(int(gids[r, c])))};padding:2px 6px;text-align:right"
            if mine is not None and int(gids[r, c]) == mine:
                style += f";outline:3px solid {HIGHLIGHT}"
            if rank == highlight_rank:
                style += f";font-weight:bold;color:{HIGHLIGHT};box-shadow:inset 0 0 0 3px {HIGHLIGHT}"
            # node boundaries wherever they fall: between columns and between rows
            if ranks_per_node and c and rank // ranks_per_node != row[c - 1] // ranks_per_node:
                style += ";border-left:3px solid #000"
            if ranks_per_node and r and rank // ranks_per_node != int(rows[r - 1, c]) // ranks_per_node:
                style += ";border-top:3px solid #000"
            cells.append(f"<td style='{style}'>{rank}</td>")
        nodes = f"<td style='padding:2px 6px'>{row_nodes(row, ranks_per_node)}</td>" if ranks_per_node else ""
        out.append(f"<tr><th>{html_lib.escape(row_label(layout, r))}</th>{''.join(cells)}{nodes}</tr>")
    out.append("</table>")
    out.append(_legend(legend_of(layout, dims, rows, gids, highlight_rank, ranks_per_node)))
    return "".join(out)


def _legend(entries: list[dict[str, object]], limit: int = 16) -> str:
    """What every colour (the first ``limit`` colours), the outline, the rank and the edges mean."""
    colours = [e for e in entries if e["kind"] == "colour"]
    items = [
        f"<span style='background:{e['colour']};padding:1px 6px;margin:2px;display:inline-block'>"
        f"{html_lib.escape(str(e['label']))}</span>"
        for e in colours[:limit]
    ]
    if len(colours) > limit:
        items.append(f"<span> … and {len(colours) - limit} more colours</span>")
    marks = {
        "outline": "outline:3px solid",
        "rank": "box-shadow:inset 0 0 0 3px",
        "node boundary": "border-left:3px solid",
    }
    for e in entries:
        if e["kind"] in marks:
            items.append(
                f"<div><span style='{marks[str(e['kind'])]} {e['colour']};padding:0 8px;margin:2px 6px 2px 2px;"
                f"display:inline-block'>&nbsp;</span>{html_lib.escape(str(e['label']))}</div>"
            )
    return f"<div style='font-family:monospace;font-size:90%'>{''.join(items)}</div>"
