"""Bytes a training step moves: every collective, on which group family, and over which level.

What a step calls (:func:`meshgroups.cost._calls.collectives`: op, family, payload, calls)
becomes bytes on links here.

:func:`traffic` turns it into bytes on links, with the usual algorithms stated, not guessed:
ring all-reduce (each rank sends ``2(g-1)/g`` of the payload to the next member, in group
order), ring all-gather and reduce-scatter (``(g-1)/g``), an all-to-all with uniform routing
(``payload/g`` to each other member) and point-to-point sends. Each link is put on the smallest
topology level holding both ends (``"world"`` above all), so a family's bytes per level add up to
its total, and the bytes *leaving* a level are those of the levels above it::

    >>> from meshgroups.cost._model import preset
    >>> t = traffic(preset("tiny"), Layout(dp_shard=4, tp=2), Topology(node=4))
    >>> sorted(t.families), t.slowest_level
    (['dp_shard', 'tp'], 'world')
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshgroups.cost._calls import Collective, collectives, stage_of
from meshgroups.cost._model import Model
from meshgroups.cost._roles import Parallelism
from meshgroups.layout import Layout, Topology

__all__ = ["FamilyTraffic", "Traffic", "traffic"]

WORLD = "world"


def _coordinates(layout: Layout, dim: str) -> np.ndarray:
    """Each rank's coordinate along ``dim``, indexed by rank."""
    out = np.zeros(layout.max_rank + 1, dtype=np.int64)
    grid = layout.grid
    axis = layout.names.index(dim)
    out[grid] = np.indices(grid.shape)[axis]
    return out


def _edges(
    c: Collective, layout: Layout, stage: np.ndarray, pp_dim: str | None
) -> tuple[np.ndarray, np.ndarray, float]:
    groups = layout.groups(*c.dims)
    g = groups.shape[1]
    if c.op == "send" and c.dims == (pp_dim,):
        cols = list(c.stages)
        peers = [(k + c.peer) % g for k in cols]
        return groups[:, cols].ravel(), groups[:, peers].ravel(), float(c.payload * c.calls)
    keep = np.isin(stage[groups[:, 0]], c.stages)
    for dim, k in c.where:  # every member of a group shares these coordinates
        keep &= _coordinates(layout, dim)[groups[:, 0]] == k
    rows = groups[keep]
    if c.op == "send":
        return rows.ravel(), np.roll(rows, -c.peer, axis=1).ravel(), float(c.payload * c.calls)
    if c.op == "all_to_all":
        i, j = np.nonzero(~np.eye(g, dtype=bool))
        return rows[:, i].ravel(), rows[:, j].ravel(), c.payload * c.calls / g
    share = (2 if c.op == "all_reduce" else 1) * (g - 1) / g
    return rows.ravel(), np.roll(rows, -1, axis=1).ravel(), share * c.payload * c.calls


@dataclass(frozen=True)
class FamilyTraffic:
    """A family's bytes in a step, over all its groups.

    Args:
        family: its name. dims: its dims. group_size: ranks per group.
        sent_per_rank: the most bytes one rank sends. total: bytes sent by all ranks.
        by_level: ``{level: bytes}``, each link on the smallest level holding both ends
            (``"world"`` last); they add up to ``total``.

    >>> FamilyTraffic("tp", ("tp",), 2, 1.0, 4.0, {"node": 4.0, "world": 0.0}).leaving("node")
    0.0
    """

    family: str
    dims: tuple[str, ...]
    group_size: int
    sent_per_rank: float
    total: float
    by_level: dict[str, float]

    def leaving(self, level: str) -> float:
        """Bytes on links that leave a unit of ``level`` (those of the levels above it).

        Args:
            level: a level of the topology.

        Returns:
            the bytes.
        """
        names = list(self.by_level)
        return sum(self.by_level[n] for n in names[names.index(level) + 1 :])

    def to_dict(self) -> dict[str, object]:
        """The fields as a dict (for JSON).

        Returns:
            the dict.
        """
        return {
            "family": self.family,
            "dims": list(self.dims),
            "group_size": self.group_size,
            "sent_per_rank": self.sent_per_rank,
            "total": self.total,
            "by_level": dict(self.by_level),
        }


@dataclass(frozen=True)
class Traffic:
    """A step's bytes, per family and per level.

    Args:
        families: ``{family: FamilyTraffic}``. levels: the level names, smallest first, then
            ``"world"``. collectives: what :func:`collectives` listed.

    >>> Traffic({}, ("node", "world")).by_level
    {'node': 0.0, 'world': 0.0}
    """

    families: dict[str, FamilyTraffic]
    levels: tuple[str, ...]
    collectives: tuple[Collective, ...] = field(default=(), repr=False)

    @property
    def by_level(self) -> dict[str, float]:
        """Bytes per level over every family."""
        return {lv: float(sum(f.by_level[lv] for f in self.families.values())) for lv in self.levels}

    @property
    def slowest_level(self) -> str | None:
        """The largest level some link uses (``None``: no traffic)."""
        used = [lv for lv, b in self.by_level.items() if b > 0]
        return used[-1] if used else None

    def order_key(self) -> tuple[float, ...]:
        """Bytes per level from the slowest to the fastest: the order :func:`enumerate_layouts`
        sorts by (bytes over the slowest level crossed first), not a predicted step time.

        Returns:
            the tuple.
        """
        return tuple(self.by_level[lv] for lv in reversed(self.levels))

    def to_dict(self) -> dict[str, object]:
        """Families, per-level totals and the slowest level, as a dict (for JSON).

        Returns:
            the dict.
        """
        return {
            "families": {k: f.to_dict() for k, f in self.families.items()},
            "by_level": self.by_level,
            "slowest_level": self.slowest_level,
        }


def traffic(
    model: Model, layout: Layout, topology: Topology | None = None, plan: Parallelism | None = None
) -> Traffic:
    """The bytes of :func:`collectives` on links, per family and per level of ``topology``
    (see the module docstring for the algorithms assumed).

    Args:
        model: the model. layout: the layout. topology: the machine (``None``: one level,
            ``"world"``). plan: roles, schedule and dtypes.

    Returns:
        a :class:`Traffic`.

    Raises:
        TypeError: ``topology`` is not a ``Topology``.
        LayoutError: as :func:`collectives`.

    >>> t = traffic(preset("tiny"), Layout(dp_shard=2, tp=4), Topology(node=4))
    >>> t.families["tp"].by_level["world"], t.families["dp_shard"].by_level["node"]
    (0.0, 0.0)
    """
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a meshgroups.Topology, got {type(topology).__name__}")
    plan = plan or Parallelism()
    found = collectives(model, layout, plan)
    levels = topology.levels if topology is not None else ()
    names = (*(n for n, _ in levels), WORLD)
    stage = stage_of(layout, plan)
    pp_dim = plan.dims(layout).get("pp")
    sent: dict[str, np.ndarray] = {}
    buckets: dict[str, np.ndarray] = {}
    dims_of: dict[str, tuple[str, ...]] = {}
    for c in found:
        src, dst, each = _edges(c, layout, stage, pp_dim)
        level = np.zeros(src.shape, dtype=np.int64)
        for _, size in levels:  # nested levels: a link leaving a unit leaves every smaller one
            level += src // size != dst // size
        sent.setdefault(c.family, np.zeros(layout.max_rank + 1))
        np.add.at(sent[c.family], src, each)
        buckets.setdefault(c.family, np.zeros(len(names)))
        buckets[c.family] += np.bincount(level, minlength=len(names)) * each
        dims_of[c.family] = c.dims
    families = {
        fam: FamilyTraffic(
            fam,
            dims_of[fam],
            layout.size(*dims_of[fam]),
            float(sent[fam].max()),
            float(buckets[fam].sum()),
            {n: float(b) for n, b in zip(names, buckets[fam])},
        )
        for fam in sent
    }
    return Traffic(families, names, tuple(found))
