"""The balanced choices of a plan: who sends across nodes, who represents a node, who sends inside.

Every choice is a function of the weights and layouts alone (never of messages exchanged), so
each rank makes the same choice for the pieces it takes part in. The planner
(:class:`~meshgroups.transfer._plan.routes.Planner`) routes the pairs and hands them here; nothing
here calls back into it:
- cross-node senders (:func:`holder_set_streams`): per set of source holders, the units of all
  its pairs (a piece to one node lacking it) are laid end to end and cut into one range of equal
  bytes per holder (see :mod:`~meshgroups.transfer._plan.senders`), cuts inside a piece on
  multiples of ``min_part_bytes`` (whole indices of its longest axis);
- representatives (:func:`representatives`): per destination block key, the holder position
  with the fewest bytes so far represents the nodes for the next weight's block;
- intra-node senders rotate with the weight and the source block (:func:`turn`).

For instance, one piece of 4 float32 elements (16 bytes) over 4 holders, to one node, cut on
multiples of 4 bytes: one element from each holder::

    >>> s = holder_set_streams((("tp", 0),), ("dp",), 4, [(1, 4, 4)], min_part_bytes=4)[0]
    >>> s.set.total, s.set.h, s.length, s.quantum, sorted(s.fragments(1)[3].tolist())
    (16, 4, 4, 1, [0, 1, 2, 3])
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from meshgroups.transfer._plan.senders import Stream, StreamSet
from meshgroups.transfer._plan.shards import BlockKey, Side
from meshgroups.transfer._spec import Box, volume


def holder_set_streams(
    key: BlockKey,
    free_dims: tuple[str, ...],
    h: int,
    pairs: Sequence[tuple[int, int, int]],
    min_part_bytes: int,
) -> list[Stream]:
    """Each pair's place in the stream of the holder set ``key`` (its ``h`` holders vary over
    ``free_dims``).

    ``pairs``: per pair of every weight with that holder set, in weight then pair order,
    ``(K, length, row)``: its ``K`` units (one per node lacking the piece), each ``length``
    indices of ``row`` bytes along its cut axis (:func:`cut_axis`). O(pairs), independent of
    ``h``; a function of the weights alone, so every rank places the same pairs alike."""
    # Each set starts its slots at its own holder (a checksum of its key: the same in every
    # process, ints normalised so numpy and Python ints read alike), so a rank in several
    # sets does not take the first range of all of them.
    canonical = (tuple((str(d), int(c)) for d, c in key), tuple(str(d) for d in free_dims))
    stream = StreamSet.of(
        [(k, length * row) for k, length, row in pairs], h, zlib.crc32(repr(canonical).encode())
    )
    return [
        stream.pair(i, length, row, max(1, -(-min_part_bytes // max(row, 1))))
        for i, (_, length, row) in enumerate(pairs)
    ]


def cut_axis(box: Box, itemsize: int) -> tuple[int, int]:
    """``(indices, bytes per index)`` of the axis a piece is cut along: its longest, the first
    of equals (as :func:`~meshgroups.transfer._plan.routes.cut_box`)::

        >>> cut_axis(((0, 2), (0, 8)), 4)
        (8, 8)
    """
    nbytes = itemsize * volume(box)
    if not box:
        return 1, nbytes
    longest = max(b - a for a, b in box)
    return longest, nbytes // max(longest, 1)


def turn(w: int, intervals: tuple[np.ndarray, ...], block: tuple[int, ...]) -> int:
    """Rotation of intra-node senders: the weight plus the source block's row-major index (its
    axes' pieces ``intervals``)::

        >>> turn(3, (np.zeros((2, 2)), np.zeros((4, 2))), (1, 2))
        9
    """
    flat = 0
    for iv, b in zip(intervals, block):
        flat = flat * len(iv) + b
    return w + flat


def representatives(
    sides: Sequence[Side], counts: Callable[[Side, BlockKey], np.ndarray]
) -> dict[tuple[int, tuple[int, ...]], int]:
    """Which holder of each destination block represents its node (number ``turn mod count``
    of the holders there), per ``(weight, block)``: one choice per block, so every piece of the
    block lands on the same representative, which can forward the block whole.

    Greedy by bytes over the weights in order (``sides``: each weight's destination side):
    per destination block key (blocks placed alike share one), the position with the least
    bytes so far takes the next block, so the forwarding load spreads evenly over a node's
    holders. Positions run over the lcm of the key's per-node holder counts (``counts``), so
    ``turn mod count`` is even on every node. One pass over every weight's destination blocks
    (the model's structure, not the world)."""
    loads: dict[tuple[BlockKey, tuple[str, ...]], np.ndarray] = {}
    table: dict[tuple[int, tuple[int, ...]], int] = {}
    for w, ds in enumerate(sides):
        sizes = [len(iv) for iv in ds.axis_intervals]
        for d_block in itertools.product(*[range(k) for k in sizes]):
            box = ds.block_box(d_block)
            if any(b <= a for a, b in box):
                continue
            key = (ds.block_key(d_block), ds.free_dims)
            load = loads.get(key)
            if load is None:
                per_node = np.unique(counts(ds, key[0])).tolist()
                positions = math.lcm(*per_node)
                if positions > 4096:  # irregular placements: bound the table, evenness is then approximate
                    positions = max(per_node)
                load = loads[key] = np.zeros(positions, np.float64)
            p = int(np.argmin(load))
            load[p] += ds.weight.itemsize * volume(box)
            table[(w, d_block)] = p
    return table


__all__ = ["cut_axis", "holder_set_streams", "representatives", "turn"]
