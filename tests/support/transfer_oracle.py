"""The transfer plan's oracle (numpy only): a brute force over every element, shared by the plan
and balance tests.

The brute force marks, per weight, which ranks hold every element (source side) and which need
it (destination side), straight from ``Weight.box`` rank by rank. From that it knows the
minimum cross-node bytes (per node: the elements some rank on it needs and no rank on it
holds) and checks each plan message element by element; ``check_balance`` recomputes the
send-balance bounds from holder sets found the same way; ``worlds`` draws random small worlds.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from meshgroups import Layout, Topology
from meshgroups.transfer import Replicate, Shard, TransferPlan, Weight, plan_transfer

T4 = Topology(node=4)


def _mask(shape: tuple[int, ...], box: tuple[tuple[int, int], ...] | None) -> np.ndarray:
    m = np.zeros(shape, bool)
    if box is not None:
        m[tuple(slice(a, b) for a, b in box)] = True
    return m


def brute_minimum(src: Layout, sws: list[Weight], dst: Layout, dws: list[Weight], node: int) -> int:
    """Σ over weights and nodes of the bytes some rank of the node needs and none holds."""
    by_name = {w.name: w for w in sws}
    total = 0
    for dw in dws:
        sw = by_name[dw.name]
        need: dict[int, np.ndarray] = {}
        have: dict[int, np.ndarray] = {}
        for r in dst.grid.ravel().tolist():
            m = need.setdefault(r // node, np.zeros(dw.shape, bool))
            m |= _mask(dw.shape, dw.box(dst, r))
        for r in src.grid.ravel().tolist():
            m = have.setdefault(r // node, np.zeros(dw.shape, bool))
            m |= _mask(dw.shape, sw.box(src, r))
        for n, m in need.items():
            lacking = m & ~have.get(n, np.zeros(dw.shape, bool))
            total += int(lacking.sum()) * dw.itemsize
    return total


def check_plan(
    plan: TransferPlan, src: Layout, sws: list[Weight], dst: Layout, dws: list[Weight], node: int
) -> None:
    """Exact coverage, no redundant byte, valid senders and forwards, minimum cross bytes."""
    by_name = {w.name: w for w in sws}
    msgs = list(plan.messages)
    got: dict[tuple[str, int], np.ndarray] = {}
    after0: dict[tuple[str, int], np.ndarray] = {}
    for m in msgs:
        dw, sw = next(w for w in dws if w.name == m.weight), by_name[m.weight]
        box = _mask(dw.shape, m.box)
        assert m.nbytes == int(box.sum()) * dw.itemsize
        mine = _mask(dw.shape, dw.box(dst, m.dst))
        assert (box <= mine).all(), f"{m} outside its receiver's box"
        if m.step == 0:
            assert (box <= _mask(dw.shape, sw.box(src, m.src))).all(), f"{m}: sender does not hold it"
            after0.setdefault((m.weight, m.dst), np.zeros(dw.shape, bool))[...] |= box
        else:
            assert m.src // node == m.dst // node, f"{m}: forwards stay inside a node"
        if m.src != m.dst:  # nothing to a rank that already holds it
            assert not (box & _mask(dw.shape, sw.box(src, m.dst))).any(), f"{m} goes to a holder"
        acc = got.setdefault((m.weight, m.dst), np.zeros(dw.shape, np.int64))
        acc[box] += 1
    for m in msgs:
        if m.step == 1:  # the forwarder got it at step 0
            held = after0[(m.weight, m.src)]
            assert (_mask(held.shape, m.box) <= held).all(), f"{m}: forwarder did not receive it at step 0"
    for dw in dws:
        for r in dst.grid.ravel().tolist():
            want = _mask(dw.shape, dw.box(dst, r)).astype(np.int64)
            have = got.get((dw.name, r), np.zeros(dw.shape, np.int64))
            assert np.array_equal(have, want), f"{dw.name} rank {r}: covered {have} want {want}"
    lower = brute_minimum(src, sws, dst, dws, node)
    cross = sum(m.nbytes for m in msgs if m.src // node != m.dst // node)
    assert plan.cross_node_bytes == cross == lower == plan.cross_node_lower_bound
    assert plan.n_messages == len(msgs)
    send: dict[int, int] = {}
    for m in msgs:
        if m.src != m.dst:
            send[m.src] = send.get(m.src, 0) + m.nbytes
    assert dict(plan.send_bytes) == send


def check_balance(
    plan: TransferPlan,
    src: Layout,
    sws: list[Weight],
    dst: Layout,
    dws: list[Weight],
    node: int,
    min_part_bytes: int = 1 << 16,
) -> None:
    """The balance the TransferPlan docstring states, against holder sets found by brute force (the
    source ranks whose box holds a message's box):
    - per holder set of ``h`` ranks sending ``X`` cross-node bytes, each member sends within
      ``Q`` of ``X / h`` (``Q``: the largest cut quantum of the set's pieces — a piece being
      its sender's box ∩ its receiver's box — ``min_part_bytes`` rounded up to whole indices of
      the piece's longest axis, at most the piece);
    - ``send_lower_bound`` is max over holder sets and over unions of sets sharing ranks of
      the step-0 bytes only they hold, over their ranks; the busiest sender is no lower;
    - ``busiest_send_bound`` is max over ranks of intra-node step-0 bytes + Σ over its sets of
      ``⌈X / h⌉ + Q``; the busiest sender is no higher."""
    by_name = {w.name: w for w in sws}
    dst_by_name = {w.name: w for w in dws}
    ranks = src.grid.ravel().tolist()
    boxes = {(w.name, r): _mask(w.shape, w.box(src, r)) for w in sws for r in ranks}
    cross: dict[frozenset[int], dict[int, int]] = {}
    quantum: dict[frozenset[int], int] = {}
    step0: dict[frozenset[int], int] = {}
    intra: dict[int, int] = {}
    for m in plan.messages:
        if m.step != 0 or m.src == m.dst:
            continue
        sw = by_name[m.weight]
        box = _mask(sw.shape, m.box)
        holders = frozenset(r for r in ranks if (box <= boxes[(m.weight, r)]).all())
        assert m.src in holders
        step0[holders] = step0.get(holders, 0) + m.nbytes
        per = cross.setdefault(holders, dict.fromkeys(holders, 0))
        if m.src // node != m.dst // node:
            per[m.src] += m.nbytes
            piece = boxes[(m.weight, m.src)] & _mask(sw.shape, dst_by_name[m.weight].box(dst, m.dst))
            extents = [
                int(piece.any(axis=tuple(a for a in range(piece.ndim) if a != i)).sum())
                for i in range(piece.ndim)
            ]
            length = max(extents, default=1)
            row = int(piece.sum()) // length * sw.itemsize
            q = min(-(-min_part_bytes // row), length) * row
            quantum[holders] = max(quantum.get(holders, 0), q)
        else:
            intra[m.src] = intra.get(m.src, 0) + m.nbytes
    for holders, per in cross.items():
        x, h, q = sum(per.values()), len(holders), quantum.get(holders, 0)
        assert all(x // h - q <= v <= -(-x // h) + q for v in per.values()), (sorted(holders), per, q)
    # The bounds, recomputed from the brute-force sets.
    groups = [set(h) for h in step0]
    merged = True
    while merged:  # unions of sets that share ranks
        merged = False
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                if groups[i] & groups[j]:
                    groups[i] |= groups.pop(j)
                    merged = True
                    break
            if merged:
                break
    lower = max(
        [b / len(h) for h, b in step0.items()]
        + [sum(b for h, b in step0.items() if h <= g) / len(g) for g in groups],
        default=0.0,
    )
    guarantee = {r: float(intra.get(r, 0)) for r in ranks}
    for holders, per in cross.items():
        h = len(holders)
        for r in holders:
            guarantee[r] += -(-sum(per.values()) // h) + quantum.get(holders, 0)
    upper = max(guarantee.values(), default=0.0)
    assert math.isclose(plan.send_lower_bound, lower, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(plan.busiest_send_bound, upper, rel_tol=1e-9, abs_tol=1e-9)
    assert lower - 1e-9 <= plan.busiest_send_bytes <= upper + 1e-9


def check_local(
    plan: TransferPlan,
    src: Layout,
    sws: list[Weight],
    dst: Layout,
    dws: list[Weight],
    topo: Topology | None,
    min_part_bytes: int = 1 << 20,
) -> None:
    msgs = list(plan.messages)
    ranks = sorted(set(src.grid.ravel().tolist()) | set(dst.grid.ravel().tolist()))
    for r in ranks:
        mine = plan_transfer(
            src, sws, dst, dws, topology=topo, rank=r, min_part_bytes=min_part_bytes
        ).messages
        assert list(mine) == [m for m in msgs if r in (m.src, m.dst)], f"rank {r}"
        assert plan.for_rank(r) == list(mine)


def _scenario(
    src: Layout, sws: list[Weight], dst: Layout, dws: list[Weight], topo: Topology | None
) -> TransferPlan:
    plan = plan_transfer(src, sws, dst, dws, topology=topo)
    check_plan(plan, src, sws, dst, dws, 1 if topo is None else _node(topo))
    check_local(plan, src, sws, dst, dws, topo)
    return plan


def _node(topo: Topology) -> int:
    """The plan's node: the level named node, else the smallest level."""
    return topo.size("node") if "node" in topo.names else topo.levels[0][1]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Layout, list[Weight], Layout, list[Weight], Topology | None]:
    def layout(prefix: str, max_world: int, offset: int) -> Layout:
        n = draw(st.integers(1, 3))
        sizes, world = [], 1
        for _ in range(n):
            s = draw(st.integers(1, max(1, min(4, max_world // world))))
            sizes.append(s)
            world *= s
        names = [f"{prefix}{i}" for i in range(n)]
        if draw(st.booleans()):
            perm = np.array(draw(st.permutations(range(world)))) + offset
            return Layout.from_grid(perm.reshape(sizes), names)
        return Layout(dict(zip(names, sizes)), rank_offset=offset)

    src = layout("s", 16, 0)
    colocated = draw(st.booleans())
    dst = layout("d", 16, 0 if colocated else draw(st.integers(0, src.world_size)))
    if not colocated and set(src.grid.ravel().tolist()) & set(dst.grid.ravel().tolist()):
        dst = layout("d", 16, src.max_rank + 1)
    n_w = draw(st.integers(1, 3))
    sws, dws = [], []
    for i in range(n_w):
        ndim = draw(st.integers(1, 2))
        shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))

        def placements(
            lay: Layout, stage_ok: bool, ndim: int
        ) -> tuple[dict[str, Shard | Replicate], tuple[str, int] | None]:
            pl: dict[str, Shard | Replicate] = {}
            stage = None
            for d, s in zip(lay.names, lay.shape):
                c = draw(st.integers(0, 3))
                if c == 0 and stage_ok and stage is None and s > 1:
                    stage = (d, draw(st.integers(0, s - 1)))
                elif c >= 2:
                    pl[d] = Shard(draw(st.integers(0, ndim - 1)))
            return pl, stage

        spl, sst = placements(src, True, ndim)
        dpl, dst_stage = placements(dst, True, ndim)
        # Sometimes nest against layout order (FSDP2 over TP): the sharding dims reversed.
        s_order = tuple(reversed(list(spl))) if spl and draw(st.booleans()) else None
        sws.append(Weight(f"w{i}", shape, "int16", spl, sst, s_order))
        dws.append(Weight(f"w{i}", shape, "int16", dpl, dst_stage))
    topo = draw(
        st.sampled_from(
            [None, Topology(node=2), Topology(node=4), Topology(node=8), Topology(host=4, rack=8)]
        )
    )
    return src, sws, dst, dws, topo


def _layers(n: int, stage: tuple[str, int] | None = None) -> list[Weight]:
    out = []
    for i in range(n):
        out.append(Weight(f"col{i}", (8, 4), "bfloat16", {"tp": Shard(0)}, stage))
        out.append(Weight(f"row{i}", (4, 8), "bfloat16", {"tp": Shard(1)}, stage))
    return out
