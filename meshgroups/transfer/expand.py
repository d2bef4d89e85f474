"""Expanding a name map into links, with every check made before anything is planned.

:func:`map_weights` reads each rollout weight's rule (:mod:`~meshgroups.transfer.names`;
names the map lacks read the same-named trainer weight), resolves its segments against the
trainer's shapes and dtypes, and returns the links (:mod:`~meshgroups.transfer.mapped`). It
refuses, naming the weights and the rule: a trainer name that does not exist, a rollout weight
nothing writes, a segment outside its source, other axes that differ, segments that do not
tile the rollout's axis exactly, a dtype change no ``cast`` allows, and trainer weights (or
ranges of one) no rollout weight reads unless ``allow_unused`` lets them be::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Weight
    >>> t = [Weight("q", (4, 2)), Weight("k", (2, 2))]
    >>> try:
    ...     map_weights(Layout(tp=1), t, Layout(tp=1), [Weight("q", (4, 2))])
    ... except ValueError as exc:
    ...     print(str(exc)[:50])
    trainer weights no rollout weight reads: k; map th
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence

from meshgroups.errors import LayoutError
from meshgroups.layout.core import Layout
from meshgroups.transfer.mapped import Link, Mapped, SegmentWeight
from meshgroups.transfer.names import NameMap, Rule
from meshgroups.transfer.spec import Weight, dtype_name

#: ``cast=``: None (dtypes must match), True (any), a dtype name, or {rollout name or pattern: dtype}.
Cast = bool | str | Mapping[str, str] | None


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
        src, src_weights: the trainer's layout and weights.
        dst, dst_weights: the rollout's layout and weights (its dtypes are the wire dtypes).
        name_map: rollout name -> rule (see :mod:`~meshgroups.transfer.names`); names it lacks
            mean the same-named trainer weight.
        cast: where a trainer dtype differs from the rollout's, a cast to the rollout's dtype is
            allowed by ``True``, by that dtype's name (``"bfloat16"``), or by
            ``{rollout name or fnmatch pattern: dtype}`` (first match); the wire dtype is
            always the rollout's (the sender casts).
        allow_unused: ``True`` or names/patterns of trainer weights that may go unused (listed
            on :attr:`Mapped.unused`).

    Returns:
        The :class:`Mapped` links (one per segment of every rollout weight), in plan order.

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


__all__ = ["Cast", "check_weights", "map_weights"]
