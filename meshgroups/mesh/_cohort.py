"""The live ranks a collective call runs over: a *cohort*, not the default group's world.

After a rank dies the default group still counts it, and every meeting of the collective
protocol (``collective_call``) would wait for it. A ``Cohort`` names the ranks that take
part (the survivors, plus ranks admitted back) and an *epoch* (one per verdict) that gives the
calls of this cohort a store namespace of their own: call numbers restart at 1, meetings and
group-creation keys never meet those of an earlier cohort (where a dead rank may have left keys
behind, or a failed recovery left a call open).

Torch-free: the group over the members (``group``) is filled in by ``meshgroups.elastic.rebuild``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

_active: list[Cohort | None] = [None]


@dataclass
class Cohort:
    """Live ranks (sorted global ranks) and the epoch of the verdict that made them.

    Attributes:
        members: the ranks every collective call of this cohort waits for.
        epoch: 0 for the job as started; each verdict adds one.
        group: a process group over ``members`` (the survivors' world-wide group), or ``None``
            until one is built.
        watch: makes a liveness probe for one wait: ``watch()`` returns a function that,
            called repeatedly with the ranks still awaited, returns those of them gone (a
            ``{rank: how}`` dict, or a list), in place of the process's own liveness observer
            with the call's lease: ``meshgroups.Elastic`` passes the observer with its
            ``stale_after``. ``None``: the process's observer.

    After ranks 4 and 5 of 8 died (the first verdict: epoch 1)::

        >>> from meshgroups.mesh import Cohort
        >>> c = Cohort((0, 1, 2, 3, 6, 7), epoch=1)
        >>> c.leader, c.tag, 5 in c, len(c)
        (0, 'e1-', False, 6)
    """

    members: tuple[int, ...]
    epoch: int
    group: Any = field(default=None, compare=False, repr=False)
    watch: Callable[[], Callable[[Sequence[int]], Mapping[int, str] | list[int]]] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        members = tuple(int(r) for r in self.members)
        if not members or list(members) != sorted(set(members)) or members[0] < 0:
            raise ValueError(
                f"a cohort's members must be distinct non-negative ranks in increasing order, got {self.members!r}"
            )
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"a cohort's epoch must be a non-negative int, got {self.epoch!r}")
        self.members = members

    @property
    def leader(self) -> int:
        """The member that publishes a meeting's reference arguments (rank 0's job otherwise)."""
        return self.members[0]

    @property
    def tag(self) -> str:
        """The store namespace of this cohort's calls (``""`` for epoch 0: the keys of a job
        that never lost a rank are unchanged)."""
        return f"e{self.epoch}-" if self.epoch else ""

    def __contains__(self, rank: object) -> bool:
        return rank in self.members

    def __len__(self) -> int:
        return len(self.members)


def current_cohort() -> Cohort | None:
    """The cohort collective calls of this process run over.

    Returns:
        The current ``Cohort``, or ``None``: the default group's world.

    >>> from meshgroups.mesh import current_cohort
    >>> current_cohort() is None  # no rank was ever lost
    True
    """
    return _active[0]


def set_cohort(cohort: Cohort | None) -> None:
    """Make ``cohort`` the one every later collective call runs over (``None``: the world)."""
    if cohort is not None and not isinstance(cohort, Cohort):
        raise TypeError(
            f"cohort must be a meshgroups.mesh._cohort.Cohort or None, got {type(cohort).__name__}"
        )
    _active[0] = cohort


@contextmanager
def use_cohort(cohort: Cohort | None) -> Iterator[Cohort | None]:
    """Run the calls inside over ``cohort``; the previous cohort is restored afterwards.

    Args:
        cohort: the live ranks to run over (``None``: the default group's world).

    Returns:
        A context manager that yields ``cohort``.

    >>> from meshgroups.mesh import Cohort, current_cohort, use_cohort
    >>> with use_cohort(Cohort((0, 1, 2, 3, 6, 7), epoch=1)) as c:
    ...     current_cohort() is c
    True
    >>> current_cohort() is None
    True
    """
    previous = _active[0]
    set_cohort(cohort)
    try:
        yield cohort
    finally:
        _active[0] = previous


__all__ = ["Cohort", "current_cohort", "set_cohort", "use_cohort"]
