"""The legacy initializers' argument checks, and the metaclass that makes a constructor's
refusal reach every rank: constructing is local, but it leads into the collective
``init_dist_group``, so a refusal on one rank is published as that call's outcome.

    >>> check_ranks([3, 1], world_size=4)  # any order, kept as given
    [3, 1]
"""

from __future__ import annotations

import itertools
from abc import ABCMeta
from collections.abc import Iterable, Mapping
from typing import Any

from meshgroups.layout import check_int, short_repr
from meshgroups.mesh import publish_refusal


def check_divides(name: str, size: object, world_size: int) -> int:
    size = check_int(size, name)
    if size < 1 or world_size % size:
        raise ValueError(
            f"{name}={size} does not divide world_size={world_size}; it must be a positive divisor"
        )
    return size


def check_ranks(ranks: object, world_size: int) -> list[int]:
    """Distinct ranks in ``[0, world_size)``; O(n log n) (one sort), and at most ``world_size + 1``
    items are read, so an endless iterable is refused rather than consumed."""
    if isinstance(ranks, (str, bytes, Mapping)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a list of ints, got {short_repr(ranks)}")
    checked = [check_int(r, "each rank in ranks") for r in itertools.islice(ranks, world_size + 1)]
    if not checked:
        raise ValueError("ranks is empty; a group needs at least one rank")
    if len(checked) > world_size:
        raise ValueError(f"ranks lists more than world_size={world_size} ranks, so some rank repeats")
    for r in checked:
        if not 0 <= r < world_size:
            raise ValueError(f"rank {r} in ranks={_short(checked)} is outside [0, world_size={world_size})")
    ordered = sorted(checked)
    repeated = next((a for a, b in zip(ordered, ordered[1:]) if a == b), None)
    if repeated is not None:
        raise ValueError(
            f"ranks={_short(checked)} lists rank {repeated} more than once; ranks must be distinct"
        )
    return checked


def _short(ranks: list[int], limit: int = 16) -> str:
    """A rank list for a message: whole when short, its first members and length otherwise."""
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit]))}, …] ({len(ranks)} ranks)"


class RefusalsReachEveryRank(ABCMeta):
    """Constructing an initializer is local, but it leads into the collective ``init_dist_group``:
    a constructor that refuses its arguments on one rank publishes the refusal as that call's
    outcome (``meshgroups.mesh._collective.publish_refusal``), so the other ranks' ``init_dist_group``
    raises the same class at once, naming this rank, instead of waiting out the timeout."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            publish_refusal(f"{cls.__name__}.init_dist_group", exc)
            raise
