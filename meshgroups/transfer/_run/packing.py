"""Packed point-to-point messages: every slice a rank sends to one peer in one step of one
bucket travels as one message (its bytes one after another in one buffer), and the receiver
unpacks them straight into its destination views. The order inside a buffer is the step's
order of slices, which both sides sort alike (weight, box, sender, receiver), so nothing but
the bytes crosses. Buffers are kept in a :class:`PackBuffers` across calls (a ``WeightSync``
holds one): the next ``sync()`` reuses them (no allocation)::

    >>> import torch
    >>> bufs = PackBuffers()
    >>> a = bufs.get(("send", 0, 0, 1), 8, torch.device("cpu"))
    >>> a is bufs.get(("send", 0, 0, 1), 8, torch.device("cpu")), len(bufs)
    (True, 1)

Bytes are unchanged (a buffer holds exactly its slices); the number of messages becomes the
number of (peer, direction) pairs per step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


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


__all__ = ["PackBuffers", "land", "pack"]
