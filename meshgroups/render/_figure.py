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
from meshgroups.render._legend import HIGHLIGHT, legend_of, row_nodes
from meshgroups.render._window import (
    PALETTE,
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
    cells), coloured by the groups of ``color_by``, node boundaries as thick lines and each row's
    nodes named at its right end, ``highlight_rank``'s group outlined in red and the rank itself
    named (bold, thick red edge); a legend under the grid says what every colour and outline is
    (:func:`meshgroups.render.legend` gives the same entries as data). Worlds beyond ``max_cells`` ranks show a window, their
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
    ['Layout(dp=2, tp=4)', 'coloured by tp groups, node boundaries every 4 ranks; rank 5 in red']
    >>> [t.get_text() for t in fig.axes[0].get_legend().get_texts()][2]
    "red outline: rank 5's tp group [4, 5, 6, 7]"
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
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch, Rectangle
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot() needs matplotlib: pip install 'meshgroups[plot]' (in a clone of the repository: "
            "pip install -e '.[plot]')"
        ) from None
    dims, rows, cols, clipped, gids = coloured_window(layout, color_by, max_cells)
    check_count(ranks_per_node, "ranks_per_node", MAX_RANK + 1, allow_none=True)
    check_rank_arg(highlight_rank, "highlight_rank")
    n_rows = len(rows)
    own_figure = ax is None
    if ax is None:
        fig = Figure(figsize=(min(max(7.0, 2 + 0.6 * cols), 16), min(2 + 0.45 * n_rows, 12)))
        ax = fig.subplots()
    else:
        fig = ax.figure
    # The same palette as the HTML and the legend: group g wears colour g % PALETTE everywhere.
    ax.imshow(
        gids % PALETTE,
        cmap=ListedColormap(palette(PALETTE)),
        vmin=0,
        vmax=PALETTE - 1,
        aspect="auto",
        interpolation="nearest",
    )
    if rows.size <= 512:
        for (r, c), rank in np.ndenumerate(rows):
            chosen = int(rank) == highlight_rank
            ax.text(
                c,
                r,
                str(rank),
                ha="center",
                va="center",
                fontsize=9 if chosen else 8,
                fontweight="bold" if chosen else "normal",
                color=HIGHLIGHT if chosen else "black",
            )
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
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=HIGHLIGHT, linewidth=2))
        for r, c in zip(*np.nonzero(rows == highlight_rank)):
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=HIGHLIGHT, linewidth=4))
    handles: list[Any] = []
    if marked:
        handles += _mark(ax, rows, marked)
    entries = legend_of(layout, dims, rows, gids, highlight_rank, ranks_per_node)
    colours = [e for e in entries if e["kind"] == "colour"]
    if len(colours) > MAX_LEGEND:
        note = f"… {len(colours) - MAX_LEGEND} more colours (meshgroups.render.legend lists them)"
        more: list[dict[str, object]] = [{"kind": "colour", "colour": "#ffffff", "label": note}]
        entries = colours[:MAX_LEGEND] + more + [e for e in entries if e["kind"] != "colour"]
    for entry in entries:
        kind, colour, label = entry["kind"], str(entry["colour"]), str(entry["label"])
        if kind == "colour":
            handles.append(Patch(facecolor=colour, edgecolor="none", label=label))
        elif kind == "outline":
            handles.append(Patch(fill=False, edgecolor=colour, linewidth=2, label=label))
        elif kind == "rank":
            handles.append(Patch(fill=False, edgecolor=colour, linewidth=4, label=label))
        else:
            handles.append(Line2D([], [], color=colour, linewidth=2.5, label=label))
    col_step = max(1, cols // 32)  # at most ~32 labels per axis, like the rows
    ax.set_xticks(
        range(0, cols, col_step), [f"{layout.names[-1]}={c}" for c in range(0, cols, col_step)], fontsize=7
    )
    step = max(1, n_rows // 32)
    ax.set_yticks(range(0, n_rows, step), [row_label(layout, r) for r in range(0, n_rows, step)], fontsize=7)
    if ranks_per_node:
        # Each row's nodes at its right end: a re-placed layout's row need not be one node.
        right = ax.secondary_yaxis("right")
        right.set_yticks(
            range(0, n_rows, step), [row_nodes(rows[r], ranks_per_node) for r in range(0, n_rows, step)]
        )
        right.tick_params(labelsize=7)
    if handles:
        if own_figure:  # room under the grid for the legend's lines
            fig.set_figheight(
                fig.get_figheight()
                + 0.16
                * (len(handles) if len(handles) <= 8 or fig.get_figwidth() < 10 else (len(handles) + 1) // 2)
            )
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.06),
            ncol=1 if len(handles) <= 8 or fig.get_figwidth() < 10 else 2,
            fontsize=7,
            frameon=False,
        )
    title = f"{layout!r}\ncoloured by {'×'.join(dims)} groups"
    if ranks_per_node:
        title += f", node boundaries every {ranks_per_node} ranks"
    if highlight_rank is not None and highlight_rank in layout:
        title += f"; rank {highlight_rank} in red"
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


#: Colour entries a figure's legend lists (the rest: :func:`meshgroups.render.legend`, whose
#: entries already name at most two groups each and say how many more share the colour).
MAX_LEGEND = 16
#: (marker, colour) per label of ``plot(marked=...)``, in order.
MARKS = (("x", "red"), ("o", "darkorange"), ("s", "blue"), ("^", "green"), ("D", "purple"))


def _mark(ax: Any, rows: np.ndarray, marked: Mapping[str, Iterable[int]]) -> list[Any]:
    """Draw the symbols of ``plot(marked=...)``; returns their legend handles."""
    if not isinstance(marked, Mapping) or len(marked) > len(MARKS):
        raise TypeError(f"marked maps at most {len(MARKS)} labels to ranks, got {short_repr(marked)}")
    handles = []
    for (label, ranks), (marker, colour) in zip(marked.items(), MARKS):
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise TypeError(f"marked[{label!r}] must be a list of ranks, got {short_repr(ranks)}")
        wanted = list(ranks)
        if not all(is_int(r) for r in wanted):
            raise TypeError(f"marked[{label!r}] must hold int ranks, got {short_repr(wanted)}")
        r, c = np.nonzero(np.isin(rows, np.array(wanted, dtype=np.int64)))
        filled = marker == "x"
        handles.append(
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
        )
    return handles
