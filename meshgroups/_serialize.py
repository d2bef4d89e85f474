"""JSON form, fingerprint and repr of a ``Layout``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .layout import Layout

FORMAT = "meshgroups.Layout/1"
_KEYS = {"format", "dims", "rank_offset", "strides", "grid", "views"}


def to_dict(layout: Layout) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format": FORMAT,
        "dims": [[name, size] for name, size in zip(layout.names, layout.shape)],
    }
    if _is_row_major(layout):
        data["rank_offset"] = layout.rank_offset
    else:
        data["grid"] = layout.grid.tolist()
    if layout.views:
        data["views"] = {name: to_dict(view) for name, view in layout.views.items()}
    return data


def from_dict(cls: type[Layout], data: Mapping[str, Any]) -> Layout:
    if not isinstance(data, Mapping):
        raise TypeError(f"from_dict needs a mapping, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {data.get('format')!r}")
    extra = set(data) - _KEYS
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)} in a {FORMAT} dict")
    dims = data.get("dims")
    if not isinstance(dims, list) or not all(isinstance(d, (list, tuple)) and len(d) == 2 for d in dims):
        raise ValueError(f"'dims' must be a list of [name, size] pairs, got {dims!r}")
    pairs = [(name, size) for name, size in dims]
    if "grid" in data:
        if "rank_offset" in data:
            raise ValueError("give either 'grid' or 'rank_offset', not both")
        layout = cls.from_grid(data["grid"], [name for name, _ in pairs])
        if list(layout.shape) != [size for _, size in pairs]:
            raise ValueError(f"grid shape {layout.shape} does not match dims {dims}")
    else:
        layout = cls(pairs, rank_offset=data.get("rank_offset", 0))
    views = data.get("views", {})
    if not isinstance(views, Mapping):
        raise ValueError(f"'views' must map view names to layout dicts, got {type(views).__name__}")
    if views:
        layout = layout.with_views(**{name: from_dict(cls, view) for name, view in views.items()})
    return layout


def from_dict_unchecked(data: Mapping[str, Any]) -> Layout:
    """Unpickling hook: the dict came from ``to_dict``."""
    from .layout import Layout

    return from_dict(Layout, data)


def fingerprint(layout: Layout) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([list(layout.names), list(layout.shape)]).encode())
    digest.update(np.ascontiguousarray(layout.grid, dtype="<i8").tobytes())
    for name, view in layout.views.items():
        digest.update(f"|view:{name}:{view.fingerprint()}".encode())
    return digest.hexdigest()[:16]


def _is_row_major(layout: Layout) -> bool:
    strides = layout._strides
    if strides is None:
        return False
    expected = 1
    for size, stride in reversed(list(zip(layout.shape, strides))):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _short_list(values: list[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return str(values)
    head = ", ".join(str(v) for v in values[: limit - 2])
    return f"[{head}, …, {values[-1]}] ({len(values)} ranks)"


def layout_repr(layout: Layout) -> str:
    dims = ", ".join(f"{n}={s}" for n, s in zip(layout.names, layout.shape))
    if _is_row_major(layout):
        extra = f", rank_offset={layout.rank_offset}" if layout.rank_offset else ""
    else:
        extra = f", grid={_short_list(layout.grid.ravel().tolist())}"
    text = f"Layout({dims}{extra})"
    if layout.views:
        text += ".with_views(" + ", ".join(f"{k}={v!r}" for k, v in layout.views.items()) + ")"
    return text
