"""MoE expert stacking: random stackings, transposes, expert placements and ep-sharded trainers
against the brute force of ``tests/support/moe_oracle.py`` (every rollout element exactly once,
cross-node bytes at the lower bound), the rules' checks, and a rank's part equal to the whole."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from meshgroups import Layout, Topology
from meshgroups.errors import LayoutError
from meshgroups.transfer import NameMap, Shard, Weight, plan_transfer
from meshgroups.transfer._names.stacking import Stack, expert_order, stack_experts

from ..support.moe_oracle import check_moe, moe_worlds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_worlds())
def test_random_moe_layers_against_brute_force(world: tuple) -> None:  # type: ignore[type-arg]
    src, sws, dst, dws, nm, topo = world
    plan = plan_transfer(src, sws, dst, dws, topo, name_map=nm, cast="bfloat16")
    check_moe(plan, src, sws, dst, dws, nm, topo.size("node"))
    for r in (0, dst.max_rank):  # a rank's own part is the whole plan's, filtered
        mine = plan_transfer(src, sws, dst, dws, topo, rank=r, name_map=nm, cast="bfloat16")
        assert mine.moves(r) == plan.moves(r)


def test_expert_orders() -> None:
    assert expert_order(6, 3) == [0, 1, 2, 3, 4, 5]
    assert expert_order(6, 3, "round_robin") == [0, 3, 1, 4, 2, 5]
    with pytest.raises(LayoutError, match="does not divide"):
        expert_order(6, 4)
    with pytest.raises(LayoutError, match="not one of"):
        expert_order(4, 2, "eplb")


def _layer(e: int = 4, i: int = 4, h: int = 2) -> tuple[list[Weight], list[Weight]]:
    t = [
        Weight(f"e{k}.{p}", (i, h), placements={"tp": Shard(0)}, stage=("ep", k // 2))
        for k in range(e)
        for p in ("gate", "up")
    ]
    r = [Weight("w13", (e, 2 * i, h), placements={"ep": Shard(0), "tp": Shard(1)})]
    return t, r


def test_round_robin_rank_holds_its_experts() -> None:
    t, r = _layer()
    src, dst = Layout(ep=2, tp=2), Layout(ep=2, tp=2, rank_offset=4)
    nm = {"w13": stack_experts(lambda k: [f"e{k}.gate", f"e{k}.up"], expert_order(4, 2, "round_robin"))}
    plan = plan_transfer(src, t, dst, r, Topology(node=4), name_map=nm)
    # rollout rank 6 (ep 1, tp 0) holds positions 2, 3 = experts 1 and 3, gate rows 0:2 then up rows 0:2
    got = sorted({(mv.src_name, mv.dst_local[0]) for mv in plan.moves(6)})
    assert got == [("e1.gate", (0, 1)), ("e1.up", (0, 1)), ("e3.gate", (1, 2)), ("e3.up", (1, 2))]
    assert plan.mapping is not None and plan.mapping.buffer_shape("w13", 6) == (2, 4, 2)
    assert plan.cross_node_bytes == plan.cross_node_lower_bound == 4 * 8 * 2 * 4


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ({"w13": {"stack": [["e0.gate", "e0.up"]] * 3}}, "a stack of 3 entries needs axis 0 of 3"),
        (
            {
                "w13": {
                    "stack": [["e0.gate", "e0.up"], ["e1.gate"], ["e2.gate", "e2.up"], ["e3.gate", "e3.up"]]
                }
            },
            "stack entry 1",
        ),
        ({"w13": {"stack": [[{"source": "e0.gate", "index": 9}, "e0.up"]] * 4}}, "index 9 is outside"),
    ],
)
def test_bad_stacks_name_the_rule(rules: dict, match: str) -> None:  # type: ignore[type-arg]
    t, r = _layer()
    with pytest.raises(LayoutError, match=match):
        plan_transfer(
            Layout(ep=2, tp=2), t, Layout(ep=2, tp=2, rank_offset=4), r, name_map=rules, allow_unused=True
        )


def test_index_outside_a_stack_refused() -> None:
    t = [Weight("gate_up", (2, 4, 2))]
    with pytest.raises(LayoutError, match="only inside a stack"):
        plan_transfer(
            Layout(tp=1),
            t,
            Layout(tp=1),
            [Weight("g", (2, 2))],
            name_map={"g": {"source": "gate_up", "index": 0, "start": 0, "stop": 2}},
        )


def test_unread_expert_named() -> None:
    t = [Weight("gate_up", (2, 4, 2))]
    nm = {"w13": {"stack": [[{"source": "gate_up", "index": 0}]]}}
    with pytest.raises(LayoutError, match=r"gate_up\[index 1\]"):
        plan_transfer(Layout(tp=1), t, Layout(tp=1), [Weight("w13", (1, 4, 2))], name_map=nm)


def test_stack_round_trips_json() -> None:
    nm = NameMap(
        {
            "w": stack_experts(
                lambda k: [{"source": "gu", "index": k, "start": 0, "stop": 2, "transpose": True}], [1, 0]
            )
        }
    )
    assert NameMap.loads(nm.dumps()) == nm
    assert isinstance(nm.rule("w"), Stack) and nm.rule("w").sources == ("gu",)
