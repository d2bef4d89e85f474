"""Buckets of a transfer, the same on every rank (torch-free): which bucket each slice moves in.

A bucket is a pure function of the plan's weights and ``bucket_bytes``, so a sender and its
receiver put every slice in the same bucket without talking: weights in plan order, a weight
bigger than a bucket cut into blocks of rows (axis 0), blocks packed while their *full* sizes
fit. A rank therefore stages at most about one bucket at a time (it receives each element once)::

    >>> from meshgroups.transfer import Weight
    >>> b = Buckets.of([Weight("a", (4, 2)), Weight("b", (10, 2))], bucket_bytes=40)
    >>> b.count, b.rows, b.bucket
    (3, (4, 5), (0, 1, 2))
    >>> b.split(1, ((3, 9), (0, 2)))          # rows 3..9 of "b": blocks 0 and 1 of it
    [(1, ((3, 5), (0, 2))), (2, ((5, 9), (0, 2)))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshgroups.errors import MeshConfigError
from meshgroups.transfer._spec import Box, Weight

if TYPE_CHECKING:
    from meshgroups.transfer._plan.plan import Message


@dataclass(frozen=True)
class Buckets:
    """Weight ``i`` is cut into blocks of ``rows[i]`` rows (the whole weight when it fits a
    bucket; a 0-d weight is one block); ``bucket[first[i] + k]`` is the bucket of its block
    ``k``. A single row bigger than a bucket gets a bucket of its own."""

    count: int
    rows: tuple[int, ...]
    first: tuple[int, ...]
    bucket: tuple[int, ...]

    @classmethod
    def of(cls, weights: Sequence[Weight], bucket_bytes: int) -> Buckets:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise MeshConfigError(f"bucket_bytes={bucket_bytes!r} must be a positive int")
        rows_t: list[int] = []
        first: list[int] = []
        bucket_of: list[int] = []
        bucket, load = -1, 0
        for w in weights:
            rows = w.shape[0] if w.shape else 1
            row_bytes = w.nbytes // rows if rows else 0
            per = max(1, min(rows, bucket_bytes // row_bytes)) if row_bytes else max(rows, 1)
            rows_t.append(per)
            first.append(len(bucket_of))
            for start in range(0, max(rows, 1), per):
                size = row_bytes * (min(rows, start + per) - start)
                if bucket < 0 or (load + size > bucket_bytes and load > 0):
                    bucket, load = bucket + 1, 0
                load += size
                bucket_of.append(bucket)
        return cls(bucket + 1, tuple(rows_t), tuple(first), tuple(bucket_of))

    def split(self, w: int, box: Box) -> list[tuple[int, Box]]:
        """``box`` of weight ``w`` cut at block boundaries: ``[(bucket, sub-box), ...]``."""
        if not box:
            return [(self.bucket[self.first[w]], box)]
        per = self.rows[w]
        (lo, hi), rest = box[0], box[1:]
        out = []
        for k in range(lo // per, -(-hi // per)):
            a, b = max(lo, k * per), min(hi, (k + 1) * per)
            out.append((self.bucket[self.first[w] + k], ((a, b), *rest)))
        return out

    def last_bucket(self, w: int) -> int:
        """The bucket holding weight ``w``'s last block (the weight is complete after it)."""
        end = self.first[w + 1] if w + 1 < len(self.first) else len(self.bucket)
        return self.bucket[end - 1]


@dataclass(frozen=True)
class Part:
    """A message clipped to one bucket (``box``); ``key`` names the plan's message (weight,
    sender, box, step), as ``TransferGroups.routes`` does."""

    w: int
    src: int
    dst: int
    box: Box
    step: int
    key: tuple[str, int, Box, int]
    nbytes: int


def count(box: Box) -> int:
    """The number of elements in ``box`` (a ``[start, stop)`` range per axis).

    Args:
        box: the box.

    Returns:
        The product of its extents.

    >>> count(((0, 2), (1, 4)))
    6
    """
    n = 1
    for a, b in box:
        n *= b - a
    return n


def parts_by_bucket(
    messages: Sequence[Message], index: Mapping[str, int], buckets: Buckets
) -> dict[int, list[Part]]:
    """``messages`` (one rank's) cut into buckets: ``{bucket: [Part, ...]}``."""
    out: dict[int, list[Part]] = {}
    for m in messages:
        w = index[m.weight]
        per_element = m.nbytes // max(1, count(m.box))
        for b, box in buckets.split(w, m.box):
            key = (m.weight, m.src, m.box, m.step)
            out.setdefault(b, []).append(Part(w, m.src, m.dst, box, m.step, key, per_element * count(box)))
    return out


__all__ = ["Buckets", "Part", "count", "parts_by_bucket"]
