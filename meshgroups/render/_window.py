"""The grid every view of a layout draws: checks of the drawing arguments, the 2-D arrangement
(one row per combination of the outer dims, one column per index of the innermost), the window
big worlds show, the groups that colour it, labels and the palette. Shared by the text and HTML
views (:mod:`meshgroups.render._formats`) and the figure (:mod:`meshgroups.render._figure`)::

    >>> from meshgroups import Layout
    >>> group_ids(Layout(dp=2, tp=2), "tp").tolist()  # each rank's tp group, in grid shape
    [[0, 0], [1, 1]]
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence

import numpy as np

from meshgroups._checks import MAX_RANK, MAX_WORLD_SIZE, check_int, check_positive
from meshgroups.errors import LayoutError
from meshgroups.layout import Layout

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


def check_layout(layout: object) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a meshgroups.Layout, got {type(layout).__name__}")
    return layout


def check_count(value: object, what: str, limit: int, allow_none: bool = False) -> int | None:
    """An int option in ``1..limit`` (or None where allowed)."""
    if value is None and allow_none:
        return None
    return check_positive(value, what, limit)


def check_rank_arg(value: object, what: str) -> int | None:
    if value is None:
        return None
    rank = check_int(value, what)
    if not 0 <= rank <= MAX_RANK:
        raise LayoutError(f"{what}={rank} is not a rank (0..{MAX_RANK})")
    return rank


def dims_arg(layout: Layout, color_by: str | Sequence[str] | None) -> tuple[str, ...]:
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

    Args:
        layout: the layout.
        dims: the dims varying within a group.

    Returns:
        An int array shaped like ``layout.grid``.
    """
    owner = check_layout(layout).resolve(*dims) if dims else layout
    rows = owner.groups(*dims)
    # Sorted lookup, not a table indexed by rank: memory follows the layout, not its rank range.
    members = rows.ravel()
    order = np.argsort(members)
    ids = np.repeat(np.arange(len(rows)), rows.shape[1])[order]
    return ids[np.searchsorted(members[order], layout.grid)]


def grid_2d(layout: Layout, max_cells: int, max_cols: int | None = None) -> tuple[np.ndarray, int, bool]:
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


def coloured_window(
    layout: Layout, color_by: str | Sequence[str] | None, max_cells: object
) -> tuple[tuple[str, ...], np.ndarray, int, bool, np.ndarray]:
    """What html() and plot() draw: the colour dims, the 2-D window of ranks (at most
    ``MAX_COLUMNS`` columns), its column count, whether it was clipped, and each cell's group
    index."""
    check_layout(layout)
    cells = check_positive(max_cells, "max_cells", MAX_CELLS)
    dims = dims_arg(layout, color_by)
    rows, cols, clipped = grid_2d(layout, cells, MAX_COLUMNS)
    return dims, rows, cols, clipped, window_group_ids(layout, dims, rows)


def window_group_ids(layout: Layout, dims: tuple[str, ...], rows: np.ndarray) -> np.ndarray:
    """``group_ids`` for the window's cells only: O(cells × ndim), not O(W), so a window of a
    16M-rank layout costs what a small layout's does. A group's index is its position among
    ``groups(*dims)``'s rows: the other dims' coordinates, row-major."""
    ids = [group_index(layout, dims, rank) for rank in rows.ravel().tolist()]
    return np.array(ids, dtype=np.int64).reshape(rows.shape)


def group_index(layout: Layout, dims: tuple[str, ...], rank: int) -> int:
    """The row of ``groups(*dims)`` holding ``rank``: its other coordinates, row-major. O(ndim)."""
    owner = layout.resolve(*dims)
    coords = owner.coords(rank)
    index = 0
    for name, size in zip(owner.names, owner.shape):
        if name not in dims:
            index = index * size + coords[name]
    return index


def group_label(layout: Layout, dims: tuple[str, ...], rank: int) -> str:
    """``[first, …, last] (size)`` of ``rank``'s group, in O(ndim) for big groups."""
    owner = layout.resolve(*dims)
    size = owner.size(*dims) if dims else 1
    if size <= 8:
        return str(owner.group_of(rank, *dims).tolist())
    coords = owner.coords(rank)
    first = owner.rank_at(**{**coords, **{d: 0 for d in dims}})
    last = owner.rank_at(**{**coords, **{d: owner.size(d) - 1 for d in dims}})
    return f"[{first}, …, {last}] ({size})"


def window_note(layout: Layout, rows: np.ndarray) -> str:
    """What a clipped drawing says it shows."""
    if rows.shape[1] < layout.shape[-1]:
        return (
            f"first {rows.shape[0]} rows × {rows.shape[1]} of {layout.shape[-1]} columns "
            f"of {layout.world_size} ranks"
        )
    return f"first {rows.size} of {layout.world_size} ranks"


def row_label(layout: Layout, row: int) -> str:
    outer = layout.shape[:-1]
    if not outer:
        return ""
    coords = np.unravel_index(row, outer)
    return " ".join(f"{n}={int(c)}" for n, c in zip(layout.names[:-1], coords))


def palette(n: int) -> list[tuple[float, float, float]]:
    golden = 0.618033988749895
    return [colorsys.hls_to_rgb((i * golden) % 1.0, 0.72, 0.55) for i in range(max(n, 1))]


def short_list(ranks: Sequence[int], limit: int | None = 16) -> str:
    """``[0, 1, 2, …, 99] (100 ranks)`` past ``limit`` members; the whole list with ``None``::

    >>> short_list(range(100), 4)
    '[0, 1, 2, …, 99] (100 ranks)'

    Args:
        ranks: the ranks.
        limit: members shown before the ellipsis, or None for all.

    Returns:
        The text.
    """
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (Sequence, np.ndarray, range)):
        raise TypeError(f"short_list takes a sequence of ranks, got {type(ranks).__name__}")
    check_count(limit, "limit", MAX_WORLD_SIZE, allow_none=True)
    ranks = [check_int(r, "each rank") for r in ranks]
    if limit is None or len(ranks) <= limit:
        return str(ranks)
    head = ", ".join(str(r) for r in ranks[: max(limit - 1, 1)])
    return f"[{head}, …, {ranks[-1]}] ({len(ranks)} ranks)"
