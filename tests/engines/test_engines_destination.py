"""A vLLM worker's parameters as global weights and a name map (``meshgroups.engines.vllm._destination``;
vLLM-free): shapes and placements per layer kind, fused parts sharded per part, kv heads
replicated over more tp ranks than there are heads (repeated segments), the refusals — and the
replicated-kv rule moving real data with ``WeightSync`` on 3 gloo processes.
"""

from __future__ import annotations

import sys

import pytest

from meshgroups.engines.vllm._destination import (
    Param,
    destination,
    destinations,
    engine_destinations,
    fused_parts,
)
from meshgroups.errors import LayoutError
from meshgroups.transfer import Replicate, Segment, Shard
from tests.support.dist import run

QKV = (("q.weight", 256, 256), ("k.weight", 128, 128), ("v.weight", 128, 128))


def test_plain_kinds():
    col, _ = destination(Param("e.weight", (128, 64), "float32", axis=0), tp=2)
    row, _ = destination(Param("o.weight", (64, 32), "bfloat16", axis=1), tp=2)
    rep, rule = destination(Param("norm.weight", (64,), "float32"), tp=2)
    assert (col.shape, col.placements) == ((256, 64), {"tp": Shard(0)})
    assert (row.shape, row.dtype, row.placements) == ((64, 64), "bfloat16", {"tp": Shard(1)})
    assert (rep.shape, dict(rep.placements)) == ((64,), {}) and rule.sources == ("norm.weight",)
    one, _ = destination(Param("e.weight", (128, 64), "float32", axis=0), tp=1)  # tp=1: whole
    assert one.shape == (128, 64) and not isinstance(one.placements.get("tp"), Shard)
    assert not isinstance(rep.placements.get("tp", Replicate()), Shard)


def test_fused_per_part():
    w, rule = destination(Param("qkv.weight", (256, 64), "float32", 0, QKV), tp=2)
    assert w.shape == (512, 64) and rule.sharding == "per_part" and rule.axis == 0
    assert rule.sources == ("q.weight", "k.weight", "v.weight")
    assert all(len(part) == 1 and part[0].full for part in rule.parts)


def test_replicated_kv_heads_are_repeated_segments():
    # 4 q heads, 1 kv head of 64 rows, tp=2: vLLM gives each rank the one kv head
    parts = (("q.weight", 256, 256), ("k.weight", 128, 64), ("v.weight", 128, 64))
    w, rule = destination(Param("qkv.weight", (256, 64), "float32", 0, parts), tp=2)
    assert w.shape == (512, 64)
    assert rule.parts[1] == (Segment("k.weight", 0, 64), Segment("k.weight", 0, 64))
    # 2 kv heads over tp=4: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    parts4 = (("q.weight", 256, 256), ("k.weight", 256, 128), ("v.weight", 256, 128))
    _, rule4 = destination(Param("qkv.weight", (192, 64), "float32", 0, parts4), tp=4)
    assert [(s.start, s.stop) for s in rule4.parts[2]] == [(0, 64), (0, 64), (64, 128), (64, 128)]


def test_refusals_name_the_parameter_and_the_rule():
    with pytest.raises(LayoutError, match=r"'qkv.weight'.*add up to 400"):
        destination(Param("qkv.weight", (256, 64), "float32", 0, (("q.weight", 400, 400),)), tp=2)
    with pytest.raises(
        LayoutError, match=r"'qkv.weight': part 'k.weight' is 96 long over tp=2.*trainer weight is 64"
    ):
        destination(Param("qkv.weight", (48, 64), "float32", 0, (("k.weight", 96, 64),)), tp=2)


def test_name_map_and_fused_names():
    ws, m = destinations(
        [Param("a.qkv.weight", (256, 64), "float32", 0, QKV), Param("n.weight", (4,), "float32")], 2
    )
    assert [w.name for w in ws] == ["a.qkv.weight", "n.weight"]
    assert list(m) == ["a.qkv.weight"]  # a same-named weight needs no rule
    assert fused_parts("m.l.0.self_attn.qkv_proj.bias", {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}) == (
        "qkv_proj",
        ["m.l.0.self_attn.q_proj.bias", "m.l.0.self_attn.k_proj.bias", "m.l.0.self_attn.v_proj.bias"],
    )
    assert fused_parts("m.norm.weight", {"qkv_proj": ["q_proj"]}) is None


def worker_replicated_kv(rank: int, world: int):
    import torch

    from meshgroups import Layout
    from meshgroups.transfer._run.sync import WeightSync

    hd = 4
    torch.manual_seed(0)
    full = {
        "q.weight": torch.randn(4 * hd, 8),
        "k.weight": torch.randn(hd, 8),
        "v.weight": torch.randn(hd, 8),
    }
    parts = (("q.weight", 4 * hd, 4 * hd), ("k.weight", 2 * hd, hd), ("v.weight", 2 * hd, hd))
    ws, m = destinations([Param("qkv.weight", (4 * hd, 8), "float32", 0, parts)], tp=2)
    buf = {"qkv.weight": torch.full((4 * hd, 8), float("nan"))}
    with WeightSync(
        full if rank == 0 else None, Layout(tp=1), buf if rank else None, Layout(tp=2, rank_offset=1),
        rollout_weights=ws, name_map=m,
    ) as sync:  # fmt: skip
        sync.sync()
    if rank:
        r = rank - 1
        want = torch.cat([full["q.weight"].chunk(2)[r], full["k.weight"], full["v.weight"]])
        return bool(torch.equal(buf["qkv.weight"], want))
    return True


@pytest.mark.processes
@pytest.mark.skipif(sys.platform != "linux", reason="gloo processes")
def test_replicated_kv_moves_the_right_rows():
    assert run(worker_replicated_kv, 3, timeout=120) == [True, True, True]


# ---------------------------------------------------------------- family maps and stacked experts
E, INTER, H = 4, 8, 4
MLP = "model.layers.0.mlp"
W13 = f"{MLP}.experts.routed_experts.w13_weight"  # vLLM 0.32's names
W2 = f"{MLP}.experts.routed_experts.w2_weight"


def moe_params(tp: int, ep: bool, experts: tuple[int, ...]) -> list[Param]:
    """What a worker of a tp=2 engine reads from a 1-layer Qwen3-MoE (read.py's Params)."""
    if ep:
        w13 = Param(W13, (E // tp, 2 * INTER, H), "float32", 0, experts=experts)
        w2 = Param(W2, (E // tp, H, INTER), "float32", 0, experts=experts)
    else:
        w13 = Param(W13, (E, 2 * INTER // tp, H), "float32", 1, experts=experts)
        w2 = Param(W2, (E, H, INTER // tp), "float32", 2, experts=experts)
    return [w13, w2, Param(f"{MLP}.gate.weight", (E, H), "float32")]


def family(ep: int = 1, placement: str = "linear", experts: str = "packed"):
    from meshgroups.transfer._names.families import hf_to_vllm

    cfg = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 1,
        "num_experts": E,
        "moe_intermediate_size": INTER,
    }
    fam = hf_to_vllm(cfg, ep=ep, placement=placement, experts=experts)
    # the attention of the layer is not among these Params: keep the map's MoE rules only
    from meshgroups.transfer import NameMap

    return NameMap({k: v for k, v in fam.items() if ".experts." in k})


def test_stacked_experts_take_the_family_stack_in_vllm_order():
    every = tuple(range(E))
    ws, m = engine_destinations([moe_params(2, False, every)] * 2, 2, family())
    assert [(w.shape, w.placements["tp"]) for w in ws[:2]] == [
        ((E, 2 * INTER, H), Shard(1)),
        ((E, H, INTER), Shard(2)),
    ]
    assert m.rule(W13) == family()[f"{MLP}.experts.w13_weight"]  # the family's stack, under vLLM's name
    # expert parallel: worker r holds positions [2r, 2r + 2), the experts its expert map says
    ws, m = engine_destinations([moe_params(2, True, (0, 1)), moe_params(2, True, (2, 3))], 2, family(ep=2))
    assert (ws[0].shape, ws[0].placements["tp"]) == ((E, 2 * INTER, H), Shard(0))
    rr = [moe_params(2, True, (0, 2)), moe_params(2, True, (1, 3))]  # round-robin placement
    _, m = engine_destinations(rr, 2, family(ep=2, placement="round_robin"))
    assert [s.index for s in m.rule(W2).segments] == [0, 2, 1, 3]
    _, m = engine_destinations(rr, 2, family(ep=2, placement="round_robin", experts="per_expert"))
    assert m.rule(W2).sources[1] == f"{MLP}.experts.2.down_proj.weight"


def test_family_refusals_name_the_weight_and_the_rule():
    rr = [moe_params(2, True, (0, 2)), moe_params(2, True, (1, 3))]
    with pytest.raises(
        LayoutError, match=r"w13_weight': position 1 holds expert 2 .*reads expert 1.*placement"
    ):
        engine_destinations(rr, 2, family(ep=2))  # the map says linear, vLLM placed round-robin
    with pytest.raises(LayoutError, match=r"holds stacked experts: .*name_map=hf_to_vllm"):
        engine_destinations([moe_params(2, False, tuple(range(E)))] * 2, 2)
    qkv = Param("a.qkv_proj.weight", (512, 64), "float32", 0, QKV)  # tp=1: the whole fused weight
    with pytest.raises(
        LayoutError, match=r"'a.qkv_proj.weight': the family map fuses \['q.weight', 'v.weight'"
    ):
        engine_destinations([[qkv]], 1, {"a.qkv_proj.weight": ["q.weight", "v.weight", "k.weight"]})
    with pytest.raises(LayoutError, match=r"does not have, e.g. \['lm_head.weight'\].*tied head"):
        engine_destinations([[qkv]], 1, {"lm_head.weight": "embed.weight"})
    with pytest.raises(LayoutError, match=r"stacks 4 experts, vLLM holds 2"):
        engine_destinations(
            [[Param(W2, (2, H, INTER), "float32", experts=(0, 1))]],
            1,
            {W2: family()[f"{MLP}.experts.w2_weight"]},
        )
    with pytest.raises(
        LayoutError, match=r"worker 1 reads another destination than worker 0 \(first difference: a"
    ):
        engine_destinations([[qkv], [Param("a.qkv_proj.weight", (256, 64), "float32", 0, QKV)]], 2)
    # a fused rule agreeing with vLLM's layer keeps the layer's (replicated kv heads live there)
    _, m = engine_destinations([[qkv]], 1, {"a.qkv_proj.weight": ["q.weight", "k.weight", "v.weight"]})
    assert m.rule("a.qkv_proj.weight").sources == ("q.weight", "k.weight", "v.weight")


def worker_stacked_experts(rank: int, world: int, ep: bool, placement: str):
    """Trainer rank 0 holds Transformers 5's packed experts whole; engine ranks 1, 2 receive
    vLLM's w13/w2 (tp: half of each expert's rows; ep: their own experts, in placement order)."""
    import torch

    from meshgroups import Layout
    from meshgroups.transfer._names.stacking import expert_order
    from meshgroups.transfer._run.sync import WeightSync

    torch.manual_seed(0)
    full = {
        f"{MLP}.experts.gate_up_proj": torch.randn(E, 2 * INTER, H),
        f"{MLP}.experts.down_proj": torch.randn(E, H, INTER),
        f"{MLP}.gate.weight": torch.randn(E, H),
    }
    order = expert_order(E, 2, placement) if ep else list(range(E))
    per_worker = [
        moe_params(2, ep, tuple(order[2 * r : 2 * r + 2]) if ep else tuple(order)) for r in range(2)
    ]
    ws, m = engine_destinations(per_worker, 2, family(ep=2 if ep else 1, placement=placement))
    mine = per_worker[rank - 1] if rank else []
    buf = {p.name: torch.full(p.local_shape, float("nan")) for p in mine}
    with WeightSync(
        full if rank == 0 else None, Layout(tp=1), buf if rank else None, Layout(tp=2, rank_offset=1),
        rollout_weights=ws, name_map=m,
    ) as sync:  # fmt: skip
        report = sync.sync()
    if not rank:
        return True
    r = rank - 1
    gu, down = full[f"{MLP}.experts.gate_up_proj"], full[f"{MLP}.experts.down_proj"]
    if ep:
        experts = list(mine[0].experts or ())
        w13, w2 = gu[experts], down[experts]
    else:  # per part: gate rows [rI/2, (r+1)INTER/2) then up rows the same
        h = INTER // 2
        w13 = torch.cat([gu[:, r * h : (r + 1) * h], gu[:, INTER + r * h : INTER + (r + 1) * h]], dim=1)
        w2 = down[:, :, r * h : (r + 1) * h]
    nbytes = sum(b.numel() * b.element_size() for b in buf.values())
    return (
        bool(torch.equal(buf[W13], w13))
        and bool(torch.equal(buf[W2], w2))
        and bool(torch.equal(buf[f"{MLP}.gate.weight"], full[f"{MLP}.gate.weight"]))
        and report.bytes_received == nbytes
    )


@pytest.mark.processes
@pytest.mark.skipif(sys.platform != "linux", reason="gloo processes")
@pytest.mark.parametrize("ep, placement", [(False, "linear"), (True, "linear"), (True, "round_robin")])
def test_stacked_experts_move_the_right_rows(ep, placement):
    assert run(worker_stacked_experts, 3, ep, placement, timeout=120) == [True, True, True]
