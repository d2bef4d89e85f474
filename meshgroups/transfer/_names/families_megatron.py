"""Ready-made maps between Megatron-Core's names and Hugging Face's for real model families, both
ways, read from a Hugging Face config (an object with its attributes, or a dict; nothing is
imported).

:func:`hf_to_megatron_family` (a Hugging Face trainer into a Megatron rollout) and
:func:`megatron_to_hf_family` (a Megatron trainer into a Hugging Face rollout) know ``llama``,
``qwen2`` (the q/k/v biases interleaved into ``linear_qkv.bias`` like the weight), ``qwen3`` and
``qwen3_moe`` (``q_norm`` / ``k_norm`` ↔ ``self_attention.q_layernorm`` / ``k_layernorm``),
``deepseek_v3`` (MLA's ``linear_q_down_proj`` ↔ ``q_a_proj``, ``linear_q_up_proj`` ↔
``q_b_proj``, ``linear_kv_down_proj`` ↔ ``kv_a_proj_with_mqa``, ``linear_kv_up_proj`` ↔
``kv_b_proj`` and their norms; shared experts; the router's ``expert_bias`` ↔
``e_score_correction_bias``; the first ``first_k_dense_replace`` layers dense) and ``gemma``.

Megatron's ``linear_qkv`` holds, per query group, its q heads, its k head, its v head (a tp
rank holds whole groups); its GLU ``linear_fc1`` is gate ‖ up, and a tp rank holds ``[gate_r;
up_r]`` (as a rollout weight: sharded per part; as a trainer weight: the tensor whose
``Shard(0)`` over ``trainer_tp`` gives each rank that). Layer norms are named by ``norms``:
``"te"`` (Transformer Engine's spec: fused into ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``; MoE layers' ``pre_mlp_layernorm`` and MLA's
``input_layernorm`` stay apart, MLA's q/kv norms fused into ``linear_q_up_proj`` /
``linear_kv_up_proj``) or ``"local"`` (the local spec: ``input_layernorm.weight``,
``pre_mlp_layernorm.weight``, ``q_layernorm``, ``kv_layernorm``).

Megatron's experts: each of a layer's ``E/ep`` local experts is one weight per ep rank —
``mlp.experts.linear_fc1.weight<i>`` (``megatron_experts="grouped"``, TE's grouped GEMM) or
``mlp.experts.local_experts.<i>.linear_fc1.weight`` (``"sequential"``) — described as a
``[ep, 2·I, H]`` weight sharded ``Shard(0)`` over ep (a rank's local tensor is its weight
``unsqueeze(0)``); global expert ``e`` is entry ``e // (E/ep)`` of local weight ``e % (E/ep)``
(Megatron places experts linearly)::

    >>> cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 8,
    ...        "num_experts": 4, "moe_intermediate_size": 8}
    >>> fc1 = hf_to_megatron_family(cfg, ep=2)["decoder.layers.0.mlp.experts.linear_fc1.weight1"]
    >>> [(s.index, s.start, s.stop) for s in fc1.entries[1].segments]  # ep rank 1's local expert 1: expert 3
    [(3, 0, 8), (3, 8, None)]
"""

from __future__ import annotations

from typing import Any

from meshgroups._checks import is_int
from meshgroups.errors import LayoutError
from meshgroups.models import EXPERT_KEYS, hf_value
from meshgroups.transfer._names.conventions import glu_cut, qkv_cut, qkv_interleaved
from meshgroups.transfer._names.families import EXPERT_FORMS, moe_layers
from meshgroups.transfer._names.names import NameMap, Rule, Segment
from meshgroups.transfer._names.stacking import Stack

#: The families both maps know (Gemma 2's extra norms have no place in Megatron-Core's layer).
MEGATRON_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma")
#: How Megatron names its layer norms: Transformer Engine's spec or the local spec.
NORM_NAMINGS = ("te", "local")
#: How Megatron holds its experts: TE's grouped GEMM or SequentialMLP.
MEGATRON_EXPERT_FORMS = ("grouped", "sequential")


def _get(config: object, key: str, default: Any = None) -> Any:
    # the package's one config reader (a dict or a config object; unset or None: default)
    return hf_value(config, key, default=default)


def _check(who: str, config: object, norms: str, megatron_experts: str, experts: str) -> str:
    kind = _get(config, "model_type")
    for what, value, allowed in (
        ("model_type", kind, MEGATRON_FAMILIES),
        ("norms", norms, NORM_NAMINGS),
        ("megatron_experts", megatron_experts, MEGATRON_EXPERT_FORMS),
        ("experts", experts, EXPERT_FORMS),
    ):
        if value not in allowed:
            raise LayoutError(f"{who}: {what}={value!r} is not one of {allowed}")
    if kind == "gemma" and norms == "local":
        raise LayoutError(
            f"{who}: Gemma's (1 + w) RMSNorm is Megatron's layernorm_zero_centered_gamma, which only "
            "Transformer Engine's norms apply to RMSNorm (the local spec's norms refuse it): use norms='te'"
        )
    if kind == "llama" and _get(config, "attention_bias", False):
        raise LayoutError(f"{who}: a llama config with attention_bias=True (o_proj's bias) is not mapped")
    return str(kind)


def _pos(who: str, **values: int) -> None:
    for k, v in values.items():
        if not is_int(v) or v < 1:
            raise LayoutError(f"{who}: {k}={v!r} must be an int >= 1")


def _pairs(config: object, kind: str, norms: str) -> tuple[list[tuple[str, str]], list[int]]:
    """``(megatron name, hf name)`` of every weight that is the same tensor on both sides, and
    the MoE layers."""
    moe = moe_layers(config)
    pairs = [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not _get(config, "tie_word_embeddings", kind == "gemma"):
        pairs.append(("output_layer.weight", "lm_head.weight"))
    for i in range(int(_get(config, "num_hidden_layers", 0))):
        pairs += _attention_pairs(config, kind, norms == "te", f"decoder.layers.{i}", f"model.layers.{i}")
        pairs += _mlp_pairs(config, kind, norms == "te", i in moe, f"decoder.layers.{i}", f"model.layers.{i}")
    return pairs, moe


def _attention_pairs(config: object, kind: str, te: bool, m: str, h: str) -> list[tuple[str, str]]:
    """One layer's renames up to the attention's output (its input norm included)."""
    a, sa = f"{m}.self_attention", f"{h}.self_attn"
    pairs = [(f"{a}.linear_proj.weight", f"{sa}.o_proj.weight")]
    if kind != "deepseek_v3":
        norm = f"{a}.linear_qkv.layer_norm_weight" if te else f"{m}.input_layernorm.weight"
        pairs.append((norm, f"{h}.input_layernorm.weight"))
        if kind in ("qwen3", "qwen3_moe"):
            pairs += [(f"{a}.{x}_layernorm.weight", f"{sa}.{x}_norm.weight") for x in "qk"]
        return pairs
    pairs.append((f"{m}.input_layernorm.weight", f"{h}.input_layernorm.weight"))  # TENorm in MLA
    ups = [("q", "q_a_layernorm", "q_b_proj")] if _get(config, "q_lora_rank") is not None else []
    if ups:
        pairs.append((f"{a}.linear_q_down_proj.weight", f"{sa}.q_a_proj.weight"))
    else:
        pairs.append((f"{a}.linear_q_proj.weight", f"{sa}.q_proj.weight"))
    pairs.append((f"{a}.linear_kv_down_proj.weight", f"{sa}.kv_a_proj_with_mqa.weight"))
    for x, norm, up in [*ups, ("kv", "kv_a_layernorm", "kv_b_proj")]:
        ours = f"{a}.linear_{x}_up_proj.layer_norm_weight" if te else f"{a}.{x}_layernorm.weight"
        pairs += [(ours, f"{sa}.{norm}.weight"), (f"{a}.linear_{x}_up_proj.weight", f"{sa}.{up}.weight")]
    return pairs


def _mlp_pairs(config: object, kind: str, te: bool, moe: bool, m: str, h: str) -> list[tuple[str, str]]:
    """One layer's renames from its pre-MLP norm on (not the GLU ``linear_fc1`` s, not experts)."""
    post = f"{h}.post_attention_layernorm.weight"
    if not moe:
        norm = f"{m}.mlp.linear_fc1.layer_norm_weight" if te else f"{m}.pre_mlp_layernorm.weight"
        return [(norm, post), (f"{m}.mlp.linear_fc2.weight", f"{h}.mlp.down_proj.weight")]
    pairs = [(f"{m}.pre_mlp_layernorm.weight", post), (f"{m}.mlp.router.weight", f"{h}.mlp.gate.weight")]
    if kind == "deepseek_v3":
        pairs.append((f"{m}.mlp.router.expert_bias", f"{h}.mlp.gate.e_score_correction_bias"))
        if int(_get(config, "n_shared_experts", 0)):
            s = "mlp.shared_experts"
            pairs.append((f"{m}.{s}.linear_fc2.weight", f"{h}.{s}.down_proj.weight"))
    return pairs


def _glu_mlps(config: object, kind: str, moe: list[int]) -> list[tuple[str, str, int]]:
    """``(megatron prefix, hf prefix, ffn)`` of every dense GLU MLP (shared experts included):
    ``<m>.linear_fc1`` ↔ ``<h>.gate_proj`` ‖ ``<h>.up_proj``."""
    out = []
    for i in range(int(_get(config, "num_hidden_layers", 0))):
        m, h = f"decoder.layers.{i}.mlp", f"model.layers.{i}.mlp"
        if i not in moe:
            out.append((m, h, int(_get(config, "intermediate_size", 0))))
        elif kind == "deepseek_v3" and int(_get(config, "n_shared_experts", 0)):
            shared = int(_get(config, "n_shared_experts")) * int(_get(config, "moe_intermediate_size", 0))
            out.append((f"{m}.shared_experts", f"{h}.shared_experts", shared))
    return out


def _attention(who: str, config: object, kind: str) -> tuple[int, int, int, bool]:
    """``(kv groups, q rows per group, kv rows per group, q/k/v biases)``."""
    heads = int(_get(config, "num_attention_heads", 0))
    groups = int(_get(config, "num_key_value_heads", heads))
    hd = int(_get(config, "head_dim", int(_get(config, "hidden_size", 0)) // heads if heads else 0))
    if kind != "deepseek_v3" and (heads < 1 or groups < 1 or heads % groups or hd < 1):
        raise LayoutError(
            f"{who}: num_attention_heads={heads}, num_key_value_heads={groups}, head_dim={hd}: linear_qkv needs "
            "heads >= 1, kv heads dividing them and head_dim (or hidden_size // heads) >= 1"
        )
    return groups, heads // max(groups, 1) * hd, hd, kind == "qwen2"


def _sizes(who: str, config: object) -> tuple[int, int]:
    n = int(hf_value(config, *EXPERT_KEYS, default=0))
    inter = _get(config, "moe_intermediate_size")
    if n < 1 or inter is None:
        raise LayoutError(f"{who}: a MoE config must give its number of experts and moe_intermediate_size")
    return n, int(inter)


def _local(mlp: str, form: str, i: int, fc: int) -> str:
    """Megatron's name of local expert ``i``'s ``linear_fc<fc>``."""
    if form == "grouped":
        return f"{mlp}.experts.linear_fc{fc}.weight{i}"
    return f"{mlp}.experts.local_experts.{i}.linear_fc{fc}.weight"


def hf_to_megatron_family(
    config: object,
    *,
    ep: int = 1,
    norms: str = "te",
    megatron_experts: str = "grouped",
    experts: str = "packed",
    tied_head: bool = False,
) -> NameMap:
    """Hugging Face names → Megatron-Core's, for the family of ``config`` (see the module
    docstring): a Hugging Face trainer into a Megatron rollout.

    Args:
        config: a Hugging Face config or a dict of its keys (``model_type``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``; MoE: ``num_experts`` / ``n_routed_experts``, ``moe_intermediate_size``).
        ep: the Megatron rollout's expert-parallel size (its expert weights are ``[ep, ...]``).
        norms: ``"te"`` or ``"local"``: Megatron's layer-norm names.
        megatron_experts: ``"grouped"`` or ``"sequential"``.
        experts: the trainer's experts, ``"packed"`` (Transformers 5) or ``"per_expert"``.
        tied_head: the rollout lists ``output_layer.weight`` of its own though the embedding
            is tied (Megatron's last pipeline stage holds a copy): read from the embedding.

    Returns:
        The map (rollout name → rule).

    Raises:
        LayoutError: an unknown family or form, Gemma with ``norms="local"``, a MoE config
            without its sizes, an ``ep`` that does not divide the experts.

    >>> m = hf_to_megatron_family({"model_type": "qwen2", "num_hidden_layers": 1, "num_attention_heads": 4,
    ...                            "num_key_value_heads": 2, "hidden_size": 16})
    >>> [(s.source.rsplit(".", 2)[-2], s.start, s.stop) for s in m["decoder.layers.0.self_attention.linear_qkv.bias"].segments][:3]
    [('q_proj', 0, 8), ('k_proj', 0, 4), ('v_proj', 0, 4)]
    """
    who = "hf_to_megatron_family"
    kind = _check(who, config, norms, megatron_experts, experts)
    _pos(who, ep=ep)
    pairs, moe = _pairs(config, kind, norms)
    rules: dict[str, object] = {m: h for m, h in pairs}
    if tied_head:
        rules["output_layer.weight"] = "model.embed_tokens.weight"
    groups, q_rows, kv_rows, bias = _attention(who, config, kind)
    for i in range(int(_get(config, "num_hidden_layers", 0))):
        a, sa = f"decoder.layers.{i}.self_attention", f"model.layers.{i}.self_attn"
        for suffix in ("weight", "bias") if bias else ("weight",):
            q, k, v = (f"{sa}.{x}_proj.{suffix}" for x in "qkv")
            if kind != "deepseek_v3":
                rules[f"{a}.linear_qkv.{suffix}"] = qkv_interleaved(q, k, v, groups, q_rows, kv_rows)
    for m, h, _ in _glu_mlps(config, kind, moe):
        rules[f"{m}.linear_fc1.weight"] = [f"{h}.gate_proj.weight", f"{h}.up_proj.weight"]
    for i in moe:
        n, inter = _sizes(who, config)
        if n % ep:
            raise LayoutError(f"{who}: ep={ep} does not divide the {n} experts (each rank holds E/ep)")
        m, e = f"decoder.layers.{i}.mlp", f"model.layers.{i}.mlp.experts"
        local = n // ep
        for j in range(local):
            fc1, fc2 = [], []
            for x in (r * local + j for r in range(ep)):
                if experts == "per_expert":
                    fc1.append(Rule.fuse([f"{e}.{x}.gate_proj.weight", f"{e}.{x}.up_proj.weight"]))
                    fc2.append(Rule.rename(f"{e}.{x}.down_proj.weight"))
                else:
                    gate_up = f"{e}.gate_up_proj"
                    fc1.append(Rule(((Segment(gate_up, 0, inter, x),), (Segment(gate_up, inter, None, x),))))
                    fc2.append(Rule(((Segment(f"{e}.down_proj", index=x),),)))
            rules[_local(m, megatron_experts, j, 1)] = Stack(tuple(fc1))
            rules[_local(m, megatron_experts, j, 2)] = Stack(tuple(fc2))
    return NameMap(rules)


def megatron_to_hf_family(
    config: object,
    *,
    trainer_tp: int = 1,
    trainer_ep: int = 1,
    trainer_etp: int | None = None,
    norms: str = "te",
    megatron_experts: str = "grouped",
    experts: str = "packed",
) -> NameMap:
    """Megatron-Core names → Hugging Face's, for the family of ``config`` (see the module
    docstring): a Megatron trainer into a Hugging Face rollout. q/k/v (and Qwen2's biases) are
    cut out of ``linear_qkv`` group by group; gate/up out of each GLU ``linear_fc1`` as the
    trainer's ranks hold it.

    Args:
        config: as :func:`hf_to_megatron_family`.
        trainer_tp: the trainer's tensor-parallel size (dense and shared-expert ``linear_fc1``).
        trainer_ep: the trainer's expert-parallel size (its expert weights are ``[ep, ...]``).
        trainer_etp: its expert-tensor-parallel size (the experts' ``linear_fc1``;
            default ``trainer_tp``).
        norms, megatron_experts: as :func:`hf_to_megatron_family`.
        experts: the rollout's experts: ``"packed"`` (``mlp.experts.gate_up_proj`` ``[E, 2·I,
            H]``, a stack over the experts, gate ‖ up each sharded on its own; ``down_proj``
            ``[E, H, I]``). ``"per_expert"`` is refused for a MoE family: one expert of a
            Megatron ``[ep, ...]`` weight is an ``index``, which only a stack may read.

    Returns:
        The map (rollout name → rule).

    Raises:
        LayoutError: as :func:`hf_to_megatron_family`; a tp or etp that does not divide the
            MLP's intermediate size; ``experts="per_expert"`` for a MoE family.

    >>> m = megatron_to_hf_family({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 4,
    ...                            "num_key_value_heads": 2, "hidden_size": 16, "intermediate_size": 8}, trainer_tp=2)
    >>> [(s.start, s.stop) for s in m["model.layers.0.mlp.up_proj.weight"].segments]
    [(4, 8), (12, 16)]
    """
    who = "megatron_to_hf_family"
    kind = _check(who, config, norms, megatron_experts, experts)
    etp = trainer_tp if trainer_etp is None else trainer_etp
    _pos(who, trainer_tp=trainer_tp, trainer_ep=trainer_ep, trainer_etp=etp)
    pairs, moe = _pairs(config, kind, norms)
    rules: dict[str, object] = {h: m for m, h in pairs}
    groups, q_rows, kv_rows, bias = _attention(who, config, kind)
    for i in range(int(_get(config, "num_hidden_layers", 0))):
        a, sa = f"decoder.layers.{i}.self_attention", f"model.layers.{i}.self_attn"
        for suffix in ("weight", "bias") if bias else ("weight",):
            if kind != "deepseek_v3":
                cut = qkv_cut(f"{a}.linear_qkv.{suffix}", groups, q_rows, kv_rows)
                for part, rule in zip("qkv", cut):
                    rules[f"{sa}.{part}_proj.{suffix}"] = rule
    for m, h, ffn in _glu_mlps(config, kind, moe):
        if ffn < 1 or ffn % trainer_tp:
            raise LayoutError(
                f"{who}: {m}.linear_fc1 has {ffn} rows of gate (the config's intermediate size); "
                f"trainer_tp={trainer_tp} must divide them"
            )
        gate, up = glu_cut(f"{m}.linear_fc1.weight", ffn, trainer_tp)
        rules[f"{h}.gate_proj.weight"], rules[f"{h}.up_proj.weight"] = Rule((gate,)), Rule((up,))
    for i in moe:
        if experts == "per_expert":
            raise LayoutError(
                f"{who}: experts='per_expert' — a Hugging Face expert of its own from a Megatron [ep, ...] "
                "expert weight reads one entry (index), which only a stack may do: use experts='packed'"
            )
        n, inter = _sizes(who, config)
        if n % trainer_ep or inter % etp:
            raise LayoutError(
                f"{who}: trainer_ep={trainer_ep} must divide the {n} experts and trainer_etp={etp} the "
                f"moe_intermediate_size={inter}"
            )
        m, e = f"decoder.layers.{i}.mlp", f"model.layers.{i}.mlp.experts"
        local = n // trainer_ep
        gate_up, down = [], []
        for x in range(n):
            j, r = x % local, x // local
            gate_up.append(Rule(glu_cut(_local(m, megatron_experts, j, 1), inter, etp, r)))
            down.append(Rule(((Segment(_local(m, megatron_experts, j, 2), index=r),),)))
        rules[f"{e}.gate_up_proj"], rules[f"{e}.down_proj"] = Stack(tuple(gate_up)), Stack(tuple(down))
    return NameMap(rules)


__all__ = [
    "MEGATRON_EXPERT_FORMS",
    "MEGATRON_FAMILIES",
    "NORM_NAMINGS",
    "hf_to_megatron_family",
    "megatron_to_hf_family",
]
