"""The transfer plan (numpy only, no processes) against a brute force over every element.

The brute force (``tests/support/transfer_oracle.py``) checks each plan message element by element and
the cross-node bytes against their minimum; the balance tests are in
``tests/transfer/test_transfer_balance.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgroups import Layout, LayoutError, Topology
from meshgroups.transfer import Message, Replicate, Shard, Weight, plan_transfer
from meshgroups.transfer._spec import chunk

from ..support.transfer_oracle import (
    T4,
    _layers,
    _node,
    _scenario,
    check_balance,
    check_local,
    check_plan,
    worlds,
)


def test_box_matches_torch_dtensor() -> None:
    torch_utils = pytest.importorskip("torch.distributed.tensor._utils")
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    rng = np.random.default_rng(0)
    for _ in range(300):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(x) for x in rng.integers(0, 9, ndim))
        sizes = [int(x) for x in rng.integers(1, 4, int(rng.integers(1, 4)))]
        names = [f"d{i}" for i in range(len(sizes))]
        lay = Layout(dict(zip(names, sizes)))
        pl = {n: (Shard(int(rng.integers(0, ndim))) if rng.random() < 0.7 else Replicate()) for n in names}
        w = Weight("w", shape, placements=pl)
        tpl = [TS(p.axis) if isinstance(p, Shard) else TR() for p in pl.values()]
        for r in range(lay.world_size):
            coord = [lay.coords(r)[n] for n in names]
            local, offset = torch_utils._compute_local_shape_and_global_offset(shape, sizes, coord, tpl)
            box = w.box(lay, r)
            if any(s == 0 for s in local):
                assert box is None
            else:
                assert box == tuple((o, o + s) for o, s in zip(offset, local)), (shape, sizes, pl, r)


@pytest.mark.parametrize(("dp", "tp", "rows"), [(2, 2, 8), (2, 4, 16), (4, 2, 24), (3, 2, 12)])
def test_shard_order_is_fsdp2_over_tp(dp: int, tp: int, rows: int) -> None:
    """FSDP2 on a TP column-sharded weight: torch's (_StridedShard(0, split_factor=tp), Shard(0))."""
    torch_utils = pytest.importorskip("torch.distributed.tensor._utils")
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard

    lay = Layout(dp_shard=dp, tp=tp)
    w = Weight(
        "w", (rows, 3), placements={"dp_shard": Shard(0), "tp": Shard(0)}, shard_order=("tp", "dp_shard")
    )
    placements = [_StridedShard(0, split_factor=tp), TS(0)]
    for r in range(lay.world_size):
        coord = [lay.coords(r)["dp_shard"], lay.coords(r)["tp"]]
        local, offset = torch_utils._compute_local_shape_and_global_offset(
            (rows, 3), (dp, tp), coord, placements
        )
        assert w.box(lay, r) == tuple((o, o + n) for o, n in zip(offset, local))


def test_weight_round_trips() -> None:
    import json
    import pickle

    w = Weight(
        "w", (6, 4), "torch.bfloat16", {"dp": Shard(0), "tp": Shard(0), "x": Replicate()}, ("pp", 1), ("tp",)
    )
    assert w.dtype == "bfloat16" and w.itemsize == 2
    assert pickle.loads(pickle.dumps(w)) == w
    assert Weight.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    with pytest.raises(LayoutError, match="write 'Shard"):
        Weight.from_dict({"name": "w", "shape": [4], "placements": {"tp": "S0"}})


def test_chunk_is_torch_chunking() -> None:
    assert [chunk(0, 5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk(3, 10, 3, i) for i in range(3)] == [(3, 6), (6, 9), (9, 10)]


def test_box_stage_and_outside() -> None:
    lay = Layout(pp=2, tp=2, rank_offset=8)
    w = Weight("w", (4,), placements={"tp": Shard(0)}, stage=("pp", 1))
    assert w.box(lay, 8) is None and w.box(lay, 0) is None
    assert w.box(lay, 10) == ((0, 2),) and w.box(lay, 11) == ((2, 4),)


@pytest.mark.parametrize(
    ("make", "error", "text"),
    [
        (lambda: Weight("w", (4,), placements={"tp": Shard(1)}), LayoutError, "Shard(1) is out of range"),
        (
            lambda: Weight("w", (4,), placements={"tp": "shard"}),
            TypeError,
            "must be Shard(axis) or Replicate()",
        ),
        (
            lambda: Weight("w", (4,), placements=[("tp", Shard(0)), ("tp", Replicate())]),
            LayoutError,
            "two placements",
        ),
        (lambda: Weight("w", (4.0,)), TypeError, "shape must hold ints"),
        (lambda: Weight("w", (4,), dtype="nope"), LayoutError, "neither a numpy dtype name"),
        (lambda: Shard(-1), LayoutError, "axis must be >= 0"),
        (lambda: Weight("w", (4,), placements={"pp": Shard(0)}, stage=("pp", 0)), LayoutError, "stage dim"),
        (
            lambda: Weight("w", (4,), placements={"xp": Shard(0)}).box(Layout(tp=2), 0),
            LayoutError,
            "unknown dim 'xp'",
        ),
        (
            lambda: Weight("w", (4,), stage=("pp", 2)).box(Layout(pp=2), 0),
            LayoutError,
            "pp=2 is out of range",
        ),
    ],
)
def test_bad_input(make, error, text) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=__import__("re").escape(text)):
        make()


def test_plan_rejects() -> None:
    a = Weight("a", (4,), placements={"tp": Shard(0)})
    with pytest.raises(LayoutError, match="'b' is in dst_weights but not in src_weights"):
        plan_transfer(Layout(tp=2), [a], Layout(tp=2), [Weight("b", (4,))])
    with pytest.raises(LayoutError, match="same shape and dtype"):
        plan_transfer(Layout(tp=2), [a], Layout(tp=2), [Weight("a", (5,))])
    with pytest.raises(LayoutError, match="listed twice"):
        plan_transfer(Layout(tp=2), [a, a], Layout(tp=2), [a])
    with pytest.raises(TypeError, match="topology"):
        plan_transfer(Layout(tp=2), [a], Layout(tp=2), [a], topology=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rank must be an int"):
        plan_transfer(Layout(tp=2), [a], Layout(tp=2), [a], rank="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="min_part_bytes"):
        plan_transfer(Layout(tp=2), [a], Layout(tp=2), [a], min_part_bytes=0)
    with pytest.raises(LayoutError, match="unknown dim 'tp' in placements; dims are dp"):
        plan_transfer(Layout(dp=2), [a], Layout(tp=2), [a])
    part = plan_transfer(Layout(tp=2), [a], Layout(tp=2, rank_offset=2), [a], rank=9)  # in neither
    assert part.n_messages == 0 and list(part.messages) == [] and part.cross_node_lower_bound is None
    with pytest.raises(LayoutError, match="rank 9's messages only"):
        part.for_rank(0)
    whole = plan_transfer(Layout(tp=2), [a], Layout(tp=2, rank_offset=2), [a])
    assert "cross-node lower bound" in whole.summary() and "2 messages" in repr(whole)


def test_fsdp2_tp_to_tp4() -> None:
    trainer, rollout = Layout(dp_shard=2, tp=2), Layout(tp=4, rank_offset=4)
    sws = [
        Weight("wq", (8, 6), placements={"dp_shard": Shard(0), "tp": Shard(0)}),
        Weight("wo", (6, 8), placements={"dp_shard": Shard(0), "tp": Shard(1)}),
        Weight("norm", (6,), placements={"dp_shard": Shard(0)}),
    ]
    dws = [
        Weight("wq", (8, 6), placements={"tp": Shard(0)}),
        Weight("wo", (6, 8), placements={"tp": Shard(1)}),
        Weight("norm", (6,)),
    ]
    plan = _scenario(trainer, sws, rollout, dws, T4)
    assert plan.cross_node_bytes == plan.cross_node_lower_bound
    nodes = plan.per_node()
    assert nodes["send_cross"].tolist() == [plan.cross_node_bytes, 0]
    assert nodes["recv_cross"].tolist() == [0, plan.cross_node_bytes]
    # one node of 4 rollout ranks: the replicated norm crosses once and is forwarded
    assert plan.src == trainer and plan.dst == rollout and plan.weights == list(zip(sws, dws))
    norm = [m for m in plan.messages if m.weight == "norm"]
    assert sum(m.nbytes for m in norm if m.step == 0) == 6 * 4
    # its two pieces (FSDP halves) land on one representative, which forwards it whole
    fwd = [m for m in norm if m.step == 1]
    assert len(fwd) == 3 and {m.box for m in fwd} == {((0, 6),)} and len({m.src for m in fwd}) == 1


def test_colocated_tp2dp4_to_tp4dp2() -> None:
    lay_s, lay_d = Layout(dp=4, tp=2), Layout(dp=2, tp=4)
    sws = [Weight("w", (8, 8), placements={"tp": Shard(0)})]
    dws = [Weight("w", (8, 8), placements={"tp": Shard(0)})]
    plan = _scenario(lay_s, sws, lay_d, dws, T4)
    local = [m for m in plan.messages if m.src == m.dst]
    assert local and plan.n_local == len(local)
    assert plan.cross_node_bytes == 0  # every node holds the whole weight


def test_pipeline_to_no_pp() -> None:
    trainer, rollout = Layout(pp=2, tp=2), Layout(tp=2, rank_offset=4)
    sws = [Weight(f"l{i}", (4, 4), placements={"tp": Shard(1)}, stage=("pp", i)) for i in range(2)]
    dws = [Weight(f"l{i}", (4, 4), placements={"tp": Shard(1)}) for i in range(2)]
    plan = _scenario(trainer, sws, rollout, dws, None)
    assert {m.src for m in plan.messages if m.weight == "l1"} == {2, 3}


def test_experts_ep4_to_ep2() -> None:
    trainer, rollout = Layout(ep=4), Layout(ep=2, etp=2, rank_offset=4)
    sws = [Weight("experts", (8, 4, 6), placements={"ep": Shard(0)})]
    dws = [Weight("experts", (8, 4, 6), placements={"ep": Shard(0), "etp": Shard(2)})]
    _scenario(trainer, sws, rollout, dws, T4)


def test_uneven_and_permuted() -> None:
    trainer = Layout(dp=2, tp=3)
    rollout = Layout.from_grid([[9, 6], [11, 7], [8, 10]], ("tp", "dp"))
    sws = [Weight("u", (7, 5), "float16", {"dp": Shard(0), "tp": Shard(0)})]
    dws = [Weight("u", (7, 5), "float16", {"tp": Shard(0), "dp": Shard(1)})]
    _scenario(trainer, sws, rollout, dws, Topology(node=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.sampled_from([1 << 20, 2, 6]))
def test_plan_against_brute_force(
    world: tuple[Layout, list[Weight], Layout, list[Weight], Topology | None], min_part_bytes: int
) -> None:
    """min_part_bytes 2 or 6 (int16 elements): pieces with more holders than nodes to reach are
    cut into parts, exercising the split sends."""
    src, sws, dst, dws, topo = world
    plan = plan_transfer(src, sws, dst, dws, topology=topo, min_part_bytes=min_part_bytes)
    check_plan(plan, src, sws, dst, dws, 1 if topo is None else _node(topo))
    check_balance(plan, src, sws, dst, dws, 1 if topo is None else _node(topo), min_part_bytes)
    check_local(plan, src, sws, dst, dws, topo, min_part_bytes)


@pytest.mark.parametrize(
    "module",
    [
        "",
        "._spec",
        *(f"._plan.{m}" for m in ("shards", "assign", "senders", "routes", "stats", "plan")),
    ],
)
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    name = f"meshgroups.transfer{module}"
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.processes
def test_import_is_torch_free() -> None:
    import subprocess
    import sys

    code = "import sys, meshgroups.transfer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rank_plan_figures_over_its_own_ranks() -> None:
    """A rank's plan in a world much larger than its messages is tallied over the ranks it
    names only; its figures and its world-wide arrays agree with its messages."""
    trainer, rollout = Layout(dp=64, tp=2), Layout(dp=2, tp=2, rank_offset=128)
    whole = plan_transfer(trainer, _layers(2), rollout, _layers(2), topology=T4)
    for r in (0, 1, 128, 131):
        mine = plan_transfer(trainer, _layers(2), rollout, _layers(2), topology=T4, rank=r)
        sent: dict[int, int] = {}
        got: dict[int, int] = {}
        step0: dict[int, int] = {}
        for m in mine.messages:
            if m.src != m.dst:
                sent[m.src] = sent.get(m.src, 0) + m.nbytes
                got[m.dst] = got.get(m.dst, 0) + m.nbytes
                if m.step == 0:
                    step0[m.src] = step0.get(m.src, 0) + m.nbytes
        assert mine._touched is not None  # the sparse tally was used
        assert dict(mine.send_bytes) == sent and dict(mine.recv_bytes) == got
        assert mine.busiest_send_bytes == max(step0.values(), default=0)
        arr = mine.send_array()
        assert arr.size == 132 and {i: int(v) for i, v in enumerate(arr) if v} == sent
        assert mine.stats.recv[r] == whole.stats.recv[r] and mine.stats.send[r] == whole.stats.send[r]


@pytest.mark.processes
def test_rank_part_is_the_same_in_another_process() -> None:
    """Sender and receiver plan in different processes (another hash seed): the choices are
    functions of the weights alone, so both compute the same messages."""
    import subprocess
    import sys

    code = (
        "from meshgroups import Layout, Topology\n"
        "from meshgroups.transfer import Shard, Weight, plan_transfer\n"
        "ws = [Weight(f'w{i}', (8, 4 + i), 'bfloat16', {'tp': Shard(i % 2)}) for i in range(6)]\n"
        "t, r = Layout(pp=1, dp=6, tp=2), Layout(tp=2, rank_offset=12)\n"
        "for k in (0, 5, 12):\n"
        "    p = plan_transfer(t, ws, r, ws, topology=Topology(node=4), rank=k, min_part_bytes=4)\n"
        "    print([(m.weight, m.src, m.dst, m.box, m.step) for m in p.messages])\n"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    there = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    here: list[str] = []
    ws = [Weight(f"w{i}", (8, 4 + i), "bfloat16", {"tp": Shard(i % 2)}) for i in range(6)]
    t, r = Layout(pp=1, dp=6, tp=2), Layout(tp=2, rank_offset=12)
    for k in (0, 5, 12):
        p = plan_transfer(t, ws, r, ws, topology=T4, rank=k, min_part_bytes=4)
        here.append(str([(m.weight, m.src, m.dst, m.box, m.step) for m in p.messages]))
    assert there.stdout.splitlines() == here and any(len(line) > 2 for line in here)


def test_message_is_value() -> None:
    m = Message("w", 0, 1, ((0, 2),), 8, 0)
    assert m == Message("w", 0, 1, ((0, 2),), 8, 0) and math.isfinite(m.nbytes)
