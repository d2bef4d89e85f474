"""The lookups a ``Layout`` answers: its groups, the group of a rank, a rank's coordinates and the
rank at given coordinates, membership — by stride arithmetic for affine placements, through a
sorted copy of the ranks for explicit ones.

A mixin of ``Layout`` (the value and its constructors live in ``layout.py``)::

    >>> from meshgroups import Layout
    >>> lay = Layout(dp=2, tp=4, rank_offset=8)
    >>> lay.coords(13), lay.rank_at(dp=1, tp=1), 7 in lay
    ({'dp': 1, 'tp': 1}, 13, False)
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from . import _grid
from .checks import MAX_RANK, check_dims, check_int, is_int, product
from .errors import LayoutError

if TYPE_CHECKING:
    from .layout import Layout


class LayoutLookup:
    """Lookup methods of ``Layout`` (see the module docstring)."""

    if TYPE_CHECKING:
        _names: tuple[str, ...]
        _shape: tuple[int, ...]
        _strides: tuple[int, ...] | None
        _offset: int

        @property
        def _rank_array(self) -> np.ndarray: ...

        @property
        def ndim(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def max_rank(self) -> int: ...

        @property
        def is_contiguous(self) -> bool: ...

        def resolve(self, *dims: str) -> Layout: ...

    def size(self, *dims: str) -> int:
        """Size of one dim, or the product for several (a flattened group's size)."""
        owner = self.resolve(*dims)
        return product(owner._shape[owner._names.index(d)] for d in dims)

    def __contains__(self, rank: object) -> bool:
        if not is_int(rank):
            return False
        return self._position(int(rank)) is not None  # type: ignore[call-overload]

    # ------------------------------------------------------------------------------ groups
    def groups(self, *dims: str) -> np.ndarray:
        """All groups varying ``dims``: a fresh int64 array ``(n_groups, group_size)``.

        Ranks in a row follow the layout's dim order (row-major over ``dims``, whatever order
        they are given in); rows enumerate the other dims row-major. ``groups()`` is every rank
        alone, ``groups(*names)`` the whole layout as one group. Dims of a view are resolved in
        that view (see :meth:`with_views`).
        """
        owner = self.resolve(*dims) if dims else self
        axes = sorted(owner._names.index(d) for d in dims)
        rest = [i for i in range(owner.ndim) if i not in axes]
        size = product(owner._shape[i] for i in axes)
        rows = np.transpose(owner._rank_array, rest + axes).reshape(-1, size)
        return _grid.readonly(np.array(rows, dtype=np.int64, order="C", copy=True))

    def group_of(self, rank: int, /, *dims: str) -> np.ndarray:
        """The group varying ``dims`` that contains ``rank``: one row of :meth:`groups`.

        O(ndim + group size) for affine layouts, O(log W + group size) for explicit ones.
        """
        owner = self.resolve(*dims) if dims else self
        coords = owner._coords_tuple(rank)
        varying = sorted(owner._names.index(d) for d in dims)
        if owner._strides is not None:
            fixed = sum(c * s for i, (c, s) in enumerate(zip(coords, owner._strides)) if i not in varying)
            ranks = np.array([owner._offset + fixed], dtype=np.int64)
            for axis in varying:
                step = np.arange(owner._shape[axis], dtype=np.int64) * owner._strides[axis]
                ranks = (ranks[:, None] + step[None, :]).ravel()
            return ranks
        index = tuple(slice(None) if i in varying else c for i, c in enumerate(coords))
        return np.array(owner._rank_array[index], dtype=np.int64).ravel()

    def coords(self, rank: int, /) -> dict[str, int]:
        """``{dim: index}`` of ``rank``; raises ``LayoutError`` if it is not in the layout."""
        return dict(zip(self._names, self._coords_tuple(rank)))

    def rank_at(self, /, **coords: int) -> int:
        """The global rank at the given index of every dim: the inverse of :meth:`coords`."""
        missing = [n for n in self._names if n not in coords]
        if missing:
            raise LayoutError(f"rank_at needs an index for every dim; missing {', '.join(missing)}")
        check_dims(tuple(coords), self._names, "this layout")
        index = []
        for name, size in zip(self._names, self._shape):
            i = check_int(coords[name], f"index of dim {name!r}")
            if not 0 <= i < size:
                raise LayoutError(f"{name}={i} is out of range; dim {name!r} has size {size}")
            index.append(i)
        if self._strides is not None:
            return self._offset + sum(i * s for i, s in zip(index, self._strides))
        return int(self._rank_array[tuple(index)])

    def _coords_tuple(self, rank: object) -> tuple[int, ...]:
        r = check_int(rank, "rank")
        position = self._position(r)
        if position is None:
            raise LayoutError(f"rank {r} is not in this layout ({self.describe_ranks()})")
        return position

    @cached_property
    def _sorted_ranks(self) -> tuple[np.ndarray, np.ndarray]:
        """(ranks sorted, flat index of each) for explicit layouts: memory O(W), not O(max rank)."""
        flat = self._rank_array.ravel()
        order = np.argsort(flat, kind="stable")
        return _grid.readonly(flat[order]), _grid.readonly(order)

    def _position(self, rank: int) -> tuple[int, ...] | None:
        if self._strides is not None:
            return _grid.coords_of(rank, self._shape, self._strides, self._offset)
        if not 0 <= rank <= MAX_RANK:
            return None
        ranks, where = self._sorted_ranks
        i = int(np.searchsorted(ranks, rank))
        if i >= ranks.size or int(ranks[i]) != rank:
            return None
        return tuple(int(c) for c in np.unravel_index(int(where[i]), self._shape))

    def describe_ranks(self) -> str:
        """``"ranks 0..15"`` or ``"16 ranks between 0 and 31"``, for messages."""
        if self.is_contiguous:
            return f"ranks {self._offset}..{self.max_rank}"
        return f"{self.world_size} ranks between {self._offset} and {self.max_rank}"
