"""Grid helpers of the layout core: sizes, affine forms, merged strides (numpy only)."""

from __future__ import annotations

import numpy as np

from ._checks import check_int, check_size, formula, is_int, product


def freeze(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


def infer_sizes(names: tuple[str, ...], sizes: list[object], world_size: int | None) -> tuple[int, ...]:
    unknown = [i for i, s in enumerate(sizes) if is_int(s) and int(s) == -1]  # type: ignore[call-overload]
    if unknown and world_size is None:
        raise ValueError(f"{names[unknown[0]]}=-1 needs world_size= to infer it from")
    if len(unknown) > 1:
        raise ValueError(f"only one size may be -1 (inferred), got {', '.join(names[i] for i in unknown)}")
    checked = [0 if i in unknown else check_size(n, s) for i, (n, s) in enumerate(zip(names, sizes))]
    if world_size is None:
        return tuple(checked)
    world = check_int(world_size, "world_size")
    if world < 1:
        raise ValueError(f"world_size={world} must be positive")
    known = [(n, s) for i, (n, s) in enumerate(zip(names, checked)) if i not in unknown]
    known_product = product(s for _, s in known)
    if unknown:
        if world % known_product:
            raise ValueError(
                f"{formula([n for n, _ in known], [s for _, s in known])} does not divide "
                f"world_size={world}, so {names[unknown[0]]} cannot be inferred"
            )
        checked[unknown[0]] = world // known_product
    elif known_product != world:
        raise ValueError(f"{formula(names, checked)} does not match world_size={world}")
    return tuple(checked)


def affine_form(grid: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    """``(offset, strides)`` if ``grid`` (distinct ranks) is a strided view of a contiguous
    range ``offset..offset+W-1``, else None."""
    offset = int(grid.flat[0])
    if int(grid.max()) - offset != grid.size - 1 or int(grid.min()) != offset:
        return None
    strides = []
    for axis, size in enumerate(grid.shape):
        if size == 1:
            strides.append(0)
            continue
        index = [0] * grid.ndim
        index[axis] = 1
        strides.append(int(grid[tuple(index)]) - offset)
    expected = np.full(grid.shape, offset, dtype=np.int64)
    for axis, (size, stride) in enumerate(zip(grid.shape, strides)):
        index_shape = [1] * grid.ndim
        index_shape[axis] = size
        expected += (np.arange(size, dtype=np.int64) * stride).reshape(index_shape)
    if not np.array_equal(expected, grid):
        return None
    return offset, tuple(strides)


def merged_stride(sizes: list[int], strides: list[int]) -> int | None:
    """The single stride of dims merged in order, or None if they don't nest contiguously."""
    live = [(n, s) for n, s in zip(sizes, strides) if n > 1]
    if not live:
        return 0
    for (_, outer), (n_inner, inner) in zip(live, live[1:]):
        if outer != inner * n_inner:
            return None
    return live[-1][1]
