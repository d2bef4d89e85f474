"""Megatron-Core ↔ Hugging Face maps of real families (``meshgroups.transfer._names.families_megatron``).

Hugging Face names and shapes are the real ``transformers`` classes' (tiny configs,
``from_config``, no download). Megatron's are megatron-core 0.16.1's own, from a ``GPTModel``
built with the local spec (``tests/support/megatron_family_names.py``; live when megatron-core
is importable, else the committed table). Transformer Engine's names differ from the local
spec's in four ways, read from megatron-core's source (TE is not installed):

- ``get_gpt_layer_local_spec``'s ``sharded_state_dict_keys_map``: ``input_layernorm.`` →
  ``self_attention.linear_qkv.layer_norm_`` and ``pre_mlp_layernorm.`` →
  ``mlp.linear_fc1.layer_norm_`` (the TE spec's ``input_layernorm`` / ``pre_mlp_layernorm``
  are IdentityOp, its ``linear_qkv`` / dense ``linear_fc1`` TELayerNormColumnParallelLinear);
- MoE layers keep ``pre_mlp_layernorm`` (TENorm when ``num_experts``), MLA layers
  ``input_layernorm``; MLA's q/kv norms go into ``linear_q_up_proj`` / ``linear_kv_up_proj``
  (TELayerNormColumnParallelLinear when ``qk_layernorm``);
- ``TEGroupedLinear`` names local expert ``i``'s weight ``weight<i>``.

Each map is planned both ways (every trainer weight read, every rollout weight written, shapes
consistent) and run on ids by the MoE brute force; then values: HF → Megatron → HF gives the
original ids back, on trainer/rollout layouts with tp (``linear_fc1``'s per-rank gate/up
blocks), ep, and an expert tp (etp) apart from tp.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgroups import Layout, Topology
from meshgroups.transfer import NameMap, Shard, Weight, plan_transfer
from meshgroups.transfer._names.families_megatron import hf_to_megatron_family, megatron_to_hf_family

from ..support import megatron_family_names as mfn
from ..support.family_configs import config, hf_shapes
from ..support.moe_oracle import check_moe, expected, full_ids, rule_parts

transformers = pytest.importorskip("transformers")

HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)


def _config(kind: str) -> object:
    return config(kind)


def _hf_shapes(kind: str) -> dict[str, tuple[int, ...]]:
    return hf_shapes(config(kind))


def _table() -> dict[str, dict[str, list[int]]]:
    return json.loads((Path(__file__).parents[1] / "data" / mfn.TABLE).read_text())["families"]


def _megatron_shapes(kind: str, norms: str, form: str, ep: int) -> dict[str, tuple[int, ...]]:
    """megatron-core's local-spec names as ``norms`` / ``form`` name them; the experts of one ep
    rank, each a ``[ep, ...]`` weight."""
    local = {n: tuple(s) for n, s in _table()[kind].items()}
    experts = {int(m.group(1)) for n in local if (m := re.search(r"local_experts\.(\d+)\.", n))}
    dense = {n.split(".mlp.")[0] for n in local if n.endswith("mlp.linear_fc1.weight")}
    out = {}
    for n, s in local.items():
        layer = ".".join(n.split(".")[:3])
        if norms == "te" and not kind.startswith("deepseek") and n.endswith(".input_layernorm.weight"):
            n = f"{layer}.self_attention.linear_qkv.layer_norm_weight"
        if norms == "te" and n.endswith(".pre_mlp_layernorm.weight") and layer in dense:
            n = f"{layer}.mlp.linear_fc1.layer_norm_weight"
        if norms == "te" and kind.startswith("deepseek"):
            n = re.sub(r"\.(q|kv)_layernorm\.weight$", r".linear_\1_up_proj.layer_norm_weight", n)
        m = re.search(r"local_experts\.(\d+)\.linear_fc(\d)\.weight$", n)
        if m:
            if int(m.group(1)) >= len(experts) // ep:
                continue
            if form == "grouped":
                n = n[: m.start()] + f"linear_fc{m.group(2)}.weight{m.group(1)}"
            s = (ep, *s)
        out[n] = s
    return out


def _hf_weights(shapes: dict[str, tuple[int, ...]]) -> list[Weight]:
    """tp shards axis 0 of matrices whose rows it divides; packed experts ``{ep: 0, tp: 1}``;
    a per-expert weight lives on its ep rank (4 experts)."""
    out = []
    for n, s in shapes.items():
        pl: dict[str, Shard] = {}
        stage = None
        if len(s) == 3:
            pl = {"ep": Shard(0), "tp": Shard(1)}
        elif len(s) == 2 and s[0] % 2 == 0:
            pl = {"tp": Shard(0)}
        m = re.search(r"experts\.(\d+)\.", n)
        if m:
            stage = ("ep", int(m.group(1)) * 2 // 4)
        out.append(Weight(n, s, "float32", pl, stage))
    return out


def _megatron_weights(shapes: dict[str, tuple[int, ...]], etp: bool) -> list[Weight]:
    """As Megatron shards them: column-parallel axis 0, row-parallel axis 1, experts over ep (and
    over tp where ``etp``); norms, routers and MLA's down projections replicated."""
    out = []
    for n, s in shapes.items():
        pl: dict[str, Shard] = {}
        if len(s) == 3:
            pl = {"ep": Shard(0), **({"tp": Shard(1 if ".linear_fc1." in n else 2)} if etp else {})}
        elif re.search(r"(linear_qkv|linear_fc1|linear_q_up_proj|linear_kv_up_proj|word_embeddings|output_layer)\.(weight|bias)$", n):  # fmt: skip
            pl = {"tp": Shard(0)}
        elif re.search(r"(linear_proj|linear_fc2)\.weight$", n):
            pl = {"tp": Shard(1)}
        out.append(Weight(n, s, "float32", pl))
    return out


def _per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Packed experts as one module per expert (Transformers 4 / checkpoint names)."""
    out: dict[str, tuple[int, ...]] = {}
    for n, s in shapes.items():
        e = n.rsplit(".", 1)[0]
        if n.endswith("experts.gate_up_proj"):
            out.update(
                {f"{e}.{x}.{p}_proj.weight": (s[1] // 2, s[2]) for x in range(s[0]) for p in ("gate", "up")}
            )
        elif n.endswith("experts.down_proj"):
            out.update({f"{e}.{x}.down_proj.weight": s[1:] for x in range(s[0])})
        else:
            out[n] = s
    return out


def _plan(src: Layout, t: list[Weight], dst: Layout, r: list[Weight], nm: NameMap) -> None:
    """Planned (coverage both ways, shapes) and run on ids by the brute force."""
    assert set(nm) == {w.name for w in r}  # every name differs: each rollout weight has its rule
    plan = plan_transfer(src, t, dst, r, Topology(node=src.size()), name_map=nm)
    assert plan.mapping is not None and plan.mapping.unused == ()
    check_moe(plan, src, t, dst, r, nm, src.size())


def _assemble(ws: list[Weight], lay: Layout, bufs: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:  # fmt: skip
    """The full tensors whose shards (each rank's box) are the given local buffers: Megatron's
    ``linear_fc1`` as a trainer holds it (rank ``r``: ``[gate_r; up_r]``)."""
    out = {}
    for w in ws:
        full = np.full(w.shape, -1, np.int64)
        for r in lay.grid.ravel().tolist():
            box = w.box(lay, r)
            if box is not None and (w.name, r) in bufs:
                full[tuple(slice(a, b) for a, b in box)] = bufs[(w.name, r)][0]
        assert (full >= 0).all(), w.name
        out[w.name] = full
    return out


def _read(ids: dict[str, np.ndarray], nm: NameMap, name: str) -> np.ndarray:
    rule = nm.rule(name)
    if rule.is_rename:
        return ids[rule.segments[0].source]
    parts, axis = rule_parts(ids, rule)
    return np.concatenate(parts, axis=axis)


def _round_trip(cfg: object, hf: dict[str, tuple[int, ...]], mg: dict[str, tuple[int, ...]], tp: int, ep: int,
                etp: int, norms: str, form: str, plan: bool = True) -> None:  # fmt: skip
    """HF trainer → Megatron rollout (tp, ep) → the same as a Megatron trainer → HF: the
    original ids come back; each plan checked by the brute force when ``plan``."""
    lay, out = Layout(ep=ep, tp=tp), Layout(ep=ep, tp=tp, rank_offset=ep * tp)
    t, r = _hf_weights(hf), _megatron_weights(mg, etp > 1)
    there = hf_to_megatron_family(cfg, ep=ep, norms=norms, megatron_experts=form)
    if plan:
        _plan(lay, t, out, r, there)
    megatron = _assemble(r, out, expected(t, out, r, there))
    back = megatron_to_hf_family(cfg, trainer_tp=tp, trainer_ep=ep, trainer_etp=etp, norms=norms,
                                 megatron_experts=form)  # fmt: skip
    if plan:
        _plan(lay, _megatron_weights(mg, etp > 1), out, _hf_weights(hf), back)
    ids = full_ids(t)
    assert set(back) == set(hf)
    for name in hf:
        assert np.array_equal(_read(megatron, back, name), ids[name]), name


ROUND_TRIPS = [
    (k, tp, ep, etp, norms, form)
    for k in ("llama", "qwen2", "qwen3", "gemma")
    for tp, ep, etp, norms, form in ((1, 1, 1, "te", "grouped"), (2, 2, 2, "te", "grouped"), (2, 1, 2, "local", "sequential"))
    if not (k == "gemma" and norms == "local")
] + [
    (k, tp, ep, etp, norms, form)
    for k in ("qwen3_moe", "deepseek_v3")
    for tp, ep, etp, norms, form in (
        (1, 1, 1, "te", "grouped"), (2, 2, 2, "te", "grouped"), (2, 2, 1, "local", "sequential"),
        (1, 2, 1, "te", "sequential"), (2, 1, 2, "local", "grouped"),
    )
] + [("deepseek_v3_q_proj", 2, 2, 2, "te", "grouped"), ("deepseek_v3_q_proj", 1, 2, 1, "local", "sequential")]  # fmt: skip


@pytest.mark.parametrize(("kind", "tp", "ep", "etp", "norms", "form"), ROUND_TRIPS)
def test_hf_to_megatron_and_back_on_the_real_classes(kind: str, tp: int, ep: int, etp: int, norms: str, form: str) -> None:  # fmt: skip
    _round_trip(
        _config(kind), _hf_shapes(kind), _megatron_shapes(kind, norms, form, ep), tp, ep, etp, norms, form
    )


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("form", ["grouped", "sequential"])
def test_per_expert_trainer_into_megatron(kind: str, form: str) -> None:
    """Transformers 4 / checkpoint names (one module per expert, on its ep rank) → Megatron."""
    hf = _per_expert(_hf_shapes(kind))
    mg = _megatron_shapes(kind, "te", form, 2)
    nm = hf_to_megatron_family(_config(kind), ep=2, megatron_experts=form, experts="per_expert")
    _plan(
        Layout(ep=2, tp=2),
        _hf_weights(hf),
        Layout(ep=2, tp=2, rank_offset=4),
        _megatron_weights(mg, True),
        nm,
    )


def test_the_maps_name_the_families_parts() -> None:
    ds = hf_to_megatron_family(_config("deepseek_v3"), ep=2)
    assert ds["decoder.layers.1.mlp.router.expert_bias"].sources == (
        "model.layers.1.mlp.gate.e_score_correction_bias",
    )
    assert ds["decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight"].sources == (
        "model.layers.1.self_attn.q_a_layernorm.weight",
    )
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in ds  # the dense layer
    q3 = megatron_to_hf_family(_config("qwen3"), norms="local")
    assert q3["model.layers.0.self_attn.q_norm.weight"].sources == (
        "decoder.layers.0.self_attention.q_layernorm.weight",
    )
    assert q3["model.layers.0.input_layernorm.weight"].sources == ("decoder.layers.0.input_layernorm.weight",)
    gemma = hf_to_megatron_family(_config("gemma"))
    assert "output_layer.weight" not in gemma  # tied on both sides


def test_a_tied_head_copied_to_megatrons_last_stage() -> None:
    """Gemma ties its head; a Megatron rollout over pipeline stages holds ``output_layer`` on its
    last stage, a copy of the embedding."""
    hf, mg = _hf_shapes("gemma"), _megatron_shapes("gemma", "te", "grouped", 1)
    mg["output_layer.weight"] = mg["embedding.word_embeddings.weight"]
    nm = hf_to_megatron_family(_config("gemma"), tied_head=True)
    _plan(
        Layout(ep=1, tp=2),
        _hf_weights(hf),
        Layout(ep=1, tp=2, rank_offset=2),
        _megatron_weights(mg, False),
        nm,
    )


def test_refusals() -> None:
    with pytest.raises(ValueError, match="is not one of"):
        hf_to_megatron_family({"model_type": "gemma2", "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma"):
        megatron_to_hf_family(_config("gemma"), norms="local")
    with pytest.raises(ValueError, match="only a stack"):
        megatron_to_hf_family(_config("qwen3_moe"), experts="per_expert")
    with pytest.raises(ValueError, match="does not divide"):
        hf_to_megatron_family(_config("qwen3_moe"), ep=3)
    with pytest.raises(ValueError, match="trainer_tp=5"):
        megatron_to_hf_family(_config("llama"), trainer_tp=5)


@pytest.mark.skipif(
    not HAVE_MCORE, reason="megatron-core is not installed: the committed table stands for it"
)
def test_the_table_is_megatron_cores_own() -> None:
    import megatron.core

    assert megatron.core.__version__ == "0.16.1"
    mfn.init()
    assert {k: mfn.family_names(k) for k in mfn.FAMILIES} == _table()
    specs = Path(megatron.core.__file__).parent / "models" / "gpt" / "gpt_layer_specs.py"
    assert '"input_layernorm.": "self_attention.linear_qkv.layer_norm_"' in specs.read_text()
    te = (Path(megatron.core.__file__).parent / "extensions" / "transformer_engine.py").read_text()
    assert 'f"weight{gemm_idx}"' in te


@st.composite
def _dense(
    draw: st.DrawFn,
) -> tuple[dict[str, object], dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], int]:
    """A random small Llama / Qwen2 / Qwen3 / Qwen3-MoE: its config, HF and Megatron (TE,
    grouped) shapes by formula, and a tp dividing its MLPs."""
    kind = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe"]))
    groups, per, hd = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tp = draw(st.sampled_from([1, 2]))
    ffn, inter, n, h = (
        tp * draw(st.integers(1, 3)),
        tp * draw(st.integers(1, 2)),
        2 * draw(st.integers(1, 2)),
        4,
    )
    cfg = {"model_type": kind, "num_hidden_layers": 1, "num_attention_heads": groups * per, "num_key_value_heads": groups,
           "head_dim": hd, "hidden_size": h, "intermediate_size": ffn, "num_experts": n, "moe_intermediate_size": inter,
           "tie_word_embeddings": draw(st.booleans())}  # fmt: skip
    q, kv = groups * per * hd, groups * hd
    hf = {"model.embed_tokens.weight": (8, h), "model.norm.weight": (h,), "model.layers.0.input_layernorm.weight": (h,),
          "model.layers.0.post_attention_layernorm.weight": (h,), "model.layers.0.self_attn.q_proj.weight": (q, h),
          "model.layers.0.self_attn.k_proj.weight": (kv, h), "model.layers.0.self_attn.v_proj.weight": (kv, h),
          "model.layers.0.self_attn.o_proj.weight": (h, q)}  # fmt: skip
    a, m = "decoder.layers.0.self_attention", "decoder.layers.0.mlp"
    mg = {"embedding.word_embeddings.weight": (8, h), "decoder.final_layernorm.weight": (h,),
          f"{a}.linear_qkv.layer_norm_weight": (h,), f"{a}.linear_qkv.weight": (q + 2 * kv, h),
          f"{a}.linear_proj.weight": (h, q)}  # fmt: skip
    if not cfg["tie_word_embeddings"]:
        hf["lm_head.weight"], mg["output_layer.weight"] = (8, h), (8, h)
    if kind == "qwen2":
        hf.update(
            {f"model.layers.0.self_attn.{x}_proj.bias": (r,) for x, r in (("q", q), ("k", kv), ("v", kv))}
        )
        mg[f"{a}.linear_qkv.bias"] = (q + 2 * kv,)
    if kind.startswith("qwen3"):
        hf.update({f"model.layers.0.self_attn.{x}_norm.weight": (hd,) for x in "qk"})
        mg.update({f"{a}.{x}_layernorm.weight": (hd,) for x in "qk"})
    if kind == "qwen3_moe":
        e = "model.layers.0.mlp"
        hf.update({f"{e}.gate.weight": (n, h), f"{e}.experts.gate_up_proj": (n, 2 * inter, h), f"{e}.experts.down_proj": (n, h, inter)})  # fmt: skip
        mg.update({"decoder.layers.0.pre_mlp_layernorm.weight": (h,), f"{m}.router.weight": (n, h)})
        mg.update({f"{m}.experts.linear_fc1.weight{j}": (2, 2 * inter, h) for j in range(n // 2)})
        mg.update({f"{m}.experts.linear_fc2.weight{j}": (2, h, inter) for j in range(n // 2)})
    else:
        hf.update({f"model.layers.0.mlp.{x}_proj.weight": (ffn, h) for x in ("gate", "up")})
        hf["model.layers.0.mlp.down_proj.weight"] = (h, ffn)
        mg.update({f"{m}.linear_fc1.layer_norm_weight": (h,), f"{m}.linear_fc1.weight": (2 * ffn, h), f"{m}.linear_fc2.weight": (h, ffn)})  # fmt: skip
    return cfg, hf, mg, tp


@settings(max_examples=25, deadline=None)
@given(_dense())
def test_round_trip_on_random_small_configs(case: tuple[dict[str, object], dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], int]) -> None:  # fmt: skip
    cfg, hf, mg, tp = case
    _round_trip(cfg, hf, mg, tp, 2, tp, "te", "grouped", plan=False)
