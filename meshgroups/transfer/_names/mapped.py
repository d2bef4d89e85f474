"""A name map applied to two sides' weights: one *link* per segment, planned like any weight.

:func:`~meshgroups.transfer.map_weights` turns every rollout weight into links, one per segment of its rule
(:mod:`~meshgroups.transfer._names.names`). A link is a pair of :class:`SegmentWeight` s of the
segment's shape: the trainer weight cut to the segment's window, and the rollout weight (or
its part, when parts are sharded one by one) cut to where the segment lands. A window keeps the
full weight's shard boundaries (its tiling is the full one clipped), so a rank holds exactly
its shard's share of each segment and the planner, unchanged, moves each trainer piece straight
into its place in the fused shard: no full tensor is gathered, and the cross-node bytes are
the links' lower bound. The links' destination dtype is the wire dtype (the rollout's): bytes
are counted as sent. Coverage is checked both ways before anything is planned::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight
    >>> t = [Weight(n, (s, 4), "float32", {"tp": Shard(0)}) for n, s in (("q", 8), ("k", 2), ("v", 2))]
    >>> r = [Weight("qkv", (12, 4), "bfloat16", {"tp": Shard(0)})]
    >>> from meshgroups.transfer import map_weights
    >>> m = map_weights(Layout(tp=2), t, Layout(tp=2, rank_offset=2), r, {"qkv": ["q", "k", "v"]}, "bfloat16")
    >>> [(link.source, link.dst_local(2)) for link in m.sources("qkv")]  # rank 2's buffer: q0 ‖ k0 ‖ v0
    [('q', ((0, 4), (0, 4))), ('k', ((4, 5), (0, 4))), ('v', ((5, 6), (0, 4)))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.transfer._spec import Box, Weight

#: One cut of one axis: ``(axis, start, full extent)``.
Window = tuple[int, int, int]


def windows_of(weight: Weight) -> tuple[Window, ...]:
    """The cuts of ``weight``: a :class:`SegmentWeight`'s windows, one per cut axis (in axis
    order); ``()`` for a whole weight.

    Args:
        weight: any weight.

    Returns:
        ``((axis, start, full), ...)``.

    >>> windows_of(SegmentWeight("w", (2, 4), window=(0, 2, 8)))
    ((0, 2, 8),)
    """
    w = getattr(weight, "window", None)
    if w is None:
        return ()
    if len(w) == 3 and all(isinstance(x, int) for x in w):
        return (w,)
    return tuple(w)


@dataclass(frozen=True)
class SegmentWeight(Weight):
    """A weight cut to windows: ``window = (axis, start, full)`` keeps indices
    ``[start, start + shape[axis])`` of an axis of ``full`` elements (several such triples cut
    several axes), keeping the full weight's shard boundaries (a rank holds its full shard
    clipped to the window, in window coordinates). ``None``: the whole weight.

    Args:
        name, shape, dtype, placements, stage, shard_order: as :class:`Weight` (``shape`` is the
            window's: the full weight's with each cut axis cut to the window's length).
        window: ``(axis, start, full)``, a tuple of such triples (one per cut axis), or ``None``.

    Raises:
        LayoutError: a window that does not fit the shape, or two on one axis (or a
            :class:`Weight` field is bad).

    >>> SegmentWeight("w", (1, 4), window=((0, 3, 8),)).full_weight().shape
    (8, 4)
    """

    window: Window | tuple[Window, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        cuts = windows_of(self)
        if len({a for a, _, _ in cuts}) != len(cuts):
            raise LayoutError(f"weight {self.name!r}: windows {self.window} cut one axis twice")
        for axis, start, full in cuts:
            if not (0 <= axis < len(self.shape) and 0 <= start and start + self.shape[axis] <= full):
                raise LayoutError(
                    f"weight {self.name!r}: window {(axis, start, full)} does not fit shape {self.shape}"
                )
        if len(cuts) > 1:  # one canonical form: sorted by axis
            object.__setattr__(self, "window", tuple(sorted(cuts)))

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.window))

    def __reduce__(self) -> tuple[object, ...]:
        p = dict(self.placements)
        return (
            SegmentWeight,
            (self.name, self.shape, self.dtype, p, self.stage, self.shard_order, self.window),
        )

    @cached_property
    def _full(self) -> Weight:
        shape = list(self.shape)
        for axis, _, full in windows_of(self):
            shape[axis] = full
        return Weight(self.name, tuple(shape), self.dtype, self.placements, self.stage, self.shard_order)

    def full_weight(self) -> Weight:
        """The uncut weight (same placements; built once)."""
        return self._full

    def starts(self) -> tuple[int, ...]:
        """Per axis, where the window starts in the full weight (0 on an uncut axis)."""
        out = [0] * len(self.shape)
        for axis, start, _ in windows_of(self):
            out[axis] = start
        return tuple(out)

    def box_at(self, layout: Layout, coords: Mapping[str, int]) -> Box | None:
        box = self.full_weight().box_at(layout, coords)
        if box is None or self.window is None:
            return box
        out = list(box)
        for axis, start, _ in windows_of(self):
            lo, hi = box[axis]
            lo, hi = max(lo - start, 0), min(hi - start, self.shape[axis])
            if hi <= lo:
                return None
            out[axis] = (lo, hi)
        return tuple(out)


def view_source(t: Any, axes: tuple[int | None, ...] | None) -> Any:
    """A trainer tensor (torch or numpy, already cut to a box) seen in a link's axes: link axis
    ``i`` is source axis ``axes[i]``, ``None`` a new axis of size 1 (a view, no copy).

    Args:
        t: the tensor.
        axes: the link's ``src_axes`` (``None``: as it is).

    Returns:
        The view.

    >>> import numpy as np
    >>> view_source(np.zeros((2, 3)), (None, 1, 0)).shape
    (1, 3, 2)
    """
    if axes is None:
        return t
    order = [a for a in axes if a is not None]
    if order != sorted(order):
        t = t.permute(*order) if hasattr(t, "permute") else t.transpose(order)
    return t[tuple(None if a is None else slice(None) for a in axes)]


@dataclass(frozen=True)
class Link:
    """One segment of one rollout weight: what the plan moves under the name :attr:`name`.

    Attributes:
        name: the plan's weight name (the rollout name itself for a rename or identity).
        rollout, source: the rollout weight written and the trainer weight read.
        src, dst: the planned pair (window coordinates; ``dst.dtype`` is the wire dtype).
        axis: the rule's axis (``None``: whole tensors).
        src_start: where the window starts in the trainer weight along ``axis``.
        parts: the rollout weight's parts as weights (one per part with ``sharding="per_part"``,
            else one), and ``part`` the index of this link's part.
        offset: where the segment starts inside its part along ``axis``.
        src_layout, dst_layout: the trainer's and the rollout's layouts (for the local slices).
        src_axes: link axis ``i`` is axis ``src_axes[i]`` of the trainer weight (``None`` in it:
            a new axis of size 1, a stack's); ``None``: the same axes (see :func:`view_source`).
        scale: a block-fp8 link (:class:`~meshgroups.transfer.BlockFP8`): ``(block, values)``, the
            block shape and, for a scale link, the name of the value link whose blocks it
            scales (``None`` for the value link itself); ``None``: no quantization.
    """

    name: str
    rollout: str
    source: str
    src: SegmentWeight
    dst: SegmentWeight
    axis: int | None
    src_start: int
    parts: tuple[Weight, ...]
    part: int
    offset: int
    src_layout: Layout = field(repr=False)
    dst_layout: Layout = field(repr=False)
    src_axes: tuple[int | None, ...] | None = None
    scale: tuple[tuple[int, int], str | None] | None = None

    @property
    def wire_dtype(self) -> str:
        return self.dst.dtype

    @property
    def cast(self) -> bool:
        """The sender casts (trainer dtype -> wire dtype) before sending."""
        return self.src.dtype != self.dst.dtype

    def src_local(self, rank: int, box: Box | None = None) -> Box | None:
        """``box`` (window coordinates; default: all ``rank`` holds of the link) as a box of
        ``rank``'s local trainer shard of :attr:`source`; ``None`` if it holds none."""
        own = self.src.box(self.src_layout, rank)
        if own is None:
            return None
        full = self.src.full_weight().box(self.src_layout, rank)
        if full is None:  # a window of a shard implies the shard
            raise LayoutError(f"link {self.name!r}: rank {rank} holds a window of no shard")
        box = own if box is None else box
        shift = self.src.starts()
        local = tuple((a + s - f0, b + s - f0) for (a, b), s, (f0, _) in zip(box, shift, full))
        if self.src_axes is None:
            return local
        out: list[tuple[int, int]] = [(0, 0)] * sum(a is not None for a in self.src_axes)
        for i, a in enumerate(self.src_axes):
            if a is not None:
                out[a] = local[i]
        return tuple(out)

    def view_source(self, t: Any) -> Any:
        """``t`` (a trainer tensor cut to :meth:`src_local`) in this link's axes (a view)."""
        return view_source(t, self.src_axes)

    def dst_local(self, rank: int, box: Box | None = None) -> Box | None:
        """``box`` (window coordinates; default: all ``rank`` gets of the link) as a box of
        ``rank``'s local rollout buffer of :attr:`rollout` (parts one after another along the
        axis, as vLLM holds them); ``None`` if it gets none."""
        own = self.dst.box(self.dst_layout, rank)
        if own is None:
            return None
        boxes = [p.box(self.dst_layout, rank) for p in self.parts]
        mine = boxes[self.part]
        if mine is None:  # a window of a part implies the part
            raise LayoutError(f"link {self.name!r}: rank {rank} holds a window of no part")
        box = own if box is None else box
        out = []
        for a, ((lo, hi), start) in enumerate(zip(box, self.dst.starts())):
            shift = start - mine[a][0]
            if a == self.axis:  # the earlier parts' local extents come first
                shift += sum(b[a][1] - b[a][0] for b in boxes[: self.part] if b is not None)
            out.append((lo + shift, hi + shift))
        return tuple(out)


@dataclass(frozen=True)
class Move:
    """One message of a mapped plan, resolved to the tensors it reads and writes.

    ``src_name`` is a trainer weight (``step`` 0: read ``src_local`` of the sender's local
    shard, cast to ``dtype`` when ``cast``) or, for a forward (``step`` 1), a rollout weight
    (read ``src_local`` of the forwarder's buffer, already in ``dtype``); ``dst_local`` is the
    slice of the receiver's buffer of rollout weight ``dst_name`` to write. ``nbytes``: in
    ``dtype``. ``box``: the message's box in the link's window coordinates. ``link``: the
    plan's weight name; ``src``, ``dst``: the sending and the receiving rank. ``src_axes``: at
    step 0, how the cut source is seen in the link's axes (:func:`view_source`)."""

    link: str
    src: int
    dst: int
    step: int
    src_name: str
    src_local: Box
    dst_name: str
    dst_local: Box
    dtype: str
    cast: bool
    nbytes: int
    box: Box
    src_axes: tuple[int | None, ...] | None = None


class Mapped:
    """The links of a mapped plan (``plan.mapping``), by plan weight name, in plan order.

    Attributes:
        links: ``{plan weight name: Link}``.
        unused: trainer weights (``name`` or ``name[axis a: start:stop]``) no rollout weight
            reads, allowed by ``allow_unused``.
    """

    def __init__(self, links: Sequence[Link], unused: tuple[str, ...]) -> None:
        self.links = {link.name: link for link in links}
        self.unused = unused
        self._by_rollout: dict[str, list[Link]] = {}
        for link in links:
            self._by_rollout.setdefault(link.rollout, []).append(link)

    @property
    def pairs(self) -> list[tuple[Weight, Weight]]:
        """``(src, dst)`` per link: what the planner moves."""
        return [(link.src, link.dst) for link in self.links.values()]

    def sources(self, rollout: str) -> list[Link]:
        """The links that write rollout weight ``rollout``, in order along its axis."""
        if rollout not in self._by_rollout:
            raise LayoutError(f"no rollout weight {rollout!r} in this plan")
        return list(self._by_rollout[rollout])

    def buffer_shape(self, rollout: str, rank: int) -> tuple[int, ...] | None:
        """The shape of ``rank``'s local buffer of ``rollout`` (its parts' local extents added
        along the axis); ``None`` if it holds none."""
        link = self.sources(rollout)[0]
        boxes = [b for b in (p.box(link.dst_layout, rank) for p in link.parts) if b is not None]
        if not boxes:
            return None
        shape = [b - a for a, b in boxes[0]]
        if link.axis is not None:
            shape[link.axis] = sum(b[link.axis][1] - b[link.axis][0] for b in boxes)
        return tuple(shape)

    def fused(self) -> list[str]:
        """Rollout weights made of more than one link (fusions, interleaves)."""
        return [name for name, links in self._by_rollout.items() if len(links) > 1]

    def resolve(self, message: object) -> Move:
        """A plan :class:`~meshgroups.transfer._plan.plan.Message` as a :class:`Move`."""
        link = self.links[message.weight]  # type: ignore[attr-defined]
        m = message
        if m.step == 0:  # type: ignore[attr-defined]
            src_name, src_local = link.source, link.src_local(m.src, m.box)  # type: ignore[attr-defined]
        else:
            src_name, src_local = link.rollout, link.dst_local(m.src, m.box)  # type: ignore[attr-defined]
        dst_local = link.dst_local(m.dst, m.box)  # type: ignore[attr-defined]
        if src_local is None or dst_local is None:
            raise LayoutError(f"plan bug: {m} is outside its sender's or receiver's shard")
        return Move(
            link.name, m.src, m.dst, m.step, src_name, src_local, link.rollout, dst_local,  # type: ignore[attr-defined]
            link.wire_dtype, link.cast and m.step == 0, m.nbytes, m.box,  # type: ignore[attr-defined]
            link.src_axes if m.step == 0 else None,  # type: ignore[attr-defined]
        )  # fmt: skip


__all__ = ["Link", "Mapped", "Move", "SegmentWeight", "Window", "view_source", "windows_of"]
