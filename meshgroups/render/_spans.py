"""Where a layout's groups sit on a machine: per dim, the group size, the smallest topology level
holding every group and how many groups leave a unit of each level, as a text table (``meshgroups
show --ranks-per-node``/``--topology``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshgroups._checks import short_repr
from meshgroups.layout import Layout, Topology
from meshgroups.render._window import check_layout


def span_table(layout: Layout, topology: Topology, dims: Sequence[Sequence[str]] | None = None) -> str:
    """Per dim (and view dim, or the given dim sets): group size, the smallest level holding
    every group (``Layout.span``), and how many groups leave a unit of each level::

        >>> from meshgroups import Layout, Topology
        >>> from meshgroups.render import span_table
        >>> print(span_table(Layout(pp=4, dp=2, tp=8), Topology(node=8, domain=32)))
        Topology(node=8, domain=32)
        dim  size  span    groups  leave node  leave domain
        ---  ----  ------  ------  ----------  ------------
        pp   4     world   16      16          16
        dp   2     domain  32      32          0
        tp   8     node    8       0           0

    Args:
        layout: the layout.
        topology: the machine's levels.
        dims: dim sets to list instead of each dim.

    Returns:
        The table as text.

    Raises:
        LayoutError: an unknown dim, or a layout bigger than the topology allows.
    """
    check_layout(layout)
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
