"""A matplotlib figure of a layout's grid: one cell per rank coloured by the groups of a dim (or
dim set), node boundaries, one rank's group outlined. matplotlib is an optional extra
(``pip install meshgroups[plot]``), imported only when a figure is drawn; :func:`plot` is
``meshgroups.render.plot``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meshgroups._checks import MAX_RANK, is_int, short_repr
from meshgroups.layout import Layout
from meshgroups.render._window import (
    check_count,
    check_rank_arg,
    coloured_window,
    group_index,
    palette,
    row_label,
    window_note,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot(
    layout: Layout,
    color_by: str | Sequence[str] | None = None,
    *,
    ranks_per_node: int | None = None,
    highlight_rank: int | None = None,
    max_cells: int = 1024,
    ax: Any = None,
    marked: Mapping[str, Iterable[int]] | None = None,
) -> Figure:
    """A matplotlib figure of the grid: one cell per rank (labelled when there are at most 512
    cells), coloured by the groups of ``color_by``, node boundaries as thick lines,
    ``highlight_rank``'s group outlined. Worlds beyond ``max_cells`` ranks show a window, their
    first ``max_cells`` ranks (the title says so), so a 16k-rank layout draws in about a second;
    grids wider than ``MAX_COLUMNS`` show their first columns (``pp=2 tp=4096``: 64 columns).

    Args:
        layout: the layout drawn.
        color_by: a dim or dims whose groups colour the cells (default: the innermost dim).
        ranks_per_node: draw node boundaries every that many ranks, or None.
        highlight_rank: a rank whose group is outlined, or None.
        max_cells: the most ranks drawn (a window of the first ones beyond).
        ax: a matplotlib ``Axes`` to draw into, or None for a new figure.
        marked: ``{label: ranks}``: a symbol on those ranks' cells, one symbol per label with a
            legend under the grid, e.g. ``{"lost": [13, 14], "spare": [40, 41]}`` (at most five
            labels), as the recovery-plan notebook marks lost ranks and spares.

    Returns:
        The matplotlib ``Figure`` (``fig.savefig(...)`` writes it; ``display(fig)`` in Jupyter).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'meshgroups[plot]'``).
        TypeError / LayoutError: a bad argument, naming it.

    >>> import io
    >>> from meshgroups import Layout
    >>> from meshgroups.render import plot
    >>> fig = plot(Layout(dp=2, tp=4), ranks_per_node=4, highlight_rank=5)
    >>> fig.axes[0].get_title().splitlines()
    ['Layout(dp=2, tp=4)', 'coloured by tp groups, node boundaries every 4 ranks']
    >>> fig.savefig(io.BytesIO(), format="png")  # or a path: layout.png
    """
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
    dims, rows, cols, clipped, gids = coloured_window(layout, color_by, max_cells)
    check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    check_rank_arg(highlight_rank, "highlight_rank")
    n_rows = len(rows)
    if ax is None:
        fig = Figure(figsize=(min(max(7.0, 2 + 0.6 * cols), 16), min(2 + 0.45 * n_rows, 12)))
        ax = fig.subplots()
    else:
        fig = ax.figure
    ax.imshow(
        gids % 20, cmap=ListedColormap(palette(20)), vmin=0, vmax=19, aspect="auto", interpolation="nearest"
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
        members = gids == group_index(layout, dims, highlight_rank)
        for r, c in zip(*np.nonzero(members)):
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    if marked:
        _mark(ax, rows, marked)
    col_step = max(1, cols // 32)  # at most ~32 labels per axis, like the rows
    ax.set_xticks(
        range(0, cols, col_step), [f"{layout.names[-1]}={c}" for c in range(0, cols, col_step)], fontsize=7
    )
    step = max(1, n_rows // 32)
    ax.set_yticks(range(0, n_rows, step), [row_label(layout, r) for r in range(0, n_rows, step)], fontsize=7)
    title = f"{layout!r}\ncoloured by {'×'.join(dims)} groups"
    if ranks_per_node:
        title += f", node boundaries every {ranks_per_node} ranks"
    if clipped:
        title += f"\n({window_note(layout, rows)} shown)"
    # The title is centred on the axes, right of the row labels: wrap it at the axes' width
    # (estimated; a character is about 0.6 of its point size wide), so a long repr (views
    # included) never makes the title, instead of the grid, the widest thing in the figure.
    label_chars = max((len(row_label(layout, r)) for r in range(0, n_rows, step)), default=0)
    chars = max(20, int((fig.get_figwidth() * 72 - 0.6 * 7 * label_chars - 30) / (0.6 * 9)))
    ax.set_title("\n".join(textwrap.fill(line, chars) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    return fig


#: (marker, colour) per label of ``plot(marked=...)``, in order.
MARKS = (("x", "red"), ("o", "darkorange"), ("s", "blue"), ("^", "green"), ("D", "purple"))


def _mark(ax: Any, rows: np.ndarray, marked: Mapping[str, Iterable[int]]) -> None:
    if not isinstance(marked, Mapping) or len(marked) > len(MARKS):
        raise TypeError(f"marked maps at most {len(MARKS)} labels to ranks, got {short_repr(marked)}")
    for (label, ranks), (marker, colour) in zip(marked.items(), MARKS):
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise TypeError(f"marked[{label!r}] must be a list of ranks, got {short_repr(ranks)}")
        wanted = list(ranks)
        if not all(is_int(r) for r in wanted):
            raise TypeError(f"marked[{label!r}] must hold int ranks, got {short_repr(wanted)}")
        r, c = np.nonzero(np.isin(rows, np.array(wanted, dtype=np.int64)))
        filled = marker == "x"
        ax.scatter(
            c,
            r,
            marker=marker,
            s=140,
            linewidths=2,
            label=f"{label} ({len(wanted)})",
            c=colour if filled else "none",
            edgecolors=None if filled else colour,
        )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=len(marked), fontsize=8, frameon=False)
