"""Grid arithmetic of the layout core (numpy only): sizes, affine forms, positions.

An *affine* placement is ``rank = offset + Σ coord[i] · stride[i]`` with non-negative strides
that *nest*: sorted by stride, each stride exceeds the largest sum the smaller ones reach. Nested
strides make the map injective and invertible digit by digit (``coords_of``), so every query on
such a layout is O(ndim). Size-1 dims have stride 0 (canonical: equal placements have equal
strides). Any other placement is kept as an explicit array of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meshgroups._checks import (
    MAX_RANK,
    MAX_WORLD_SIZE,
    check_int,
    check_size,
    check_world,
    formula,
    is_int,
    product,
    short_repr,
)
from meshgroups.errors import LayoutError, NameCountError, torch_says


def readonly(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


def infer_sizes(names: tuple[str, ...], sizes: list[object], world_size: object) -> tuple[int, ...]:
    unknown = [i for i, s in enumerate(sizes) if is_int(s) and int(s) == -1]  # type: ignore[call-overload]
    if unknown and world_size is None:
        raise LayoutError(f"{names[unknown[0]]}=-1 needs world_size= to infer it from")
    if len(unknown) > 1:
        raise LayoutError(f"only one size may be -1 (inferred), got {', '.join(names[i] for i in unknown)}")
    checked = [0 if i in unknown else check_size(n, s) for i, (n, s) in enumerate(zip(names, sizes))]
    if world_size is None:
        check_world(names, checked)
        return tuple(checked)
    world = check_int(world_size, "world_size")
    if world < 1:
        raise LayoutError(f"world_size={world} must be positive")
    known = [(n, s) for i, (n, s) in enumerate(zip(names, checked)) if i not in unknown]
    known_product = product(s for _, s in known)
    if unknown:
        if world % known_product:
            raise LayoutError(
                f"{formula([n for n, _ in known], [s for _, s in known])} does not divide "
                f"world_size={world}, so {names[unknown[0]]} cannot be inferred"
            )
        checked[unknown[0]] = world // known_product
    elif known_product != world:
        raise LayoutError(f"{formula(names, checked)} does not match world_size={world}")
    check_world(names, checked)
    return tuple(checked)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return canonical_strides(shape, [product(shape[i + 1 :]) for i in range(len(shape))])


def canonical_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    return tuple(0 if n == 1 else int(s) for n, s in zip(shape, strides))


def nests(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if the (non-negative) strides nest, i.e. the affine map is injective digit by digit."""
    reach = 0  # the largest offset the smaller strides reach
    for stride, size in sorted((s, n) for n, s in zip(shape, strides) if n > 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Largest rank minus smallest of an affine layout."""
    return sum((n - 1) * s for n, s in zip(shape, strides))


def affine_grid(
    shape: Sequence[int], strides: Sequence[int], offset: int, dtype: np.dtype | type = np.int64
) -> np.ndarray:
    grid = np.full(tuple(shape), offset, dtype=dtype)
    for axis, (size, stride) in enumerate(zip(shape, strides)):
        if size > 1:
            index_shape = [1] * len(shape)
            index_shape[axis] = size
            grid += (np.arange(size, dtype=dtype) * stride).reshape(index_shape)
    return grid


def affine_take(
    shape: Sequence[int], strides: Sequence[int], offset: int, axis: int, picked: Sequence[int]
) -> np.ndarray:
    """``np.take(affine_grid(shape, strides, offset), picked, axis)`` without building the
    whole grid first (one array, of the kept positions only)."""
    out_shape = [len(picked) if a == axis else n for a, n in enumerate(shape)]
    grid = np.full(out_shape, offset, dtype=np.int64)
    for a, (size, stride) in enumerate(zip(shape, strides)):
        index = np.asarray(picked, dtype=np.int64) if a == axis else np.arange(size, dtype=np.int64)
        if stride and index.any():
            view = [1] * len(shape)
            view[a] = index.size
            grid += (index * stride).reshape(view)
    return grid


def increasing(flat: np.ndarray) -> bool:
    """True if the 1-D ``flat`` is strictly increasing (so its ranks are distinct and sorted). O(W)."""
    return bool(np.all(flat[1:] > flat[:-1]))


def affine_form(grid: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    """``(offset, strides)`` if ``grid`` (distinct ranks) is an affine placement with nested
    non-negative strides, else None. O(W)."""
    offset = int(grid.flat[0])
    strides = []
    for axis, size in enumerate(grid.shape):
        if size == 1:
            strides.append(0)
            continue
        index = [0] * grid.ndim
        index[axis] = 1
        stride = int(grid[tuple(index)]) - offset
        if stride <= 0:
            return None
        strides.append(stride)
    if not nests(grid.shape, strides):
        return None
    if not np.array_equal(affine_grid(grid.shape, strides, offset), grid):
        return None
    return offset, tuple(strides)


def coords_of(rank: int, shape: Sequence[int], strides: Sequence[int], offset: int) -> tuple[int, ...] | None:
    """Coordinates of ``rank`` in an affine layout with nested strides, or None if absent. O(ndim)."""
    r = rank - offset
    if r < 0 or r > span(shape, strides):
        return None
    coords = [0] * len(shape)
    for stride, axis in sorted(
        ((s, i) for i, (n, s) in enumerate(zip(shape, strides)) if n > 1), reverse=True
    ):
        c = r // stride
        if c >= shape[axis]:
            return None
        coords[axis] = c
        r -= c * stride
    return tuple(coords) if r == 0 else None


def check_affine(
    shape: Sequence[int], strides: Sequence[object], offset: object
) -> tuple[tuple[int, ...], int]:
    """Validate ``from_strides`` input: canonical strides and the offset."""
    if isinstance(strides, (str, bytes)) or not isinstance(strides, Sequence):
        raise TypeError(f"strides must be a sequence of ints, got {short_repr(strides)}")
    if len(strides) != len(shape):
        raise LayoutError(f"{len(strides)} strides given for {len(shape)} dims")
    checked = [check_int(s, "stride") for s in strides]
    off = check_int(offset, "rank_offset")
    if off < 0:
        raise LayoutError(f"rank_offset={off} must be >= 0")
    canon = canonical_strides(shape, checked)
    if any(s <= 0 for n, s in zip(shape, canon) if n > 1):
        bad = next(s for n, s in zip(shape, canon) if n > 1 and s <= 0)
        raise LayoutError(f"stride {bad} must be positive for dims of size > 1 (use from_grid for others)")
    if off > MAX_RANK or span(shape, canon) > MAX_RANK - off:
        raise LayoutError(
            f"rank_offset={off} with strides {tuple(canon)} reaches rank {off + span(shape, canon)}, "
            f"above the largest rank {MAX_RANK}"
        )
    if not nests(shape, canon):
        raise LayoutError(
            f"strides {tuple(canon)} for shape {tuple(shape)} map two coordinates to one rank (or do not "
            "nest: sorted by stride, each must exceed what the smaller ones reach); use from_grid"
        )
    return canon, off


def merged_stride(sizes: list[int], strides: list[int]) -> int | None:
    """The single stride of dims merged in order, or None if they don't nest contiguously."""
    live = [(n, s) for n, s in zip(sizes, strides) if n > 1]
    if not live:
        return 0
    for (_, outer), (n_inner, inner) in zip(live, live[1:]):
        if outer != inner * n_inner:
            return None
    return live[-1][1]


def rank_grid(grid: Any, names: tuple[str, ...]) -> np.ndarray:
    """``grid`` checked for ``Layout.from_grid``: integers, one dim per name, not empty, at most
    ``MAX_WORLD_SIZE`` ranks, each in ``0..MAX_RANK`` and distinct."""
    if not names:
        raise LayoutError("a Layout needs at least one dim; give one name per grid dim")
    arr = _as_rank_array(grid)
    if arr.ndim != len(names):
        raise NameCountError(
            torch_says(
                f"grid has {arr.ndim} dims but {len(names)} names were given: {names}; give one name per dim",
                "mesh_shape and mesh_dim_names should have same length! "
                f"Found len(mesh_dim_names): {len(names)} and len(mesh_shape):{arr.ndim}.",
            )
        )
    if arr.size == 0:
        raise LayoutError(f"grid of shape {arr.shape} is empty; every dim needs size >= 1")
    check_world(names, arr.shape)
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high > MAX_RANK:
        bad = low if low < 0 else high
        raise LayoutError(f"grid holds rank {bad}; ranks must be between 0 and {MAX_RANK}")
    if increasing(arr.ravel()):  # distinct without a sort
        return arr
    flat = np.sort(arr, axis=None)
    repeated = flat[1:][flat[1:] == flat[:-1]]
    if repeated.size:
        raise LayoutError(f"grid holds rank {int(repeated[0])} more than once; ranks must be distinct")
    return arr


def _as_rank_array(grid: Any) -> np.ndarray:
    try:
        arr = np.asarray(grid)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # ragged or too deep
        raise LayoutError(f"grid is not a rectangular array of ranks: {str(exc)[:200]}") from None
    if arr.dtype == object:
        items = arr.ravel().tolist()
        if not (items and all(is_int(v) for v in items)):
            raise TypeError(f"grid must hold integer ranks, got {type(grid).__name__} of objects")
        bad = next((v for v in items if not 0 <= v <= MAX_RANK), None)
        if bad is not None:
            raise LayoutError(f"grid holds rank {bad}; ranks must be between 0 and {MAX_RANK}")
        arr = np.array(items, dtype=np.int64).reshape(arr.shape)  # Python ints that all fit
    if arr.size > MAX_WORLD_SIZE:
        raise LayoutError(f"grid holds {arr.size} ranks, more than the {MAX_WORLD_SIZE} a layout may hold")
    if not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0) or arr.dtype == np.bool_:
        raise TypeError(f"grid must hold integer ranks, got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise LayoutError("grid is a single number; a layout needs at least one dim (e.g. [5] with ('dp',))")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > MAX_RANK:
        raise LayoutError(f"grid holds rank {int(arr.max())}; ranks must be between 0 and {MAX_RANK}")
    return arr.astype(np.int64, copy=False)
