"""How each *owner* of group families (the main layout, a view, a subset) follows a recovery,
and the whole-family listings of kept / created / gone groups (numpy only, vectorised).

An owner changes in one of three ways: its ranks are renamed (substitute), the indices
``indices`` of its dim ``dim`` are dropped (shrink), or ``grown`` new indices are appended
along ``dim`` (grow). Views and subsets are found to follow the main layout's change by name
when they share the replicate dim (shared dims enumerate identical groups in the same member
order, so a rank's index along it is the same), else by looking for the one dim of theirs whose
slabs are exactly the removed ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from meshgroups.errors import RecoveryError
from meshgroups.layout import Layout, keep


@dataclass(frozen=True)
class Owner:
    """One factorisation whose groups the plan tracks: ``label`` is ``"main"``,
    ``"view <name>"`` or ``"subset <name>"``. ``new`` is None for a subset that lost every rank."""

    label: str
    old: Layout
    dim: str | None = None
    indices: tuple[int, ...] = ()
    grown: int = 0
    renamed: bool = False
    _new: Layout | None = field(default=None, compare=False)
    vanished: bool = False

    @property
    def changed(self) -> bool:
        """True if any of the owner's groups can differ after the recovery."""
        return self.renamed or self.vanished or self.dim is not None


def flat_positions(layout: Layout, ranks: np.ndarray) -> np.ndarray:
    """Flat index of each of ``ranks`` in ``layout.grid`` (-1 where absent): O(W log W) once."""
    flat = layout.grid.ravel()
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    at = np.clip(np.searchsorted(ordered, ranks), 0, max(ordered.size - 1, 0))
    found = ordered[at] == ranks
    return np.where(found, order[at], -1)


def slab_dim(layout: Layout, removed: np.ndarray, prefer: str) -> tuple[str, tuple[int, ...]] | None:
    """The dim of ``layout`` (``prefer`` first, then outermost first) along which the ranks in
    ``removed`` (sorted) are whole slabs, and the slab indices; None if no dim fits."""
    flags = np.isin(layout.grid, removed)
    names = sorted(layout.names, key=lambda d: (d != prefer, layout.names.index(d)))
    for name in names:
        axis = layout.names.index(name)
        others = tuple(i for i in range(layout.ndim) if i != axis)
        anywhere = flags.any(axis=others) if others else flags
        everywhere = flags.all(axis=others) if others else flags
        if np.array_equal(anywhere, everywhere):
            return name, tuple(int(i) for i in np.flatnonzero(anywhere))
    return None


def shrink_owner(label: str, layout: Layout, main_dim: str, removed: np.ndarray) -> Owner:
    """The owner ``layout`` after the ranks ``removed`` (sorted, whole replicas of the main
    layout's ``main_dim``) leave."""
    inside = np.isin(layout.grid, removed)
    if not inside.any():
        return Owner(label, layout)
    if inside.all():
        if label.startswith("view"):
            raise RecoveryError(f"{label} would lose every rank")  # views cover the world: unreachable
        return Owner(label, layout, vanished=True)
    found = slab_dim(layout, removed, main_dim)
    if found is None:
        raise RecoveryError(
            f"{label} ({layout!r}) cannot follow a shrink of {main_dim!r}: the dropped ranks are not "
            f"whole slabs of any of its dims (rule: each view/subset must drop whole indices of one dim); "
            "drop it from the plan (layout.without_views(), or leave the subset out)"
        )
    return Owner(label, layout, dim=found[0], indices=found[1])


def grow_owner(label: str, layout: Layout, main: Layout, dim: str, slabs: np.ndarray) -> Owner:
    """The owner ``layout`` after the main layout grows by the replicas ``slabs`` (shape
    ``(k, *main.shape without dim)``) along ``dim``. An owner with the dim that spans every
    replica grows; a subset without it (or over part of the replicas) is unchanged; a view
    without it cannot follow."""
    axis_main = main.names.index(dim)
    if dim not in layout.names or layout.shape[layout.names.index(dim)] != main.shape[axis_main]:
        if label.startswith("view"):
            raise RecoveryError(
                f"{label} ({layout!r}) has no dim {dim!r} of size {main.shape[axis_main]}, so it cannot "
                f"grow with the main layout (rule: a view follows a grow through the same dim name)"
            )
        return Owner(label, layout)
    axis = layout.names.index(dim)
    # The owner's index along dim must be the main layout's (true for views by the shared-dim
    # rule; checked for subsets).
    pos = flat_positions(main, layout.grid.ravel())
    main_index = np.unravel_index(pos, main.shape)[axis_main].reshape(layout.shape)
    expected = np.arange(layout.shape[axis]).reshape([-1 if i == axis else 1 for i in range(layout.ndim)])
    if not np.array_equal(main_index, np.broadcast_to(expected, layout.shape)):
        if label.startswith("view"):
            raise RecoveryError(f"{label}: its dim {dim!r} does not index the main layout's replicas")
        return Owner(label, layout)
    base = np.take(layout.grid, [0], axis=axis)
    coords = list(np.unravel_index(flat_positions(main, base.ravel()), main.shape))
    del coords[axis_main]
    slab_pos = np.ravel_multi_index(tuple(coords), slabs.shape[1:]) if coords else np.zeros(base.size, int)
    flat = slabs.reshape(slabs.shape[0], -1)
    extra = [flat[j][slab_pos].reshape(base.shape) for j in range(slabs.shape[0])]
    grid = np.concatenate([layout.grid, *extra], axis=axis)
    return Owner(label, layout, dim=dim, grown=slabs.shape[0], _new=Layout.from_grid(grid, layout.names))


def rename_owner(label: str, layout: Layout, replaced: Iterable[int]) -> Owner:
    """The owner ``layout`` when the ranks ``replaced`` get new ranks: O(len(replaced) · ndim);
    the renamed grid is built lazily by :class:`Changed`."""
    return Owner(label, layout, renamed=any(x in layout for x in replaced))


class Changed:
    """An owner's new layout (lazy) and its family listings."""

    def __init__(self, owner: Owner, replaced: np.ndarray, by: np.ndarray) -> None:
        self.owner = owner
        self.replaced = replaced  # sorted old ranks renamed (substitute) ...
        self.by = by  # ... and their new ranks

    def _renamed(self) -> Layout:
        grid = self.owner.old.grid
        at = np.clip(np.searchsorted(self.replaced, grid), 0, self.replaced.size - 1)
        hit = self.replaced[at] == grid
        return Layout.from_grid(np.where(hit, self.by[at], grid), self.owner.old.names)

    @cached_property
    def new(self) -> Layout | None:
        """The owner after the recovery (None: a subset that lost every rank)."""
        o = self.owner
        if o.vanished:
            return None
        if o._new is not None:
            return o._new
        if o.renamed:
            return self._renamed()
        if o.dim is None:
            return o.old
        dropped = set(o.indices)
        kept = [i for i in range(o.old.size(o.dim)) if i not in dropped]
        return keep(o.old, o.old.names.index(o.dim), kept)  # trusted: indices of its own

    def listing(self, dims: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(kept, created, gone)`` group arrays of the family varying ``dims``."""
        o, old, new = self.owner, self.owner.old, self.new
        size = old.size(*dims)
        none = np.zeros((0, size), dtype=np.int64)
        if not o.changed:
            return old.groups(*dims), none, none
        if new is None:
            return none, none, old.groups(*dims)
        if o.renamed:
            before, after = old.groups(*dims), new.groups(*dims)
            hit = np.isin(before, self.replaced).any(axis=1)
            return after[~hit], after[hit], before[hit]
        if o.dim is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: o.dim is None")
        if o.dim in dims:
            return none, new.groups(*dims), old.groups(*dims)
        if o.grown:
            n = old.size(o.dim)
            return old.groups(*dims), new.select(o.dim, list(range(n, n + o.grown))).groups(*dims), none
        gone = old.without_views().select(o.dim, list(o.indices)).groups(*dims)
        return new.groups(*dims), np.zeros((0, new.size(*dims)), np.int64), gone
