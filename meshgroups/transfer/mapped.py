"""A name map applied to two sides' weights: one *link* per segment, planned like any weight.

:func:`map_weights` turns every rollout weight into links, one per segment of its rule
(:mod:`~meshgroups.transfer.names`). A link is a pair of :class:`SegmentWeight` s of the
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
    >>> m = map_weights(Layout(tp=2), t, Layout(tp=2, rank_offset=2), r, {"qkv": ["q", "k", "v"]}, "bfloat16")
    >>> [(link.source, link.dst_local(2)) for link in m.sources("qkv")]  # rank 2's buffer: q0 ‖ k0 ‖ v0
    [('q', ((0, 4), (0, 4))), ('k', ((4, 5), (0, 4))), ('v', ((5, 6), (0, 4)))]
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import LayoutError
from ..layout import Layout
from .names import NameMap, Rule
from .spec import Box, Weight, dtype_name

#: ``cast=``: None (dtypes must match), True (any), a dtype name, or {rollout name or pattern: dtype}.
Cast = bool | str | Mapping[str, str] | None


@dataclass(frozen=True)
class SegmentWeight(Weight):
    """A weight cut to ``window = (axis, start, full)``: indices ``[start, start + shape[axis])``
    of an axis of ``full`` elements, keeping the full weight's shard boundaries (a rank holds
    its full shard clipped to the window, in window coordinates). ``None``: the whole weight."""

    window: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None:
            axis, start, full = self.window
            if not (0 <= axis < len(self.shape) and 0 <= start and start + self.shape[axis] <= full):
                raise LayoutError(
                    f"weight {self.name!r}: window {self.window} does not fit shape {self.shape}"
                )

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.window))

    def __reduce__(self) -> tuple[object, ...]:
        p = dict(self.placements)
        return (
            SegmentWeight,
            (self.name, self.shape, self.dtype, p, self.stage, self.shard_order, self.window),
        )

    def full_weight(self) -> Weight:
        """The uncut weight (same placements)."""
        if self.window is None:
            return Weight(self.name, self.shape, self.dtype, self.placements, self.stage, self.shard_order)
        axis, _, full = self.window
        shape = (*self.shape[:axis], full, *self.shape[axis + 1 :])
        return Weight(self.name, shape, self.dtype, self.placements, self.stage, self.shard_order)

    def box_at(self, layout: Layout, coords: Mapping[str, int]) -> Box | None:
        box = self.full_weight().box_at(layout, coords)
        if box is None or self.window is None:
            return box
        axis, start, _ = self.window
        lo, hi = box[axis]
        lo, hi = max(lo - start, 0), min(hi - start, self.shape[axis])
        return None if hi <= lo else (*box[:axis], (lo, hi), *box[axis + 1 :])


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
        assert full is not None
        box = own if box is None else box
        shift = [0] * len(box)
        if self.axis is not None:
            shift[self.axis] = self.src_start
        return tuple((a + s - f0, b + s - f0) for (a, b), s, (f0, _) in zip(box, shift, full))

    def dst_local(self, rank: int, box: Box | None = None) -> Box | None:
        """``box`` (window coordinates; default: all ``rank`` gets of the link) as a box of
        ``rank``'s local rollout buffer of :attr:`rollout` (parts one after another along the
        axis, as vLLM holds them); ``None`` if it gets none."""
        own = self.dst.box(self.dst_layout, rank)
        if own is None:
            return None
        boxes = [p.box(self.dst_layout, rank) for p in self.parts]
        mine = boxes[self.part]
        assert mine is not None
        box = own if box is None else box
        out = []
        for a, (lo, hi) in enumerate(box):
            f0 = mine[a][0]
            if a == self.axis:  # the earlier parts' local extents come first
                before = sum(b[a][1] - b[a][0] for b in boxes[: self.part] if b is not None)
                out.append((before + self.offset + lo - f0, before + self.offset + hi - f0))
            else:
                out.append((lo - f0, hi - f0))
        return tuple(out)


@dataclass(frozen=True)
class Move:
    """One message of a mapped plan, resolved to the tensors it reads and writes.

    ``src_name`` is a trainer weight (``step`` 0: read ``src_local`` of the sender's local
    shard, cast to ``dtype`` when ``cast``) or, for a forward (``step`` 1), a rollout weight
    (read ``src_local`` of the forwarder's buffer, already in ``dtype``); ``dst_local`` is the
    slice of the receiver's buffer of rollout weight ``dst_name`` to write. ``nbytes``: in
    ``dtype``. ``box``: the message's box in the link's window coordinates."""

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
        """A plan :class:`~meshgroups.transfer.plan.Message` as a :class:`Move`."""
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
        )  # fmt: skip


def check_weights(
    src: Layout, src_weights: Sequence[Weight], dst: Layout, dst_weights: Sequence[Weight]
) -> None:
    """Both sides' layouts and weight lists are what planning needs: Layouts, sequences of
    Weight with unique names, placements on dims their layout has (``TypeError`` /
    ``LayoutError`` naming the offender)."""
    for what, layout, weights in (("src", src, src_weights), ("dst", dst, dst_weights)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{what} must be a meshgroups.Layout, got {layout!r}")
        if isinstance(weights, (str, bytes, Weight)) or not isinstance(weights, Sequence):
            raise TypeError(f"{what}_weights must be a sequence of Weight, got {weights!r}")
        seen: set[str] = set()
        for w in weights:
            if not isinstance(w, Weight):
                raise TypeError(f"{what}_weights must hold Weight objects, got {w!r}")
            if w.name in seen:
                raise LayoutError(
                    f"weight {w.name!r} is listed twice in {what}_weights; names must be unique"
                )
            seen.add(w.name)
            w.check(layout)


def map_weights(
    src: Layout,
    src_weights: Sequence[Weight],
    dst: Layout,
    dst_weights: Sequence[Weight],
    name_map: NameMap | Mapping[str, object] | None = None,
    cast: Cast = None,
    allow_unused: bool | Sequence[str] = False,
) -> Mapped:
    """Every rollout weight's links under ``name_map``, checked both ways.

    Args:
        name_map: rollout name -> rule (see :mod:`~meshgroups.transfer.names`); names it lacks
            mean the same-named trainer weight.
        cast: where a trainer dtype differs from the rollout's, a cast to the rollout's dtype is
            allowed by ``True``, by that dtype's name (``"bfloat16"``), or by
            ``{rollout name or fnmatch pattern: dtype}`` (first match); the wire dtype is
            always the rollout's (the sender casts).
        allow_unused: ``True`` or names/patterns of trainer weights that may go unused (listed
            on :attr:`Mapped.unused`).

    Raises:
        LayoutError: a rule names a trainer weight that does not exist, a segment outside its
            source, other axes that differ, parts that do not add up to the rollout's axis, a
            dtype mismatch no ``cast`` allows, a trainer weight (or rows of one) nothing reads.
        TypeError: an argument of the wrong kind.
    """
    check_weights(src, src_weights, dst, dst_weights)
    nm = NameMap.of(name_map)
    allowed_unused = _allow_patterns(allow_unused)
    _check_cast(cast)
    by_name = {w.name: w for w in src_weights}
    rollout_names = {w.name for w in dst_weights}
    links: list[Link] = []
    used: dict[str, list[tuple[int | None, int, int]]] = {}
    for rw in dst_weights:
        rule = nm.rule(rw.name)
        for seg in rule.segments:
            if seg.source not in by_name:
                raise LayoutError(_missing(rw.name, seg.source, rw.name in nm, by_name))
        if rule.is_rename:
            tw = by_name[rule.segments[0].source]
            if tw.shape != rw.shape:
                raise LayoutError(
                    f"rollout weight {rw.name!r} {rw.shape} is trainer weight {tw.name!r} {tw.shape}: "
                    "a rename needs the same shape (fuse or split with a rule along an axis)"
                )
            wire = _wire(cast, rw, tw)
            pair = (_seg(rw.name, tw, tw.dtype, None), _seg(rw.name, rw, wire, None))
            links.append(Link(rw.name, rw.name, tw.name, *pair, None, 0, (rw,), 0, 0, src, dst))
            used.setdefault(tw.name, []).append((None, 0, 0))
            continue
        links.extend(_links(rw, rule, by_name, cast, used, src, dst))
    for link in links:
        if link.name != link.rollout and link.name in rollout_names:
            raise LayoutError(f"link name {link.name!r} is also a rollout weight's name; rename that weight")
    return Mapped(links, _unused(src_weights, used, allowed_unused, allow_unused))


def _links(
    rw: Weight,
    rule: Rule,
    by_name: Mapping[str, Weight],
    cast: Cast,
    used: dict[str, list[tuple[int | None, int, int]]],
    src: Layout,
    dst: Layout,
) -> list[Link]:
    """The links of one rollout weight under a rule of segments along ``rule.axis``."""
    axis = rule.axis
    if axis >= len(rw.shape):
        raise LayoutError(f"name map, rollout weight {rw.name!r} {rw.shape}: axis {axis} is out of range")
    resolved: list[list[tuple[Weight, int, int]]] = []
    for part in rule.parts:
        rows = []
        for seg in part:
            tw = by_name[seg.source]
            other = [a for a in range(len(rw.shape)) if a != axis]
            if len(tw.shape) != len(rw.shape) or any(tw.shape[a] != rw.shape[a] for a in other):
                raise LayoutError(
                    f"name map, rollout weight {rw.name!r} {rw.shape}: trainer weight {tw.name!r} "
                    f"{tw.shape} must match it on every axis but {axis}"
                )
            stop = tw.shape[axis] if seg.stop is None else seg.stop
            if stop > tw.shape[axis]:
                raise LayoutError(
                    f"name map, rollout weight {rw.name!r}: segment [{seg.start}, {stop}) of trainer weight "
                    f"{tw.name!r} is outside its axis {axis} of {tw.shape[axis]}"
                )
            rows.append((tw, seg.start, stop))
        resolved.append(rows)
    total = sum(b - a for rows in resolved for _, a, b in rows)
    if total != rw.shape[axis]:
        sizes = " + ".join(f"{tw.name}[{a}:{b}]" for rows in resolved for tw, a, b in rows)
        raise LayoutError(
            f"name map, rollout weight {rw.name!r}: its segments must tile axis {axis} of {rw.shape[axis]} "
            f"exactly, but {sizes} = {total}"
        )
    # With sharding="whole" the concatenation is one part: the rollout shards it as one tensor.
    groups = [[(p, k, r) for k, r in enumerate(rows)] for p, rows in enumerate(resolved)]
    if rule.sharding == "whole":
        groups = [[row for g in groups for row in g]]
    extents = [sum(b - a for _, _, (_, a, b) in g) for g in groups]
    parts = tuple(
        Weight(rw.name, _with(rw.shape, axis, n), rw.dtype, rw.placements, rw.stage, rw.shard_order)
        for n in extents
    )
    out = []
    for gi, (g, extent) in enumerate(zip(groups, extents)):
        offset = 0
        for p, k, (tw, a, b) in g:
            name = f"{rw.name}[{p}.{k}]"
            n = b - a
            shape = _with(rw.shape, axis, n)
            s_win = None if (a, b) == (0, tw.shape[axis]) else (axis, a, tw.shape[axis])
            d_win = None if (offset, n) == (0, extent) else (axis, offset, extent)
            s = _seg(name, tw, tw.dtype, s_win, shape)
            d = _seg(name, rw, _wire(cast, rw, tw), d_win, shape)
            out.append(Link(name, rw.name, tw.name, s, d, axis, a, parts, gi, offset, src, dst))
            used.setdefault(tw.name, []).append((axis, a, b))
            offset += n
    return out


def _with(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], n, *shape[axis + 1 :])


def _seg(
    name: str,
    w: Weight,
    dtype: str,
    window: tuple[int, int, int] | None,
    shape: tuple[int, ...] | None = None,
) -> SegmentWeight:
    return SegmentWeight(name, shape or w.shape, dtype, w.placements, w.stage, w.shard_order, window)


def _check_cast(cast: Cast) -> None:
    if cast is None or isinstance(cast, bool):
        return
    if isinstance(cast, str):
        dtype_name(cast, "cast")
        return
    if isinstance(cast, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in cast.items()):
        for k, v in cast.items():
            dtype_name(v, k)
        return
    raise TypeError(
        f"cast must be None, True, a dtype name or {{rollout name or pattern: dtype}}, got {cast!r}"
    )


def _wire(cast: Cast, rw: Weight, tw: Weight) -> str:
    """The wire dtype of trainer weight ``tw`` going into rollout weight ``rw``: the rollout's,
    if the dtypes match or ``cast`` allows the cast."""
    if tw.dtype == rw.dtype or cast is True:
        return rw.dtype
    want: str | None = None
    if isinstance(cast, str):
        want = dtype_name(cast, "cast")
    elif isinstance(cast, Mapping):
        want = next((dtype_name(v) for k, v in cast.items() if k == rw.name), None) or next(
            (dtype_name(v) for k, v in cast.items() if fnmatch.fnmatchcase(rw.name, k)), None
        )
    if want == rw.dtype:
        return rw.dtype
    how = "no cast= allows it" if want is None else f"cast={cast!r} names {want} for it"
    raise LayoutError(
        f"rollout weight {rw.name!r} is {rw.dtype} but trainer weight {tw.name!r} is {tw.dtype}, and {how}; "
        f"pass cast={rw.dtype!r} (or cast=True) to cast at the sender"
    )


def _missing(rollout: str, source: str, explicit: bool, by_name: Mapping[str, Weight]) -> str:
    near = difflib.get_close_matches(source, list(by_name), n=3)
    hint = f" (close: {', '.join(near)})" if near else ""
    if explicit:
        return f"name map: rollout weight {rollout!r} reads trainer weight {source!r}, which the trainer lacks{hint}"
    return (
        f"rollout weight {rollout!r} has no rule in the name map and the trainer has no weight of that "
        f"name: nothing would write it{hint}"
    )


def _allow_patterns(allow: bool | Sequence[str]) -> tuple[str, ...]:
    if allow is True:
        return ("*",)
    if allow is False:
        return ()
    if (
        isinstance(allow, str)
        or not isinstance(allow, Sequence)
        or not all(isinstance(a, str) for a in allow)
    ):
        raise TypeError(f"allow_unused must be a bool or a sequence of names/patterns, got {allow!r}")
    return tuple(allow)


def _unused(
    src_weights: Sequence[Weight],
    used: Mapping[str, list[tuple[int | None, int, int]]],
    allowed: tuple[str, ...],
    allow: object,
) -> tuple[str, ...]:
    """Trainer weights (or ranges of one) no link reads; an error unless ``allowed``."""
    out: list[str] = []
    for tw in src_weights:
        uses = used.get(tw.name)
        if uses is None:
            out.append(tw.name)
            continue
        if any(axis is None for axis, _, _ in uses):
            continue
        axes = sorted({a for a, _, _ in uses if a is not None})
        gaps_by_axis = {a: _gaps(tw.shape[a], [(lo, hi) for ax, lo, hi in uses if ax == a]) for a in axes}
        if all(gaps_by_axis.values()):  # no one axis is covered whole
            axis, gaps = next(iter(gaps_by_axis.items()))
            out.extend(f"{tw.name}[axis {axis}: {lo}:{hi}]" for lo, hi in gaps)
    refused = [u for u in out if not any(fnmatch.fnmatchcase(u.split("[")[0], p) for p in allowed)]
    if refused:
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise LayoutError(
            f"trainer weights no rollout weight reads: {', '.join(refused[:8])}{more}; map them, or pass "
            f"allow_unused=True (or their names) to leave them (allow_unused={allow!r})"
        )
    return tuple(out)


def _gaps(n: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in sorted(ranges):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < n:
        out.append((at, n))
    return out


__all__ = ["Cast", "Link", "Mapped", "Move", "SegmentWeight", "check_weights", "map_weights"]
