"""Ready-made maps of real model families (``meshgroups.transfer._names.families``) against the real
``transformers`` model classes, built from tiny configs (``from_config``, random init, no
download): the trainer's names and shapes are the class's own; the rollout's are vLLM's names
with the shapes derived here from the class's (fused q/k/v, gate/up, MLA's ``fused_qkv_a_proj``,
stacked experts). Each plan is checked both ways (every trainer weight read, every rollout
weight written) and run on ids by the MoE brute force (every element exactly once, cross-node
bytes at the lower bound), on an ep × tp trainer into an ep rollout in both expert placements."""

from __future__ import annotations

import pytest

from meshgroups import Layout, Topology
from meshgroups.transfer import NameMap, Shard, Weight, plan_transfer
from meshgroups.transfer._names.families import hf_to_vllm, moe_layers

from ..support.family_configs import config, hf_shapes
from ..support.moe_oracle import check_moe

transformers = pytest.importorskip("transformers")


def _configs() -> dict[str, object]:
    return {k: config(k) for k in ("llama", "qwen2", "qwen3", "gemma", "qwen3_moe", "deepseek_v3")}


_hf_shapes = hf_shapes


def _vllm_shapes(hf: dict[str, tuple[int, ...]], kind: str) -> dict[str, tuple[int, ...]]:
    """vLLM's parameter names, shapes from the class's: what vLLM fuses, fused."""
    out = dict(hf)

    def fuse(new: str, olds: list[str]) -> None:
        if all(o in out for o in olds):
            shapes = [out.pop(o) for o in olds]
            out[new] = (sum(s[0] for s in shapes), *shapes[0][1:])

    for n in list(hf):
        a = n.rsplit(".", 2)[0]
        if n.endswith("self_attn.q_proj.weight") and kind != "deepseek_v3":
            fuse(f"{a}.qkv_proj.weight", [f"{a}.{x}_proj.weight" for x in "qkv"])
            fuse(f"{a}.qkv_proj.bias", [f"{a}.{x}_proj.bias" for x in "qkv"])
        if n.endswith("self_attn.q_a_proj.weight"):
            fuse(f"{a}.fused_qkv_a_proj.weight", [f"{a}.q_a_proj.weight", f"{a}.kv_a_proj_with_mqa.weight"])
        if n.endswith("mlp.gate_proj.weight") or n.endswith("shared_experts.gate_proj.weight"):
            fuse(f"{a}.gate_up_proj.weight", [f"{a}.gate_proj.weight", f"{a}.up_proj.weight"])
        if n.endswith("mlp.experts.gate_up_proj"):
            e = n.rsplit(".", 1)[0]
            out[f"{e}.w13_weight"] = out.pop(n)  # [E, 2I, H]: vLLM's layout, gate then up
            out[f"{e}.w2_weight"] = out.pop(f"{e}.down_proj")  # [E, H, I]
    return out


def _per_expert(hf: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The packed experts as one module per expert (Transformers 4 / checkpoint names)."""
    out = {}
    for n, s in hf.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            e = n.rsplit(".", 1)[0]
            for x in range(s[0]):
                for p in ("gate", "up"):
                    out[f"{e}.{x}.{p}_proj.weight"] = (s[1] // 2, s[2])
        elif n.endswith("mlp.experts.down_proj"):
            e = n.rsplit(".", 1)[0]
            for x in range(s[0]):
                out[f"{e}.{x}.down_proj.weight"] = s[1:]
        else:
            out[n] = s
    return out


def _placed(shapes: dict[str, tuple[int, ...]], lay: Layout, side: str) -> list[Weight]:
    """Trainer: tp shards axis 0 of matrices where it divides, ep axis 0 of packed experts
    (per-expert weights live on their ep rank). Rollout: ep shards the stacked experts."""
    ep = lay.size("ep") if "ep" in lay.names else 1
    out = []
    for n, s in shapes.items():
        pl: dict[str, Shard] = {}
        stage = None
        if side == "t":
            if len(s) == 3:
                pl = {"ep": Shard(0), "tp": Shard(1)}
            elif len(s) == 2 and s[0] % 2 == 0:
                pl = {"tp": Shard(0)}
            parts = n.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
                stage = ("ep", int(parts[parts.index("experts") + 1]) * ep // 4)
        elif len(s) == 3:
            pl = {"ep": Shard(0)}
        out.append(Weight(n, s, "float32" if side == "t" else "bfloat16", pl, stage))
    return out


CASES = [(k, "packed", "linear") for k in ("llama", "qwen2", "qwen3", "gemma")] + [
    (k, e, p)
    for k in ("qwen3_moe", "deepseek_v3")
    for e in ("packed", "per_expert")
    for p in ("linear", "round_robin")
]


@pytest.mark.parametrize(("kind", "experts", "placement"), CASES)
def test_family_map_on_the_real_classes(kind: str, experts: str, placement: str) -> None:
    cfg = _configs()[kind]
    assert bool(moe_layers(cfg)) == (kind in ("qwen3_moe", "deepseek_v3"))
    hf = _hf_shapes(cfg)
    rollout = _vllm_shapes(hf, kind)
    trainer_names = _per_expert(hf) if experts == "per_expert" else hf
    src, dst = Layout(ep=2, tp=2), Layout(ep=2, rank_offset=4)
    nm = hf_to_vllm(cfg, experts=experts, ep=2, placement=placement)
    t, r = _placed(trainer_names, src, "t"), _placed(rollout, dst, "r")
    plan = plan_transfer(src, t, dst, r, Topology(node=4), name_map=nm, cast="bfloat16")
    assert plan.mapping is not None and plan.mapping.unused == ()
    check_moe(plan, src, t, dst, r, nm, 4)
    if kind == "qwen2":
        assert any(n.endswith("qkv_proj.bias") for n in rollout)
    if kind == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in rollout
    if kind == "deepseek_v3":
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in rollout
        assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in rollout
        assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" in rollout


def test_gemma_head_tied_on_both_sides() -> None:
    cfg = _configs()["gemma"]
    hf = _hf_shapes(cfg)
    assert "lm_head.weight" not in hf  # the class ties it: one parameter, the embedding's
    rollout = {**_vllm_shapes(hf, "gemma"), "lm_head.weight": hf["model.embed_tokens.weight"]}
    src, dst = Layout(tp=2), Layout(tp=1, rank_offset=2)
    nm = hf_to_vllm(cfg, tied_head=True)
    t, r = _placed(hf, src, "t"), _placed(rollout, dst, "r")
    plan = plan_transfer(src, t, dst, r, Topology(node=2), name_map=nm, cast="bfloat16")
    check_moe(plan, src, t, dst, r, NameMap(nm), 2)
    assert plan.mapping is not None and [ln.source for ln in plan.mapping.sources("lm_head.weight")] == [
        "model.embed_tokens.weight"
    ]


def test_unknown_family_refused() -> None:
    with pytest.raises(ValueError, match="is not one of"):
        hf_to_vllm({"model_type": "mamba", "num_hidden_layers": 1})
