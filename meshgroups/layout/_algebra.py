"""Layout algebra: flatten, split (unflatten) and select (subsets).

Built on ``Layout``'s public API and constructors (``from_strides`` for affine results,
``from_grid`` for the rest, ``with_views`` to carry views over), with one exception: a selection
of a layout's own positions (``select``, ``keep``) is built with the trusted constructor
``Layout._derived``, which skips re-validating ranks that cannot have changed (distinct, in
range). ``Layout`` methods delegate here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np

from meshgroups._checks import (
    check_dims,
    check_int,
    check_names,
    check_size,
    formula,
    is_int,
    product,
    short_repr,
)
from meshgroups.errors import LayoutError
from meshgroups.layout._grid import affine_take, merged_stride

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout


def _carry_views(out: Layout, source: Layout) -> Layout:
    return out.with_views(**dict(source.views)) if source.views else out


def flatten(layout: Layout, *dims: str, name: str | None = None) -> Layout:
    """See ``Layout.flatten``. Merged dims whose strides nest stay affine; others keep a grid."""
    if not dims:
        raise LayoutError("flatten needs at least one dim")
    dims = check_dims(dims, layout.names, "this layout")
    axes = sorted(layout.names.index(d) for d in dims)
    new_name = name if name is not None else "_".join(layout.names[i] for i in axes)
    names = [n for i, n in enumerate(layout.names) if i not in axes]
    names.insert(axes[0], new_name)
    names_t = check_names(names)
    shape = [s for i, s in enumerate(layout.shape) if i not in axes]
    shape.insert(axes[0], product(layout.shape[i] for i in axes))
    strides = layout.strides
    stride = None
    if strides is not None:
        stride = merged_stride([layout.shape[i] for i in axes], [strides[i] for i in axes])
    if strides is not None and stride is not None:
        kept = [s for i, s in enumerate(strides) if i not in axes]
        kept.insert(axes[0], stride)
        out = type(layout).from_strides(names_t, shape, kept, layout.rank_offset)
    else:
        order = [i for i in range(layout.ndim) if i not in axes]
        order[axes[0] : axes[0]] = axes
        grid = np.transpose(layout.grid, order).reshape(shape)
        out = type(layout).from_grid(grid, names_t)
    return _carry_views(out, layout)


def split(layout: Layout, dim: str, **subdims: int) -> Layout:
    """See ``Layout.split``."""
    (dim,) = check_dims((dim,), layout.names, "this layout")
    if not subdims:
        raise LayoutError(f"split({dim!r}) needs at least one sub-dim, e.g. split({dim!r}, a=2, b=2)")
    axis = layout.names.index(dim)
    sub_sizes = [check_size(n, s) for n, s in subdims.items()]
    if product(sub_sizes) != layout.shape[axis]:
        raise LayoutError(
            f"split sizes {formula(list(subdims), sub_sizes)} do not multiply to {dim}={layout.shape[axis]}"
        )
    names = check_names(layout.names[:axis] + tuple(subdims) + layout.names[axis + 1 :])
    shape = layout.shape[:axis] + tuple(sub_sizes) + layout.shape[axis + 1 :]
    strides = layout.strides
    if strides is not None:
        s = strides[axis]
        sub_strides = tuple(s * product(sub_sizes[i + 1 :]) for i in range(len(sub_sizes)))
        out = type(layout).from_strides(
            names, shape, strides[:axis] + sub_strides + strides[axis + 1 :], layout.rank_offset
        )
    else:
        out = type(layout).from_grid(layout.grid.reshape(shape), names)
    return _carry_views(out, layout)


def select(layout: Layout, dim: str, indices: int | Iterable[int]) -> Layout:
    """See ``Layout.select``."""
    (dim,) = check_dims((dim,), layout.names, "this layout")
    axis = layout.names.index(dim)
    size = layout.shape[axis]
    if not is_int(indices) and (isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable)):
        raise TypeError(f"select({dim!r}, ...) takes an int or a list of ints, got {short_repr(indices)}")
    # Each index may be given as i and as i - size (2 * size indices say everything; a few more
    # repeats are tolerated); reading at most one more refuses an endless iterable.
    limit = 2 * size + 1024
    raw = [indices] if is_int(indices) else list(itertools.islice(indices, limit + 1))  # type: ignore[arg-type]
    if not raw:
        raise LayoutError(f"select({dim!r}, []) keeps no ranks; give at least one index")
    if len(raw) > limit:
        raise LayoutError(
            f"select({dim!r}, ...) was given more than {limit} indices for a dim of size {size}; "
            "give each index once"
        )
    picked: list[int] = []
    seen: set[int] = set()  # a set, not `in picked`: linear in the number of indices
    for i in raw:
        i = check_int(i, f"index of dim {dim!r}")
        if not -size <= i < size:
            raise LayoutError(f"index {i} is out of range for dim {dim!r} of size {size}")
        i %= size
        if i not in seen:
            seen.add(i)
            picked.append(i)
    return keep(layout, axis, picked)


def keep(layout: Layout, axis: int, picked: list[int]) -> Layout:
    """The sub-layout keeping the indices ``picked`` (distinct, in range: checked by the caller)
    of dim number ``axis``, in that order; views are dropped. The trusted path of ``select`` for
    callers that derive indices from the layout itself (a recovery plan's kept replicas): a
    subset of a valid layout's positions holds distinct ranks, so no rank is re-checked —
    evenly spaced indices of an affine layout stay affine in O(ndim), others take one copy of
    the kept positions (no sort).

        >>> from meshgroups import Layout
        >>> keep(Layout(dp=4, tp=2), 0, [0, 1, 3]).groups("dp").tolist()
        [[0, 2, 6], [1, 3, 7]]
    """
    strides = layout.strides
    steps = {b - a for a, b in zip(picked, picked[1:])}
    if strides is not None and (len(picked) == 1 or (len(steps) == 1 and min(steps) > 0)):
        # Evenly spaced indices of an affine layout: affine again, O(ndim) (no grid).
        step = steps.pop() if steps else 1
        new_strides = list(strides)
        new_strides[axis] = strides[axis] * step
        shape = list(layout.shape)
        shape[axis] = len(picked)
        offset = layout.rank_offset + picked[0] * strides[axis]
        try:
            return type(layout).from_strides(layout.names, shape, new_strides, offset)
        except ValueError:
            pass  # strides that no longer nest: keep the explicit grid
    if strides is not None:
        # Never affine here (the kept indices are unevenly spaced, or their strides do not nest,
        # so the rank steps along ``axis`` differ or collide): no affine-form check either.
        grid = affine_take(layout.shape, strides, layout.rank_offset, axis, picked)
        return type(layout)._derived(layout.names, grid, affine=False)
    return type(layout)._derived(layout.names, np.take(layout.grid, picked, axis=axis))


class LayoutAlgebra:
    """The algebra as ``Layout``'s methods (a mixin; the functions above do the work)."""

    def flatten(self, *dims: str, name: str | None = None) -> Layout:
        """Merge ``dims`` into one dim named ``name`` (default: the names joined by ``_``).

        The merged dim takes the place of the outermost merged dim; its ranks follow the
        layout's order, so ``flatten("dp", "cp").groups("dp_cp")`` equals ``groups("dp", "cp")``.
        """
        return flatten(cast("Layout", self), *dims, name=name)

    def split(self, dim: str, /, **subdims: int) -> Layout:
        """Unflatten ``dim`` into ``subdims`` (outermost first), e.g.
        ``split("dp", dp_replicate=2, dp_shard=4)``; the sizes must multiply to ``dim``'s size."""
        return split(cast("Layout", self), dim, **subdims)

    def select(self, dim: str, indices: int | Iterable[int], /) -> Layout:
        """The sub-layout keeping only ``indices`` of ``dim`` (negative indices allowed;
        repeated indices collapse). ``select("pp", [0, -1])`` gives Megatron's embedding ranks
        (with ``pp=4``: stages 0 and 3). Views are not carried over: the result covers fewer
        ranks."""
        return select(cast("Layout", self), dim, indices)
