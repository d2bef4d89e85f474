"""A brute force for mapped plans (numpy only): every rollout buffer filled element by element.

Each trainer element gets a unique id. From a rule alone the brute force builds each rollout
weight's full tensor of ids (segments concatenated along the axis) and each rollout rank's local
buffer (per part: the part's shard of each part, one after another; whole: the rank's box of
the concatenation), using only ``Weight.box`` (checked against torch DTensor elsewhere). It then
runs the plan's resolved moves on per-rank arrays — trainer shards of ids, rollout buffers —
step 0 before step 1, and checks every buffer element is written exactly once with the id the
rule says; and that the cross-node bytes equal the mapped problem's lower bound: per node, the
distinct rollout elements its ranks need whose trainer element no rank of the node holds, in
the rollout's dtype.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from meshgroups import Layout, Topology
from meshgroups.transfer import NameMap, Replicate, Shard, TransferPlan, Weight, plan_transfer
from meshgroups.transfer._names.rules import Rule


def _cut(box: tuple[tuple[int, int], ...] | None) -> tuple[slice, ...]:
    assert box is not None
    return tuple(slice(a, b) for a, b in box)


def _full_ids(sws: list[Weight]) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for w in sws:
        n = int(np.prod(w.shape))
        out[w.name] = np.arange(at, at + n, dtype=np.int64).reshape(w.shape)
        at += n
    return out


def expected(
    sws: list[Weight], dst: Layout, dws: list[Weight], name_map: NameMap
) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """``{(rollout name, rank): (ids, positions)}`` of each rollout rank's local buffer."""
    ids = _full_ids(sws)
    out = {}
    for rw in dws:
        rule = name_map.rule(rw.name)
        if rule.is_rename:
            full = ids[rule.segments[0].source]
            parts = [(rw, full, np.arange(full.size).reshape(full.shape))]
            axis = 0
        else:
            axis = rule.axis
            pieces = []
            for part in rule.parts:
                segs = []
                for s in part:
                    t = ids[s.source]
                    stop = t.shape[axis] if s.stop is None else s.stop
                    segs.append(np.take(t, np.arange(s.start, stop), axis=axis))
                pieces.append(np.concatenate(segs, axis=axis))
            full = np.concatenate(pieces, axis=axis)
            pos = np.arange(full.size).reshape(full.shape)
            groups = pieces if rule.sharding == "per_part" else [full]
            parts, at = [], 0
            for g in groups:
                n = g.shape[axis]
                shape = (*rw.shape[:axis], n, *rw.shape[axis + 1 :])
                pw = Weight(rw.name, shape, rw.dtype, rw.placements, rw.stage, rw.shard_order)
                sel = np.arange(at, at + n)
                parts.append((pw, np.take(full, sel, axis=axis), np.take(pos, sel, axis=axis)))
                at += n
        for r in dst.grid.ravel().tolist():
            got = [(f[_cut(b)], p[_cut(b)]) for pw, f, p in parts if (b := pw.box(dst, r)) is not None]
            if got:
                out[(rw.name, r)] = (
                    np.concatenate([g[0] for g in got], axis=axis),
                    np.concatenate([g[1] for g in got], axis=axis),
                )
    return out


def check_mapped(
    plan: TransferPlan,
    src: Layout,
    sws: list[Weight],
    dst: Layout,
    dws: list[Weight],
    name_map: NameMap,
    node: int,
) -> None:
    """Run the plan's moves on ids and check buffers, coverage and the cross-node bytes."""
    assert plan.mapping is not None
    want = expected(sws, dst, dws, name_map)
    ids = _full_ids(sws)
    trainer = {
        (w.name, r): ids[w.name][_cut(b)]
        for w in sws
        for r in src.grid.ravel().tolist()
        if (b := w.box(src, r)) is not None
    }
    bufs = {k: np.full(v[0].shape, -1, np.int64) for k, v in want.items()}
    writes = {k: np.zeros(v[0].shape, np.int64) for k, v in want.items()}
    for k in want:
        assert plan.mapping.buffer_shape(k[0], k[1]) == want[k][0].shape
    dtypes = {w.name: w for w in dws}
    moves = [plan.mapping.resolve(m) for m in plan.messages]
    for mv in sorted(moves, key=lambda m: m.step):  # forwards read what step 0 wrote
        rw = dtypes[mv.dst_name]
        n = int(np.prod([b - a for a, b in mv.box]))
        assert mv.nbytes == n * rw.itemsize and mv.dtype == rw.dtype
        if mv.step == 0:
            data = trainer[(mv.src_name, mv.src)][_cut(mv.src_local)]
        else:
            assert mv.src // node == mv.dst // node
            data = bufs[(mv.src_name, mv.src)][_cut(mv.src_local)]
            assert (data >= 0).all(), f"{mv}: forwarded before it arrived"
        bufs[(mv.dst_name, mv.dst)][_cut(mv.dst_local)] = data
        writes[(mv.dst_name, mv.dst)][_cut(mv.dst_local)] += 1
    for k, (ids_want, _) in want.items():
        assert (writes[k] == 1).all(), f"{k}: written {writes[k].tolist()} times"
        assert np.array_equal(bufs[k], ids_want), f"{k}: {bufs[k].tolist()} != {ids_want.tolist()}"
    # The mapped problem's lower bound: per node, needed rollout elements held nowhere on it.
    bound = 0
    held: dict[int, set[int]] = {}
    for (_, r), t in trainer.items():
        held.setdefault(r // node, set()).update(t.ravel().tolist())
    for rw in dws:
        need: dict[int, dict[int, int]] = {}
        for r in dst.grid.ravel().tolist():
            if (rw.name, r) in want:
                got_ids, pos = want[(rw.name, r)]
                need.setdefault(r // node, {}).update(zip(pos.ravel().tolist(), got_ids.ravel().tolist()))
        for n, elems in need.items():
            bound += sum(1 for i in elems.values() if i not in held.get(n, set())) * rw.itemsize
    cross = sum(m.nbytes for m in plan.messages if m.src // node != m.dst // node)
    assert plan.cross_node_bytes == cross == bound == plan.cross_node_lower_bound


def check_mapped_local(
    plan: TransferPlan, src: Layout, sws: list[Weight], dst: Layout, dws: list[Weight], **kw: object
) -> None:
    """A rank's part equals the whole plan's messages filtered to it, moves included."""
    msgs = list(plan.messages)
    for r in sorted(set(src.grid.ravel().tolist()) | set(dst.grid.ravel().tolist())):
        mine = plan_transfer(src, sws, dst, dws, rank=r, **kw)  # type: ignore[arg-type]
        assert list(mine.messages) == [m for m in msgs if r in (m.src, m.dst)], f"rank {r}"
        assert mine.moves(r) == plan.moves(r)


@st.composite
def mapped_worlds(
    draw: st.DrawFn,
) -> tuple[Layout, list[Weight], Layout, list[Weight], NameMap, Topology | None]:
    """Random layouts, trainer weights, and rollout weights made of them by random fusions,
    splits, interleaves and ties (rules sharded per part or whole)."""

    def layout(prefix: str, offset: int) -> Layout:
        sizes = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2)))]
        names = [f"{prefix}{i}" for i in range(len(sizes))]
        if draw(st.booleans()):
            world = int(np.prod(sizes))
            perm = np.array(draw(st.permutations(range(world)))) + offset
            return Layout.from_grid(perm.reshape(sizes), names)
        return Layout(dict(zip(names, sizes)), rank_offset=offset)

    src = layout("s", 0)
    dst = layout("d", 0 if draw(st.booleans()) else src.max_rank + 1)
    axis = draw(st.integers(0, 1))
    other = draw(st.integers(1, 4))

    def shape(n: int) -> tuple[int, int]:
        return (n, other) if axis == 0 else (other, n)

    def placements(lay: Layout) -> dict[str, Shard | Replicate]:
        pl: dict[str, Shard | Replicate] = {}
        for d in lay.names:
            c = draw(st.integers(0, 2))
            if c:
                pl[d] = Shard(axis if c == 1 else 1 - axis)
        return pl

    def trainer_weight(i: int, n: int) -> Weight:
        pl = placements(src)
        # FSDP2 over TP: sharding dims nested against layout order; a pipeline stage
        order = tuple(reversed([d for d, p in pl.items() if isinstance(p, Shard)])) or None
        free = [d for d, k in zip(src.names, src.shape) if d not in pl and k > 1]
        stage = (
            (free[0], draw(st.integers(0, src.size(free[0]) - 1))) if free and draw(st.booleans()) else None
        )
        return Weight(f"t{i}", shape(n), "float32", pl, stage, order if draw(st.booleans()) else None)

    n_t = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 7)) for _ in range(n_t)]
    sws = [trainer_weight(i, n) for i, n in enumerate(sizes)]
    rules: dict[str, object] = {}
    lengths: dict[str, int] = {}
    i = 0
    while i < n_t:
        kind = draw(st.sampled_from(["fuse", "split", "interleave", "rename"]))
        name = f"r{len(rules)}"
        if kind == "fuse":
            k = draw(st.integers(1, min(3, n_t - i)))
            rules[name] = {"parts": [f"t{j}" for j in range(i, i + k)], "axis": axis}
            lengths[name] = sum(sizes[i : i + k])
            i += k
        elif kind == "split" and sizes[i] > 1:
            cut = draw(st.integers(1, sizes[i] - 1))
            for lo, hi in ((0, cut), (cut, sizes[i])):
                rules[f"r{len(rules)}"] = {"source": f"t{i}", "start": lo, "stop": hi, "axis": axis}
                lengths[f"r{len(rules) - 1}"] = hi - lo
            i += 1
        elif kind == "interleave" and i + 1 < n_t:
            a, b = sizes[i], sizes[i + 1]
            segs, pa, pb = [], 0, 0
            while pa < a or pb < b:
                if pa < a:
                    step = draw(st.integers(1, a - pa))
                    segs.append([f"t{i}", pa, pa + step])
                    pa += step
                if pb < b:
                    step = draw(st.integers(1, b - pb))
                    segs.append([f"t{i + 1}", pb, pb + step])
                    pb += step
            rules[name] = {"segments": segs, "axis": axis}
            lengths[name] = a + b
            i += 2
        else:
            rules[name] = f"t{i}"
            lengths[name] = sizes[i]
            i += 1
    if draw(st.booleans()):  # a tie: one more rollout weight reads t0 whole
        rules[f"r{len(rules)}"] = "t0"
        lengths[f"r{len(rules) - 1}"] = sizes[0]
    for spec in rules.values():
        if isinstance(spec, dict) and draw(st.booleans()):
            spec["sharding"] = "whole"
    wire = draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]))
    dws = [Weight(name, shape(n), wire, placements(dst)) for name, n in lengths.items()]
    topo = draw(st.sampled_from([None, Topology(node=2), Topology(node=4)]))
    return src, sws, dst, dws, NameMap(rules), topo


def node_of(topo: Topology | None) -> int:
    return 1 if topo is None else topo.size("node")


__all__ = ["Rule", "check_mapped", "check_mapped_local", "expected", "mapped_worlds", "node_of"]
