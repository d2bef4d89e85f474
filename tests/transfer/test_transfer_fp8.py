"""Block-fp8 destinations: the plan's scale tensors and the sender's quantizer against a
reference quantizer applied to each full rollout tensor (``tests/support/fp8_oracle.py``):
random layouts, fusions, stacked experts (packed, round-robin) and block sizes; every value and
scale bit-exact and written exactly once, cross-node bytes at the brute force's lower bound;
the alignment rules' errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgroups import Layout, Topology
from meshgroups.errors import LayoutError
from meshgroups.transfer import NameMap, Shard, Weight, plan_transfer
from meshgroups.transfer._names.quant import BlockFP8
from meshgroups.transfer._names.stacking import expert_order, stack_experts
from meshgroups.transfer._run.fp8 import block_scales, quantize_blocks

from ..support.fp8_oracle import check_fp8, reference_quantize


@st.composite
def fp8_worlds(draw: st.DrawFn) -> tuple:  # type: ignore[type-arg]
    br, bc = draw(st.sampled_from([(1, 1), (2, 2), (2, 3), (3, 2)]))
    t_dp, t_tp = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    r_ep, r_tp = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    src = Layout(dp=t_dp, tp=t_tp)
    dst = Layout(ep=r_ep, tp=r_tp, rank_offset=0 if draw(st.booleans()) else src.size())
    k = draw(st.integers(1, 2))
    rows, cols = br * 4 * k, bc * 4 * draw(st.integers(1, 2))  # every shard holds whole blocks
    i_size = br * 2 * draw(st.integers(1, 2))
    e = 2 * r_ep
    fsdp = {"dp": Shard(1)} if draw(st.booleans()) else {}
    sws = [
        Weight("dense", (rows, cols), "float32", {"tp": Shard(0), **fsdp}),
        Weight("gate", (i_size, cols), "float32", {"tp": Shard(0)}),
        Weight("up", (i_size, cols), "float32", {"tp": Shard(0)}),
        Weight("experts.gate_up", (e, 2 * i_size, cols), "float32", {"dp": Shard(0), "tp": Shard(1)}),
        Weight("norm", (cols,), "float32"),
    ]
    order = expert_order(e, r_ep, draw(st.sampled_from(["linear", "round_robin"])))
    nm = NameMap(
        {
            "gate_up": ["gate", "up"],
            "w13": stack_experts(
                lambda x: [
                    {"source": "experts.gate_up", "index": x, "start": 0, "stop": i_size},
                    {"source": "experts.gate_up", "index": x, "start": i_size, "stop": 2 * i_size},
                ],
                order,
            ),
        }
    )
    q = BlockFP8((br, bc))
    d_axis = draw(st.sampled_from([0, 1]))
    r_pl = {"tp": Shard(d_axis)}
    dws = [
        Weight("dense", (rows, cols), "float8_e4m3fn", r_pl),
        Weight("dense_scale_inv", q.scale_shape((rows, cols)), "float32", r_pl),
        Weight("gate_up", (2 * i_size, cols), "float8_e4m3fn", {"tp": Shard(0)}),
        Weight("gate_up_scale_inv", q.scale_shape((2 * i_size, cols)), "float32", {"tp": Shard(0)}),
        Weight("w13", (e, 2 * i_size, cols), "float8_e4m3fn", {"ep": Shard(0), "tp": Shard(1)}),
        Weight(
            "w13_scale_inv", q.scale_shape((e, 2 * i_size, cols)), "float32", {"ep": Shard(0), "tp": Shard(1)}
        ),
        Weight("norm", (cols,), "bfloat16"),
    ]
    topo = draw(st.sampled_from([Topology(node=1), Topology(node=2), Topology(node=4)]))
    return src, sws, dst, dws, nm, q, topo, draw(st.integers(0, 1000))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_worlds())
def test_random_fp8_destinations_bit_exact(world: tuple) -> None:  # type: ignore[type-arg]
    src, sws, dst, dws, nm, q, topo, seed = world
    plan = plan_transfer(src, sws, dst, dws, topo, name_map=nm, cast="bfloat16", quantize=q)
    assert check_fp8(plan, src, sws, dst, dws, nm, q, seed) > 0
    for r in (0, dst.max_rank):
        mine = plan_transfer(src, sws, dst, dws, topo, rank=r, name_map=nm, cast="bfloat16", quantize=q)
        assert mine.moves(r) == plan.moves(r)


def test_quantizer_matches_reference_ragged_blocks() -> None:
    x = torch.randn(2, 5, 7) * 10
    x[0, :3, :3] = 0  # an all-zero block
    q, s = quantize_blocks(x, (3, 3))
    rq, rs = reference_quantize(x, (3, 3))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert s.shape == (2, 2, 3) and torch.equal(block_scales(x, (3, 3)), s)


def test_ragged_last_block_on_an_unsharded_axis() -> None:
    t = [Weight("w", (5, 7), "float32", {"tp": Shard(1)})]
    q = BlockFP8((2, 7))
    r = [Weight("w", (5, 7), "float8_e4m3fn"), Weight("w_scale_inv", (3, 1), "float32")]
    src, dst = Layout(tp=1), Layout(tp=2, rank_offset=1)
    plan = plan_transfer(src, t, dst, r, quantize=q)
    assert check_fp8(plan, src, t, dst, r, NameMap({}), q) == 2 * (35 + 3)


def test_scales_count_in_the_plan_bytes() -> None:
    t = [Weight("w", (256, 256), "float32", {"tp": Shard(0)})]
    r = [
        Weight("w", (256, 256), "float8_e4m3fn", {"tp": Shard(0)}),
        Weight("w_scale_inv", (2, 2), "float32", {"tp": Shard(0)}),
    ]
    plan = plan_transfer(
        Layout(tp=2), t, Layout(tp=2, rank_offset=2), r, Topology(node=2), quantize=BlockFP8()
    )
    assert plan.cross_node_bytes == plan.cross_node_lower_bound == 256 * 256 + 4 * 4


@pytest.mark.parametrize(
    ("t", "r", "match"),
    [
        (  # trainer tp=2 over 6 rows with blocks of 4: a shard holds [0, 3)
            [Weight("w", (6, 4), "float32", {"tp": Shard(0)})],
            [Weight("w", (6, 4), "float8_e4m3fn"), Weight("w_scale_inv", (2, 1), "float32")],
            r"the trainer's shard over tp at tp=0 holds \[0, 3\) of axis 0",
        ),
        (
            [Weight("w", (8, 4), "float32")],
            [Weight("w", (8, 4), "float8_e4m3fn")],
            "list its scales 'w_scale_inv'",
        ),
        (
            [Weight("w", (8, 4), "float32")],
            [Weight("w", (8, 4), "float8_e4m3fn"), Weight("w_scale_inv", (2, 2), "float32")],
            r"must be float32 of shape \(2, 1\)",
        ),
        (  # q ‖ k with q of 6 rows: k starts inside a block
            [Weight("q", (6, 4), "float32"), Weight("k", (2, 4), "float32")],
            [Weight("qk", (8, 4), "float8_e4m3fn"), Weight("qk_scale_inv", (2, 1), "float32")],
            "part 1 starts at 6",
        ),
    ],
)
def test_misaligned_blocks_refused(t: list, r: list, match: str) -> None:  # type: ignore[type-arg]
    nm = {"qk": ["q", "k"]} if r[0].name == "qk" else {}
    with pytest.raises(LayoutError, match=match):
        plan_transfer(Layout(tp=2), t, Layout(tp=1, rank_offset=2), r, name_map=nm, quantize=BlockFP8((4, 4)))
