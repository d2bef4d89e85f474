"""The planner enters each weight once per plan (issue 45): counters on our own planner functions
(``Planner._route``, the per-weight entry point, and ``Planner._list``, the routing of one source
block's pairs) over one ``plan_transfer`` and everything later stages read from it — the
messages (iterated and indexed), ``for_rank``, the statistics, ``moves``, the transfer groups,
``execute`` and ``WeightSync.sync`` (on a one-process gloo world, in this process).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from meshgroups import Layout, Topology
from meshgroups.transfer import Shard, Weight, plan_transfer
from meshgroups.transfer._plan.routes import Planner


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Counter, Counter]]:
    """``(weights, blocks)``: how often each plan's weight was entered and each of its source
    blocks routed, keyed by ``(plan, weight)`` and ``(plan, weight, block)``."""
    weights: Counter = Counter()
    blocks: Counter = Counter()
    route, listing = Planner._route, Planner._list

    def counted_route(self, w):  # type: ignore[no-untyped-def]
        weights[(id(self), w)] += 1
        return route(self, w)

    def counted_list(self, w, s_block):  # type: ignore[no-untyped-def]
        blocks[(id(self), w, s_block)] += 1
        return listing(self, w, s_block)

    monkeypatch.setattr(Planner, "_route", counted_route)
    monkeypatch.setattr(Planner, "_list", counted_list)
    yield weights, blocks


def _weights(n: int) -> list[Weight]:
    return [
        Weight(f"l{i}.{kind}", (16, 8), placements={"tp": Shard(axis)}, stage=("pp", i % 2))
        for i in range(n)
        for kind, axis in (("q", 0), ("o", 1))
    ]


def test_a_whole_plan_and_everything_read_from_it_enter_each_weight_once(entered):
    weights, blocks = entered
    trainer, rollout = Layout(pp=2, dp=2, tp=2), Layout(dp=2, tp=4, rank_offset=8)
    src = _weights(4)
    dst = [Weight(w.name, w.shape, placements={"tp": Shard(1 - w.placements["tp"].axis)}) for w in src]
    plan = plan_transfer(trainer, src, rollout, dst, topology=Topology(node=4), min_part_bytes=16)
    first = list(plan.messages)
    assert list(plan.messages) == first and [plan.messages[i] for i in range(len(first))] == first
    for r in range(16):
        mine = plan.for_rank(r)
        assert mine == plan.for_rank(r) == [m for m in first if r in (m.src, m.dst)]
    assert plan.stats.send.sum() == plan.send_array().sum() > 0
    (key,) = {plan_id for plan_id, _ in weights}
    assert weights == Counter({(key, w): 1 for w in range(len(dst))})
    assert blocks and set(blocks.values()) == {1}, "a source block was routed twice"


def test_a_mapped_plan_and_its_moves_enter_each_weight_once(entered):
    weights, blocks = entered
    t = [Weight(n, (s, 8), "float32", {"tp": Shard(0)}) for n, s in (("q", 16), ("k", 8), ("v", 8))]
    r = [Weight("qkv", (32, 8), "bfloat16", {"tp": Shard(0)})]
    plan = plan_transfer(
        Layout(dp=2, tp=2),
        t,
        Layout(tp=4, rank_offset=4),
        r,
        name_map={"qkv": ["q", "k", "v"]},
        cast="bfloat16",
    )
    for rank in range(8):
        plan.moves(rank)
    assert plan.mapping is not None and len(plan.mapping.links) == 3
    assert sorted(w for _, w in weights) == [0, 1, 2] and set(weights.values()) == {1}
    assert set(blocks.values()) == {1}


def test_a_rank_part_executed_and_synced_enters_each_weight_once(entered):
    """One process, one rank: ``plan_transfer`` (whole, and this rank's part), the transfer
    groups, ``execute``, and a ``WeightSync`` built and synced twice (one plan)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from meshgroups.transfer import TransferGroups, WeightSync, execute

    weights, blocks = entered
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ws = [Weight(f"w{i}", (4, 3)) for i in range(3)]
        for rank in (None, 0):
            plan = plan_transfer(Layout(dp=1), ws, Layout(dp=1), ws, rank=rank)
            buffers = {w.name: torch.zeros(4, 3) for w in ws}
            with TransferGroups(plan) as groups:
                execute(plan, {w.name: torch.ones(4, 3) for w in ws}, buffers, groups=groups)
            assert all(bool((b == 1).all()) for b in buffers.values())
        trainer = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        rollout = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        with WeightSync(trainer, Layout(dp=1), rollout, Layout(dp=1)) as sync:
            sync.sync()
            sync.sync()
            assert sync.plans == 1 and torch.equal(rollout[1].weight, trainer[1].weight)
    finally:
        dist.destroy_process_group()
    per_plan = Counter(plan_id for plan_id, _ in weights)
    assert sorted(per_plan.values()) == [3, 3, 4]  # two plans of 3 weights, the sync's of 4
    assert set(weights.values()) == {1} and set(blocks.values()) == {1}
