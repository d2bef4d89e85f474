"""One step of one bucket on one rank: prepared (views and staging buffers), posted
(non-blocking sends, receives and broadcasts), finished (waited for, written into the
destination buffers).

``execute`` drives these. Posting and finishing are apart so that a bucket's step 0 can be in
flight while the rank unpacks the bucket before it (``execute(overlap=True)``): a posted step
owns its staging and packed buffers until :func:`finish` returns, and nothing of it lands in a
destination buffer before then (local copies aside, which :func:`post` makes at once)::

    >>> step = Step()                                    # nothing to move on this rank
    >>> finish(post(step, None, tag=1), timedelta(seconds=5))
    0

**Packed point-to-point messages.** Every slice a rank sends to one peer in one step of one
bucket travels as one message (its bytes one after another in one buffer, :func:`pack`), and
the receiver unpacks them straight into its destination views (:func:`land`). The order inside
a buffer is the step's order of slices, which both sides sort alike (weight, box, sender,
receiver), so nothing but the bytes crosses. Buffers are kept in a :class:`PackBuffers` across
calls (a ``WeightSync`` holds one): the next ``sync()`` reuses them (no allocation). Bytes are
unchanged (a buffer holds exactly its slices); the number of messages becomes the number of
(peer, direction) pairs per step.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from meshgroups.errors import MeshConfigError
from meshgroups.layout import Layout
from meshgroups.transfer._run.buckets import Part
from meshgroups.transfer._spec import Box, Weight, dtype_name

if TYPE_CHECKING:
    from meshgroups.transfer._run.fanout_groups import TransferGroups


class LocalTensors:
    """This rank's tensors, checked against its boxes; views by global box."""

    def __init__(self, me: int, pairs: Sequence[tuple[Weight, Weight]], src: Layout, dst: Layout) -> None:
        self.me, self.pairs, self.src, self.dst = me, pairs, src, dst
        self.tensors: dict[tuple[str, int], tuple[torch.Tensor, Box]] = {}

    def take(self, side: str, w: int, tensors: Mapping[str, Any]) -> None:
        weight = self.pairs[w][0 if side == "src" else 1]
        what = "src_tensors" if side == "src" else "dst_buffers"
        box = weight.box(self.src if side == "src" else self.dst, self.me)
        if box is None:  # the plan never asks this; a mismatched plan would
            raise MeshConfigError(
                f"rank {self.me} holds no {side} shard of {weight.name!r} but the plan uses one"
            )
        if weight.name not in tensors:
            raise MeshConfigError(f"{what} has no {weight.name!r}; rank {self.me} holds its box {box}")
        t = tensors[weight.name]
        if hasattr(t, "to_local"):  # a DTensor: its local shard
            t = t.to_local()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{weight.name!r}] must be a torch.Tensor, got {type(t).__name__}")
        need = tuple(b - a for a, b in box)
        if tuple(t.shape) != need:
            raise MeshConfigError(
                f"{what}[{weight.name!r}] on rank {self.me} has shape {tuple(t.shape)}, but its box {box} "
                f"needs {need}"
            )
        wire = self.pairs[w][1].dtype
        # A source may come already in the wire dtype (block fp8: quantized by the caller).
        if dtype_name(t.dtype) != weight.dtype and not (side == "src" and dtype_name(t.dtype) == wire):
            raise MeshConfigError(
                f"{what}[{weight.name!r}] on rank {self.me} is {dtype_name(t.dtype)}, the plan says {weight.dtype}"
            )
        self.tensors[(side, w)] = (t, box)

    def view(self, side: str, w: int, box: Box) -> torch.Tensor:
        t, own = self.tensors[(side, w)]
        return t[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(box, own))]

    def wire(self, w: int) -> torch.dtype | None:
        """The dtype weight ``w`` crosses links in when it differs from the source's (the
        destination's: a mapped plan with a cast), else ``None``."""
        src, dst = self.pairs[w]
        given = self.tensors.get(("src", w))
        if src.dtype == dst.dtype or (given is not None and dtype_name(given[0].dtype) == dst.dtype):
            return None
        return getattr(torch, dst.dtype)


class Counts(Protocol):
    """What ``prepare`` adds to (``execute``'s ``Report``)."""

    messages: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int


@dataclass
class Step:
    """One step of one bucket on this rank, prepared: every view taken and staging buffer
    allocated, so what can fail locally fails before any rank moves data."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src) local
    fills: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, view) to send
    p2p: list[tuple[bool, torch.Tensor, int]] = field(default_factory=list)  # (is send, tensor, peer)
    casts: list[tuple[tuple[int, ...], int, Box, int, torch.Tensor]] = field(default_factory=list)
    landing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (staging, dst view)
    messages: int = 0  # point-to-point messages posted (after packing)


@dataclass
class Posted:
    """A posted step: its pending works and what lands once they complete."""

    works: list[Any]
    landing: list[tuple[torch.Tensor, torch.Tensor]]
    unpack: list[tuple[torch.Tensor, torch.Tensor]]
    broadcasts: int
    key: Hashable = None  # the step's (bucket, step)


def staged(
    view: torch.Tensor, fills: list[tuple[torch.Tensor, torch.Tensor]], wire: torch.dtype | None = None
) -> torch.Tensor:
    """``view`` itself when contiguous and already in the ``wire`` dtype, else a staging buffer
    filled from it when the step is posted (a forward's view is written at step 0, after this is
    prepared). A cast happens here, once, at the sender: ``copy_`` into a ``wire`` buffer is
    ``view.to(wire)`` bit for bit, and only the cast bytes cross the link.

    >>> fills = []
    >>> v = torch.arange(6.0).view(2, 3)[:, :2]          # not contiguous: staged
    >>> staged(v, fills).shape, len(fills)
    (torch.Size([2, 2]), 1)
    """
    if view.is_contiguous() and (wire is None or wire == view.dtype):
        return view
    buf = torch.empty(view.shape, dtype=wire or view.dtype, device=view.device)
    fills.append((buf, view))
    return buf


def prepare(
    parts: Sequence[Part],
    local: LocalTensors,
    groups: TransferGroups | None,
    counts: Counts,
    packed: bool = False,
) -> Step:
    """The step of ``parts`` on this rank. Sends and receives are ordered by (weight, box,
    sender, receiver) on both sides, so the point-to-point pairs match; a fan-out is one
    broadcast for its sender and each receiver. ``packed``: a point-to-point receive lands
    straight in its view (unpacked from the peer's one message, :func:`land`), with no staging
    buffer of its own.

    Raises:
        MeshConfigError: this rank lacks a transfer group the step needs.
    """
    me, step = local.me, Step()
    staging: dict[tuple[int, Box], torch.Tensor] = {}
    cast_seen: set[tuple[tuple[int, ...], int, Box]] = set()
    for p in sorted(parts, key=lambda p: (p.w, p.box, p.src, p.dst)):
        ranks = groups.routes.get(p.key) if groups is not None else None
        if ranks is not None and groups is not None and groups.group(ranks) is None:
            raise MeshConfigError(
                f"rank {me} has no transfer group over ranks {ranks}; rebuild TransferGroups"
            )
        if ranks is None and p.src != p.dst and groups is not None and groups.p2p is None:
            raise MeshConfigError(f"rank {me} is outside the TransferGroups' point-to-point group")
        if p.src == me and p.dst == me:
            # copy_ casts as .to() does when the plan's dtypes differ (colocated: no link)
            step.copies.append((local.view("dst", p.w, p.box), local.view("src", p.w, p.box)))
            counts.bytes_copied += p.nbytes
        elif p.src == me:
            if (p.w, p.box) not in staging:  # a forward (step 1) re-sends what step 0 wrote
                if p.step == 0:  # from the source shard, cast to the wire dtype here
                    view, wire = local.view("src", p.w, p.box), local.wire(p.w)
                else:  # from the destination buffer, already in the wire dtype
                    view, wire = local.view("dst", p.w, p.box), None
                staging[(p.w, p.box)] = staged(view, step.fills, wire)
            counts.bytes_sent += p.nbytes
            if ranks is None:
                step.p2p.append((True, staging[(p.w, p.box)], p.dst))
            elif (ranks, p.w, p.box) not in cast_seen:
                cast_seen.add((ranks, p.w, p.box))
                step.casts.append((ranks, p.w, p.box, p.src, staging[(p.w, p.box)]))
        elif packed and ranks is None:
            step.p2p.append((False, local.view("dst", p.w, p.box), p.src))
            counts.bytes_received += p.nbytes
        else:
            view = local.view("dst", p.w, p.box)
            buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            step.landing.append((buf, view))
            counts.bytes_received += p.nbytes
            if ranks is None:
                step.p2p.append((False, buf, p.src))
            else:
                step.casts.append((ranks, p.w, p.box, p.src, buf))
    counts.messages += len(parts)
    return step


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (same storage): gloo's collectives know no float8 dtype.

    >>> as_bytes(torch.zeros(2, dtype=torch.float8_e4m3fn)).dtype
    torch.uint8
    """
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


class PackBuffers:
    """Byte buffers by key (bucket, step, peer, direction), reused while their size is the same."""

    def __init__(self) -> None:
        self._bufs: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, nbytes: int, device: torch.device) -> torch.Tensor:
        """The ``uint8`` buffer of ``key``, of ``nbytes`` on ``device`` (kept, or made now).

        Args:
            key: what the buffer carries.
            nbytes: its size.
            device: where its tensors live.

        Returns:
            A 1-D ``uint8`` tensor.

        >>> PackBuffers().get("k", 3, torch.device("cpu")).shape
        torch.Size([3])
        """
        buf = self._bufs.get(key)
        if buf is None or buf.numel() != nbytes or buf.device != device:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._bufs[key] = buf
        return buf

    def __len__(self) -> int:
        return len(self._bufs)

    def clear(self) -> None:
        """Forget every buffer (the next call allocates anew): after a failed call, whose
        pending operations may still read or write the old ones.

        >>> bufs = PackBuffers(); _ = bufs.get("k", 4, torch.device("cpu")); bufs.clear(); len(bufs)
        0
        """
        self._bufs.clear()

    def nbytes(self) -> int:
        """Bytes held in all."""
        return sum(b.numel() for b in self._bufs.values())


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return (
        t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
    )


def pack(
    p2p: Sequence[tuple[bool, torch.Tensor, int]], buffers: PackBuffers, key: Hashable
) -> tuple[list[tuple[bool, torch.Tensor, int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One message per (direction, peer) from ``p2p`` (``(is send, tensor, peer)``, sends
    already filled): sends copied into their buffer now; receives unpacked after the wait.

    Args:
        p2p: the step's slices; a receive's tensor is the view it lands in.
        buffers: where the packed buffers are kept.
        key: the step's key (bucket, step); the buffer's key adds direction and peer.

    Returns:
        ``(messages, unpack)``: the packed ``(is send, buffer, peer)``, and ``(bytes, view)``
        pairs to :func:`land` after the receives complete.

    >>> m, u = pack([(True, torch.ones(2), 1), (True, torch.zeros(1), 1)], PackBuffers(), 0)
    >>> [(s, b.numel(), p) for s, b, p in m], u
    ([(True, 12, 1)], [])
    """
    groups: dict[tuple[bool, int], list[torch.Tensor]] = {}
    for send, t, peer in p2p:
        groups.setdefault((send, peer), []).append(t)
    messages: list[tuple[bool, torch.Tensor, int]] = []
    unpack: list[tuple[torch.Tensor, torch.Tensor]] = []
    for (send, peer), ts in groups.items():
        sizes = [t.numel() * t.element_size() for t in ts]
        device = ts[0].device
        buf = buffers.get((key, "send" if send else "recv", peer), sum(sizes), device)
        at = 0
        for t, n in zip(ts, sizes):
            piece = buf[at : at + n]
            if send:
                piece.copy_(_flat_bytes(t))
            else:
                unpack.append((piece, t))
            at += n
        messages.append((send, buf, peer))
    return messages, unpack


def land(piece: torch.Tensor, view: torch.Tensor) -> None:
    """Write the bytes ``piece`` (of a packed buffer) into ``view`` as its dtype and shape.

    Slices of several dtypes share one buffer unpadded (the bytes on the wire are the slices'),
    so a piece may start at an offset its dtype cannot be viewed at: it is then copied to an
    aligned buffer first.

    Args:
        piece: ``uint8``, ``view``'s size in bytes.
        view: the destination (any strides).

    >>> out = torch.empty(2)
    >>> land(torch.tensor([1.0, 2.0]).view(torch.uint8), out)
    >>> out.tolist()
    [1.0, 2.0]
    """
    if piece.storage_offset() % view.element_size():
        piece = piece.clone()
    view.copy_(piece.view(view.dtype).view(view.shape))


def post(
    step: Step,
    groups: TransferGroups | None,
    tag: int,
    buffers: PackBuffers | None = None,
    key: Hashable = None,
) -> Posted:
    """Make the step's local copies, fill its staging buffers, and post every send, receive and
    broadcast without waiting. Point-to-point operations carry the step's ``tag``; broadcasts go
    in one order on every rank (by group, weight, box). With ``buffers``, the point-to-point
    slices go packed, one message per peer and direction (:func:`pack`), in the buffers of
    ``key``: a key's buffers must not be posted twice before the first is finished."""
    with torch.no_grad():  # buffers may be parameters (leaves that require grad)
        for dst_view, src_view in step.copies:
            dst_view.copy_(src_view)
        for buf, view in step.fills:
            buf.copy_(view)
    p2p = groups.p2p if groups is not None else None  # None: the default group
    messages: list[tuple[bool, torch.Tensor, int]] = step.p2p
    unpack: list[tuple[torch.Tensor, torch.Tensor]] = []
    if buffers is not None:
        with torch.no_grad():
            messages, unpack = pack(step.p2p, buffers, key)
    step.messages = len(messages)
    ops = [
        dist.P2POp(dist.isend if send else dist.irecv, as_bytes(t), peer, p2p, tag)
        for send, t, peer in messages
    ]
    works: list[Any] = list(dist.batch_isend_irecv(ops)) if ops else []
    for ranks, _, _, src, data in sorted(step.casts, key=lambda c: (c[0], c[1], c[2])):
        group = groups.group(ranks) if groups is not None else None
        works.append(dist.broadcast(as_bytes(data), src=src, group=group, async_op=True))
    return Posted(works, step.landing, unpack, len(step.casts), key)


def finish(posted: Posted, timeout: timedelta) -> int:
    """Wait for a posted step (``timeout`` for all its works together), then write what it
    received into the destination views. Returns the broadcasts it made.

    Raises:
        TimeoutError: a send, receive or broadcast did not finish within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    for work in posted.works:
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        if work is not None and work.wait(left) is False:
            raise TimeoutError(f"a send or receive of rank {dist.get_rank()} did not finish within {timeout}")
    with torch.no_grad():
        for buf, view in posted.landing:
            view.copy_(buf)
        for piece, view in posted.unpack:
            land(piece, view)
    return posted.broadcasts


def parts_of_step(parts: Mapping[int, Sequence[Part]], bucket: int, step: int) -> list[Part]:
    """This rank's parts of one step of one bucket.

    >>> parts_of_step({}, 0, 1)
    []
    """
    return [p for p in parts.get(bucket, ()) if p.step == step]


__all__ = [
    "Counts",
    "LocalTensors",
    "PackBuffers",
    "Posted",
    "Step",
    "as_bytes",
    "finish",
    "land",
    "pack",
    "parts_of_step",
    "post",
    "prepare",
    "staged",
]
