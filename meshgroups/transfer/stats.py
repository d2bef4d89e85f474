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
    """Accumulates :class:`RankStats` from batches of messages; see the module docstring."""

    _FLUSH = 1 << 22  # messages buffered before one bincount pass over the world

    def __init__(self, size: int, node_size: int) -> None:
        self.size, self.node_size = size, node_size
        self._acc = {f.name: np.zeros(size, np.float64) for f in fields(RankStats)}
        self._buf: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._buffered = 0
        self.n_local = 0
        self.n_messages = 0
        self.cross_bytes = 0

    def add(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, step: np.ndarray) -> None:
        self.n_messages += int(src.size)
        moved = src != dst
        self.n_local += int(src.size - moved.sum())
        self._buf.append((src[moved], dst[moved], nbytes[moved], step[moved]))
        self._buffered += int(moved.sum())
        if self._buffered >= self._FLUSH:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        s, d, b, t = (np.concatenate(col) for col in zip(*self._buf))
        self._buf, self._buffered = [], 0
        n = self.size
        bf = b.astype(np.float64)
        cross = s // self.node_size != d // self.node_size
        fwd = t == 1
        acc = self._acc
        acc["send"] += np.bincount(s, weights=bf, minlength=n)
        acc["recv"] += np.bincount(d, weights=bf, minlength=n)
        acc["send_step0"] += np.bincount(s[~fwd], weights=bf[~fwd], minlength=n)
        acc["send_cross"] += np.bincount(s[cross], weights=bf[cross], minlength=n)
        acc["recv_cross"] += np.bincount(d[cross], weights=bf[cross], minlength=n)
        acc["n_send"] += np.bincount(s, minlength=n)
        acc["n_recv"] += np.bincount(d, minlength=n)
        acc["n_send_step1"] += np.bincount(s[fwd], minlength=n)
        acc["n_recv_step1"] += np.bincount(d[fwd], minlength=n)
        self.cross_bytes += int(b[cross].sum())

    def result(self) -> RankStats:
        """The totals so far (bytes below 2**53 per rank are exact in the float64 tallies)."""
        self._flush()
        return RankStats(**{k: v.astype(np.int64) for k, v in self._acc.items()})


__all__ = ["RankStats", "Tally"]
