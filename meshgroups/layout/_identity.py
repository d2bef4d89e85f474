"""What a ``Layout`` is equal to, and how it is written down: equality, hash and fingerprint,
JSON, ``repr``, pickling and Jupyter's HTML — a mixin of ``Layout`` on its public API only.

Equality means the same placement: the same names, shape, strides and offset for an affine
layout (O(ndim)), the same rank array for an explicit one, the same views in the same order.
The fingerprint is stable across processes (what ranks compare before building groups).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from meshgroups.layout._core import Layout

#: Functions drawing a layout as HTML for ``Layout._repr_html_``: ``import meshgroups`` registers
#: one that loads ``meshgroups.render`` on first use; the last one registered wins.
HTML_RENDERERS: list[Callable[[Layout], str]] = []


def register_html_renderer(render: Callable[[Layout], str]) -> None:
    """Make ``render`` what ``Layout._repr_html_`` calls (``import meshgroups`` does)."""
    HTML_RENDERERS.append(render)


class LayoutIdentity:
    """Identity and serialisation of ``Layout`` (see the module docstring)."""

    if TYPE_CHECKING:  # Layout's public properties, which the methods below build on

        @property
        def names(self) -> tuple[str, ...]: ...

        @property
        def shape(self) -> tuple[int, ...]: ...

        @property
        def strides(self) -> tuple[int, ...] | None: ...

        @property
        def rank_offset(self) -> int: ...

        @property
        def is_affine(self) -> bool: ...

        @property
        def grid(self) -> np.ndarray: ...

        @property
        def views(self) -> Mapping[str, Layout]: ...

    @cached_property
    def _identity(self) -> tuple[Any, ...]:
        """What equality means: the canonical form (O(ndim) for affine layouts)."""
        explicit = None if self.is_affine else hashlib.sha256(self.grid.tobytes()).hexdigest()
        views = tuple((name, view._identity) for name, view in self.views.items())
        return (self.names, self.shape, self.strides, self.rank_offset, explicit, views)

    def fingerprint(self) -> str:
        """16 hex chars, equal for equal layouts in any process, different otherwise.
        O(ndim) for affine layouts (O(W) once for explicit ones).

        >>> from meshgroups import Layout
        >>> Layout(dp=2, tp=2).fingerprint() == Layout.from_strides(("dp", "tp"), (2, 2), (2, 1)).fingerprint()
        True
        """
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self._identity).encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutIdentity):
            return NotImplemented
        if self is other:
            return True
        mine = (self.names, self.shape, self.strides, self.rank_offset)
        if mine != (other.names, other.shape, other.strides, other.rank_offset):
            return False
        if not self.is_affine and not np.array_equal(self.grid, other.grid):
            return False
        return tuple(self.views.items()) == tuple(other.views.items())

    def __hash__(self) -> int:
        return hash(self._identity)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict; :meth:`from_dict` rebuilds an equal layout."""
        from meshgroups.layout._serialize import to_dict

        return to_dict(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> Layout:
        """The layout of a :meth:`to_dict` dict; unknown keys are refused."""
        from meshgroups.layout._serialize import from_dict

        return from_dict(cls, data)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        from meshgroups.layout._serialize import layout_repr

        return layout_repr(self)  # type: ignore[arg-type]

    def _repr_html_(self) -> str | None:
        # Drawn by whoever registered in HTML_RENDERERS (the package front, through
        # meshgroups.render): the core sits below every renderer and imports none. None: the repr.
        return HTML_RENDERERS[-1](self) if HTML_RENDERERS else None  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self.to_dict(),))


def _unpickle(data: Mapping[str, Any]) -> Layout:
    from meshgroups.layout._core import Layout

    return Layout.from_dict(data)


__all__ = ["HTML_RENDERERS", "LayoutIdentity", "register_html_renderer"]
