"""Seeing a layout: a text table (terminal), HTML (Jupyter) and a matplotlib figure.

Every view arranges the grid in 2-D: one row per combination of the outer dims, one column per
index of the innermost dim. Colours mark the groups of a chosen dim (or dim set). Big worlds
show a window: the first rows and at most ``MAX_COLUMNS`` columns, ``max_cells`` cells in all,
said so in the caption. Every argument is checked (``TypeError``/``LayoutError``). matplotlib is
an optional extra (``pip install meshgroups[plot]``), imported only by :func:`plot`.
"""

from __future__ import annotations

import colorsys
import html as html_lib
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import MAX_RANK, MAX_WORLD_SIZE, check_int, check_positive, short_repr
from .errors import LayoutError
from .layout import Layout
from .topology import Topology

if TYPE_CHECKING:
    from matplotlib.figure import Figure


#: Most columns a drawing (HTML or figure) shows: wider grids show a window of their first
#: columns, as taller ones show their first rows, so drawing time and figure size stay bounded.
MAX_COLUMNS = 64
#: Most cells a drawing's window may be asked for (``max_cells``).
MAX_CELLS = 16384
#: Largest resolution ``savefig`` is given by the command line (a 16 × 12 inch figure at 400 dpi
#: is 6400 × 4800 pixels, ~120 MB in memory).
MAX_DPI = 400
#: Colours of the HTML grid; groups beyond these reuse them (the figure uses 20).
PALETTE = 64


def _check_layout(layout: object) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a meshgroups.Layout, got {type(layout).__name__}")
    return layout


def _check_count(value: object, what: str, limit: int, allow_none: bool = False) -> int | None:
    """An int option in ``1..limit`` (or None where allowed)."""
    if value is None and allow_none:
        return None
    return check_positive(value, what, limit)


def _check_rank_arg(value: object, what: str) -> int | None:
    if value is None:
        return None
    rank = check_int(value, what)
    if not 0 <= rank <= MAX_RANK:
        raise LayoutError(f"{what}={rank} is not a rank (0..{MAX_RANK})")
    return rank


def _dims_arg(layout: Layout, color_by: str | Sequence[str] | None) -> tuple[str, ...]:
    if color_by is None:
        return (layout.names[-1],)
    if not isinstance(color_by, (str, Sequence)):
        raise TypeError(f"color_by must be a dim name or a sequence of them, got {type(color_by).__name__}")
    dims = (color_by,) if isinstance(color_by, str) else tuple(color_by)
    layout.resolve(*dims)  # validates, views included
    return dims


def group_ids(layout: Layout, *dims: str) -> np.ndarray:
    """For every cell of ``layout.grid``, the index of its group varying ``dims`` (a row of
    ``groups(*dims)``, dims of a view allowed)::

        >>> group_ids(Layout(dp=2, tp=2), "tp").tolist()
        [[0, 0], [1, 1]]
    """
    owner = _check_layout(layout).resolve(*dims) if dims else layout
    rows = owner.groups(*dims)
    # Sorted lookup, not a table indexed by rank: memory follows the layout, not its rank range.
    members = rows.ravel()
    order = np.argsort(members)
    ids = np.repeat(np.arange(len(rows)), rows.shape[1])[order]
    return ids[np.searchsorted(members[order], layout.grid)]


def _grid_2d(layout: Layout, max_cells: int, max_cols: int | None = None) -> tuple[np.ndarray, int, bool]:
    """The first rows (and, with ``max_cols``, columns) of the 2-D grid holding at most
    ``max_cells`` cells; its column count; whether anything was left out."""
    full_cols = layout.shape[-1]
    cols = full_cols if max_cols is None else min(full_cols, max_cols, max_cells)
    total_rows = layout.world_size // full_cols
    n_rows = min(total_rows, max(1, max_cells // cols))
    # Only the window's ranks are computed (affine: from the strides), never the whole grid.
    index = (np.arange(n_rows, dtype=np.int64)[:, None] * full_cols + np.arange(cols)[None, :]).ravel()
    if layout.strides is not None:
        coords = np.unravel_index(index, layout.shape)
        ranks = layout.rank_offset + sum(c * s for c, s in zip(coords, layout.strides))
    else:
        ranks = layout.grid.ravel()[index]
    window = np.asarray(ranks, dtype=np.int64).reshape(n_rows, cols)
    return window, cols, total_rows > n_rows or cols < full_cols


def _coloured_window(
    layout: Layout, color_by: str | Sequence[str] | None, max_cells: object
) -> tuple[tuple[str, ...], np.ndarray, int, bool, np.ndarray]:
    """What html() and plot() draw: the colour dims, the 2-D window of ranks (at most
    ``MAX_COLUMNS`` columns), its column count, whether it was clipped, and each cell's group
    index."""
    _check_layout(layout)
    cells = check_positive(max_cells, "max_cells", MAX_CELLS)
    dims = _dims_arg(layout, color_by)
    rows, cols, clipped = _grid_2d(layout, cells, MAX_COLUMNS)
    return dims, rows, cols, clipped, _window_group_ids(layout, dims, rows)


def _window_group_ids(layout: Layout, dims: tuple[str, ...], rows: np.ndarray) -> np.ndarray:
    """``group_ids`` for the window's cells only: O(cells × ndim), not O(W), so a window of a
    16M-rank layout costs what a small layout's does. A group's index is its position among
    ``groups(*dims)``'s rows: the other dims' coordinates, row-major."""
    ids = [_group_index(layout, dims, rank) for rank in rows.ravel().tolist()]
    return np.array(ids, dtype=np.int64).reshape(rows.shape)


def _group_index(layout: Layout, dims: tuple[str, ...], rank: int) -> int:
    """The row of ``groups(*dims)`` holding ``rank``: its other coordinates, row-major. O(ndim)."""
    owner = layout.resolve(*dims)
    coords = owner.coords(rank)
    index = 0
    for name, size in zip(owner.names, owner.shape):
        if name not in dims:
            index = index * size + coords[name]
    return index


def _group_label(layout: Layout, dims: tuple[str, ...], rank: int) -> str:
    """``[first, …, last] (size)`` of ``rank``'s group, in O(ndim) for big groups."""
    owner = layout.resolve(*dims)
    size = owner.size(*dims)
    if size <= 8:
        return str(owner.group_of(rank, *dims).tolist())
    coords = owner.coords(rank)
    first = owner.rank_at(**{**coords, **{d: 0 for d in dims}})
    last = owner.rank_at(**{**coords, **{d: owner.size(d) - 1 for d in dims}})
    return f"[{first}, …, {last}] ({size})"


def _window_note(layout: Layout, rows: np.ndarray) -> str:
    """What a clipped drawing says it shows."""
    if rows.shape[1] < layout.shape[-1]:
        return (
            f"first {rows.shape[0]} rows × {rows.shape[1]} of {layout.shape[-1]} columns "
            f"of {layout.world_size} ranks"
        )
    return f"first {rows.size} of {layout.world_size} ranks"


def _row_label(layout: Layout, row: int) -> str:
    outer = layout.shape[:-1]
    if not outer:
        return ""
    coords = np.unravel_index(row, outer)
    return " ".join(f"{n}={int(c)}" for n, c in zip(layout.names[:-1], coords))


def _palette(n: int) -> list[tuple[float, float, float]]:
    golden = 0.618033988749895
    return [colorsys.hls_to_rgb((i * golden) % 1.0, 0.72, 0.55) for i in range(max(n, 1))]


def short_list(ranks: Sequence[int], limit: int | None = 16) -> str:
    """``[0, 1, 2, …, 99] (100 ranks)`` past ``limit`` members; the whole list with ``None``::

    >>> short_list(range(100), 4)
    '[0, 1, 2, …, 99] (100 ranks)'
    """
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (Sequence, np.ndarray, range)):
        raise TypeError(f"short_list takes a sequence of ranks, got {type(ranks).__name__}")
    _check_count(limit, "limit", MAX_WORLD_SIZE, allow_none=True)
    ranks = [check_int(r, "each rank") for r in ranks]
    if limit is None or len(ranks) <= limit:
        return str(ranks)
    head = ", ".join(str(r) for r in ranks[: max(limit - 1, 1)])
    return f"[{head}, …, {ranks[-1]}] ({len(ranks)} ranks)"


def span_table(layout: Layout, topology: Topology, dims: Sequence[Sequence[str]] | None = None) -> str:
    """Per dim (and view dim, or the given dim sets): group size, the smallest level holding
    every group (``Layout.span``), and how many groups leave a unit of each level::

        dim  size  span    groups  leave node  leave domain
        tp   8     node    16      0           0
    """
    _check_layout(layout)
    if not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be a meshgroups.Topology (e.g. Topology.parse({short_repr(topology)}) for a str), "
            f"got {type(topology).__name__}"
        )
    families: list[tuple[str, Layout, tuple[str, ...]]] = []
    if dims is not None and (isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence)):
        raise TypeError(f"dims must be a list of dim tuples such as [('dp', 'cp')], got {short_repr(dims)}")
    if dims is None:
        families = [(d, layout, (d,)) for d in layout.names]
        for k, view in layout.views.items():
            families += [(f"{k}.{d}", view, (d,)) for d in view.names if d not in layout.names]
    else:
        for group in dims:
            if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
                raise TypeError(
                    f"each entry of dims is a tuple of dim names such as ('dp', 'cp'), got {short_repr(group)}"
                )
            owner = layout.resolve(*group)
            families.append(("×".join(group), owner, tuple(group)))
    header = ("dim", "size", "span", "groups", *tuple(f"leave {name}" for name in topology.names))
    table = [header]
    for label, owner, group in families:
        lows, highs = _extents(owner, group)
        crossing = topology.crossings_of_extents(lows, highs)
        table.append(
            (
                label,
                str(owner.size(*group)),
                topology.span_of_extents(lows, highs),
                str(len(lows)),
                *tuple(str(crossing[name]) for name in topology.names),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [repr(topology)]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _extents(owner: Layout, dims: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each group's smallest and largest rank, in ``groups(*dims)`` row order. For an affine
    layout the smallest is the member at coordinate 0 of ``dims`` and the largest adds each
    dim's (size - 1) · stride: O(W / group size), no group array."""
    if owner.strides is None:
        rows = owner.groups(*dims)
        return rows.min(axis=1), rows.max(axis=1)
    lows = np.full((1,) * owner.ndim, owner.rank_offset, dtype=np.int64)
    reach = 0
    for axis, (name, size, stride) in enumerate(zip(owner.names, owner.shape, owner.strides)):
        if name in dims:
            reach += (size - 1) * stride
        elif size > 1:
            step = np.arange(size, dtype=np.int64) * stride
            lows = lows + step.reshape([size if i == axis else 1 for i in range(owner.ndim)])
    lows = lows.ravel()
    return lows, lows + reach


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
    intra/inter-node status when ``ranks_per_node`` is given."""
    _check_layout(layout)
    _check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    _check_count(max_groups, "max_groups", MAX_WORLD_SIZE)
    _check_count(max_grid, "max_grid", MAX_WORLD_SIZE)
    _check_count(max_members, "max_members", MAX_WORLD_SIZE, allow_none=True)
    lines = [repr(layout), f"world: {layout.world_size} ranks ({layout.describe_ranks()})"]
    if layout.world_size <= max_grid:
        rows, cols, _ = _grid_2d(layout, max_grid)
        label_width = max(len(_row_label(layout, r)) for r in range(len(rows)))
        width = max(len(str(layout.max_rank)), len(layout.names[-1]) + 2)
        header = (
            " " * label_width + " | " + " ".join(f"{layout.names[-1]}={c}".rjust(width) for c in range(cols))
        )
        lines += ["", header, "-" * len(header)]
        for r, row in enumerate(rows):
            cells = " ".join(str(v).rjust(width) for v in row.tolist())
            lines.append(f"{_row_label(layout, r).ljust(label_width)} | {cells}")
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
    innermost dim); ``highlight_rank``'s group is outlined; node changes get a thick left edge."""
    dims, rows, cols, clipped, gids = _coloured_window(layout, color_by, max_cells)
    _check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    _check_rank_arg(highlight_rank, "highlight_rank")
    colors = _palette(min(int(gids.max()) + 1, PALETTE))
    mine = None
    if highlight_rank is not None and highlight_rank in layout:
        mine = _group_index(layout, dims, highlight_rank)
    caption = f"{html_lib.escape(repr(layout))} — coloured by {'×'.join(dims)}"
    if clipped:
        caption += f" ({_window_note(layout, rows)})"
    out = [f"<table style='border-collapse:collapse;font-family:monospace'><caption>{caption}</caption>"]
    out.append("<tr><th></th>" + "".join(f"<th>{layout.names[-1]}={c}</th>" for c in range(cols)) + "</tr>")
    for r, row in enumerate(rows.tolist()):
        cells = []
        for c, rank in enumerate(row):
            red, green, blue = (int(255 * x) for x in colors[int(gids[r, c]) % len(colors)])
            style = f"background:rgb({red},{green},{blue});padding:2px 6px;text-align:right"
            if mine is not None and int(gids[r, c]) == mine:
                style += ";outline:3px solid black"
            # node boundaries wherever they fall: between columns and between rows
            if ranks_per_node and c and rank // ranks_per_node != row[c - 1] // ranks_per_node:
                style += ";border-left:3px solid #333"
            if ranks_per_node and r and rank // ranks_per_node != int(rows[r - 1, c]) // ranks_per_node:
                style += ";border-top:3px solid #333"
            cells.append(f"<td style='{style}'>{rank}</td>")
        out.append(f"<tr><th>{html_lib.escape(_row_label(layout, r))}</th>{''.join(cells)}</tr>")
    out.append("</table>")
    out.append(_legend(layout, dims, gids, rows, colors, ranks_per_node))
    return "".join(out)


def _legend(
    layout: Layout,
    dims: tuple[str, ...],
    gids: np.ndarray,
    rows: np.ndarray,
    colors: list[tuple[float, float, float]],
    ranks_per_node: int | None,
    limit: int = 16,
) -> str:
    """Which colour is which group (the first ``limit`` groups shown), and what the edges mean."""
    rank_of = {int(g): int(r) for g, r in zip(gids.ravel()[::-1].tolist(), rows.ravel()[::-1].tolist())}
    owner = layout.resolve(*dims)
    n_groups = owner.world_size // owner.size(*dims)
    shown = sorted(set(int(g) for g in np.unique(gids)))[:limit]
    items = []
    for g in shown:
        red, green, blue = (int(255 * x) for x in colors[g % len(colors)])
        label = _group_label(layout, dims, rank_of[g])
        items.append(
            f"<span style='background:rgb({red},{green},{blue});padding:1px 6px;margin:2px;"
            f"display:inline-block'>{'×'.join(dims)} group {g}: {label}</span>"
        )
    more = n_groups - len(shown)
    note = f" … and {more} more groups" if more > 0 else ""
    edges = f" Thick edges: node boundaries (every {ranks_per_node} ranks)." if ranks_per_node else ""
    return f"<div style='font-family:monospace;font-size:90%'>{''.join(items)}{note}{edges}</div>"


def plot(
    layout: Layout,
    color_by: str | Sequence[str] | None = None,
    *,
    ranks_per_node: int | None = None,
    highlight_rank: int | None = None,
    max_cells: int = 1024,
    ax: Any = None,
) -> Figure:
    """A matplotlib figure of the grid: one cell per rank (labelled when there are at most 512
    cells), coloured by the groups of ``color_by``, node boundaries as thick lines,
    ``highlight_rank``'s group outlined. Worlds beyond ``max_cells`` ranks show a window, their
    first ``max_cells`` ranks (the title says so), so a 16k-rank layout draws in about a second;
    grids wider than ``MAX_COLUMNS`` show their first columns (``pp=2 tp=4096``: 64 columns)."""
    if ax is not None and not hasattr(ax, "imshow"):
        raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}")
    try:
        # The object-oriented API only: no pyplot, no backend switch, so a Jupyter kernel keeps
        # its inline backend (the figure shows with display(fig)) and the caller's own plots too.
        import matplotlib  # noqa: F401  (the package first: a clear ImportError without it)
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot() needs matplotlib: pip install 'meshgroups[plot]' (in a clone of the repository: "
            "pip install -e '.[plot]')"
        ) from None
    dims, rows, cols, clipped, gids = _coloured_window(layout, color_by, max_cells)
    _check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    _check_rank_arg(highlight_rank, "highlight_rank")
    n_rows = len(rows)
    if ax is None:
        fig = Figure(figsize=(min(max(7.0, 2 + 0.6 * cols), 16), min(2 + 0.45 * n_rows, 12)))
        ax = fig.subplots()
    else:
        fig = ax.figure
    ax.imshow(
        gids % 20, cmap=ListedColormap(_palette(20)), vmin=0, vmax=19, aspect="auto", interpolation="nearest"
    )
    if rows.size <= 512:
        for (r, c), rank in np.ndenumerate(rows):
            ax.text(c, r, str(rank), ha="center", va="center", fontsize=8)
    if ranks_per_node:
        nodes = rows // ranks_per_node
        width = 2.5 if n_rows <= 64 else 0.8
        r, c = np.nonzero(nodes[:, 1:] != nodes[:, :-1])
        ax.vlines(c + 0.5, r - 0.5, r + 0.5, colors="black", linewidth=width)
        r, c = np.nonzero(nodes[1:, :] != nodes[:-1, :])
        ax.hlines(r + 0.5, c - 0.5, c + 0.5, colors="black", linewidth=width)
    if highlight_rank is not None and highlight_rank in layout:
        members = gids == _group_index(layout, dims, highlight_rank)
        for r, c in zip(*np.nonzero(members)):
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    col_step = max(1, cols // 32)  # at most ~32 labels per axis, like the rows
    ax.set_xticks(
        range(0, cols, col_step), [f"{layout.names[-1]}={c}" for c in range(0, cols, col_step)], fontsize=7
    )
    step = max(1, n_rows // 32)
    ax.set_yticks(range(0, n_rows, step), [_row_label(layout, r) for r in range(0, n_rows, step)], fontsize=7)
    title = f"{layout!r}\ncoloured by {'×'.join(dims)} groups"
    if ranks_per_node:
        title += f", node boundaries every {ranks_per_node} ranks"
    if clipped:
        title += f"\n({_window_note(layout, rows)} shown)"
    # The title is centred on the axes, right of the row labels: wrap it at the axes' width
    # (estimated; a character is about 0.6 of its point size wide), so a long repr (views
    # included) never makes the title, instead of the grid, the widest thing in the figure.
    label_chars = max((len(_row_label(layout, r)) for r in range(0, n_rows, step)), default=0)
    chars = max(20, int((fig.get_figwidth() * 72 - 0.6 * 7 * label_chars - 30) / (0.6 * 9)))
    ax.set_title("\n".join(textwrap.fill(line, chars) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    return fig
