"""One weight on one side's layout as blocks of distinct data and the ranks holding each.

A *block* is one distinct shard: it is fixed by the coordinates of the dims that shard the
weight (and the pipeline stage); the dims that replicate it enumerate its *holders*. Per tensor
axis the sharding dims cut the axis into pieces that tile it in row-major order of their
coordinates (:func:`~meshgroups.transfer._spec.intervals`), so a block is one piece index per
axis and its box is the product of those pieces::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight
    >>> side = Side(Layout(dp=2, tp=2), Weight("w", (4, 4), placements={"tp": Shard(1)}))
    >>> side.holders(side.block_key((0, 1))).tolist()   # the tp=1 shard: held by both dp ranks
    [1, 3]

Everything here is O(ndim + holders) per block, from coordinates; nothing scans the world.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property, lru_cache

import numpy as np

from meshgroups.layout import Layout
from meshgroups.transfer._spec import Box, Weight, intervals

#: One axis's tiling: ``(full extent, sharding dim sizes, window start, window stop)`` — the
#: pieces of the full axis clipped to the window and counted from its start (a whole axis:
#: ``(n, sizes, 0, n)``). Pieces keep their block index, so a rank's piece of a window is its
#: full piece's share of it.
Tiling = tuple[int, tuple[int, ...], int, int]

#: A block's identity, independent of the weight's shape: the stage and the coordinates of the
#: sharding dims. Weights with the same key have the same holders.
BlockKey = tuple[tuple[str, int], ...]


class Side:
    """A weight's placement on one layout, as blocks (see the module docstring)."""

    def __init__(self, layout: Layout, weight: Weight) -> None:
        self.layout = layout
        self.weight = weight
        self.axis_dims = weight.shard_dims(layout)
        sizes = dict(zip(layout.names, layout.shape))
        self.axis_sizes = tuple(tuple(sizes[d] for d in dims) for dims in self.axis_dims)
        sharding = {d for dims in self.axis_dims for d in dims}
        stage_dim = weight.stage[0] if weight.stage is not None else None
        # Holders vary over every dim that neither shards the weight nor is its stage dim. Dims
        # of size 1 are left out of both the key and the free dims, so two weights with the same
        # holders always get the same key (their senders are then chosen from one history).
        self.free_dims = tuple(
            d for d in layout.names if d not in sharding and d != stage_dim and sizes[d] > 1
        )
        self.stage_key = weight.stage if stage_dim is not None and sizes[stage_dim] > 1 else None
        keyed = {d for d in sharding if sizes[d] > 1}
        if self.stage_key is not None:
            keyed.add(self.stage_key[0])
        self.keyed_dims = frozenset(keyed)
        cuts = {a: (start, full) for a, start, full in _windows(weight)}  # a SegmentWeight's
        self.axis_tilings: tuple[Tiling, ...] = tuple(
            (cuts[a][1], s, cuts[a][0], cuts[a][0] + n) if a in cuts else (n, s, 0, n)
            for a, (n, s) in enumerate(zip(weight.shape, self.axis_sizes))
        )

    def like(self, weight: Weight) -> Side:
        """This side for another weight of the same shape and placement (nothing recomputed)."""
        twin = Side.__new__(Side)
        twin.__dict__.update(self.__dict__)
        twin.weight = weight
        return twin

    @cached_property
    def axis_intervals(self) -> tuple[np.ndarray, ...]:
        """Per axis, every piece as ``[start, stop)`` rows, in block-index order."""
        return tuple(_intervals(*t) for t in self.axis_tilings)

    def block_of(self, rank: int, coords: dict[str, int] | None = None) -> tuple[int, ...] | None:
        """The block ``rank`` holds (one piece index per axis), or ``None`` (outside the layout,
        another stage, an empty shard). O(ndim); ``coords``: the rank's, if already known."""
        if coords is None:
            if rank not in self.layout:
                return None
            coords = self.layout.coords(rank)
        stage = self.weight.stage
        if stage is not None and coords[stage[0]] != stage[1]:
            return None
        out = []
        for dims, sizes, iv in zip(self.axis_dims, self.axis_sizes, self.axis_intervals):
            index = 0
            for d, k in zip(dims, sizes):
                index = index * k + coords[d]
            if iv[index, 1] <= iv[index, 0]:
                return None
            out.append(index)
        return tuple(out)

    def block_with(self, key: BlockKey) -> tuple[int, ...] | None:
        """The non-empty block whose holders are ``key``, if any: :meth:`block_of` at the key's
        coordinates (the size-1 dims keys leave out at 0)."""
        return self.block_of(-1, defaultdict(int, key))

    def block_box(self, block: tuple[int, ...]) -> Box:
        return tuple((int(iv[b, 0]), int(iv[b, 1])) for iv, b in zip(self.axis_intervals, block))

    def block_key(self, block: tuple[int, ...]) -> BlockKey:
        """The stage and sharding-dim coordinates of ``block`` (what fixes its holders)."""
        return _block_key(self.layout.names, self.stage_key, self.axis_dims, self.axis_sizes, block)

    def holders(self, key: BlockKey) -> np.ndarray:
        """Ranks holding the block of ``key``, in layout order over the replicating dims."""
        return holders(self.layout, key, self.free_dims)


def _windows(weight: Weight) -> tuple[tuple[int, int, int], ...]:
    """A SegmentWeight's cut axes (mapped.py), ``()`` for a whole weight."""
    from meshgroups.transfer._names.mapped import (
        windows_of,  # mapped imports the layout side; only its helper here
    )

    return windows_of(weight)


@lru_cache(maxsize=65536)
def _block_key(
    names: tuple[str, ...],
    stage: tuple[str, int] | None,
    axis_dims: tuple[tuple[str, ...], ...],
    axis_sizes: tuple[tuple[int, ...], ...],
    block: tuple[int, ...],
) -> BlockKey:
    """Cached: every layer placed alike asks for the same keys."""
    key: list[tuple[str, int]] = [stage] if stage is not None else []
    for dims, sizes, b in zip(axis_dims, axis_sizes, block):
        for d, k in zip(reversed(dims), reversed(sizes)):  # mixed radix, last dim fastest
            if k > 1:
                key.append((d, b % k))
            b //= k
    return tuple(sorted(key, key=lambda kv: names.index(kv[0])))


@lru_cache(maxsize=4096)
def _intervals(extent: int, sizes: tuple[int, ...], start: int = 0, stop: int = -1) -> np.ndarray:
    """:func:`intervals` of one :data:`Tiling`, cached: the layers of a model repeat a few shapes."""
    out = intervals(extent, sizes)
    if stop >= 0 and (start, stop) != (0, extent):  # a window: clipped, counted from its start
        out = np.clip(out, start, stop) - start
    out.setflags(write=False)
    return out


@lru_cache(maxsize=65536)
def axis_pairs(
    s_tiling: Tiling, d_tiling: Tiling, s_index: int | None, d_index: int | None
) -> tuple[tuple[int, int, int, int], ...]:
    """Rows ``(src piece, dst piece, start, stop)`` of one axis where the source's and the
    destination's pieces (two tilings of the same extent) intersect, restricted to one source
    or one destination piece."""
    s_iv, d_iv = _intervals(*s_tiling), _intervals(*d_tiling)
    if s_index is not None:
        rows = overlaps(d_iv, s_iv, only=np.array([s_index]))[:, [1, 0, 2, 3]]
    elif d_index is not None:
        rows = overlaps(s_iv, d_iv, only=np.array([d_index]))
    else:
        rows = overlaps(s_iv, d_iv)
    return tuple(tuple(r) for r in rows.tolist())


def holders(layout: Layout, key: BlockKey, free_dims: tuple[str, ...]) -> np.ndarray:
    """Ranks with the coordinates of ``key`` and any coordinate on ``free_dims``, in layout
    order. O(ndim + result)."""
    fixed = dict(key)
    corner = layout.rank_at(**{d: fixed.get(d, 0) for d in layout.names})
    return np.asarray(layout.group_of(corner, *free_dims), dtype=np.int64)


def overlaps(src: np.ndarray, dst: np.ndarray, only: np.ndarray | None = None) -> np.ndarray:
    """Pairs of pieces of one axis that intersect: rows ``(src index, dst index, start, stop)``.

    ``src`` and ``dst`` are two tilings of the same axis (rows ``[start, stop)`` in order, empty
    ones allowed); ``only`` restricts to those dst indices. O(result + log) per dst piece.
    """
    js = np.arange(len(dst), dtype=np.int64) if only is None else np.asarray(only, dtype=np.int64)
    lo, hi = dst[js, 0], dst[js, 1]
    keep = hi > lo
    js, lo, hi = js[keep], lo[keep], hi[keep]
    first = np.searchsorted(src[:, 1], lo, side="right")  # first src piece ending after lo
    last = np.searchsorted(src[:, 0], hi, side="left")  # one past the last starting before hi
    counts = np.maximum(last - first, 0)
    rep_j = np.repeat(js, counts)
    offs = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    i = np.repeat(first, counts) + offs
    a = np.maximum(src[i, 0], dst[rep_j, 0])
    b = np.minimum(src[i, 1], dst[rep_j, 1])
    ok = b > a
    return np.stack([i[ok], rep_j[ok], a[ok], b[ok]], axis=1)


__all__ = ["BlockKey", "Side", "Tiling", "axis_pairs", "holders", "overlaps"]
