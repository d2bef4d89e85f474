"""``Layout``: a named n-D grid of global ranks, as an immutable value (numpy only, never torch).

The value model. A layout *is* ``(names, shape, strides, offset)`` when its placement is affine
(``rank = offset + Σ coord·stride`` with non-negative strides that nest; every row-major layout,
every ``split``/``flatten`` of one, most subsets), plus — only for other placements — an
explicit read-only array of ranks. Whichever constructor built it, one placement has one form,
so equality, ``hash`` and ``fingerprint()`` agree between ``Layout(dp=2, tp=2)`` and
``Layout.from_grid([[0, 1], [2, 3]], ("dp", "tp"))``, and cost O(ndim) for affine layouts.

A layout is frozen: attributes cannot be assigned, ``__init__`` cannot run twice, and no array
it hands out (``grid``, ``groups``, ``group_of``) shares memory with its state, so writing
through one (``torch.from_numpy(lay.grid).add_(1)``) cannot change the layout. Derived data
(the grid, inverse lookups, the fingerprint) is computed once and cached.

Explicit placements answer rank lookups through a sorted copy of their ranks (memory O(W), time
O(log W)); affine ones by digit arithmetic (O(ndim)).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from types import MappingProxyType
from typing import Any

import numpy as np

from meshgroups._checks import (
    MAX_NDIM,
    MAX_RANK,
    check_dims,
    check_int,
    check_name,
    check_names,
    is_int,
    product,
    short_repr,
)
from meshgroups.errors import LayoutError
from meshgroups.layout import _grid
from meshgroups.layout import _views as views
from meshgroups.layout._algebra import LayoutAlgebra
from meshgroups.layout._identity import LayoutIdentity
from meshgroups.layout._layout_topology import LayoutTopology


class Layout(LayoutTopology, LayoutAlgebra, LayoutIdentity):
    """A named n-D grid of global ranks, an immutable value. The first dim is the outermost
    (slowest varying), the last the innermost (contiguous ranks), as in ``init_device_mesh``::

        >>> from meshgroups import Layout
        >>> lay = Layout(pp=2, dp=2, cp=1, tp=4)
        >>> lay.groups("tp")[:2].tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> lay.group_of(5, "dp", "cp").tolist(), lay.coords(5)
        ([1, 5], {'pp': 0, 'dp': 1, 'cp': 0, 'tp': 1})

    Args:
        dims: ``{"pp": 2, ...}`` or ``[("pp", 2), ...]``; or give sizes as keywords instead.
        rank_offset: first global rank of the grid (a layout over ranks 64..127 has 64).
        world_size: if given, the sizes must multiply to it; one size may then be ``-1`` and is
            inferred (``Layout(pp=2, dp=-1, tp=4, world_size=64)`` has ``dp=8``).
        **sizes: dim sizes in order, outermost first.

    Raises:
        TypeError: a size or the offset is not an int; both ``dims`` and keywords are given.
        LayoutError: (a ``ValueError``) a size is not positive, names repeat or are not
            identifiers, the sizes do not multiply to ``world_size``, or the layout would hold
            more than 2**24 ranks or a rank above 2**31 - 1.
    """

    def __init__(
        self,
        dims: Mapping[str, int] | Sequence[tuple[str, int]] | None = None,
        /,
        *,
        rank_offset: int = 0,
        world_size: int | None = None,
        **sizes: int,
    ) -> None:
        if "_names" in self.__dict__:
            raise TypeError("a Layout is immutable; build a new one instead of calling __init__ again")
        if dims is not None and sizes:
            raise TypeError("give dims either as one mapping/sequence or as keywords, not both")
        if dims is not None and (isinstance(dims, (str, bytes)) or not isinstance(dims, (Mapping, Iterable))):
            raise TypeError(
                f"dims must be a mapping or a sequence of (name, size) pairs, got {short_repr(dims)}"
            )
        # At most MAX_NDIM + 1 pairs are read: an endless iterable is refused, not consumed.
        source = dims.items() if isinstance(dims, Mapping) else sizes.items() if dims is None else dims
        pairs = list(itertools.islice(source, MAX_NDIM + 1))
        if not pairs:
            raise LayoutError("a Layout needs at least one dim, e.g. Layout(dp=8)")
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"dims must be (name, size) pairs, got {short_repr(pair)}")
        names = check_names([name for name, _ in pairs])
        shape = _grid.infer_sizes(names, [size for _, size in pairs], world_size)
        strides, offset = _grid.check_affine(shape, _grid.row_major_strides(shape), rank_offset)
        self._set(names, shape, strides, offset, None, ())

    # ---------------------------------------------------------------- construction
    def _set(
        self,
        names: tuple[str, ...],
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        offset: int,
        ranks: np.ndarray | None,
        view_items: tuple[tuple[str, Layout], ...],
    ) -> None:
        for attr, value in (
            ("_names", names),
            ("_shape", shape),
            ("_strides", strides),
            ("_offset", offset),
            ("_ranks", ranks),
            ("_views", view_items),
        ):
            object.__setattr__(self, attr, value)

    @classmethod
    def _new(
        cls,
        names: tuple[str, ...],
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        offset: int,
        ranks: np.ndarray | None = None,
        view_items: tuple[tuple[str, Layout], ...] = (),
    ) -> Layout:
        layout = cls.__new__(cls)
        layout._set(names, shape, strides, offset, ranks, view_items)
        return layout

    @classmethod
    def from_strides(
        cls, names: Sequence[str], shape: Sequence[int], strides: Sequence[int], rank_offset: int = 0
    ) -> Layout:
        """The affine layout ``rank = rank_offset + Σ coord[i] · strides[i]``, like torch's
        ``_MeshLayout(shape, stride)``::

            >>> Layout.from_strides(("dp", "tp"), (2, 2), (1, 2)).groups("tp").tolist()
            [[0, 2], [1, 3]]

        Strides must be positive for dims of size > 1 and *nest* (sorted, each exceeds what the
        smaller ones reach), which makes every rank distinct; a size-1 dim's stride is ignored.
        """
        names_t = check_names(names)
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise TypeError(f"shape must be a sequence of ints, got {short_repr(shape)}")
        if len(shape) != len(names_t):
            raise LayoutError(f"{len(shape)} sizes given for {len(names_t)} names {names_t}")
        if not names_t:
            raise LayoutError("a Layout needs at least one dim")
        shape_t = _grid.infer_sizes(names_t, list(shape), None)
        strides_t, offset = _grid.check_affine(shape_t, strides, rank_offset)
        return cls._new(names_t, shape_t, strides_t, offset)

    @classmethod
    def from_grid(cls, grid: Any, names: Sequence[str]) -> Layout:
        """A layout over an explicit placement, like ``DeviceMesh(mesh=tensor)``.

        ``grid`` holds distinct non-negative global ranks in any arrangement (e.g. a
        topology-aware order); ranks along a dim need not increase::

            >>> Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp")).groups("tp").tolist()
            [[3, 1], [2, 0]]

        An affine placement becomes the affine form (equal to the layout built with strides).
        """
        if isinstance(grid, Layout):
            raise TypeError("from_grid takes an array of ranks; a Layout is already a layout")
        names_t = check_names(names)
        return cls._from_distinct(names_t, _grid.rank_grid(grid, names_t))

    @classmethod
    def _from_distinct(cls, names: tuple[str, ...], arr: np.ndarray) -> Layout:
        """``arr`` holds distinct, in-range ranks (checked by the caller)."""
        return cls._derived(names, np.array(arr, dtype=np.int64, order="C", copy=True))

    @classmethod
    def _derived(cls, names: tuple[str, ...], arr: np.ndarray, affine: bool = True) -> Layout:
        """The trusted path: ``arr`` is a fresh C-contiguous int64 array nobody else holds, of
        distinct in-range ranks (positions of a valid layout), one dim per name in ``names``
        (already checked names). Kept without a copy; its affine form is found as ``from_grid``
        would, unless the caller knows there is none (``affine=False``)."""
        shape = tuple(int(s) for s in arr.shape)
        form = _grid.affine_form(arr) if affine else None
        if form is not None:
            offset, strides = form
            return cls._new(names, shape, strides, offset)
        return cls._new(names, shape, None, int(arr.min()), _grid.readonly(arr))

    @classmethod
    def from_order(cls, order: str, /, *, rank_offset: int = 0, **sizes: int) -> Layout:
        """Megatron-Core order strings: the first token varies fastest.

        ``Layout.from_order("tp-cp-ep-dp-pp", tp=2, cp=1, ep=1, dp=2, pp=2)`` is
        ``Layout(pp=2, dp=2, ep=1, cp=1, tp=2)``; its ``groups(...)`` equal Megatron's
        ``RankGenerator.get_ranks(...)``. A dim with a size but missing from ``order`` is allowed
        only if its size is 1 (it becomes the outermost dim, as Megatron appends it).
        """
        from meshgroups.layout._order import parse_order

        return cls(parse_order(order, sizes), rank_offset=rank_offset)

    # ---------------------------------------------------------------- immutability
    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Layout is immutable; cannot set {name!r} (build a new layout instead)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Layout is immutable; cannot delete {name!r}")

    # ---------------------------------------------------------------- properties
    _names: tuple[str, ...]
    _shape: tuple[int, ...]
    _strides: tuple[int, ...] | None
    _offset: int
    _ranks: np.ndarray | None
    _views: tuple[tuple[str, Layout], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Dim names, outermost first."""
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        """Dim sizes, outermost first."""
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def world_size(self) -> int:
        """Number of ranks in the layout."""
        return product(self._shape)

    @property
    def strides(self) -> tuple[int, ...] | None:
        """Rank strides of an affine layout (0 for size-1 dims), ``None`` for an explicit one."""
        return self._strides

    @property
    def is_affine(self) -> bool:
        """True if the layout is ``(names, shape, strides, offset)`` (see the module docstring)."""
        return self._strides is not None

    @property
    def is_contiguous(self) -> bool:
        """True if the ranks are exactly ``rank_offset .. rank_offset + world_size - 1``."""
        return self.max_rank - self._offset == self.world_size - 1

    @property
    def is_row_major(self) -> bool:
        """True if the layout is what ``Layout(**sizes, rank_offset=...)`` builds."""
        return self._strides == _grid.row_major_strides(self._shape)

    @property
    def rank_offset(self) -> int:
        """The smallest rank of the layout (the rank at coordinates 0 for affine layouts)."""
        return self._offset

    @property
    def max_rank(self) -> int:
        """The largest rank of the layout."""
        if self._strides is not None:
            return self._offset + _grid.span(self._shape, self._strides)
        return int(self._sorted_ranks[0][-1])

    @property
    def views(self) -> Mapping[str, Layout]:
        """Other factorisations of the same ranks declared with :meth:`with_views`."""
        return MappingProxyType(dict(self._views))

    @cached_property
    def _rank_array(self) -> np.ndarray:
        """The grid; read-only and never handed out (callers get copies)."""
        if self._ranks is not None:
            return self._ranks
        if self._strides is None:  # an invariant of this module, not a check of user input
            raise RuntimeError("meshgroups internal error: self._strides is None")
        return _grid.readonly(_grid.affine_grid(self._shape, self._strides, self._offset))

    @property
    def grid(self) -> np.ndarray:
        """A fresh read-only C-contiguous int64 array of global ranks, of shape :attr:`shape`.

        A copy: writing to it (after ``setflags``, or through ``torch.from_numpy``) leaves the
        layout unchanged. O(W) per access; single-rank queries never need it."""
        return _grid.readonly(self._rank_array.copy())

    def grid_as(self, dtype: Any = np.int64) -> np.ndarray:
        """A fresh, writable C-contiguous array of the grid in an integer ``dtype``, built once
        (no intermediate int64 copy): what a consumer keeps as its own, e.g. the int32 rank map
        of a ``DeviceMesh``. Refused if a rank does not fit the dtype."""
        try:
            kind = np.dtype(dtype)
        except (TypeError, ValueError, RecursionError):
            raise TypeError(f"grid_as needs an integer dtype, got {short_repr(dtype)}") from None
        if kind.kind not in "iu":
            raise TypeError(f"grid_as needs an integer dtype, got {kind}")
        if self.max_rank > np.iinfo(kind).max:
            raise LayoutError(f"rank {self.max_rank} does not fit {kind}")
        if self._strides is not None:
            return _grid.affine_grid(self._shape, self._strides, self._offset, kind)
        return self._rank_array.astype(kind)

    def size(self, *dims: str) -> int:
        """Size of one dim, the product for several (a flattened group's size), and with no dims
        the layout's world size, as torch's ``DeviceMesh.size()`` answers::

            >>> lay = Layout(dp=2, tp=4)
            >>> lay.size("tp"), lay.size("dp", "tp"), lay.size()
            (4, 8, 8)
        """
        if not dims:  # 0.4.0 answered 1 (the empty product); torch's mesh.size() is the world
            return self.world_size
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
        if _grid.increasing(flat):  # often so (a selection of a row-major layout): no sort
            return flat, _grid.readonly(np.arange(flat.size, dtype=np.int64))
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

    # ------------------------------------------------------------------------------- views
    def with_views(self, /, **views_: Layout) -> Layout:
        """Declare other factorisations of the same ranks, e.g. a dense and an expert layout::

            dense = Layout(pp=2, dp=2, cp=1, tp=2)
            both = dense.with_views(expert=Layout(pp=2, edp=1, ep=4, etp=1))
            both.groups("ep")      # resolved in the expert view

        A dim name present in several factorisations must give the same groups in each (each
        with the same member order; the order of the rows may differ) — ``LayoutError`` naming a
        rank whose groups differ otherwise. O(ndim) for contiguous affine layouts.
        """
        items = tuple(views_.items())
        for name, _ in items:
            check_name(name, "view name")
        if not items:
            return self
        checked = views.check_views(self.without_views(), self._views + items)
        return type(self)._new(self._names, self._shape, self._strides, self._offset, self._ranks, checked)

    def without_views(self) -> Layout:
        """The same placement with no views."""
        if not self._views:
            return self
        return type(self)._new(self._names, self._shape, self._strides, self._offset, self._ranks)

    def resolve(self, *dims: str) -> Layout:
        """The factorisation (this layout or one of its views) that has every dim in ``dims``."""
        return views.resolve(self, dims)
