"""``Layout``: a named, row-major n-D grid of global ranks (numpy only, never torch).

The first dim is the outermost (slowest varying), the last the innermost (contiguous ranks),
as in ``init_device_mesh``, torchtitan and JAX::

    >>> lay = Layout(pp=2, dp=2, cp=1, tp=4)
    >>> lay.groups("tp")[:2].tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> lay.group_of(5, "dp", "cp").tolist()
    [1, 5]

A layout is immutable and hashable. Most layouts are *affine* (``rank = offset + Σ coord·stride``),
and single-rank queries (``coords``, ``rank_at``, ``group_of``) are index arithmetic on them.
Explicit placements (``from_grid``) and subsets (``select``) keep the grid itself and answer the
same queries through an inverse index built once, on first use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from . import _serialize, algebra, topology
from ._checks import check_dims, check_int, check_names, is_int, product
from ._grid import affine_form, freeze, infer_sizes
from .views import check_views

Locality = Literal["intra", "inter", "mixed"]


class Layout:
    """A named n-D grid of global ranks; see the module docstring.

    Args:
        dims: ``{"pp": 2, ...}`` or ``[("pp", 2), ...]``; or give sizes as keywords instead.
        rank_offset: first global rank of the grid (a layout over ranks 64..127 has 64).
        world_size: if given, the sizes must multiply to it; one size may then be ``-1`` and is
            inferred (``Layout(pp=2, dp=-1, tp=4, world_size=64)`` has ``dp=8``).
        **sizes: dim sizes in order, outermost first.

    Raises:
        TypeError: a size or the offset is not an int; both ``dims`` and keywords are given.
        ValueError: a size is not positive, names repeat or are not identifiers, or the sizes
            do not multiply to ``world_size``.
    """

    __slots__ = ("_fp", "_grid", "_inverse", "_names", "_offset", "_shape", "_strides", "_views")

    def __init__(
        self,
        dims: Mapping[str, int] | Sequence[tuple[str, int]] | None = None,
        /,
        *,
        rank_offset: int = 0,
        world_size: int | None = None,
        **sizes: int,
    ) -> None:
        if dims is not None and sizes:
            raise TypeError("give dims either as one mapping/sequence or as keywords, not both")
        pairs = list(dims.items() if isinstance(dims, Mapping) else dims or sizes.items())
        if not pairs:
            raise ValueError("a Layout needs at least one dim, e.g. Layout(dp=8)")
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"dims must be (name, size) pairs, got {pair!r}")
        names = check_names(name for name, _ in pairs)
        shape = infer_sizes(names, [size for _, size in pairs], world_size)
        offset = check_int(rank_offset, "rank_offset")
        if offset < 0:
            raise ValueError(f"rank_offset={offset} must be >= 0")
        strides = tuple(product(shape[i + 1 :]) for i in range(len(shape)))
        self._init(names, shape, offset=offset, strides=strides)

    # ---------------------------------------------------------------- construction helpers
    def _init(
        self,
        names: tuple[str, ...],
        shape: tuple[int, ...],
        *,
        offset: int = 0,
        strides: tuple[int, ...] | None = None,
        grid: np.ndarray | None = None,
        views: tuple[tuple[str, Layout], ...] = (),
    ) -> None:
        self._names = names
        self._shape = shape
        self._offset = offset
        self._strides = strides
        self._grid = None if grid is None else freeze(grid)
        self._inverse: np.ndarray | None = None
        self._views = views
        self._fp: str | None = None

    @classmethod
    def _make(cls, names: tuple[str, ...], shape: tuple[int, ...], **kw: Any) -> Layout:
        layout = cls.__new__(cls)
        layout._init(names, shape, **kw)
        return layout

    @classmethod
    def _from_checked_grid(cls, grid: np.ndarray, names: tuple[str, ...]) -> Layout:
        """A layout over ``grid`` (already known to hold distinct non-negative ranks)."""
        shape = tuple(int(s) for s in grid.shape)
        affine = affine_form(grid)
        if affine is not None:
            offset, strides = affine
            return cls._make(names, shape, offset=offset, strides=strides, grid=grid)
        return cls._make(names, shape, offset=int(grid.min()), grid=grid)

    @classmethod
    def from_grid(cls, grid: Any, names: Sequence[str]) -> Layout:
        """A layout over an explicit placement, like ``DeviceMesh(mesh=tensor)``.

        ``grid`` holds distinct non-negative global ranks in any arrangement (e.g. a
        topology-aware order); ranks along a dim need not increase::

            >>> Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp")).groups("tp").tolist()
            [[3, 1], [2, 0]]
        """
        names = check_names(names)
        try:
            arr = np.array(grid)
        except ValueError as exc:  # ragged nested lists
            raise ValueError(f"grid is not a rectangular array: {exc}") from None
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise TypeError(f"grid must hold integer ranks, got dtype {arr.dtype}")
        if arr.ndim != len(names):
            raise ValueError(f"grid has {arr.ndim} dims but {len(names)} names were given: {names}")
        if arr.size == 0:
            raise ValueError(f"grid of shape {arr.shape} is empty; every dim needs size >= 1")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        if arr.min() < 0:
            raise ValueError(f"grid holds negative rank {int(arr.min())}; ranks must be >= 0")
        flat = np.sort(arr, axis=None)
        repeated = flat[1:][flat[1:] == flat[:-1]]
        if repeated.size:
            raise ValueError(f"grid holds rank {int(repeated[0])} more than once; ranks must be distinct")
        return cls._from_checked_grid(arr, names)

    @classmethod
    def from_order(cls, order: str, *, rank_offset: int = 0, **sizes: int) -> Layout:
        """Megatron-Core order strings: the first token varies fastest.

        ``Layout.from_order("tp-cp-ep-dp-pp", tp=2, cp=1, ep=1, dp=2, pp=2)`` is
        ``Layout(pp=2, dp=2, ep=1, cp=1, tp=2)``; its ``groups(...)`` equal Megatron's
        ``RankGenerator.get_ranks(...)``. A dim with a size but missing from ``order`` is allowed
        only if its size is 1 (it becomes the outermost dim, as Megatron appends it).
        """
        from .order import parse_order

        pairs = parse_order(order, sizes)
        return cls(pairs, rank_offset=rank_offset)

    # ---------------------------------------------------------------------------- properties
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
    def rank_offset(self) -> int:
        """The smallest rank of the layout (its offset for affine layouts)."""
        return self._offset

    @property
    def max_rank(self) -> int:
        """The largest rank of the layout."""
        if self._strides is not None:
            return self._offset + self.world_size - 1
        return int(self.grid.max())

    @property
    def views(self) -> Mapping[str, Layout]:
        """Other factorisations of the same ranks declared with :meth:`with_views`."""
        return MappingProxyType(dict(self._views))

    @property
    def grid(self) -> np.ndarray:
        """Read-only C-contiguous int64 array of global ranks, of shape :attr:`shape`."""
        if self._grid is None:
            grid = np.full(self._shape, self._offset, dtype=np.int64)
            for axis, (size, stride) in enumerate(zip(self._shape, self._strides or ())):
                index_shape = [1] * self.ndim
                index_shape[axis] = size
                grid += (np.arange(size, dtype=np.int64) * stride).reshape(index_shape)
            self._grid = freeze(grid)
        return self._grid

    def size(self, *dims: str) -> int:
        """Size of one dim, or the product for several (a flattened group's size)."""
        owner = self.resolve(*dims)
        return product(owner._shape[owner._names.index(d)] for d in dims)

    def __contains__(self, rank: object) -> bool:
        if not is_int(rank):
            return False
        return self._position(check_int(rank, "rank")) is not None

    # ------------------------------------------------------------------------------ groups
    def groups(self, *dims: str) -> np.ndarray:
        """All groups varying ``dims``: an int64 array ``(n_groups, group_size)``.

        Ranks in a row follow the layout's dim order (row-major over ``dims``, whatever order
        they are given in); rows enumerate the other dims row-major. ``groups()`` is every rank
        alone, ``groups(*names)`` the whole layout as one group. Dims of a view are resolved in
        that view (see :meth:`with_views`).
        """
        owner = self.resolve(*dims) if dims else self
        axes = sorted(owner._names.index(d) for d in dims)
        rest = [i for i in range(owner.ndim) if i not in axes]
        size = product(owner._shape[i] for i in axes)
        rows = np.transpose(owner.grid, rest + axes).reshape(-1, size)
        return freeze(np.ascontiguousarray(rows))

    def group_of(self, rank: int, *dims: str) -> np.ndarray:
        """The group varying ``dims`` that contains ``rank``: one row of :meth:`groups`.

        O(ndim + group size): never scans the world.
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
        return np.array(owner.grid[index], dtype=np.int64).ravel()

    def coords(self, rank: int) -> dict[str, int]:
        """``{dim: index}`` of ``rank``; raises ``ValueError`` if it is not in the layout."""
        return dict(zip(self._names, self._coords_tuple(rank)))

    def rank_at(self, **coords: int) -> int:
        """The global rank at the given index of every dim: the inverse of :meth:`coords`."""
        missing = [n for n in self._names if n not in coords]
        if missing:
            raise ValueError(f"rank_at needs an index for every dim; missing {', '.join(missing)}")
        check_dims(tuple(coords), self._names, "this layout")
        index = []
        for name, size in zip(self._names, self._shape):
            i = check_int(coords[name], f"index of dim {name!r}")
            if not 0 <= i < size:
                raise ValueError(f"{name}={i} is out of range; dim {name!r} has size {size}")
            index.append(i)
        if self._strides is not None:
            return self._offset + sum(i * s for i, s in zip(index, self._strides))
        return int(self.grid[tuple(index)])

    def _coords_tuple(self, rank: int) -> tuple[int, ...]:
        rank = check_int(rank, "rank")
        position = self._position(rank)
        if position is None:
            raise ValueError(f"rank {rank} is not in this layout ({self._describe_ranks()})")
        return position

    def _position(self, rank: int) -> tuple[int, ...] | None:
        if self._strides is not None:
            r = rank - self._offset
            if not 0 <= r < self.world_size:
                return None
            # Affine layouts are a permutation of mixed-radix digits: each dim's coordinate is
            # one digit, read off with its own stride.
            return tuple((r // s) % n if n > 1 else 0 for n, s in zip(self._shape, self._strides))
        if self._inverse is None:
            flat = self.grid.ravel()
            inverse = np.full(int(flat.max()) - self._offset + 1, -1, dtype=np.int64)
            inverse[flat - self._offset] = np.arange(flat.size, dtype=np.int64)
            self._inverse = inverse
        r = rank - self._offset
        if not 0 <= r < self._inverse.size or self._inverse[r] < 0:
            return None
        return tuple(int(i) for i in np.unravel_index(int(self._inverse[r]), self._shape))

    def _describe_ranks(self) -> str:
        if self._strides is not None:
            return f"ranks {self._offset}..{self._offset + self.world_size - 1}"
        return f"{self.world_size} ranks between {self._offset} and {self.max_rank}"

    # ----------------------------------------------------------------------------- algebra
    def flatten(self, *dims: str, name: str | None = None) -> Layout:
        """Merge ``dims`` into one dim named ``name`` (default: the names joined by ``_``).

        The merged dim takes the place of the outermost merged dim; its ranks follow the
        layout's order, so ``flatten("dp", "cp").groups("dp_cp")`` equals ``groups("dp", "cp")``.
        """
        return algebra.flatten(self, *dims, name=name)

    def split(self, dim: str, **subdims: int) -> Layout:
        """Unflatten ``dim`` into ``subdims`` (outermost first), e.g.
        ``split("dp", dp_replicate=2, dp_shard=4)``; the sizes must multiply to ``dim``'s size."""
        return algebra.split(self, dim, **subdims)

    def select(self, dim: str, indices: int | Iterable[int]) -> Layout:
        """The sub-layout keeping only ``indices`` of ``dim`` (negative indices allowed;
        repeated indices collapse). ``select("pp", [0, -1])`` gives Megatron's embedding ranks.
        Views are not carried over: the result covers fewer ranks."""
        return algebra.select(self, dim, indices)

    # ------------------------------------------------------------------------------- views
    def with_views(self, **views: Layout) -> Layout:
        """Declare other factorisations of the same ranks, e.g. a dense and an expert layout::

            dense = Layout(pp=2, dp=2, cp=1, tp=2)
            both = dense.with_views(expert=Layout(pp=2, edp=1, ep=4, etp=1))
            both.groups("ep")      # resolved in the expert view

        A dim name present in several factorisations must give the same groups in each (each
        with the same member order; the order of the rows may differ) — ``ValueError`` naming a
        rank whose groups differ otherwise.
        """
        return self._with_views_checked(self._views + tuple(views.items()))

    def _with_views_checked(self, views: tuple[tuple[str, Layout], ...]) -> Layout:
        if not views:
            return self
        out = Layout._make(
            self._names, self._shape, offset=self._offset, strides=self._strides, grid=self._grid
        )
        out._views = check_views(self, views)
        return out

    def resolve(self, *dims: str) -> Layout:
        """The factorisation (this layout or one of its views) that has every dim in ``dims``."""
        owners = [self] + [v for _, v in self._views]
        for owner in owners:
            if all(isinstance(d, str) and d in owner._names for d in dims):
                check_dims(dims, owner._names)  # rejects repeats
                return owner
        known = list(self._names) + [n for v in owners[1:] for n in v._names if n not in self._names]
        for d in dims:
            if not isinstance(d, str) or d not in known:
                check_dims((d,), known, "this layout and its views")
        where = "; ".join(
            [f"main: {', '.join(self._names)}"]
            + [f"view {k!r}: {', '.join(v._names)}" for k, v in self._views]
        )
        raise ValueError(f"dims {dims} are not all in one factorisation ({where})")

    # ---------------------------------------------------------------------------- topology
    def node_locality(self, *dims: str, ranks_per_node: int) -> Locality:
        """``"intra"`` if every group of ``dims`` stays within one node, ``"inter"`` if every
        group has each rank on a different node, else ``"mixed"``. Node = rank // ranks_per_node."""
        return topology.node_locality(self.groups(*dims), ranks_per_node)

    def split_by_node(self, dim: str, ranks_per_node: int) -> Layout:
        """Split ``dim`` into ``{dim}_inter`` (across nodes) and ``{dim}_intra`` (within a node)."""
        inter, intra = topology.node_split_sizes(self.groups(dim), ranks_per_node, dim)
        return self.split(dim, **{f"{dim}_inter": inter, f"{dim}_intra": intra})

    # ------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict; :meth:`from_dict` rebuilds an equal layout."""
        return _serialize.to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        return _serialize.from_dict(cls, data)

    def fingerprint(self) -> str:
        """16 hex chars, equal for equal layouts in any process, different otherwise."""
        if self._fp is None:
            self._fp = _serialize.fingerprint(self)
        return self._fp

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        if self is other:
            return True
        return (
            self._names == other._names
            and self._shape == other._shape
            and self._offset == other._offset
            and np.array_equal(self.grid, other.grid)
            and self._views == other._views
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return _serialize.layout_repr(self)

    def render(self, **kwargs: Any) -> str:
        """Long text form: the grid (small worlds) and every dim's groups. See ``render.text``."""
        from .render import text

        return text(self, **kwargs)

    def _repr_html_(self) -> str:
        from .render import html

        return html(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_serialize.from_dict_unchecked, (self.to_dict(),))
