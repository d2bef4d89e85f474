"""A brute force for stacked (MoE) and viewed name maps (numpy only), in the manner of
``mapped_oracle``: trainer elements get unique ids; from the rules alone (stacks, expert
``index``, ``transpose``, segments) each rollout weight's full tensor of ids is built, and each
rollout rank's local buffer from ``Weight.box`` of the parts. The plan's resolved moves then run
on per-rank arrays (a step-0 move reads the trainer shard through ``Move.src_axes``); every
buffer element must be written exactly once with the id the rule says, and the cross-node bytes
must equal the lower bound (per node, the needed rollout elements no rank of it holds).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from meshgroups import Layout, Topology
from meshgroups.transfer import NameMap, Replicate, Shard, TransferPlan, Weight
from meshgroups.transfer._names.mapped import view_source
from meshgroups.transfer._names.rules import Rule, Segment
from meshgroups.transfer._names.stacking import Stack, expert_order


def _cut(box: tuple[tuple[int, int], ...] | None) -> tuple[slice, ...]:
    assert box is not None
    return tuple(slice(a, b) for a, b in box)


def full_ids(sws: list[Weight]) -> dict[str, np.ndarray]:
    """A unique id per trainer element."""
    out, at = {}, 0
    for w in sws:
        n = int(np.prod(w.shape))
        out[w.name] = np.arange(at, at + n, dtype=np.int64).reshape(w.shape)
        at += n
    return out


def _segment(ids: dict[str, np.ndarray], s: Segment, axis: int) -> np.ndarray:
    t = ids[s.source]
    if s.index is not None:
        t = t[s.index]
    if s.transpose:
        t = np.swapaxes(t, -1, -2)
    stop = t.shape[axis] if s.stop is None else s.stop
    return np.take(t, np.arange(s.start, stop), axis=axis)


def _entry(ids: dict[str, np.ndarray], rule: Rule) -> list[np.ndarray]:
    """One rule's parts (each its segments concatenated along the rule's axis)."""
    return [np.concatenate([_segment(ids, s, rule.axis) for s in p], axis=rule.axis) for p in rule.parts]


def rule_parts(ids: dict[str, np.ndarray], rule: Rule | Stack) -> tuple[list[np.ndarray], int]:
    """The rollout weight's parts as full id arrays, and the axis they are concatenated along."""
    if isinstance(rule, Stack):
        entries = [_entry(ids, e) for e in rule.entries]
        parts = [np.stack([e[k] for e in entries]) for k in range(len(entries[0]))]
        return parts, rule.axis
    return _entry(ids, rule), rule.axis


def expected(
    sws: list[Weight], dst: Layout, dws: list[Weight], name_map: NameMap
) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """``{(rollout name, rank): (ids, positions)}`` of each rollout rank's local buffer."""
    ids = full_ids(sws)
    out = {}
    for rw in dws:
        rule = name_map.rule(rw.name)
        if rule.is_rename:
            pieces, axis = [ids[rule.segments[0].source]], 0
        else:
            pieces, axis = rule_parts(ids, rule)
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


def check_moe(
    plan: TransferPlan,
    src: Layout,
    sws: list[Weight],
    dst: Layout,
    dws: list[Weight],
    name_map: NameMap,
    node: int,
) -> None:
    """Run the plan's moves on ids; check every buffer element (exactly once), and the
    cross-node bytes against the lower bound."""
    assert plan.mapping is not None
    want = expected(sws, dst, dws, name_map)
    ids = full_ids(sws)
    trainer = {
        (w.name, r): ids[w.name][_cut(b)]
        for w in sws
        for r in src.grid.ravel().tolist()
        if (b := w.box(src, r)) is not None
    }
    bufs = {k: np.full(v[0].shape, -1, np.int64) for k, v in want.items()}
    writes = {k: np.zeros(v[0].shape, np.int64) for k, v in want.items()}
    for k in want:
        assert plan.mapping.buffer_shape(k[0], k[1]) == want[k][0].shape, k
    by_name = {w.name: w for w in dws}
    moves = [plan.mapping.resolve(m) for m in plan.messages]
    for mv in sorted(moves, key=lambda m: m.step):  # forwards read what step 0 wrote
        rw = by_name[mv.dst_name]
        n = int(np.prod([b - a for a, b in mv.box]))
        assert mv.nbytes == n * rw.itemsize and mv.dtype == rw.dtype
        if mv.step == 0:
            data = view_source(trainer[(mv.src_name, mv.src)][_cut(mv.src_local)], mv.src_axes)
        else:
            assert mv.src // node == mv.dst // node
            data = bufs[(mv.src_name, mv.src)][_cut(mv.src_local)]
            assert (data >= 0).all(), f"{mv}: forwarded before it arrived"
        bufs[(mv.dst_name, mv.dst)][_cut(mv.dst_local)] = data
        writes[(mv.dst_name, mv.dst)][_cut(mv.dst_local)] += 1
    for k, (ids_want, _) in want.items():
        assert (writes[k] == 1).all(), f"{k}: written {writes[k].tolist()} times"
        assert np.array_equal(bufs[k], ids_want), f"{k}: {bufs[k].tolist()} != {ids_want.tolist()}"
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
        for nd, elems in need.items():
            bound += sum(1 for i in elems.values() if i not in held.get(nd, set())) * rw.itemsize
    cross = sum(m.nbytes for m in plan.messages if m.src // node != m.dst // node)
    assert plan.cross_node_bytes == cross == bound == plan.cross_node_lower_bound


@st.composite
def moe_worlds(draw: st.DrawFn) -> tuple[Layout, list[Weight], Layout, list[Weight], NameMap, Topology]:
    """A random MoE layer: E experts of gate/up ``[I, H]`` and down ``[H, I]`` on an ep × tp
    trainer in one of three forms (per-expert names on their ep rank; Megatron's grouped
    ``fc1.weight<i>`` ``[ep, 2I, H]``; packed ``gate_up`` ``[E, 2I, H]``), optionally stored
    transposed; a rollout of ep × tp holding stacked ``w13`` / ``w2`` in linear or round-robin
    expert order, parts sharded per part or whole."""
    t_ep, t_tp = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    r_ep, r_tp = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    local = draw(st.integers(1, 2))
    e_count = local * t_ep * r_ep  # both sides' ep divide E
    i_size, h = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    src = Layout(ep=t_ep, tp=t_tp)
    dst = Layout(ep=r_ep, tp=r_tp, rank_offset=0 if draw(st.booleans()) else src.size())
    form = draw(st.sampled_from(["per_expert", "grouped", "packed"]))
    t_trans = draw(st.booleans())  # the trainer stores gate/up as [H, I] (and down as [I, H])
    tp_axis = draw(st.sampled_from([0, 1]))
    sws: list[Weight] = []
    e_local = e_count // t_ep

    def mat(rows: int, cols: int) -> tuple[int, int]:
        return (cols, rows) if t_trans else (rows, cols)

    if form == "per_expert":
        for e in range(e_count):
            stage = ("ep", e // e_local)
            for p in ("gate", "up"):
                sws.append(Weight(f"e{e}.{p}", mat(i_size, h), "float32", {"tp": Shard(tp_axis)}, stage))
            sws.append(Weight(f"e{e}.down", mat(h, i_size), "float32", {"tp": Shard(1 - tp_axis)}, stage))
    elif form == "grouped":
        for j in range(e_local):
            pl = {"ep": Shard(0), "tp": Shard(1 + tp_axis)}
            sws.append(Weight(f"fc1.weight{j}", (t_ep, *mat(2 * i_size, h)), "float32", pl))
            sws.append(Weight(f"fc2.weight{j}", (t_ep, *mat(h, i_size)), "float32", {"ep": Shard(0)}))
    else:
        pl = {"ep": Shard(0), "tp": Shard(1 + tp_axis)}
        sws.append(Weight("gate_up", (e_count, *mat(2 * i_size, h)), "float32", pl))
        sws.append(Weight("down", (e_count, *mat(h, i_size)), "float32", {"ep": Shard(0), "tp": Shard(2)}))

    def seg(kind: str, e: int, lo: int, hi: int | None) -> dict[str, object]:
        if form == "per_expert":
            s: dict[str, object] = {"source": f"e{e}.{kind}"}
        elif form == "grouped":
            s = {"source": f"fc{1 if kind != 'down' else 2}.weight{e % e_local}", "index": e // e_local}
        else:
            s = {"source": "gate_up" if kind != "down" else "down", "index": e}
        s.update(start=lo, stop=hi, transpose=t_trans)
        return s

    def gate_up(e: int) -> list[object]:
        if form == "per_expert":
            return [seg("gate", e, 0, None), seg("up", e, 0, None)]
        return [seg("gate", e, 0, i_size), seg("up", e, i_size, 2 * i_size)]

    order = expert_order(e_count, r_ep, draw(st.sampled_from(["linear", "round_robin"])))
    sharding = draw(st.sampled_from(["per_part", "whole"]))
    rules = {
        "w13": {"stack": [{"parts": gate_up(e), "sharding": sharding} for e in order]},
        "w2": {"stack": [{"parts": [seg("down", e, 0, None)]} for e in order]},
    }
    r_pl: dict[str, Shard | Replicate] = {"ep": Shard(0), "tp": Shard(1)}
    dws = [
        Weight("w13", (e_count, 2 * i_size, h), "bfloat16", r_pl),
        Weight("w2", (e_count, h, i_size), "bfloat16", {"ep": Shard(0), "tp": Shard(2)}),
    ]
    topo = draw(st.sampled_from([Topology(node=1), Topology(node=2), Topology(node=4)]))
    return src, sws, dst, dws, NameMap(rules), topo


__all__ = ["check_moe", "expected", "full_ids", "moe_worlds", "rule_parts"]
