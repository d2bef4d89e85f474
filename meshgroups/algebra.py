"""Layout algebra: flatten, split (unflatten) and select (subsets). ``Layout`` methods delegate here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from ._checks import check_dims, check_int, check_names, check_size, formula, is_int, product
from ._grid import merged_stride

if TYPE_CHECKING:
    from .layout import Layout


def flatten(layout: Layout, *dims: str, name: str | None = None) -> Layout:
    """See ``Layout.flatten``. Merged dims whose strides nest stay affine; others keep a grid."""
    if not dims:
        raise ValueError("flatten needs at least one dim")
    dims = check_dims(dims, layout._names, "this layout")
    axes = sorted(layout._names.index(d) for d in dims)
    new_name = name if name is not None else "_".join(layout._names[i] for i in axes)
    kept = [n for i, n in enumerate(layout._names) if i not in axes]
    names = list(kept)
    names.insert(axes[0], new_name)
    names_t = check_names(names)
    shape = [s for i, s in enumerate(layout._shape) if i not in axes]
    shape.insert(axes[0], product(layout._shape[i] for i in axes))
    stride = None
    if layout._strides is not None:
        stride = merged_stride([layout._shape[i] for i in axes], [layout._strides[i] for i in axes])
    if stride is not None:
        strides = [s for i, s in enumerate(layout._strides) if i not in axes]  # type: ignore[arg-type]
        strides.insert(axes[0], stride)
        out = type(layout)._make(names_t, tuple(shape), offset=layout._offset, strides=tuple(strides))
    else:
        order = [i for i in range(layout.ndim) if i not in axes]
        order[axes[0] : axes[0]] = axes
        grid = np.ascontiguousarray(np.transpose(layout.grid, order)).reshape(shape)
        out = type(layout)._from_checked_grid(grid, names_t)
    return out._with_views_checked(layout._views)


def split(layout: Layout, dim: str, **subdims: int) -> Layout:
    """See ``Layout.split``."""
    (dim,) = check_dims((dim,), layout._names, "this layout")
    if not subdims:
        raise ValueError(f"split({dim!r}) needs at least one sub-dim, e.g. split({dim!r}, a=2, b=2)")
    axis = layout._names.index(dim)
    sub_sizes = [check_size(n, s) for n, s in subdims.items()]
    if product(sub_sizes) != layout._shape[axis]:
        raise ValueError(
            f"split sizes {formula(list(subdims), sub_sizes)} do not multiply to {dim}={layout._shape[axis]}"
        )
    names = check_names(layout._names[:axis] + tuple(subdims) + layout._names[axis + 1 :])
    shape = layout._shape[:axis] + tuple(sub_sizes) + layout._shape[axis + 1 :]
    if layout._strides is not None:
        s = layout._strides[axis]
        sub_strides = tuple(s * product(sub_sizes[i + 1 :]) for i in range(len(sub_sizes)))
        strides = layout._strides[:axis] + sub_strides + layout._strides[axis + 1 :]
        out = type(layout)._make(names, shape, offset=layout._offset, strides=strides)
    else:
        out = type(layout)._from_checked_grid(layout.grid.reshape(shape), names)
    return out._with_views_checked(layout._views)


def select(layout: Layout, dim: str, indices: int | Iterable[int]) -> Layout:
    """See ``Layout.select``."""
    (dim,) = check_dims((dim,), layout._names, "this layout")
    axis = layout._names.index(dim)
    size = layout._shape[axis]
    raw = [indices] if is_int(indices) else list(indices)  # type: ignore[arg-type]
    if not raw:
        raise ValueError(f"select({dim!r}, []) keeps no ranks; give at least one index")
    picked: list[int] = []
    for i in raw:
        i = check_int(i, f"index of dim {dim!r}")
        if not -size <= i < size:
            raise ValueError(f"index {i} is out of range for dim {dim!r} of size {size}")
        i %= size
        if i not in picked:
            picked.append(i)
    grid = np.ascontiguousarray(np.take(layout.grid, picked, axis=axis))
    return type(layout)._from_checked_grid(grid, layout._names)
