"""What delta sync keeps and reports (torch side): the policy, the sender's shadow, the stats.

**The shadow.** A sender keeps, per message of the plan it sends (weight, sender, box, step),
the values it last sent in the wire (destination) dtype — after the name map's cut, the cast
and the block-fp8 quantization: what the receiver holds. Each box once, however many ranks it
goes to. So a rank's shadow is exactly the bytes it sends in a dense sync, each box counted
once: for a trainer rank whose every shard it sends, its share of the model in the rollout's
dtype (a bf16 rollout of an fp32 trainer: half the trainer's local fp32 weights). A forward
inside a node (step 1) is a message of its own: the forwarding rollout rank keeps a shadow of
the boxes it forwards. Receivers keep nothing beyond their tensors: their base is what they
hold, checked by version and digest before a delta is taken (``delta``).

    >>> s = Shadows()
    >>> s.store(("w", 0, ((0, 4),), 0), ((0, 4),), ((0, 2),), torch.ones(2, dtype=torch.bfloat16))
    >>> s.nbytes(), s.base(("w", 0, ((0, 4),), 0), ((0, 2),)) is None   # no version yet
    (8, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshgroups.transfer._run.delta_codec import BLOCK
from meshgroups.transfer._spec import Box

#: A plan message's key: (weight, sender, box, step), as ``Part.key``.
Key = tuple[str, int, Box, int]


@dataclass(frozen=True)
class DeltaPolicy:
    """How ``WeightSync(delta=...)`` sends (``delta=True`` is ``DeltaPolicy()``).

    Attributes:
        block: elements per block of the block-sparse encoding.
        dense_every: every this many versions a dense sync (version ``% dense_every == 0``),
            shadows refreshed; ``None``: only when no sender has a base.
        on_mismatch: ``"dense"``: a receiver whose version or digest is not the delta's base
            gets a dense sync (the reason in ``Report.delta.reasons``); ``"raise"``: a
            ``VersionError`` on every rank before any byte moves.

    >>> DeltaPolicy(block=32)
    DeltaPolicy(block=32, dense_every=None, on_mismatch='dense')
    """

    block: int = BLOCK
    dense_every: int | None = None
    on_mismatch: str = "dense"

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"DeltaPolicy(block={self.block!r}): a block is an int >= 1 (elements)")
        every = self.dense_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"DeltaPolicy(dense_every={every!r}): None or an int >= 1 (versions)")
        if self.on_mismatch not in ("dense", "raise"):
            raise ValueError(f"DeltaPolicy(on_mismatch={self.on_mismatch!r}): 'dense' or 'raise'")

    @classmethod
    def of(cls, value: object) -> DeltaPolicy | None:
        """``False``/``None`` → ``None``, ``True`` → ``DeltaPolicy()``, a policy as it is.

        >>> DeltaPolicy.of(True) == DeltaPolicy(), DeltaPolicy.of(False)
        (True, None)
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"delta={value!r}: True, False or a DeltaPolicy")


@dataclass
class DeltaStats:
    """One sync's delta figures (``Report.delta``), this rank's and the whole world's.

    Attributes:
        version: the version this sync made.
        base: the version deltas were computed against (``None``: a dense sync).
        dense_bytes: what this rank would have sent in a dense sync (as ``bytes_sent`` counts).
        sent_bytes: what it sent: payloads plus headers and the base checks.
        header_bytes: of ``sent_bytes``, headers and base checks.
        modes: slices sent by encoding (``dense``, ``sparse``, ``blocks``; ``unchanged`` for
            ``sparse`` with nothing in it), this rank's.
        refused: receivers (global ranks) whose base was not the delta's: they got dense.
        reasons: why, one line per refusing receiver.
        total_dense, total_sent, total_header: ``dense_bytes``, ``sent_bytes`` and
            ``header_bytes`` summed over every rank.

    >>> stats = DeltaStats(version=3, base=2, dense_bytes=1000, sent_bytes=60, total_dense=4000, total_sent=240)
    >>> stats.ratio
    0.06
    """

    version: int
    base: int | None = None
    dense_bytes: int = 0
    sent_bytes: int = 0
    header_bytes: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    refused: tuple[int, ...] = ()
    reasons: tuple[str, ...] = ()
    total_dense: int = 0
    total_sent: int = 0
    total_header: int = 0

    @property
    def ratio(self) -> float:
        """``total_sent / total_dense``: everything a delta sync sent (headers and base checks
        included) against a dense sync (1.0 for a sync that moved nothing)."""
        return self.total_sent / self.total_dense if self.total_dense else 1.0

    @property
    def payload_ratio(self) -> float:
        """The values and positions alone against dense (``total_sent - total_header``): what
        the ratio tends to where slices are large (48 bytes of header and check per slice)."""
        return (self.total_sent - self.total_header) / self.total_dense if self.total_dense else 1.0


class Shadows:
    """The sender's shadow (see the module docstring): values by message key, the version
    they are, kept across syncs; emptied when a sync fails or the plan changes."""

    def __init__(self) -> None:
        self.tensors: dict[Key, torch.Tensor] = {}
        self._boxes: dict[Key, Box] = {}
        self.version: int | None = None

    def __len__(self) -> int:
        return len(self.tensors)

    def nbytes(self) -> int:
        """Bytes held (the memory cost: see the module docstring)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def clear(self) -> None:
        """Forget everything: the next sync is dense from this rank."""
        self.tensors.clear()
        self._boxes.clear()
        self.version = None

    def _view(self, key: Key, box: Box) -> torch.Tensor:
        own = self._boxes[key]
        return self.tensors[key][tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(box, own))]

    def base(self, key: Key, box: Box) -> torch.Tensor | None:
        """The shadow of ``box`` of message ``key`` (a view), or ``None`` when there is no
        base: nothing kept for it, or no version."""
        if self.version is None or key not in self.tensors:
            return None
        return self._view(key, box)

    def store(self, key: Key, message_box: Box, box: Box, values: torch.Tensor) -> None:
        """Keep ``values`` as the shadow of ``box`` (inside the message's ``message_box``)."""
        if key not in self.tensors:
            shape = tuple(b - a for a, b in message_box)
            self.tensors[key] = torch.empty(shape, dtype=values.dtype, device=values.device)
            self._boxes[key] = message_box
        with torch.no_grad():
            self._view(key, box).copy_(values)


__all__ = ["DeltaPolicy", "DeltaStats", "Key", "Shadows"]
