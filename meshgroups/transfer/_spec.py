"""Where a weight lives on a layout: ``Shard``/``Replicate`` per layout dim, as torch DTensor.

A :class:`Weight` names a tensor (global shape, dtype) and its placement on one side's layout:
per layout dim ``Shard(axis)`` (that tensor axis is split over the dim) or ``Replicate()``
(dims not named replicate), optionally only on one pipeline stage. ``box(layout, rank)`` is the
rank's local shard as a global ``[start, stop)`` range per axis, computed from the rank's
coordinates alone (O(ndim), never a scan over the world)::

    >>> from meshgroups import Layout
    >>> w = Weight("wq", (8, 6), placements={"dp": Shard(0), "tp": Shard(1)})
    >>> w.box(Layout(dp=2, tp=3), 4)
    ((4, 8), (2, 4))

Semantics are torch DTensor's (``compute_local_shape_and_global_offset``): dims that shard the
same axis split it in layout (mesh) order, outer dim first, then each piece again; a piece of
``n`` elements over ``k`` ranks is cut in chunks of ``ceil(n / k)``, the last ones smaller or
empty. Expert weights shard the experts axis like any other, e.g. shape ``(experts, h, f)``
with ``{"ep": Shard(0), "etp": Shard(2)}``. No torch is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from meshgroups._checks import did_you_mean, is_int
from meshgroups.errors import LayoutError

if TYPE_CHECKING:
    from meshgroups.layout import Layout

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Shard:
    """The tensor axis ``axis`` is split over the layout dim this placement is given for, in
    equal blocks in rank order (torch's DTensor ``Shard``)::

        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import Shard, Weight
        >>> w = Weight("wq", (8, 4), placements={"tp": Shard(0)})  # rows split over tp
        >>> [w.box(Layout(tp=2), rank) for rank in (0, 1)]
        [((0, 4), (0, 4)), ((4, 8), (0, 4))]
    """

    axis: int

    def __post_init__(self) -> None:
        if not is_int(self.axis):
            raise TypeError(f"Shard axis must be an int, got {self.axis!r}")
        if self.axis < 0:
            raise LayoutError(
                f"Shard(axis={self.axis}): the axis must be >= 0 (give it counted from the front)"
            )


@dataclass(frozen=True)
class Replicate:
    """Every rank along the layout dim holds the same data (a dim a weight's placements do not
    name replicates too)::

        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import Replicate, Weight
        >>> norm = Weight("norm", (8,), placements={"tp": Replicate()})
        >>> [norm.box(Layout(tp=2), rank) for rank in (0, 1)]
        [((0, 8),), ((0, 8),)]
    """


Placement: TypeAlias = Shard | Replicate

#: Bytes per element of torch dtypes numpy lacks.
TORCH_ONLY_DTYPES = {
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def dtype_name(dtype: object, weight: str = "") -> str:
    """The canonical name of ``dtype`` — a numpy name, a torch-only name, ``"torch.xxx"`` or a
    ``torch.dtype`` — the one spelling the plan, the wire and the reports use::

    >>> dtype_name("torch.bfloat16"), dtype_name("f4")
    ('bfloat16', 'float32')
    """
    if type(dtype).__module__ == "torch":  # a torch.dtype, read without importing torch here
        dtype = str(dtype)
    if not isinstance(dtype, str):
        raise TypeError(f"Weight {weight!r}: dtype must be a str like 'bfloat16', got {dtype!r}")
    name = dtype.removeprefix("torch.")
    if name in TORCH_ONLY_DTYPES:
        return name
    try:
        return np.dtype(name).name
    except TypeError:
        raise LayoutError(
            f"Weight {weight!r}: dtype {dtype!r} is neither a numpy dtype name nor one of "
            f"{', '.join(TORCH_ONLY_DTYPES)}"
        ) from None


def itemsize(dtype: str) -> int:
    """Bytes per element of a canonical dtype name."""
    return TORCH_ONLY_DTYPES.get(dtype) or int(np.dtype(dtype).itemsize)


def volume(box: Box) -> int:
    """The number of elements in ``box``::

    >>> volume(((0, 2), (1, 4)))
    6
    """
    n = 1
    for a, b in box:
        n *= b - a
    return n


def chunk(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of ``[start, stop)`` cut into ``parts`` as torch's ``Shard`` cuts it:
    chunks of ``ceil(n / parts)``, the last ones smaller or empty::

        >>> [chunk(0, 5, 4, i) for i in range(4)]
        [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    n = stop - start
    size = -(-n // parts)
    lo = min(size * index, n)
    return start + lo, start + min(lo + size, n)


def intervals(extent: int, sizes: tuple[int, ...]) -> np.ndarray:
    """Every piece of an axis of ``extent`` split by nested dims of ``sizes`` (outer first), in
    row-major order of the dims' coordinates: an int64 array ``(prod(sizes), 2)`` of
    ``[start, stop)``. Pieces tile the axis in this order (empty ones included)."""
    pieces = np.array([[0, extent]], dtype=np.int64)
    for k in sizes:
        n = pieces[:, 1] - pieces[:, 0]
        size = -(-n // k)
        idx = np.arange(k, dtype=np.int64)
        lo = np.minimum(size[:, None] * idx[None, :], n[:, None])
        hi = np.minimum(lo + size[:, None], n[:, None])
        pieces = np.stack([pieces[:, :1] + lo, pieces[:, :1] + hi], axis=-1).reshape(-1, 2)
    return pieces


def _placement_map(name: str, placements: object) -> Mapping[str, Placement]:
    """A read-only ``{dim: placement}`` from a mapping or a sequence of ``(dim, placement)``
    pairs; a dim given twice is refused (one layout dim has one placement)."""
    if isinstance(placements, Mapping):
        pairs = list(placements.items())
    elif isinstance(placements, (list, tuple)) and all(
        isinstance(p, tuple) and len(p) == 2 for p in placements
    ):
        pairs = list(placements)
    else:
        raise TypeError(
            f"Weight {name!r}: placements must be a mapping dim -> Shard|Replicate (or (dim, placement) pairs), "
            f"got {placements!r}"
        )
    out: dict[str, Placement] = {}
    for dim, p in pairs:
        if dim in out:
            raise LayoutError(
                f"Weight {name!r}: dim {dim!r} is given two placements ({out[dim]!r}, {p!r}); one per dim"
            )
        out[dim] = p
    return MappingProxyType(out)


@dataclass(frozen=True)
class Weight:
    """A tensor and its placement on one layout: its global shape and dtype, and per layout dim
    a ``Shard`` or ``Replicate``; ``box(layout, rank)`` is the slice ``rank`` holds. A weight of
    pipeline stage 1 only, its columns split over tp::

        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import Shard, Weight
        >>> w = Weight("layers.1.w", (8, 4), stage=("pp", 1), placements={"tp": Shard(1)})
        >>> [w.box(Layout(pp=2, tp=2), rank) for rank in range(4)], w.nbytes
        ([None, None, ((0, 8), (0, 2)), ((0, 8), (2, 4))], 128)

    Args:
        name: matched between the source and destination sides.
        shape: global shape.
        dtype: a numpy dtype name or a torch-only one (``bfloat16``, ``float8_e4m3fn``; a
            ``torch.`` prefix is dropped); its itemsize counts the bytes.
        placements: ``{dim: Shard(axis) | Replicate()}``; dims not named replicate.
        stage: ``("pp", 1)``: only ranks whose ``pp`` coordinate is 1 hold it; ``None``: all.
        shard_order: dims that shard one axis split it in layout order unless listed here:
            listed dims split first, in this order (outermost first). FSDP2 over a TP
            column-sharded weight (torch's ``_StridedShard(0, split_factor=tp)`` on
            ``dp_shard``, ``Shard(0)`` on ``tp``) is ``shard_order=("tp", "dp_shard")``.

    Raises:
        TypeError: a field of the wrong kind (a placement that is not ``Shard``/``Replicate``).
        LayoutError: (a ``ValueError``) a negative size, an unknown dtype, a ``Shard`` axis out
            of range, the stage dim also given a placement other than ``Replicate``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    placements: Mapping[str, Placement] = field(default_factory=dict)
    stage: tuple[str, int] | None = None
    shard_order: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Weight name must be a non-empty str, got {self.name!r}")
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, (tuple, list)):
            raise TypeError(f"Weight {self.name!r}: shape must be a tuple of ints, got {self.shape!r}")
        for n in self.shape:
            if not is_int(n):
                raise TypeError(f"Weight {self.name!r}: shape must hold ints, got {self.shape!r}")
            if n < 0:
                raise LayoutError(f"Weight {self.name!r}: shape {tuple(self.shape)} has a negative size")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype, self.name))
        object.__setattr__(self, "placements", _placement_map(self.name, self.placements))
        for dim, p in self.placements.items():
            if not isinstance(dim, str):
                raise TypeError(f"Weight {self.name!r}: placement keys are dim names, got {dim!r}")
            if not isinstance(p, (Shard, Replicate)):
                raise TypeError(
                    f"Weight {self.name!r}: placement of dim {dim!r} must be Shard(axis) or Replicate(), got {p!r}"
                )
            if isinstance(p, Shard) and p.axis >= len(self.shape):
                raise LayoutError(
                    f"Weight {self.name!r}: {dim}=Shard({p.axis}) is out of range for shape {self.shape} "
                    f"(axes 0..{len(self.shape) - 1})"
                )
        if self.stage is not None:
            if not (
                isinstance(self.stage, tuple)
                and len(self.stage) == 2
                and isinstance(self.stage[0], str)
                and is_int(self.stage[1])
            ):
                raise TypeError(
                    f"Weight {self.name!r}: stage must be (dim, index) like ('pp', 1), got {self.stage!r}"
                )
            if isinstance(self.placements.get(self.stage[0]), Shard):
                raise LayoutError(
                    f"Weight {self.name!r}: dim {self.stage[0]!r} is its pipeline stage dim; it cannot also shard it"
                )

        if self.shard_order is not None:
            order = self.shard_order
            if isinstance(order, str) or not isinstance(order, (tuple, list)):
                raise TypeError(
                    f"Weight {self.name!r}: shard_order must be a tuple of dim names, got {order!r}"
                )
            for dim in order:
                if not isinstance(self.placements.get(dim), Shard):
                    raise LayoutError(
                        f"Weight {self.name!r}: shard_order names {dim!r}, which has no Shard placement"
                    )
            if len(set(order)) != len(order):
                raise LayoutError(f"Weight {self.name!r}: shard_order {tuple(order)} repeats a dim")
            object.__setattr__(self, "shard_order", tuple(order))

    def __hash__(self) -> int:
        items = tuple(self.placements.items())
        return hash((self.name, self.shape, self.dtype, items, self.stage, self.shard_order))

    def __reduce__(self) -> tuple[object, ...]:
        # The read-only placements view does not pickle; rebuild from a plain dict.
        return (
            Weight,
            (self.name, self.shape, self.dtype, dict(self.placements), self.stage, self.shard_order),
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict; placements as ``"Shard(0)"`` / ``"Replicate()"``::

        >>> Weight("w", (4, 2), "bfloat16", {"tp": Shard(1)}).to_dict()["placements"]
        {'tp': 'Shard(1)'}
        """
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "placements": {
                d: f"Shard({p.axis})" if isinstance(p, Shard) else "Replicate()"
                for d, p in self.placements.items()
            },
            "stage": list(self.stage) if self.stage is not None else None,
            "shard_order": list(self.shard_order) if self.shard_order is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Weight:
        """The inverse of :meth:`to_dict` (``LayoutError`` naming a placement it cannot read)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"Weight.from_dict takes a mapping, got {data!r}")
        pl: dict[str, Placement] = {}
        raw = data.get("placements") or {}
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"placements must be a mapping of dim -> 'Shard(axis)'|'Replicate()', got {raw!r}"
            )
        for dim, text in raw.items():
            t = str(text).replace(" ", "")
            if t == "Replicate()":
                pl[dim] = Replicate()
            elif t.startswith("Shard(") and t.endswith(")") and t[6:-1].isdigit():
                pl[dim] = Shard(int(t[6:-1]))
            else:
                raise LayoutError(f"placement {text!r} of dim {dim!r}: write 'Shard(axis)' or 'Replicate()'")
        stage, order = data.get("stage"), data.get("shard_order")
        shape = data.get("shape")
        return cls(
            str(data.get("name")),
            tuple(shape) if isinstance(shape, (list, tuple)) else shape,  # type: ignore[arg-type]
            str(data.get("dtype", "float32")),
            pl,
            tuple(stage) if isinstance(stage, (list, tuple)) else stage,  # type: ignore[arg-type]
            tuple(order) if isinstance(order, (list, tuple)) else order,  # type: ignore[arg-type]
        )

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    def check(self, layout: Layout) -> None:
        """Raise ``LayoutError`` if a placement or the stage names a dim ``layout`` lacks, or the
        stage index is out of range."""
        for dim in self.placements:
            if dim not in layout.names:
                raise LayoutError(
                    f"Weight {self.name!r}: unknown dim {dim!r} in placements; dims are {', '.join(layout.names)}"
                    + did_you_mean(dim, layout.names, "; ")
                )
        if self.stage is not None:
            dim, index = self.stage
            if dim not in layout.names:
                raise LayoutError(
                    f"Weight {self.name!r}: unknown stage dim {dim!r}; dims are {', '.join(layout.names)}"
                    + did_you_mean(dim, layout.names, "; ")
                )
            size = layout.shape[layout.names.index(dim)]
            if not 0 <= index < size:
                raise LayoutError(
                    f"Weight {self.name!r}: stage {dim}={index} is out of range; {dim} has size {size}"
                )

    def shard_dims(self, layout: Layout) -> tuple[tuple[str, ...], ...]:
        """Per tensor axis, the layout dims that shard it, in nesting order (``shard_order``
        first, then layout order)."""
        self.check(layout)
        per_axis: list[list[str]] = [[] for _ in self.shape]
        first = self.shard_order or ()
        for dim in (*first, *(d for d in layout.names if d not in first)):
            p = self.placements.get(dim)
            if isinstance(p, Shard):
                per_axis[p.axis].append(dim)
        return tuple(tuple(d) for d in per_axis)

    def box_at(self, layout: Layout, coords: Mapping[str, int]) -> Box | None:
        """The box held at layout coordinates ``coords`` (see :meth:`box`)."""
        if self.stage is not None and coords[self.stage[0]] != self.stage[1]:
            return None
        sizes = dict(zip(layout.names, layout.shape))
        box = []
        for axis, dims in enumerate(self.shard_dims(layout)):
            lo, hi = 0, self.shape[axis]
            for dim in dims:
                lo, hi = chunk(lo, hi, sizes[dim], coords[dim])
            if hi <= lo:
                return None
            box.append((lo, hi))
        return tuple(box)

    def box(self, layout: Layout, rank: int) -> Box | None:
        """This rank's local shard as a global ``[start, stop)`` per axis; ``None`` if the rank
        is outside ``layout``, on another pipeline stage, or holds an empty (uneven) shard."""
        if not is_int(rank):
            raise TypeError(f"rank must be an int, got {rank!r}")
        self.check(layout)
        if rank not in layout:
            return None
        return self.box_at(layout, layout.coords(int(rank)))


__all__ = ["Box", "Placement", "Replicate", "Shard", "Weight", "chunk", "intervals", "volume"]
