"""JSON form and repr of a ``Layout``, on its public API.

Three forms, the shortest that states the placement: row-major layouts give ``dims`` (and
``rank_offset``), other affine ones add ``strides``, explicit ones give the ``grid``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from meshgroups._checks import MAX_NDIM, short_repr
from meshgroups.errors import LayoutError

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout

FORMAT = "meshgroups.Layout/1"
_KEYS = {"format", "dims", "rank_offset", "strides", "grid", "views"}


def to_dict(layout: Layout) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format": FORMAT,
        "dims": [[name, size] for name, size in zip(layout.names, layout.shape)],
    }
    if layout.strides is not None:
        data["rank_offset"] = layout.rank_offset
        if not layout.is_row_major:
            data["strides"] = list(layout.strides)
    else:
        data["grid"] = layout.grid.tolist()
    if layout.views:
        data["views"] = {name: to_dict(view) for name, view in layout.views.items()}
    return data


def from_dict(cls: type[Layout], data: Mapping[str, Any], view_of: str | None = None) -> Layout:
    """The layout of a :func:`to_dict` dict. Views are one level deep (a view has no views of its
    own), which is checked before reading them, so a deeply nested dict is refused at once."""
    if not isinstance(data, Mapping):
        raise TypeError(f"from_dict needs a mapping, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise LayoutError(f"format must be {FORMAT!r}, got {short_repr(data.get('format'))}")
    extra = set(data) - _KEYS
    if extra:
        raise LayoutError(f"unknown keys {sorted(extra, key=str)} in a {FORMAT} dict; known: {sorted(_KEYS)}")
    dims = data.get("dims")
    if not isinstance(dims, list):
        raise LayoutError(f"'dims' must be a list of [name, size] pairs, got {short_repr(dims)}")
    if len(dims) > MAX_NDIM:
        raise LayoutError(f"'dims' lists {len(dims)} dims; a layout has at most {MAX_NDIM} (numpy's limit)")
    if not all(isinstance(d, (list, tuple)) and len(d) == 2 for d in dims):
        raise LayoutError(f"'dims' must be a list of [name, size] pairs, got {short_repr(dims)}")
    names = [name for name, _ in dims]
    sizes = [size for _, size in dims]
    if "grid" in data:
        if "rank_offset" in data or "strides" in data:
            raise LayoutError("give either 'grid' or 'rank_offset'/'strides', not both")
        layout = cls.from_grid(data["grid"], names)
        if list(layout.shape) != sizes:
            raise LayoutError(f"grid shape {layout.shape} does not match dims {dims}")
    elif "strides" in data:
        layout = cls.from_strides(names, sizes, data["strides"], data.get("rank_offset", 0))
    else:
        layout = cls([(name, size) for name, size in dims], rank_offset=data.get("rank_offset", 0))
    views = data.get("views", {})
    if not isinstance(views, Mapping):
        raise LayoutError(f"'views' must map view names to layout dicts, got {type(views).__name__}")
    if views and view_of is not None:
        raise LayoutError(f"view {view_of!r} has views of its own; declare all views on the main layout")
    if views:
        for name in views:
            if not isinstance(name, str):
                raise TypeError(f"view names must be str, got {name!r}")
        layout = layout.with_views(**{name: from_dict(cls, view, name) for name, view in views.items()})
    return layout


def _short_grid(layout: Layout, limit: int = 12) -> str:
    size = layout.world_size
    if size <= limit:
        return str(layout.grid.ravel().tolist())

    def at(i: int) -> int:  # O(ndim): a repr (made for every init_mesh) copies no world-size grid
        return layout.rank_at(**dict(zip(layout.names, (int(c) for c in np.unravel_index(i, layout.shape)))))

    head = ", ".join(str(at(i)) for i in range(limit - 2))
    return f"[{head}, …, {at(size - 1)}] ({size} ranks)"


def layout_repr(layout: Layout) -> str:
    dims = ", ".join(f"{n}={s}" for n, s in zip(layout.names, layout.shape))
    extra = f", rank_offset={layout.rank_offset}" if layout.rank_offset else ""
    if layout.strides is None:
        extra = f", grid={_short_grid(layout)}"
    elif not layout.is_row_major:
        extra = f", strides={layout.strides}{extra}"
    text = f"Layout({dims}{extra})"
    if layout.views:
        text += ".with_views(" + ", ".join(f"{k}={v!r}" for k, v in layout.views.items()) + ")"
    return text
