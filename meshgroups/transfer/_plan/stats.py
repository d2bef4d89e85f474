"""Per-rank figures of a plan: bytes and messages sent and received, split by step and by
whether they cross a node — tallied in batches of messages with ``np.bincount``, so a whole
plan of tens of millions of messages never holds them all::

    >>> import numpy as np
    >>> t = Tally(size=4, node_size=2)
    >>> t.add(np.array([0, 0, 3]), np.array([1, 2, 3]), np.array([8, 8, 8]), np.array([0, 0, 0]))
    >>> s = t.result()
    >>> s.send.tolist(), s.send_cross.tolist(), t.n_local, t.cross_bytes
    ([16, 0, 0, 0], [8, 0, 0, 0], 1, 8)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RankStats:
    """Arrays indexed by global rank (local copies excluded)."""

    send: np.ndarray  # bytes sent, both steps
    recv: np.ndarray  # bytes received, both steps
    send_step0: np.ndarray  # bytes sent by source holders (step 0)
    send_cross: np.ndarray  # bytes sent to another node
    recv_cross: np.ndarray  # bytes received from another node
    n_send: np.ndarray  # messages sent
    n_recv: np.ndarray  # messages received
    n_send_step1: np.ndarray  # forwards sent
    n_recv_step1: np.ndarray  # forwards received

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Tally:
    """Accumulates :class:`RankStats` from batches of messages; see the module docstring.

    Batches much smaller than the world (a rank's own part) are tallied over the ranks they
    name only (:attr:`touched`, with :meth:`values` aligned to it), so a rank's plan costs
    O(its messages) here; the arrays over the whole world are built only when asked for
    (:meth:`result`). A large batch switches to arrays over the world."""

    _FLUSH = 1 << 22  # messages buffered before one bincount pass over the world
    _NAMES = tuple(f.name for f in fields(RankStats))

    def __init__(self, size: int, node_size: int) -> None:
        self.size, self.node_size = size, node_size
        self._ranks: np.ndarray | None = np.zeros(0, np.int64)  # None: arrays span the world
        self._acc = {name: np.zeros(0, np.int64) for name in self._NAMES}
        self._buf: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._buffered = 0
        self.n_local = 0
        self.n_messages = 0
        self.cross_bytes = 0

    @property
    def touched(self) -> np.ndarray | None:
        """Sorted ranks with any traffic while tallied sparsely, else ``None``."""
        self._flush()
        return self._ranks

    def values(self, name: str) -> np.ndarray:
        """One :class:`RankStats` field over :attr:`touched` (or over the world when ``None``)."""
        self._flush()
        return self._acc[name]

    def add(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, step: np.ndarray) -> None:
        self.n_messages += int(src.size)
        moved = src != dst
        self.n_local += int(src.size - moved.sum())
        self._buf.append((src[moved], dst[moved], nbytes[moved], step[moved]))
        self._buffered += int(moved.sum())
        if self._buffered >= self._FLUSH:
            self._flush()

    def _widen(self, old: np.ndarray, ranks: np.ndarray | None) -> None:
        """Re-index the accumulators from ``old`` ranks to ``ranks`` (a superset; ``None``: the
        whole world)."""
        n = self.size if ranks is None else ranks.size
        at = old if ranks is None else np.searchsorted(ranks, old)
        for name in self._NAMES:
            grown = np.zeros(n, np.int64)
            grown[at] = self._acc[name]
            self._acc[name] = grown
        self._ranks = ranks

    def _flush(self) -> None:
        if not self._buf:
            return
        s, d, b, t = (np.concatenate(col) for col in zip(*self._buf))
        self._buf, self._buffered = [], 0
        gs, gd = s, d  # global ranks (the node test needs them)
        old = self._ranks
        if old is not None and s.size * 16 < self.size:  # sparse: the ranks named only
            wider = np.union1d(old, np.concatenate([s, d]))
            self._widen(old, wider)
            s, d = np.searchsorted(wider, s), np.searchsorted(wider, d)
        elif old is not None:
            self._widen(old, None)
        n = self._acc["send"].size
        bf = b.astype(np.float64)
        cross = gs // self.node_size != gd // self.node_size
        fwd = t == 1
        sums = {
            "send": np.bincount(s, weights=bf, minlength=n),
            "recv": np.bincount(d, weights=bf, minlength=n),
            "send_step0": np.bincount(s[~fwd], weights=bf[~fwd], minlength=n),
            "send_cross": np.bincount(s[cross], weights=bf[cross], minlength=n),
            "recv_cross": np.bincount(d[cross], weights=bf[cross], minlength=n),
            "n_send": np.bincount(s, minlength=n),
            "n_recv": np.bincount(d, minlength=n),
            "n_send_step1": np.bincount(s[fwd], minlength=n),
            "n_recv_step1": np.bincount(d[fwd], minlength=n),
        }
        # Bytes below 2**53 per rank and batch are exact in bincount's float64 sums.
        for name, got in sums.items():
            self._acc[name] += got.astype(np.int64)
        self.cross_bytes += int(b[cross].sum())

    def result(self) -> RankStats:
        """The totals so far as arrays indexed by rank over the whole world (built now, O(world),
        when tallied sparsely)."""
        self._flush()
        if self._ranks is None:
            return RankStats(**self._acc)
        out = {name: np.zeros(self.size, np.int64) for name in self._NAMES}
        for name, v in out.items():
            v[self._ranks] = self._acc[name]
        return RankStats(**out)


class HolderSets:
    """Step-0 bytes per set of source holders (the ranks holding one distinct block), for the
    plan's balance bounds; see :meth:`bounds`::

        >>> hs = HolderSets()
        >>> a, b = np.array([0, 1]), np.array([1, 2, 3])  # two sets sharing rank 1
        >>> hs.add(a, step0=80, cross=80, quantum=4); hs.add(b, step0=30, cross=30, quantum=2)
        >>> sent = np.array([40, 50, 10, 10])  # step-0 bytes, all of them cross-node
        >>> hs.bounds(sent, sent)  # 80 over a's 2 ranks; rank 1: ⌈80/2⌉ + 4 + ⌈30/3⌉ + 2
        (40.0, 56.0)
    """

    def __init__(self) -> None:
        # id of the planner's cached holder array -> [holders, step-0 bytes, cross bytes, quantum]
        self._sets: dict[int, list[Any]] = {}

    def add(self, holders: np.ndarray, step0: int, cross: int, quantum: int) -> None:
        """One pair's bytes: ``holders`` is the planner's cached array of its source holders."""
        if not step0:  # local copies only: the set sends nothing, it joins no group
            return
        e = self._sets.setdefault(id(holders), [holders, 0, 0, 0])
        e[1] += step0
        e[2] += cross
        if cross:
            e[3] = max(e[3], quantum)

    def bounds(self, send_step0: np.ndarray, send_cross: np.ndarray) -> tuple[float, float]:
        """``(lower, upper)`` on the busiest step-0 sender.

        ``lower``: max over groups G (each holder set, and each union of holder sets that
        share ranks) of the step-0 bytes of the pieces only G holds, over G's ranks — no
        choice of senders among the holders does better. ``upper``: what the planner
        guarantees: per rank, its intra-node step-0 bytes plus, per holder set H it is in,
        ``⌈X_H / h⌉ + Q_H`` (``X_H``: H's cross-node bytes, cut into one range per member;
        ``Q_H``: the most a cut on a quantum moves a range, see
        :mod:`~meshgroups.transfer._plan.senders`)."""
        sets = list(self._sets.values())
        if not sets:
            return 0.0, 0.0
        size = send_step0.size
        guarantee = (send_step0 - send_cross).astype(np.float64)  # intra-node step-0 bytes
        owner = np.full(size, -1, np.int64)
        parent = list(range(len(sets)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        lower = 0.0
        for i, (hs, step0, cross, quantum) in enumerate(sets):
            h = hs.size
            lower = max(lower, step0 / h)
            guarantee[hs] += -(-cross // h) + quantum
            for j in np.unique(owner[hs]).tolist():
                if j >= 0:
                    parent[find(j)] = find(i)
            owner[hs] = i
        roots = np.array([find(i) for i in range(len(sets))], np.int64)
        members = np.bincount(roots[owner[owner >= 0]], minlength=len(sets))
        total = np.bincount(roots, weights=[e[1] for e in sets], minlength=len(sets))
        busy = members > 0
        lower = max(lower, float((total[busy] / members[busy]).max()))
        return lower, float(guarantee.max())


__all__ = ["HolderSets", "RankStats", "Tally"]
