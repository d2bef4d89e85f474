"""Process groups by rank set, shared and reference-counted: what a ``MeshGroups`` holds.

A ``GroupCache`` maps (ranks in mesh order, backend) to the group this rank holds for it
(``None`` where this rank made the creation call but is not a member). Every ``MeshGroups`` that
uses an entry holds a reference; ``MeshGroups.close()`` drops its references and destroys the
groups nobody uses any more, so two meshes sharing a cache never lose a group the other needs.
Two groups over the same ranks in a different order are different groups: a rank's position
must equal its group rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.distributed as dist

from meshgroups.mesh._torch_seam import group_is_live

GroupKey = tuple[tuple[int, ...], str]


def backend_key(backend: str | None) -> str:
    """The cache key part of a backend: its name, or ``"<default>"`` for None.

    Args:
        backend: a backend name or None.

    Returns:
        The key.

    >>> backend_key(None)
    '<default>'
    """
    return backend or "<default>"


def _destroy(group: dist.ProcessGroup) -> bool:
    # Torch may have destroyed it already (torch >= 2.15's DeviceMesh.abort() on a meshgroups
    # mesh, the user's destroy_process_group, the default group's destruction): releasing what
    # is left must still work, so close() after an abort neither raises nor leaks the rest.
    if not group_is_live(group):
        return False
    dist.destroy_process_group(group)
    return True


@dataclass
class GroupHandle:
    """This rank's group of one family: ``ranks`` in mesh order, or all ``None`` for a rank
    that is not a member."""

    ranks: tuple[int, ...] | None
    group: dist.ProcessGroup | None
    gloo: dist.ProcessGroup | None


@dataclass
class GroupCache:
    """Process groups by (ranks in mesh order, backend), shared by ``init_mesh`` calls that
    pass the same cache (one strategy per cache).

    Attributes:
        calls: ``new_group``/``split_group`` calls this rank made (members and non-members).
        created: groups this rank is a member of that were created through this cache.
        pads: one-rank groups still alive that kept torch's group counts aligned.
        since: the number of the collective call that first filled the cache since it was last
            empty (``None`` while empty); compared across ranks, so a rank passing another cache
            is told rather than left creating different groups.

    Two meshes over the same ranks share their groups (torch's single-process ``"fake"``
    backend stands in for rank 5 of 8)::

        >>> import torch.distributed as dist
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> from meshgroups import GroupCache, Layout, init_mesh
        >>> dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        >>> cache = GroupCache()
        >>> a = init_mesh(Layout(dp=2, tp=4), cache=cache)
        >>> b = init_mesh(Layout(pp=2, dp=1, tp=4), cache=cache)  # its pp is a's dp
        >>> b.group("tp") is a.group("tp"), b.group("pp") is a.group("dp"), len(cache)
        (True, True, 3)
        >>> a.close(), b.close()  # a's groups live on in b; b's close destroys them
        (0, 3)
        >>> dist.destroy_process_group()
    """

    strategy: str | None = None
    since: int | None = None
    calls: int = 0
    created: int = 0
    _groups: dict[GroupKey, dist.ProcessGroup | None] = field(default_factory=dict)
    _refs: dict[GroupKey, int] = field(default_factory=dict)
    pads: list[dist.ProcessGroup] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(1 for g in self._groups.values() if g is not None)

    def groups(self) -> list[dist.ProcessGroup]:
        """Every distinct group this rank holds through the cache (WORLD excluded)."""
        return [g for g in self._groups.values() if g is not None and g is not dist.group.WORLD]

    def get(self, key: GroupKey) -> tuple[bool, dist.ProcessGroup | None]:
        if key in self._groups:
            return True, self._groups[key]
        return False, None

    def put(self, key: GroupKey, group: dist.ProcessGroup | None, *, created: bool = False) -> None:
        """Hold ``group`` under ``key``; ``created``: this rank just made it (counted in
        ``created``) rather than receiving one built elsewhere."""
        self._groups[key] = group
        if created:
            self.created += 1

    def acquire(self, keys: Iterable[GroupKey]) -> None:
        for key in keys:
            self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, keys: Iterable[GroupKey], pads: Iterable[dist.ProcessGroup] = ()) -> int:
        """Drop one reference to each key; destroy groups (and ``pads``) no longer used.
        Returns how many process groups were destroyed (not counting those torch had
        already destroyed)."""
        destroyed = 0
        for key in keys:
            left = self._refs.get(key, 0) - 1
            if left > 0:
                self._refs[key] = left
                continue
            self._refs.pop(key, None)
            group = self._groups.pop(key, None)
            if group is not None and group is not dist.group.WORLD:
                destroyed += _destroy(group)
        for pad in pads:
            if pad in self.pads:
                self.pads.remove(pad)
                destroyed += _destroy(pad)
        if not self._groups and not self.pads:
            self.strategy = self.since = None
        return destroyed

    def evict(self, key: GroupKey) -> bool:
        """Forget ``key``'s group now, whoever uses it, and destroy it (a group that cannot be
        reused, e.g. out of step after a failure); the next build creates a new one. The
        holders must drop ``key`` from what they release (``MeshGroups.forget_group``). Returns whether there was a group to destroy (one torch had not destroyed already)."""
        group = self._groups.pop(key, None)
        self._refs.pop(key, None)
        if group is None or group is dist.group.WORLD:
            return False
        return _destroy(group)

    def items(self) -> list[tuple[GroupKey, dist.ProcessGroup | None]]:
        """Every (key, group) entry (``None``: this rank made the call but is no member)."""
        return list(self._groups.items())

    def destroy(self) -> None:
        """Destroy every group the cache holds (and the pads), whoever uses them, then forget them."""
        for group in self.groups() + self.pads:
            _destroy(group)
        self._groups.clear()
        self._refs.clear()
        self.pads.clear()
        self.strategy = self.since = None
