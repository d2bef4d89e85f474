"""Delta sync on one rank, no collective: one slice's encoding, the sender's shadow it is
taken against, the policy and the figures (``delta`` runs the collective part).

**One slice's delta**: the new values at the positions that changed, bit for bit.

A delta is never an arithmetic difference: two values are *changed* when their bits differ
(``-0.0`` and ``0.0`` differ, a NaN equals the same NaN), and the receiver writes the sender's
new values at those positions — so after a delta the receiver holds exactly what a dense copy
would have written. Positions are flat, row-major indices into the slice (its box), whatever
the strides of the tensors on either side.

Three encodings; :func:`encode` takes the smallest:

- ``DENSE``: every value (the slice as a dense sync sends it);
- ``SPARSE``: the changed positions (``int32``, or ``int64`` for a slice of 2^31 elements or
  more: both sides know the slice's size) then their new values;
- ``BLOCKS``: the changed blocks of ``block`` consecutive elements (their ``int32`` / ``int64``
  numbers) then every value of those blocks (the last block may be short) — denser than
  ``SPARSE`` where changes cluster (an embedding's rows of the tokens seen, a bias).

An unchanged slice is ``SPARSE`` with no position: nothing but its header crosses. The header
of a slice is ``(mode, count, payload bytes)`` (count: positions or blocks)::

    >>> import torch
    >>> old = torch.zeros(8, dtype=torch.bfloat16)
    >>> new = old.clone(); new[3] = 1.5
    >>> mode, count, payload = encode(new, old, block=4)
    >>> mode, count, payload.numel()                # 1 position (4 bytes) + 1 bf16 value
    (1, 1, 6)
    >>> apply(old, mode, count, payload, block=4); torch.equal(old, new)
    True

:func:`digest` is the cheap per-slice check a receiver makes before it takes a delta: two
64-bit sums of the slice's bits, position-weighted, so that changing any one element always
changes it.

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

:class:`DeltaPolicy` tunes both (the block size, when to go dense, what a refusal does);
:class:`DeltaStats` is what one delta sync reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from meshgroups.transfer._spec import Box

DENSE, SPARSE, BLOCKS = 0, 1, 2
#: The encodings by number, for messages.
MODES = {DENSE: "dense", SPARSE: "sparse", BLOCKS: "blocks"}
#: Default elements per block of ``BLOCKS``.
BLOCK = 64
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PERIOD = 4096  # the digest's weights repeat with this period (see digest)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (same storage, same strides): the bits
    that are compared and hashed.

    >>> bits(torch.tensor([-0.0, 0.0])).tolist()
    [-2147483648, 0]
    """
    if t.element_size() not in _INTS:
        raise TypeError(f"no delta encoding for dtype {t.dtype} ({t.element_size()} bytes per element)")
    return t.view(_INTS[t.element_size()]) if t.dtype != _INTS[t.element_size()] else t


def index_bytes(n: int) -> int:
    """Bytes of one position in a slice of ``n`` elements.

    >>> index_bytes(100), index_bytes(2**31)
    (4, 8)
    """
    return 4 if n < 2**31 else 8


def encoded_bytes(mode: int, count: int, n: int, itemsize: int, block: int = BLOCK) -> int:
    """The payload size of a slice of ``n`` elements of ``itemsize`` bytes by its encoding
    (``count``: positions, or blocks — a short last block of the slice counted whole: an upper
    bound for ``BLOCKS``; the exact size travels in the header).

    >>> encoded_bytes(DENSE, 0, 10, 2), encoded_bytes(SPARSE, 3, 10, 2), encoded_bytes(BLOCKS, 1, 10, 2, 4)
    (20, 18, 12)
    """
    if mode == DENSE:
        return n * itemsize
    if mode == SPARSE:
        return count * (index_bytes(n) + itemsize)
    if mode == BLOCKS:
        return count * (index_bytes(n) + block * itemsize)
    raise ValueError(f"unknown delta mode {mode!r}; modes are {MODES}")


def encode(new: torch.Tensor, old: torch.Tensor, block: int = BLOCK) -> tuple[int, int, torch.Tensor]:
    """``new`` against ``old`` (same shape and dtype): ``(mode, count, payload)``, the smallest
    encoding; ``payload`` is ``uint8`` (its size is what the header carries).

    Args:
        new: the values the receiver must end with.
        old: the values it holds (the sender's shadow of what it last sent).
        block: elements per block of ``BLOCKS``.

    Raises:
        ValueError: the shapes or dtypes differ.
        TypeError: a dtype of an element size without an integer twin.
    """
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
            f"a delta needs new and old of one shape and dtype, got {tuple(new.shape)} {new.dtype} and "
            f"{tuple(old.shape)} {old.dtype}"
        )
    n, size, width = new.numel(), new.element_size(), index_bytes(new.numel())
    flat_new = bits(new.reshape(-1))  # indexing as integers: float8 has no index kernels
    changed = (flat_new != bits(old.reshape(-1))).nonzero().squeeze(1)
    k = int(changed.numel())
    ids = torch.unique_consecutive(torch.div(changed, block, rounding_mode="floor"))
    positions = _block_positions(ids, n, block)
    sizes = {
        DENSE: n * size,
        SPARSE: k * (width + size),
        BLOCKS: ids.numel() * width + positions.numel() * size,
    }
    mode = min(sizes, key=lambda m: (sizes[m], m))  # ties: the simplest
    idx_dtype = torch.int32 if width == 4 else torch.int64
    if mode == DENSE:
        return DENSE, 0, _as_bytes(flat_new)
    if mode == SPARSE:
        return SPARSE, k, torch.cat([_as_bytes(changed.to(idx_dtype)), _as_bytes(flat_new[changed])])
    return BLOCKS, int(ids.numel()), torch.cat([_as_bytes(ids.to(idx_dtype)), _as_bytes(flat_new[positions])])


def _block_positions(ids: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The element positions of blocks ``ids`` (ascending), the short last block clipped."""
    pos = (ids.to(torch.int64)[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
    return pos[pos < n]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def apply(view: torch.Tensor, mode: int, count: int, payload: torch.Tensor, block: int = BLOCK) -> None:
    """Write an encoded slice into ``view`` (any strides), in place.

    Args:
        view: the receiver's slice (the values the delta was computed against).
        mode, count: the slice's header.
        payload: its ``uint8`` bytes (any alignment).
        block: as for :func:`encode`.

    Raises:
        ValueError: a payload of the wrong size.
    """
    n, size = view.numel(), view.element_size()
    width = index_bytes(n)
    with torch.no_grad():
        if mode == DENSE:
            if payload.numel() != n * size:
                raise ValueError(
                    f"a dense slice of {n} elements needs {n * size} bytes, got {payload.numel()}"
                )
            view.copy_(_aligned(payload, size).view(view.dtype).view(view.shape))
            return
        if count == 0:
            return
        idx = (
            _aligned(payload[: count * width], width)
            .view(torch.int32 if width == 4 else torch.int64)
            .to(torch.int64)
        )
        if mode == BLOCKS:
            idx = _block_positions(idx, n, block)
        values = payload[count * width :]
        if values.numel() != idx.numel() * size:
            raise ValueError(
                f"a {MODES.get(mode, mode)} slice of {idx.numel()} values needs {idx.numel() * size} value bytes, "
                f"got {values.numel()}"
            )
        values = _aligned(values, size).view(bits(view).dtype)
        target = bits(view)  # written as integers: float8 has no index kernels
        if view.dim() == 0:
            target.copy_(values.reshape(()))
        elif view.is_contiguous():
            target.view(-1)[idx] = values
        else:
            target.index_put_(torch.unravel_index(idx, view.shape), values)


def _aligned(piece: torch.Tensor, size: int) -> torch.Tensor:
    """``piece`` (bytes of a packed buffer) where a ``size``-byte dtype can view it: copied
    when its offset is not a multiple of ``size``."""
    return piece.clone() if piece.storage_offset() % size else piece


@lru_cache(maxsize=4)
def _weights(device: str) -> torch.Tensor:
    # fixed odd multipliers below 2**31 (a product with a 32-bit value fits in int64)
    gen = torch.Generator().manual_seed(0x6D657368)
    w = torch.randint(1, 2**30, (_PERIOD,), generator=gen, dtype=torch.int64) * 2 + 1
    return w.to(device)


def digest(t: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums of ``t``'s bits (row-major order, any strides): ``Σ x_i · w_(i mod P)``
    with odd weights ``w`` (so one changed element always changes it: an odd number is
    invertible modulo 2^64) and ``Σ_j (j + 1) · (Σ of period j)`` (which orders the periods).
    Integer sums wrap modulo 2^64, so the order of summation does not matter: the sender's and
    the receiver's digests of equal bits are equal. O(n) reads, two small temporaries.

    >>> digest(torch.zeros(3)) == digest(torch.zeros(3)), digest(torch.zeros(3)) == digest(torch.tensor([0.0, 0.0, 1e-30]))
    (True, False)
    """
    x = bits(t).reshape(-1)
    if x.dtype != torch.int64:
        x = x.to(torch.int64)
    n = x.numel()
    rows = -(-n // _PERIOD)
    if rows * _PERIOD != n:
        x = torch.nn.functional.pad(x, (0, rows * _PERIOD - n))
    x = x.view(rows, _PERIOD)
    w = _weights(str(x.device))
    first = int((x * w).sum())
    per_row = x.sum(dim=1)
    second = int((per_row * torch.arange(1, rows + 1, device=x.device)).sum())
    return _wrap(first), _wrap(second)


def _wrap(v: int) -> int:
    """A Python int as the signed 64-bit value it wraps to."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


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


__all__ = [
    "BLOCK",
    "BLOCKS",
    "DENSE",
    "MODES",
    "SPARSE",
    "DeltaPolicy",
    "DeltaStats",
    "Key",
    "Shadows",
    "apply",
    "bits",
    "digest",
    "encode",
    "encoded_bytes",
    "index_bytes",
]
