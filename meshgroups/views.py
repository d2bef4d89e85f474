"""Views: several factorisations of one world, checked to agree on the dims they share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._checks import formula

if TYPE_CHECKING:
    from .layout import Layout


def check_views(main: Layout, views: tuple[tuple[str, Layout], ...]) -> tuple[tuple[str, Layout], ...]:
    """The views, after checking each covers the same ranks as ``main`` and agrees with it (and
    the earlier views) on every dim name they share."""
    layout_type = type(main)
    seen: dict[str, Layout] = {}
    main_ranks = None
    for name, view in views:
        if not isinstance(view, layout_type):
            raise TypeError(f"view {name!r} must be a Layout, got {type(view).__name__}")
        if not name.isidentifier():
            raise ValueError(f"view name {name!r} is not a Python identifier")
        if name in seen:
            raise ValueError(f"view {name!r} declared twice")
        if view._views:
            raise ValueError(f"view {name!r} has views of its own; declare all views on the main layout")
        if view.world_size != main.world_size:
            raise ValueError(
                f"view {name!r} has {view.world_size} ranks ({formula(view.names, view.shape)}) but the "
                f"main layout has {main.world_size} ({formula(main.names, main.shape)})"
            )
        if main_ranks is None:
            main_ranks = np.sort(main.grid, axis=None)
        if not np.array_equal(np.sort(view.grid, axis=None), main_ranks):
            raise ValueError(
                f"view {name!r} covers other ranks than the main layout ({main._describe_ranks()})"
            )
        for other_name, other in [("main layout", main)] + [(f"view {k!r}", v) for k, v in seen.items()]:
            for dim in set(view.names) & set(other.names):
                # The same groups, each in the same member order; the order in which two
                # factorisations enumerate their groups may differ and does not matter.
                mine, theirs = _sorted_rows(view.groups(dim)), _sorted_rows(other.groups(dim))
                if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
                    row = _first_differing_row(mine, theirs)
                    rank = int(mine[row][0]) if row < len(mine) else int(theirs[row][0])
                    raise ValueError(
                        f"dim {dim!r} of view {name!r} does not match the {other_name}: rank {rank} is in "
                        f"{_group_with(view, dim, rank)} in view {name!r} but in "
                        f"{_group_with(other, dim, rank)} in the {other_name}"
                    )
        seen[name] = view
    return views


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def _group_with(layout: Layout, dim: str, rank: int) -> str:
    return str(layout.group_of(rank, dim).tolist()) if rank in layout else "(no group)"


def _first_differing_row(a: np.ndarray, b: np.ndarray) -> int:
    for i in range(min(len(a), len(b))):
        if a[i].shape != b[i].shape or not np.array_equal(a[i], b[i]):
            return i
    return min(len(a), len(b))
