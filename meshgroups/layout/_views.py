"""Views: several factorisations of one world, checked to agree on the dims they share.

Built on ``Layout``'s public API. Two contiguous affine factorisations over the same ranks agree
on a dim exactly when the dim has the same size and stride in both (a rank's coordinate is then
the same digit), so the check is O(ndim) for them; other layouts are compared group by group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from meshgroups._checks import check_dims, check_name, formula
from meshgroups.errors import LayoutError

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout


def check_views(main: Layout, views: tuple[tuple[str, Layout], ...]) -> tuple[tuple[str, Layout], ...]:
    """The views, after checking each covers the same ranks as ``main`` and agrees with it (and
    the earlier views) on every dim name they share."""
    layout_type = type(main)
    seen: dict[str, Layout] = {}
    for name, view in views:
        check_name(name, "view name")
        if not isinstance(view, layout_type):
            raise TypeError(f"view {name!r} must be a Layout, got {type(view).__name__}")
        if name in seen:
            raise LayoutError(f"view {name!r} declared twice")
        if view.views:
            raise LayoutError(f"view {name!r} has views of its own; declare all views on the main layout")
        if view.world_size != main.world_size:
            raise LayoutError(
                f"view {name!r} has {view.world_size} ranks ({formula(view.names, view.shape)}) but the "
                f"main layout has {main.world_size} ({formula(main.names, main.shape)})"
            )
        if not _same_ranks(main, view):
            raise LayoutError(
                f"view {name!r} covers other ranks than the main layout ({main.describe_ranks()})"
            )
        for other_name, other in [("main layout", main)] + [(f"view {k!r}", v) for k, v in seen.items()]:
            for dim in [d for d in view.names if d in other.names]:
                if not _same_groups(view, other, dim):
                    rank = _first_differing_rank(view, other, dim)
                    raise LayoutError(
                        f"dim {dim!r} of view {name!r} does not match the {other_name}: rank {rank} is in "
                        f"{_short(view.group_of(rank, dim))} in view {name!r} but in "
                        f"{_short(other.group_of(rank, dim))} in the {other_name}"
                    )
        seen[name] = view
    return views


def _both_dense(a: Layout, b: Layout) -> bool:
    return a.is_affine and b.is_affine and a.is_contiguous and b.is_contiguous


def _same_ranks(a: Layout, b: Layout) -> bool:
    if _both_dense(a, b):
        return a.rank_offset == b.rank_offset
    return bool(np.array_equal(np.sort(a.grid, axis=None), np.sort(b.grid, axis=None)))


def _same_groups(a: Layout, b: Layout, dim: str) -> bool:
    """Same groups of ``dim``, each in the same member order (row order may differ)."""
    i, j = a.names.index(dim), b.names.index(dim)
    if a.shape[i] != b.shape[j]:
        return False
    if a.shape[i] == 1:
        return True
    if _both_dense(a, b):
        return a.strides[i] == b.strides[j]  # type: ignore[index]
    mine, theirs = _sorted_rows(a.groups(dim)), _sorted_rows(b.groups(dim))
    return bool(np.array_equal(mine, theirs))


def _short(ranks: np.ndarray, limit: int = 8) -> str:
    if ranks.size <= limit:
        return str(ranks.tolist())
    return f"[{', '.join(map(str, ranks[: limit - 1].tolist()))}, …, {int(ranks[-1])}] ({ranks.size} ranks)"


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def _first_differing_rank(a: Layout, b: Layout, dim: str) -> int:
    """A rank whose group of ``dim`` differs between ``a`` and ``b`` (error path only)."""
    for rank in a.grid.ravel().tolist():
        if not np.array_equal(a.group_of(rank, dim), b.group_of(rank, dim)):
            return int(rank)
    return a.rank_offset


def resolve(layout: Layout, dims: tuple[str, ...]) -> Layout:
    """The factorisation (``layout`` or one of its views) that has every dim in ``dims``; a
    ``LayoutError`` naming the factorisations otherwise."""
    owners = [layout, *layout.views.values()]
    for owner in owners:
        if all(isinstance(d, str) and d in owner.names for d in dims):
            check_dims(dims, owner.names)  # rejects repeats
            return owner
    known = list(layout.names) + [n for v in owners[1:] for n in v.names if n not in layout.names]
    for d in dims:
        if not isinstance(d, str) or d not in known:
            check_dims((d,), known, "this layout and its views" if layout.views else "this layout")
    where = "; ".join(
        [f"main: {', '.join(layout.names)}"]
        + [f"view {k!r}: {', '.join(v.names)}" for k, v in layout.views.items()]
    )
    raise LayoutError(f"dims {dims} are not all in one factorisation ({where})")
