"""What a ``Layout`` is as a value: its identity (the canonical form), equality, ``hash`` and
``fingerprint()``, JSON (``to_dict``/``from_dict``), ``repr``, the HTML shown in Jupyter and
pickling. A mixin of ``Layout`` (the placement itself lives in ``layout.py``)::

    >>> from meshgroups import Layout
    >>> a, b = Layout(dp=2, tp=2), Layout.from_grid([[0, 1], [2, 3]], ("dp", "tp"))
    >>> a == b, hash(a) == hash(b), a.fingerprint() == b.fingerprint()
    (True, True, True)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from .layout import Layout


class LayoutValue:
    """Value methods of ``Layout`` (see the module docstring)."""

    if TYPE_CHECKING:
        _names: tuple[str, ...]
        _shape: tuple[int, ...]
        _strides: tuple[int, ...] | None
        _offset: int
        _ranks: np.ndarray | None
        _views: tuple[tuple[str, Layout], ...]

    # ------------------------------------------------------------------------ identity
    @cached_property
    def _identity(self) -> tuple[Any, ...]:
        """What equality means: the canonical form (O(ndim) for affine layouts)."""
        explicit = None if self._ranks is None else hashlib.sha256(self._ranks.tobytes()).hexdigest()
        return (
            self._names,
            self._shape,
            self._strides,
            self._offset,
            explicit,
            tuple((name, view._identity) for name, view in self._views),
        )

    def fingerprint(self) -> str:
        """16 hex chars, equal for equal layouts in any process, different otherwise.
        O(ndim) for affine layouts (O(W) once for explicit ones)."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self._identity).encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayoutValue):  # every Layout, nothing else
            return NotImplemented
        if self is other:
            return True
        if (self._names, self._shape, self._strides, self._offset) != (
            other._names,
            other._shape,
            other._strides,
            other._offset,
        ):
            return False
        if self._ranks is not None and not np.array_equal(self._ranks, other._ranks):  # type: ignore[arg-type]
            return False
        return self._views == other._views

    def __hash__(self) -> int:
        return hash(self._identity)

    # ------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict; :meth:`from_dict` rebuilds an equal layout."""
        from ._serialize import to_dict

        return to_dict(cast("Layout", self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> Layout:
        """The layout of a :meth:`to_dict` dict; unknown keys are refused."""
        from ._serialize import from_dict

        return from_dict(cast("type[Layout]", cls), data)

    def __repr__(self) -> str:
        from ._serialize import layout_repr

        return layout_repr(cast("Layout", self))

    def _repr_html_(self) -> str:
        from .render import html  # lazily: the core imports no renderer

        return html(cast("Layout", self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self.to_dict(),))


def _unpickle(data: Mapping[str, Any]) -> Layout:
    from .layout import Layout

    return Layout.from_dict(data)
