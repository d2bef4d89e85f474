"""Ready-made name maps (Llama/HF -> vLLM fused, Megatron <-> HF) on the preset models: plans
checked element by element against the brute force, and the maps' meaning checked on real
numbers against an independent construction of Megatron's layouts."""

from __future__ import annotations

import numpy as np
import pytest

from meshgroups import Layout, LayoutError, Topology
from meshgroups.transfer import NameMap, plan_transfer
from meshgroups.transfer._names.conventions import (
    ModelConfig,
    hf_to_megatron,
    layer_names,
    megatron_to_hf,
    preset_map,
    vllm_map,
)
from meshgroups.transfer._names.presets import model_config, model_weights

from ..support.mapped_oracle import check_mapped, check_mapped_local

GQA = ModelConfig(layers=2, hidden=16, heads=4, kv_heads=2, ffn=12, vocab=20)
T2 = Topology(node=2)


def _assemble(nm: NameMap, tensors: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """Full rollout tensors from full trainer tensors, straight from the rules (tp=1 view)."""
    out = {}
    for name in names:
        rule = nm.rule(name)
        segs = [
            np.take(
                tensors[s.source], np.arange(s.start, s.stop or tensors[s.source].shape[rule.axis]), rule.axis
            )
            for s in rule.segments
        ]
        out[name] = segs[0] if rule.is_rename else np.concatenate(segs, axis=rule.axis)
    return out


def _random(cfg: ModelConfig, convention: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {n: rng.standard_normal(s) for n, s, *_ in layer_names(cfg, convention)}


def _megatron_from_hf(cfg: ModelConfig, hf: dict[str, np.ndarray], tp: int) -> dict[str, np.ndarray]:
    """Megatron's tensors built independently: qkv by reshaping heads into query groups; fc1
    as the concatenation of tp ranks' [gate_r; up_r]."""
    hd, g, qpg, h = cfg.head_dim, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.hidden
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(cfg.layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].reshape(g, qpg * hd, h)
        k = hf[p + "self_attn.k_proj.weight"].reshape(g, hd, h)
        v = hf[p + "self_attn.v_proj.weight"].reshape(g, hd, h)
        out[m + "self_attention.linear_qkv.weight"] = np.concatenate([q, k, v], axis=1).reshape(-1, h)
        gate = np.split(hf[p + "mlp.gate_proj.weight"], tp)
        up = np.split(hf[p + "mlp.up_proj.weight"], tp)
        out[m + "mlp.linear_fc1.weight"] = np.concatenate([x for r in range(tp) for x in (gate[r], up[r])])
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_hf_maps_mean_what_megatron_holds(tp: int) -> None:
    hf = _random(GQA, "hf")
    mega = _megatron_from_hf(GQA, hf, tp)
    hf_names = [n for n, *_ in layer_names(GQA, "hf")]
    mega_names = [n for n, *_ in layer_names(GQA, "megatron")]
    back = _assemble(megatron_to_hf(GQA, trainer_tp=tp), mega, hf_names)
    assert all(np.array_equal(back[n], hf[n]) for n in hf_names)
    if tp == 1:  # the tp-independent Megatron tensors (fc1 = gate ‖ up)
        there = _assemble(hf_to_megatron(GQA), hf, mega_names)
        assert all(np.array_equal(there[n], mega[n]) for n in mega_names)
    vl = _assemble(vllm_map(GQA), hf, [n for n, *_ in layer_names(GQA, "vllm")])
    qkv = vl["model.layers.1.self_attn.qkv_proj.weight"]
    assert np.array_equal(
        qkv[GQA.q_rows : GQA.q_rows + GQA.kv_rows], hf["model.layers.1.self_attn.k_proj.weight"]
    )


@pytest.mark.parametrize(
    ("src_names", "dst_names", "mapname", "trainer", "rollout"),
    [
        ("hf", "vllm", "vllm", Layout(dp_shard=2, tp=2), Layout(tp=4, rank_offset=4)),
        ("hf", "vllm", "vllm", Layout(pp=2, tp=2), Layout(dp=2, tp=2)),  # colocated
        ("hf", "megatron", "hf-to-megatron", Layout(dp_shard=2, tp=2), Layout(pp=2, tp=2, rank_offset=4)),
        ("megatron", "hf", "megatron-to-hf", Layout(pp=2, tp=2), Layout(tp=4, rank_offset=4)),
    ],
)
def test_ready_made_maps_against_brute_force(
    src_names: str, dst_names: str, mapname: str, trainer: Layout, rollout: Layout
) -> None:
    sws = model_weights(GQA, trainer, names=src_names)
    dws = model_weights(GQA, rollout, names=dst_names, dtype="bfloat16")
    nm = preset_map(mapname, GQA, trainer_tp=trainer.size("tp"))
    for topo in (None, T2):
        plan = plan_transfer(trainer, sws, rollout, dws, topo, name_map=nm, cast="bfloat16")
        check_mapped(plan, trainer, sws, rollout, dws, nm, 1 if topo is None else 2)
    check_mapped_local(plan, trainer, sws, rollout, dws, topology=T2, name_map=nm, cast="bfloat16")


@pytest.mark.parametrize("model", ["small", "llama-8b"])
def test_presets_plan_at_the_lower_bound(model: str) -> None:
    trainer, rollout = Layout(dp_shard=4, tp=2), Layout(dp=2, tp=4, rank_offset=8)
    sws = model_weights(model, trainer, names="hf", dtype="float32")
    dws = model_weights(model, rollout, names="vllm", dtype="bfloat16")
    plan = plan_transfer(
        trainer, sws, rollout, dws, Topology(node=8), name_map=vllm_map(sws_names(sws)), cast="bfloat16"
    )
    assert plan.mapping is not None and len(plan.mapping.fused()) == 2 * model_config(model).layers
    assert plan.cross_node_bytes == plan.cross_node_lower_bound == 2 * sum(w.nbytes for w in sws) // 4
    # a rank's part: its own shards only, the same messages as the whole plan's
    mine = plan_transfer(
        trainer,
        sws,
        rollout,
        dws,
        Topology(node=8),
        rank=9,
        name_map=vllm_map(model_config(model)),
        cast="bfloat16",
    )
    assert list(mine.messages) == plan.for_rank(9)


def sws_names(ws: list) -> list[str]:  # type: ignore[type-arg]
    return [w.name for w in ws]


def test_map_errors() -> None:
    with pytest.raises(LayoutError, match="has no 'a.v_proj.w'"):
        vllm_map(["a.q_proj.w", "a.k_proj.w"])
    with pytest.raises(LayoutError, match="trainer_tp=3 must be"):
        megatron_to_hf(GQA, trainer_tp=3)
    with pytest.raises(LayoutError, match="ready-made maps are vllm"):
        preset_map("sglang", GQA)
    with pytest.raises(LayoutError, match="kv_heads=3 must divide heads"):
        ModelConfig(1, 16, 4, 3, 8, 8)
    with pytest.raises(ValueError, match="has experts"):
        model_config("moe-small")
    assert vllm_map(GQA, tied=True)["lm_head.weight"].sources == ("model.embed_tokens.weight",)


def test_maps_round_trip_json(tmp_path: object) -> None:
    for nm in (vllm_map(GQA), hf_to_megatron(GQA), megatron_to_hf(GQA, 2)):
        assert NameMap.loads(nm.dumps()) == nm
