"""Expanding a name map into links, with every check made before anything is planned.

:func:`map_weights` reads each rollout weight's rule (:class:`~meshgroups.transfer.NameMap`;
names the map lacks read the same-named trainer weight), resolves its segments against the
trainer's shapes and dtypes, and returns the links (:mod:`~meshgroups.transfer._names.mapped`). It
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
from functools import partial

from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.transfer._names.linking import Used, rule_links
from meshgroups.transfer._names.mapped import Link, Mapped, SegmentWeight
from meshgroups.transfer._names.names import NameMap
from meshgroups.transfer._names.quant import BlockFP8, quantized_links, scale_weights
from meshgroups.transfer._spec import Weight, dtype_name

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
    quantize: BlockFP8 | None = None,
) -> Mapped:
    """Every rollout weight's links under ``name_map``, checked both ways.

    Args:
        src, src_weights: the trainer's layout and weights.
        dst, dst_weights: the rollout's layout and weights (its dtypes are the wire dtypes).
        name_map: rollout name -> rule (see :class:`~meshgroups.transfer.NameMap`); names it lacks
            mean the same-named trainer weight.
        cast: where a trainer dtype differs from the rollout's, a cast to the rollout's dtype is
            allowed by ``True``, by that dtype's name (``"bfloat16"``), or by
            ``{rollout name or fnmatch pattern: dtype}`` (first match); the wire dtype is
            always the rollout's (the sender casts).
        allow_unused: ``True`` or names/patterns of trainer weights that may go unused (listed
            on :attr:`Mapped.unused`).
        quantize: ``BlockFP8()``: each ``float8_e4m3fn`` rollout weight is quantized in
            blocks at the sender (the cast to it is allowed), and its scale tensor
            ``<name>_scale_inv`` (listed among ``dst_weights``, no rule of its own) gets one
            scale link per link of the weight (:class:`~meshgroups.transfer.BlockFP8`).

    Returns:
        The :class:`Mapped` links (one per segment of every rollout weight), in plan order.

    Raises:
        LayoutError: a rule names a trainer weight that does not exist, a segment outside its
            source, other axes that differ, parts that do not add up to the rollout's axis, a
            dtype mismatch no ``cast`` allows, a trainer weight (or rows of one) nothing reads.
        TypeError: an argument of the wrong kind.

    A fused qkv on a tp=2 rollout, from three trainer weights::

        >>> from meshgroups import Layout
        >>> from meshgroups.transfer import Shard, Weight, map_weights
        >>> trainer = [Weight(name, (4, 8)) for name in ("q", "k", "v")]
        >>> rollout = [Weight("qkv", (12, 8), placements={"tp": Shard(0)})]
        >>> mapped = map_weights(Layout(dp=1), trainer, Layout(tp=2), rollout, name_map={"qkv": ["q", "k", "v"]})
        >>> [(link.name, link.source) for link in mapped.sources("qkv")]
        [('qkv[0.0]', 'q'), ('qkv[1.0]', 'k'), ('qkv[2.0]', 'v')]
    """
    check_weights(src, src_weights, dst, dst_weights)
    nm = NameMap.of(name_map)
    allowed_unused = _allow_patterns(allow_unused)
    _check_cast(cast)
    scales = scale_weights(dst_weights, quantize)
    for name in scales:
        if name in nm:
            raise LayoutError(
                f"name map: {name!r} is the block-fp8 scales of {scales[name].name!r}; the sender computes them, "
                "so it takes no rule"
            )
    cast = _with_fp8(cast, scales.values())
    by_name = {w.name: w for w in src_weights}
    rollout_names = {w.name for w in dst_weights}
    links: list[Link] = []
    used: Used = {}
    for rw in dst_weights:
        if rw.name in scales:  # derived below from its value tensor's links
            continue
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
            wire = wire_dtype(cast, rw, tw)
            pair = (_seg(rw.name, tw, tw.dtype, None), _seg(rw.name, rw, wire, None))
            links.append(Link(rw.name, rw.name, tw.name, *pair, None, 0, (rw,), 0, 0, src, dst))
            used.setdefault(tw.name, []).append((None, 0, 0, None))
            continue
        links.extend(rule_links(rw, rule, by_name, partial(wire_dtype, cast), used, src, dst))
    if quantize is not None and scales:
        links = quantized_links(links, scales, dst_weights, quantize)
    for link in links:
        if link.name != link.rollout and link.name in rollout_names:
            raise LayoutError(f"link name {link.name!r} is also a rollout weight's name; rename that weight")
    return Mapped(
        links, _unused(src_weights, used, allowed_unused, allow_unused, _redirected(dst_weights, nm))
    )


def _seg(
    name: str,
    w: Weight,
    dtype: str,
    window: tuple[int, int, int] | None,
    shape: tuple[int, ...] | None = None,
) -> SegmentWeight:
    return SegmentWeight(name, shape or w.shape, dtype, w.placements, w.stage, w.shard_order, window)


def _with_fp8(cast: Cast, fp8: object) -> Cast:
    """``cast`` that also allows the cast into each block-fp8 rollout weight (by exact name)."""
    names = {w.name: w.dtype for w in fp8}  # type: ignore[attr-defined]
    if not names or cast is True:
        return cast
    if cast is None:
        return names
    if isinstance(cast, str):
        return {**names, "*": cast}
    return {**names, **cast}  # type: ignore[dict-item]


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


def wire_dtype(cast: Cast, rw: Weight, tw: Weight) -> str:
    """The wire dtype of trainer weight ``tw`` going into rollout weight ``rw``: the rollout's,
    if the dtypes match or ``cast`` allows the cast.

    Args:
        cast: as :func:`map_weights`' ``cast``.
        rw, tw: the rollout and the trainer weight.

    Returns:
        The rollout's dtype name.

    Raises:
        LayoutError: a dtype change ``cast`` does not allow, naming both weights.

    >>> wire_dtype("bfloat16", Weight("w", (2,), "bfloat16"), Weight("w", (2,)))
    'bfloat16'
    """
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


def _redirected(dst_weights: Sequence[Weight], nm: NameMap) -> dict[str, tuple[str, ...]]:
    """Rollout weights the map makes read trainer weights of *other* names: ``{name: sources}``
    (a tied head reading the embedding)."""
    out: dict[str, tuple[str, ...]] = {}
    for rw in dst_weights:
        if rw.name in nm:
            sources = nm.rule(rw.name).sources
            if rw.name not in sources:
                out[rw.name] = tuple(sources)
    return out


def _unused(
    src_weights: Sequence[Weight],
    used: Used,
    allowed: tuple[str, ...],
    allow: object,
    redirected: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[str, ...]:
    """Trainer weights (or ranges of one) no link reads; an error unless ``allowed``. A weight
    read expert by expert (segments with ``index``) is checked per expert."""
    out: list[str] = []
    for tw in src_weights:
        uses = used.get(tw.name)
        if uses is None:
            out.append(tw.name)
            continue
        if any(axis is None for axis, _, _, _ in uses):
            continue
        indexed = {i for *_, i in uses if i is not None}
        if not indexed:
            out.extend(_range_gaps(tw.name, tw.shape, [(a, lo, hi) for a, lo, hi, _ in uses]))
            continue
        for i in range(tw.shape[0]):
            mine = [(a, lo, hi) for a, lo, hi, j in uses if j == i]
            if not mine:
                out.append(f"{tw.name}[index {i}]")
            else:
                out.extend(_range_gaps(f"{tw.name}[index {i}]", tw.shape, mine))
    refused = [u for u in out if not any(fnmatch.fnmatchcase(u.split("[")[0], p) for p in allowed)]
    shadowed = [u for u in refused if u in (redirected or {})]
    if shadowed:  # allow_unused would hide the trainer's own weight behind another one
        name = shadowed[0]
        raise LayoutError(
            f"trainer weight {name!r} is unused because the name map makes rollout weight {name!r} read "
            f"{list((redirected or {})[name])} instead (a tie the trainer does not have): drop that rule so {name!r} "
            "reads the trainer's own weight (for hf_to_vllm: tied_head=False when config.tie_word_embeddings is "
            "False); allow_unused=True would serve the other weight in its place"
        )
    if refused:
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise LayoutError(
            f"trainer weights no rollout weight reads: {', '.join(refused[:8])}{more}; map them, or pass "
            f"allow_unused=True (or their names) to leave them (allow_unused={allow!r})"
        )
    return tuple(out)


def _range_gaps(name: str, shape: tuple[int, ...], uses: list[tuple[int | None, int, int]]) -> list[str]:
    """``name[axis a: lo:hi]`` for the gaps, unless one axis is covered whole."""
    axes = sorted({a for a, _, _ in uses if a is not None})
    gaps_by_axis = {a: _gaps(shape[a], [(lo, hi) for ax, lo, hi in uses if ax == a]) for a in axes}
    if gaps_by_axis and all(gaps_by_axis.values()):  # no one axis is covered whole
        axis, gaps = next(iter(gaps_by_axis.items()))
        return [f"{name}[axis {axis}: {lo}:{hi}]" for lo, hi in gaps]
    return []


def _gaps(n: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in sorted(ranges):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < n:
        out.append((at, n))
    return out


__all__ = ["Cast", "check_weights", "map_weights", "wire_dtype"]
