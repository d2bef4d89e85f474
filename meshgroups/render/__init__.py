"""Seeing a layout: a text table (terminal), HTML (Jupyter), a matplotlib figure, the span
table, and an interactive explorer (ipywidgets)::

    >>> from meshgroups import Layout
    >>> from meshgroups.render import text
    >>> print(text(Layout(dp=2, tp=2)).splitlines()[1])
    world: 4 ranks (ranks 0..3)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshgroups import _deprecated
from meshgroups.render._formats import (
    MAX_CELLS,
    MAX_COLUMNS,
    MAX_DPI,
    PALETTE,
    group_ids,
    html,
    legend,
    plot,
    short_list,
    span_table,
    text,
)

if TYPE_CHECKING:
    from meshgroups.render._widgets import layout_explorer

__all__ = [
    "MAX_CELLS",
    "MAX_COLUMNS",
    "MAX_DPI",
    "PALETTE",
    "group_ids",
    "html",
    "layout_explorer",
    "legend",
    "plot",
    "short_list",
    "span_table",
    "text",
]


def __getattr__(name: str) -> Any:
    # ipywidgets is an optional extra: the explorer's module loads on first use
    if name == "layout_explorer":
        from meshgroups.render._widgets import layout_explorer

        return layout_explorer
    return _deprecated.old_name(__name__, name)
