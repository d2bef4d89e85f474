"""One rollout weight's links under a rule or a stack: segments resolved against the trainer's
shapes, sources seen through their views (an expert of a packed tensor, a transpose, a new
stacking axis), every check made before anything is planned.

Each link pairs two :class:`~meshgroups.transfer._names.mapped.SegmentWeight` s of one shape in the
link's axes: the trainer weight *as a view* (its shape and ``Shard`` axes permuted into the
link's axes, cut by windows: the segment's range, the expert ``index``) and the rollout weight's
part cut to where the segment lands (the stack position, the offset inside the part). A view
only renames axes, so a rank's box of it is its shard's box permuted: the planner moves each
trainer piece straight to its place and its byte bound holds unchanged::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight
    >>> from meshgroups.transfer import Stack
    >>> t = [Weight(f"e{e}.{p}", (4, 8), placements={"tp": Shard(0)}) for e in range(2) for p in ("gate", "up")]
    >>> rw = Weight("w13", (2, 8, 8), placements={"tp": Shard(1)})
    >>> stack = Stack.of({"stack": [["e0.gate", "e0.up"], ["e1.gate", "e1.up"]]})
    >>> same = lambda rw, tw: rw.dtype  # the rollout's dtype on the wire
    >>> links = rule_links(rw, stack, {w.name: w for w in t}, same, {}, Layout(tp=2), Layout(tp=2, rank_offset=2))
    >>> [(ln.source, ln.src.shape, ln.dst_local(3)) for ln in links][:2]
    [('e0.gate', (1, 4, 8), ((0, 1), (0, 2), (0, 8))), ('e0.up', (1, 4, 8), ((0, 1), (2, 4), (0, 8)))]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.transfer._names.mapped import Link, SegmentWeight, Window
from meshgroups.transfer._names.rules import Rule, Segment
from meshgroups.transfer._names.stacking import Stack
from meshgroups.transfer._spec import Placement, Shard, Weight

#: Where each segment reads its trainer weight: ``{name: [(axis, start, stop, index), ...]}``
#: in the trainer weight's own axes (``axis None``: all of it; ``index``: one expert of axis 0).
Used = dict[str, list[tuple[int | None, int, int, int | None]]]


def _view(rollout: str, seg: Segment, tw: Weight, stacked: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The segment's view of ``tw``: its shape, and per view axis the axis of ``tw``."""
    shape, axes = list(tw.shape), list(range(len(tw.shape)))
    if seg.index is not None:
        if not stacked:
            raise LayoutError(
                f"name map, rollout weight {rollout!r}: segment of {tw.name!r} has index={seg.index}, "
                "which reads one entry of a packed tensor: only inside a stack ({'stack': [...]})"
            )
        if not shape or seg.index >= shape[0]:
            raise LayoutError(
                f"name map, rollout weight {rollout!r}: index {seg.index} is outside axis 0 of trainer "
                f"weight {tw.name!r} {tw.shape}"
            )
        shape, axes = shape[1:], axes[1:]
    if seg.transpose:
        if len(shape) < 2:
            raise LayoutError(
                f"name map, rollout weight {rollout!r}: transpose of {tw.name!r} needs 2 axes to swap, "
                f"its view has shape {tuple(shape)}"
            )
        shape[-2:], axes[-2:] = shape[:-3:-1], axes[:-3:-1]
    return tuple(shape), tuple(axes)


def _in_link_axes(name: str, tw: Weight, axes: tuple[int | None, ...], shape: tuple[int, ...],
                  windows: tuple[Window, ...]) -> SegmentWeight:  # fmt: skip
    """``tw`` as a weight in the link's axes: placements' ``Shard`` axes renamed, cut by
    ``windows`` (a rank's box is its shard's box, permuted)."""
    placements: dict[str, Placement] = {}
    for dim, p in tw.placements.items():
        placements[dim] = Shard(axes.index(p.axis)) if isinstance(p, Shard) else p
    return SegmentWeight(name, shape, tw.dtype, placements, tw.stage, tw.shard_order, windows or None)


def rule_links(
    rw: Weight,
    rule: Rule | Stack,
    by_name: Mapping[str, Weight],
    wire: Callable[[Weight, Weight], str],
    used: Used,
    src: Layout,
    dst: Layout,
) -> list[Link]:
    """The links of rollout weight ``rw`` under ``rule`` (segments along ``rule.axis``; a
    :class:`~meshgroups.transfer.Stack` adds axis 0), recording in ``used`` what each
    reads.

    Args:
        rw: the rollout weight.
        rule: its rule (not a plain rename) or stack.
        by_name: the trainer's weights by name (every source is in it).
        wire: the wire dtype of a trainer weight going into ``rw``, ``wire(rw, trainer weight)``
            (``expand.wire_dtype`` under ``map_weights``' ``cast``: the one place casts are
            read, handed in so this module needs nothing of the one that calls it).
        used: filled with what each segment reads (for the coverage check).
        src, dst: the trainer's and the rollout's layouts.

    Returns:
        The links, in order: stack position, part, segment.

    Raises:
        LayoutError: an axis out of range, a stack whose length is not ``rw``'s axis 0, a view
            or segment that does not fit its source, other axes that differ, segments that do
            not tile the axis, entries whose parts differ in size — naming the rollout weight,
            the trainer weight and the rule; and what ``wire`` raises (a dtype change no cast
            allows).
    """

    stacked = isinstance(rule, Stack)
    entries: tuple[Rule, ...] = rule.entries if isinstance(rule, Stack) else (rule,)
    lead = 1 if stacked else 0
    if stacked and (not rw.shape or rw.shape[0] != len(entries)):
        raise LayoutError(
            f"name map, rollout weight {rw.name!r} {rw.shape}: a stack of {len(entries)} entries needs axis 0 "
            f"of {len(entries)}"
        )
    inner = rw.shape[lead:]
    axis_in = entries[0].axis
    if axis_in >= len(inner):
        raise LayoutError(
            f"name map, rollout weight {rw.name!r} {rw.shape}: axis {axis_in + lead} is out of range"
        )
    axis = axis_in + lead
    resolved = [
        _resolve(rw, e, p if stacked else None, by_name, stacked, inner, axis_in)
        for p, e in enumerate(entries)
    ]
    grouped = [_groups(r, entries[0].sharding) for r in resolved]
    extents = [sum(row[5] - row[4] for _, _, row in g) for g in grouped[0]]
    for p, groups in enumerate(grouped):
        got = [sum(row[5] - row[4] for _, _, row in g) for g in groups]
        if got != extents:
            raise LayoutError(
                f"name map, rollout weight {rw.name!r}: stack entry {p} has parts of {got} along axis {axis}, "
                f"entry 0 of {extents}; every entry's parts must have the same sizes"
            )
    parts = tuple(
        Weight(rw.name, _with(rw.shape, axis, n), rw.dtype, rw.placements, rw.stage, rw.shard_order)
        for n in extents
    )
    out = []
    for p, groups in enumerate(grouped):
        for gi, (g, extent) in enumerate(zip(groups, extents)):
            offset = 0
            for pi, k, (seg, tw, vshape, vaxes, a, b) in g:
                name = f"{rw.name}[{p}|{pi}.{k}]" if stacked else f"{rw.name}[{pi}.{k}]"
                n = b - a
                shape = _with(rw.shape, axis, n)
                s_cuts: list[Window] = []
                d_cuts: list[Window] = []
                if stacked:
                    shape = (1, *shape[1:])
                    link_axes: tuple[int | None, ...] = (0 if seg.index is not None else None, *vaxes)
                    d_cuts.append((0, p, len(entries)))
                    if seg.index is not None:
                        s_cuts.append((0, seg.index, tw.shape[0]))
                else:
                    link_axes = vaxes
                if (a, b) != (0, vshape[axis_in]):
                    s_cuts.append((axis, a, vshape[axis_in]))
                if (offset, n) != (0, extent):
                    d_cuts.append((axis, offset, extent))
                s = _in_link_axes(name, tw, link_axes, shape, tuple(s_cuts))
                d = SegmentWeight(name, shape, wire(rw, tw), rw.placements, rw.stage, rw.shard_order,
                                  tuple(d_cuts) or None)  # fmt: skip
                axes = None if link_axes == tuple(range(len(tw.shape))) else link_axes
                out.append(Link(name, rw.name, tw.name, s, d, axis, a, parts, gi, offset, src, dst, axes))
                used.setdefault(tw.name, []).append((vaxes[axis_in], a, b, seg.index))
                offset += n
    return out


Row = tuple[Segment, Weight, tuple[int, ...], tuple[int, ...], int, int]


def _resolve(
    rw: Weight,
    rule: Rule,
    position: int | None,
    by_name: Mapping[str, Weight],
    stacked: bool,
    inner: tuple[int, ...],
    axis: int,
) -> list[list[Row]]:
    """Each segment of ``rule`` (one stack entry) against its source's view, checked."""
    where = f"rollout weight {rw.name!r}" + (f", stack entry {position}" if position is not None else "")
    out = []
    for part in rule.parts:
        rows = []
        for seg in part:
            tw = by_name[seg.source]
            vshape, vaxes = _view(rw.name, seg, tw, stacked)
            other = [a for a in range(len(inner)) if a != axis]
            if len(vshape) != len(inner) or any(vshape[a] != inner[a] for a in other):
                seen = f" (seen as {vshape})" if seg.viewed else ""
                it = "it" if not stacked else f"its entries {inner}"
                raise LayoutError(
                    f"name map, {where} {rw.shape}: trainer weight {tw.name!r} {tw.shape}{seen} must match "
                    f"{it} on every axis but {axis}"
                )
            stop = vshape[axis] if seg.stop is None else seg.stop
            if stop > vshape[axis]:
                raise LayoutError(
                    f"name map, {where}: segment [{seg.start}, {stop}) of trainer weight {tw.name!r} is outside "
                    f"its axis {axis + (1 if stacked else 0)} of {vshape[axis]}"
                )
            rows.append((seg, tw, vshape, vaxes, seg.start, stop))
        out.append(rows)
    total = sum(r[5] - r[4] for rows in out for r in rows)
    if total != inner[axis]:
        sizes = " + ".join(f"{r[1].name}[{r[4]}:{r[5]}]" for rows in out for r in rows)
        raise LayoutError(
            f"name map, {where}: its segments must tile axis {axis + (1 if stacked else 0)} of {inner[axis]} "
            f"exactly, but {sizes} = {total}"
        )
    return out


def _groups(resolved: Sequence[Sequence[Row]], sharding: str) -> list[list[tuple[int, int, Row]]]:
    """Rows by rollout part: one group per rule part, or one for all (``"whole"``)."""
    groups = [[(p, k, r) for k, r in enumerate(rows)] for p, rows in enumerate(resolved)]
    if sharding == "whole":  # the concatenation is one part: the rollout shards it as one tensor
        groups = [[row for g in groups for row in g]]
    return groups


def _with(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], n, *shape[axis + 1 :])


__all__ = ["Used", "rule_links"]
