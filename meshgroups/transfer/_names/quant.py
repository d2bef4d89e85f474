"""Block-fp8 destinations: the scale tensors planned as destinations, cut on block boundaries.

A rollout weight of dtype ``float8_e4m3fn`` under ``quantize=BlockFP8()`` is served as
DeepSeek-V3's and vLLM's block fp8: values, and a float32 ``<name>_scale_inv`` of shape
``[..., ⌈rows/128⌉, ⌈cols/128⌉]`` (one scale per 128 × 128 block of the last two axes of the
rollout's full tensor). The sender quantizes: for each link (one segment of one rollout weight)
the plan also gets a *scale link*, the same segment counted in blocks, from the same trainer
shard into the scale tensor's place — so the scales are planned destinations like any other
(coverage checked exactly once, bytes counted). For a sender to quantize alone, every block
must lie whole inside one trainer shard and one link: segment starts, part starts and the shard
boundaries of both sides must fall on block boundaries (refused otherwise, naming the weight,
the axis and the boundary)::

    >>> from meshgroups import Layout
    >>> from meshgroups.transfer import Shard, Weight, plan_transfer
    >>> t = [Weight("w", (256, 256), "float32", {"tp": Shard(0)})]
    >>> r = [Weight("w", (256, 256), "float8_e4m3fn", {"tp": Shard(0)}),
    ...      Weight("w_scale_inv", (2, 2), "float32", {"tp": Shard(0)})]
    >>> plan = plan_transfer(Layout(tp=2), t, Layout(tp=2, rank_offset=2), r, cast=True, quantize=BlockFP8())
    >>> sorted((m.dst_name, m.dst_local) for m in plan.moves(2))
    [('w', ((0, 128), (0, 256))), ('w_scale_inv', ((0, 1), (0, 2)))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshgroups._checks import is_int
from meshgroups.errors import LayoutError
from meshgroups.layout import Layout
from meshgroups.transfer._names.mapped import Link, SegmentWeight, Window, windows_of
from meshgroups.transfer._spec import Weight, intervals

#: The fp8 dtype block quantization writes.
FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class BlockFP8:
    """Block-fp8 destinations: a ``float8_e4m3fn`` rollout weight is served as its values and a
    float32 ``<name>_scale_inv`` (one scale per block of its last two axes), quantized at the
    sender; every block must lie whole inside one trainer shard and one link (``docs/moe-fp8.md``).

    Args:
        block: the block's rows and columns (the last two axes).
        suffix: the scale tensor's name is the value tensor's plus this.

    Raises:
        LayoutError: a block size below 1, an empty suffix.

    >>> BlockFP8().scale_name("model.layers.0.mlp.experts.w13_weight")
    'model.layers.0.mlp.experts.w13_weight_scale_inv'
    """

    block: tuple[int, int] = (128, 128)
    suffix: str = "_scale_inv"

    def __post_init__(self) -> None:
        b = self.block
        if not (isinstance(b, tuple) and len(b) == 2 and all(is_int(x) and x >= 1 for x in b)):
            raise LayoutError(f"BlockFP8 block={b!r} must be two ints >= 1 (rows, cols)")
        if not isinstance(self.suffix, str) or not self.suffix:
            raise LayoutError(f"BlockFP8 suffix={self.suffix!r} must be a non-empty str")

    def scale_name(self, name: str) -> str:
        """The scale tensor of value tensor ``name``."""
        return name + self.suffix

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` counted in blocks on its last two axes."""
        if len(shape) < 2:
            raise LayoutError(f"block fp8 needs a tensor of 2 or more axes, got shape {shape}")
        return (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], self.block)))


def scale_weights(dst_weights: Sequence[Weight], quantize: BlockFP8 | None) -> dict[str, Weight]:
    """``{scale tensor name: its value weight}`` for every fp8 rollout weight; checks that each
    scale tensor is listed, float32, of the blocked shape.

    Raises:
        LayoutError: a missing scale tensor, a wrong shape or dtype, a wrong ``quantize``.
    """
    if quantize is None:
        return {}
    if not isinstance(quantize, BlockFP8):
        raise TypeError(f"quantize must be a BlockFP8 or None, got {quantize!r}")
    by_name = {w.name: w for w in dst_weights}
    out = {}
    for w in dst_weights:
        if w.dtype != FP8:
            continue
        name = quantize.scale_name(w.name)
        want = quantize.scale_shape(w.shape)
        s = by_name.get(name)
        if s is None:
            raise LayoutError(
                f"rollout weight {w.name!r} is {FP8} under quantize={quantize}: list its scales {name!r} "
                f"(float32, shape {want}) among the rollout weights"
            )
        if s.shape != want or s.dtype != "float32":
            raise LayoutError(
                f"scales {name!r} of {w.name!r} {w.shape} must be float32 of shape {want} "
                f"(blocks of {quantize.block}), got {s.dtype} {s.shape}"
            )
        out[name] = w
    return out


def quantized_links(
    links: Sequence[Link], scales: Mapping[str, Weight], dst_weights: Sequence[Weight], quantize: BlockFP8
) -> list[Link]:
    """Every link, fp8 value links marked, each followed by its scale link (see the module
    docstring); block alignment checked on both sides."""
    by_name = {w.name: w for w in dst_weights}
    value_of = {v.name: s for s, v in scales.items()}
    out: list[Link] = []
    for link in links:
        scale_name = value_of.get(link.rollout)
        if scale_name is None:
            out.append(link)
            continue
        block = quantize.block
        _check_aligned(link, block)
        sw = by_name[scale_name]
        parts = tuple(
            replace(_blocked(p, block), name=sw.name, dtype="float32", placements=sw.placements)
            for p in link.parts
        )
        rollout_shape = by_name[link.rollout].shape
        for k, (p, vp) in enumerate(zip(parts, link.parts)):
            before = sum(q.shape[link.axis] for q in link.parts[:k]) if link.axis is not None else 0
            where = _Where("rollout", link.rollout, rollout_shape, link.axis, before, k, len(link.parts))
            _check_scale_tiling(where, vp, p, link.dst_layout, block)
        src = _blocked(link.src, block)
        full = link.src.full_weight()
        where = _Where("trainer", link.source, full.shape, None, 0, 0, 1)
        _check_scale_tiling(where, full, src.full_weight(), link.src_layout, block)
        name = f"{link.name}{quantize.suffix}"
        src = replace(src, name=name, dtype="float32")
        dst = replace(_blocked(link.dst, block), name=name, dtype="float32", placements=sw.placements,
                      stage=sw.stage, shard_order=sw.shard_order)  # fmt: skip
        nd = len(link.dst.shape)
        offset = link.offset // {nd - 2: block[0], nd - 1: block[1]}.get(
            link.axis if link.axis is not None else -1, 1
        )
        out.append(replace(link, scale=(block, None)))
        out.append(
            replace(
                link,
                name=name,
                rollout=sw.name,
                src=src,
                dst=dst,
                parts=parts,
                offset=offset,
                src_start=link.src_start,
                scale=(block, link.name),
            )
        )
    return out


def _blocked(w: Weight, block: tuple[int, int]) -> SegmentWeight:
    """``w`` counted in blocks on its last two axes (windows too: their starts are aligned)."""
    nd = len(w.shape)
    b = {nd - 2: block[0], nd - 1: block[1]}
    shape = tuple(-(-n // b[a]) if a in b else n for a, n in enumerate(w.shape))
    cuts: list[Window] = []
    for a, start, full in windows_of(w):
        cuts.append((a, start // b[a], -(-full // b[a])) if a in b else (a, start, full))
    return SegmentWeight(w.name, shape, w.dtype, w.placements, w.stage, w.shard_order, tuple(cuts) or None)


def _check_aligned(link: Link, block: tuple[int, int]) -> None:
    """Every block of the link lies in one trainer shard and starts where a rollout block does."""
    nd = len(link.dst.shape)
    if nd < 2:
        raise LayoutError(
            f"rollout weight {link.rollout!r}: block fp8 needs 2 or more axes, got {link.dst.shape}"
        )
    for a, b in ((nd - 2, block[0]), (nd - 1, block[1])):
        for side, w in (
            ("trainer weight " + repr(link.source), link.src),
            ("rollout weight " + repr(link.rollout), link.dst),
        ):
            start = w.starts()[a] if isinstance(w, SegmentWeight) else 0
            if start % b:
                raise LayoutError(
                    f"block fp8 of {link.rollout!r}: {side} is cut at {start} on axis {a}, not a multiple of the "
                    f"block {b}; every block must come whole from one trainer weight"
                )
        if a == link.axis and link.part:
            before = sum(p.shape[a] for p in link.parts[: link.part])
            if before % b:
                raise LayoutError(
                    f"block fp8 of {link.rollout!r}: part {link.part} starts at {before} on axis {a}, not a "
                    f"multiple of the block {b}"
                )


@dataclass(frozen=True)
class _Where:
    """Whose tensor a tiling check looks at, in the user's terms: the side (``"trainer"`` or
    ``"rollout"``), the weight's name and full shape, and for a fused rollout weight whose parts
    are sharded separately (vLLM's ``w13_weight`` = gate ‖ up) the part and where it starts."""

    side: str
    name: str
    shape: tuple[int, ...]
    axis: int | None  # the fused axis (parts lie along it)
    offset: int  # where this part starts on it
    part: int
    parts: int


def _shard_refusal(
    where: _Where, a: int, lo: int, hi: int, n: int, b: int, dims: list[str], coords: list[int]
) -> str:
    """The refusal of a shard that cuts a block, in the caller's shapes: the full weight's
    indices on its axis, the side and the dims whose shard it is."""
    off = where.offset if a == where.axis else 0
    owner = " × ".join(dims) or "no dim"
    at = ", ".join(f"{d}={c}" for d, c in zip(dims, coords))
    part = ""
    if where.parts > 1 and a == where.axis:
        part = (
            f" (in its part {where.part} of {where.parts}, [{off}, {off + n}), each part sharded on its own)"
        )
    return (
        f"block fp8 of {where.side} weight {where.name!r} {where.shape}: the {where.side}'s shard over "
        f"{owner} at {at} holds [{lo + off}, {hi + off}) of axis {a} (of {where.shape[a]}){part}, which does "
        f"not begin and end on blocks of {b}; shard it in multiples of {b} (or keep it bfloat16)"
    )


def _check_scale_tiling(
    where: _Where, value: Weight, scale: Weight, layout: Layout, block: tuple[int, int]
) -> None:
    """On the blocked axes, every shard of ``value`` starts on a block boundary and ends on one
    (or at the axis' end), and ``scale``'s shards are exactly its blocks."""
    nd = len(value.shape)
    sizes = dict(zip(layout.names, layout.shape))
    name = where.name
    v_dims, s_dims = value.shard_dims(layout), scale.shard_dims(layout)
    for a, b in ((nd - 2, block[0]), (nd - 1, block[1])):
        n = value.shape[a]
        v = intervals(n, tuple(sizes[d] for d in v_dims[a]))
        s = intervals(scale.shape[a], tuple(sizes[d] for d in s_dims[a]))
        bad = (v[:, 1] > v[:, 0]) & ((v[:, 0] % b != 0) | ((v[:, 1] % b != 0) & (v[:, 1] != n)))
        if bad.any():
            i = int(np.argmax(bad))
            lo, hi = v[i].tolist()
            dims = list(v_dims[a])
            coords = [int(c) for c in np.unravel_index(i, [sizes[d] for d in dims])] if dims else []
            raise LayoutError(_shard_refusal(where, a, lo, hi, n, b, dims, coords))
        want = np.stack([v[:, 0] // b, -(-v[:, 1] // b)], axis=1)
        want[v[:, 1] <= v[:, 0]] = 0
        got = s.copy()
        got[s[:, 1] <= s[:, 0]] = 0
        if v_dims[a] != s_dims[a] or not np.array_equal(want, got):
            raise LayoutError(
                f"block fp8 of {name!r}: its scales are sharded over {s_dims[a]} on axis {a}, the values over "
                f"{v_dims[a]}: each rank's scales must be the blocks of its values (shard them alike)"
            )


__all__ = ["FP8", "BlockFP8", "quantized_links", "scale_weights"]
