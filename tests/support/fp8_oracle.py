"""A brute force for block-fp8 plans (torch on one process): a reference quantizer applied to
each rollout weight's full tensor, against the plan's moves run on per-rank tensors where each
sender quantizes its own link views with the library's quantizer.

The reference is written here from the format alone (per block of the last two axes: ``amax``
of magnitudes, at least ``1e-4``, over 448 is ``scale_inv``; values ``clamp(x / scale_inv,
-448, 448)`` cast to float8_e4m3fn), a loop over blocks, sharing no code with
``meshgroups.transfer._run.fp8``. The cross-node bytes are checked against a lower bound computed
here from ids (per node: needed rollout elements and block scales whose trainer data no rank
of the node holds).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from meshgroups import Layout
from meshgroups.transfer import NameMap, TransferPlan, Weight
from meshgroups.transfer._names.mapped import view_source
from meshgroups.transfer._names.quant import BlockFP8
from meshgroups.transfer._run.fp8 import quantize_blocks

from .moe_oracle import expected as moe_expected
from .moe_oracle import full_ids, rule_parts


def reference_quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-fp8 of the full tensor ``x`` (float32), block by block."""
    rows, cols = x.shape[-2:]
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    lead = x.shape[:-2]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((*lead, nr, nc), dtype=torch.float32)
    for idx in itertools.product(*(range(n) for n in lead)):
        for i in range(nr):
            for j in range(nc):
                blk = x[idx][i * br : (i + 1) * br, j * bc : (j + 1) * bc].to(torch.float32)
                scale = max(float(blk.abs().max()), 1e-4)
                sc = torch.tensor(scale, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
                s[idx][i, j] = sc
                q[idx][i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (
                    (blk / sc).clamp(-448, 448).to(torch.float8_e4m3fn)
                )
    return q, s


def _cut(box: tuple[tuple[int, int], ...] | None) -> tuple[slice, ...]:
    assert box is not None
    return tuple(slice(a, b) for a, b in box)


def _local(
    parts: list[tuple[Weight, torch.Tensor]], layout: Layout, rank: int, axis: int
) -> torch.Tensor | None:
    got = [t[_cut(b)] for pw, t in parts if (b := pw.box(layout, rank)) is not None]
    return torch.cat(got, dim=axis) if got else None


def expected_fp8(
    sws: list[Weight], full: dict[str, torch.Tensor], dst: Layout, dws: list[Weight], nm: NameMap, q: BlockFP8
) -> dict[tuple[str, int], torch.Tensor]:
    """Each rollout rank's buffers: fp8 weights (and their scales) from the reference quantizer
    on the full rollout tensor; others cast from it."""
    ids = full_ids(sws)
    flat = torch.cat([full[w.name].flatten() for w in sws])
    by_name = {w.name: w for w in dws}
    out: dict[tuple[str, int], torch.Tensor] = {}
    for rw in dws:
        if rw.name.endswith(q.suffix) and rw.name[: -len(q.suffix)] in by_name:
            continue
        rule = nm.rule(rw.name)
        if rule.is_rename:
            pieces, axis = [ids[rule.segments[0].source]], 0
        else:
            pieces, axis = rule_parts(ids, rule)
        groups = pieces if rule.sharding == "per_part" else [np.concatenate(pieces, axis=axis)]
        values = [flat[torch.from_numpy(g)] for g in groups]
        whole = torch.cat(values, dim=axis)
        if rw.dtype == "float8_e4m3fn":
            qv, sv = reference_quantize(whole, q.block)
            sw = by_name[q.scale_name(rw.name)]
            nd = len(rw.shape)
            b_axis = {nd - 2: q.block[0], nd - 1: q.block[1]}.get(axis, 1)
            at, v_parts, s_parts = 0, [], []
            for g in groups:
                n = g.shape[axis]
                shape = (*rw.shape[:axis], n, *rw.shape[axis + 1 :])
                pw = Weight(rw.name, shape, rw.dtype, rw.placements, rw.stage, rw.shard_order)
                s_shape = q.scale_shape(shape)
                spw = Weight(sw.name, s_shape, "float32", sw.placements, sw.stage, sw.shard_order)
                v_parts.append((pw, qv.narrow(axis, at, n)))
                s_parts.append((spw, sv.narrow(axis, at // b_axis, s_shape[axis])))
                at += n
            for r in dst.grid.ravel().tolist():
                if (v := _local(v_parts, dst, r, axis)) is not None:
                    out[(rw.name, r)] = v
                if (s := _local(s_parts, dst, r, axis)) is not None:
                    out[(sw.name, r)] = s
        else:
            at, parts = 0, []
            for g, v in zip(groups, values):
                n = g.shape[axis]
                shape = (*rw.shape[:axis], n, *rw.shape[axis + 1 :])
                parts.append(
                    (Weight(rw.name, shape, rw.dtype, rw.placements), v.to(getattr(torch, rw.dtype)))
                )
            for r in dst.grid.ravel().tolist():
                if (v := _local(parts, dst, r, axis)) is not None:
                    out[(rw.name, r)] = v
    return out


def run_fp8(
    plan: TransferPlan, src: Layout, sws: list[Weight], full: dict[str, torch.Tensor], dst: Layout
) -> tuple[dict[tuple[str, int], torch.Tensor], dict[tuple[str, int], torch.Tensor]]:
    """The plan's moves on per-rank tensors: each sender quantizes its own link views (the
    library's quantizer), as ``WeightSync`` does. Returns the buffers and write counts."""
    m = plan.mapping
    assert m is not None
    by_name = {w.name: w for w in sws}
    scale_of = {
        ln.scale[1]: ln.name for ln in m.links.values() if ln.scale is not None and ln.scale[1] is not None
    }
    sent: dict[tuple[str, int], torch.Tensor] = {}
    for ln in m.links.values():
        if ln.scale is not None and ln.scale[1] is not None:
            continue
        for r in src.grid.ravel().tolist():
            if (box := ln.src_local(r)) is None:
                continue
            tw = by_name[ln.source]
            v = view_source(full[tw.name][_cut(tw.box(src, r))][_cut(box)], ln.src_axes)
            if ln.scale is not None:
                sent[(ln.name, r)], sent[(scale_of[ln.name], r)] = quantize_blocks(v, ln.scale[0])
            else:
                sent[(ln.name, r)] = v.to(getattr(torch, ln.wire_dtype))
    bufs: dict[tuple[str, int], torch.Tensor] = {}
    writes: dict[tuple[str, int], torch.Tensor] = {}
    for ln in m.links.values():
        for r in dst.grid.ravel().tolist():
            shape = m.buffer_shape(ln.rollout, r)
            if shape is not None and (ln.rollout, r) not in bufs:
                bufs[(ln.rollout, r)] = torch.zeros(shape, dtype=getattr(torch, ln.wire_dtype))
                writes[(ln.rollout, r)] = torch.zeros(shape, dtype=torch.int64)
    for mv in sorted((m.resolve(x) for x in plan.messages), key=lambda x: x.step):
        ln = m.links[mv.link]
        if mv.step == 0:
            own = ln.src.box(src, mv.src)
            assert own is not None
            data = sent[(mv.link, mv.src)][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(mv.box, own))]
        else:
            data = bufs[(mv.src_name, mv.src)][_cut(mv.src_local)]
        bufs[(mv.dst_name, mv.dst)][_cut(mv.dst_local)] = data
        writes[(mv.dst_name, mv.dst)][_cut(mv.dst_local)] += 1
    return bufs, writes


def check_fp8(
    plan: TransferPlan,
    src: Layout,
    sws: list[Weight],
    dst: Layout,
    dws: list[Weight],
    nm: NameMap,
    q: BlockFP8,
    seed: int = 0,
) -> int:
    """Every rollout element and scale bit-exact against the reference, written exactly once;
    the plan's cross-node bytes its lower bound. Returns the elements checked."""
    g = torch.Generator().manual_seed(seed)
    full = {w.name: torch.randn(w.shape, generator=g) * 3 for w in sws}
    want = expected_fp8(sws, full, dst, dws, nm, q)
    bufs, writes = run_fp8(plan, src, sws, full, dst)
    assert set(want) == set(bufs), (sorted(want), sorted(bufs))
    n = 0
    for k, t in want.items():
        assert (writes[k] == 1).all(), f"{k}: written {writes[k].tolist()} times"
        a, b = bufs[k], t
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert a.shape == b.shape and torch.equal(a, b), f"{k}: {bufs[k]} != {t}"
        n += t.numel()
    bound = _lower_bound(src, sws, dst, dws, nm, q, plan.node_size)
    cross = sum(m.nbytes for m in plan.messages if m.src // plan.node_size != m.dst // plan.node_size)
    assert plan.cross_node_bytes == cross == bound == plan.cross_node_lower_bound, (cross, bound)
    return n


def _lower_bound(
    src: Layout, sws: list[Weight], dst: Layout, dws: list[Weight], nm: NameMap, q: BlockFP8, node: int
) -> int:
    """Per node: the distinct rollout elements its ranks need whose trainer element no rank of
    the node holds (in the rollout's dtype), and the scales of blocks no rank of it holds (a
    block is held whole or not at all: its first element stands for it), 4 bytes each."""
    by_name = {w.name: w for w in dws}
    values = [w for w in dws if not (w.name.endswith(q.suffix) and w.name[: -len(q.suffix)] in by_name)]
    want = moe_expected(sws, dst, values, nm)
    ids = full_ids(sws)
    held: dict[int, set[int]] = {}
    for w in sws:
        for r in src.grid.ravel().tolist():
            if (b := w.box(src, r)) is not None:
                held.setdefault(r // node, set()).update(ids[w.name][_cut(b)].ravel().tolist())
    bound = 0
    for w in values:
        need: dict[int, dict[int, int]] = {}
        scales: dict[int, dict[int, int]] = {}
        for r in dst.grid.ravel().tolist():
            if (w.name, r) not in want:
                continue
            got, pos = want[(w.name, r)]
            need.setdefault(r // node, {}).update(zip(pos.ravel().tolist(), got.ravel().tolist()))
            if w.dtype == "float8_e4m3fn":  # a block's first element, per local block
                b0, b1 = q.block
                firsts = (got[..., ::b0, ::b1], pos[..., ::b0, ::b1])
                scales.setdefault(r // node, {}).update(
                    zip(firsts[1].ravel().tolist(), firsts[0].ravel().tolist())
                )
        for nd, elems in need.items():
            bound += sum(1 for i in elems.values() if i not in held.get(nd, set())) * w.itemsize
        for nd, elems in scales.items():
            bound += sum(1 for i in elems.values() if i not in held.get(nd, set())) * 4
    return bound


__all__ = ["check_fp8", "expected_fp8", "reference_quantize", "run_fp8"]
