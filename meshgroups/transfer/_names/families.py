"""Ready-made maps for real model families: Hugging Face names into vLLM's, read from a
Hugging Face config (any object with its attributes, or a dict; nothing is imported).

:func:`hf_to_vllm` knows ``llama``, ``qwen2`` (q/k/v biases fused like the weights),
``qwen3`` (q/k norms kept), ``qwen3_moe`` (experts stacked into ``experts.w13_weight``
``[E, 2·I, H]`` = gate ‖ up and ``experts.w2_weight`` ``[E, H, I]``), ``deepseek_v3`` (MLA's
``fused_qkv_a_proj`` = ``q_a_proj`` ‖ ``kv_a_proj_with_mqa``, shared experts' ``gate_up_proj``,
the router's ``e_score_correction_bias`` kept, the first ``first_k_dense_replace`` layers dense)
and ``gemma`` / ``gemma2`` (the head tied to the embedding on both sides). Trainer experts are
Transformers 5's packed ``mlp.experts.gate_up_proj`` ``[E, 2·I, H]`` / ``down_proj``
``[E, H, I]`` (``experts="packed"``) or one module per expert, ``mlp.experts.<e>.gate_proj``
(``experts="per_expert"``, Transformers 4 and the checkpoints); the rollout's expert order is
``placement`` over its ``ep`` ranks (:func:`~meshgroups.transfer.expert_order`). vLLM
0.32 keeps the experts in a ``routed_experts`` submodule (``mlp.experts.routed_experts.w13_weight``);
its loader, and the ``meshgroups`` vLLM backend, read this map's ``mlp.experts.w13_weight`` for it::

    >>> cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 4, "moe_intermediate_size": 16}
    >>> m = hf_to_vllm(cfg, ep=2, placement="round_robin")
    >>> w13 = m["model.layers.0.mlp.experts.w13_weight"]
    >>> [(s.source.rsplit(".", 1)[-1], s.index, s.start, s.stop) for s in w13.entries[1].segments]
    [('gate_up_proj', 2, 0, 16), ('gate_up_proj', 2, 16, None)]
"""

from __future__ import annotations

from typing import Any

from meshgroups.errors import LayoutError
from meshgroups.models import EXPERT_KEYS, hf_value
from meshgroups.transfer._names.names import NameMap
from meshgroups.transfer._names.stacking import expert_order, stack_experts

#: The families :func:`hf_to_vllm` knows.
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma", "gemma2")
#: How a trainer holds its experts.
EXPERT_FORMS = ("packed", "per_expert")


def _get(config: object, key: str, default: Any = None) -> Any:
    # the package's one config reader (a dict or a config object; unset or None: default)
    return hf_value(config, key, default=default)


def moe_layers(config: object) -> list[int]:
    """The layers whose MLP is a mixture of experts, as the family's config says.

    Args:
        config: a Hugging Face config (or dict) of a family in :data:`FAMILIES`.

    Returns:
        Layer indices, ascending (``[]`` for a dense family).

    >>> moe_layers({"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1})
    [1, 2, 3]
    """
    kind, n = _get(config, "model_type"), int(_get(config, "num_hidden_layers", 0))
    if kind == "qwen3_moe":
        step = int(_get(config, "decoder_sparse_step", 1) or 1)
        dense = set(_get(config, "mlp_only_layers", None) or ())
        experts = int(_get(config, "num_experts", 0) or 0)
        return [i for i in range(n) if experts > 0 and i not in dense and (i + 1) % step == 0]
    if kind == "deepseek_v3":
        first = int(_get(config, "first_k_dense_replace", 0) or 0)
        freq = int(_get(config, "moe_layer_freq", 1) or 1)
        return [i for i in range(n) if i >= first and i % freq == 0]
    return []


def _experts(config: object) -> int:
    return int(hf_value(config, *EXPERT_KEYS, default=0))


def hf_to_vllm(
    config: object,
    *,
    experts: str = "packed",
    ep: int = 1,
    placement: str = "linear",
    tied_head: bool = False,
) -> NameMap:
    """Hugging Face names → vLLM's, for the family of ``config`` (``llama``, ``qwen2``, ``qwen3``,
    ``qwen3_moe``, ``deepseek_v3``, ``gemma``, ``gemma2``; what each fuses: ``docs/engines.md``).

    Args:
        config: a Hugging Face config or a dict with its keys (``model_type``,
            ``num_hidden_layers``; MoE: ``num_experts`` / ``n_routed_experts``,
            ``moe_intermediate_size``, the dense-layer keys; DeepSeek: ``q_lora_rank``).
        experts: ``"packed"`` (Transformers 5) or ``"per_expert"``: how the trainer names its
            experts.
        ep, placement: the rollout's expert-parallel size and expert placement
            (``"linear"`` / ``"round_robin"``).
        tied_head: the rollout lists ``lm_head.weight`` of its own, read from the embedding
            (a tied trainer names only ``model.embed_tokens.weight``).

    Returns:
        The map; names it lacks are the same on both sides (norms, ``o_proj``, routers,
        ``down_proj`` of dense MLPs, the embedding).

    Raises:
        LayoutError: an unknown family or expert form, a MoE config without its sizes, an ``ep``
            that does not divide the experts.

    >>> m = hf_to_vllm({"model_type": "qwen2", "num_hidden_layers": 1})
    >>> m["model.layers.0.self_attn.qkv_proj.bias"].sources
    ('model.layers.0.self_attn.q_proj.bias', 'model.layers.0.self_attn.k_proj.bias', 'model.layers.0.self_attn.v_proj.bias')
    """
    kind = _get(config, "model_type")
    if kind not in FAMILIES:
        raise LayoutError(f"hf_to_vllm: model_type {kind!r} is not one of {FAMILIES}")
    if experts not in EXPERT_FORMS:
        raise LayoutError(f"hf_to_vllm: experts={experts!r} is not one of {EXPERT_FORMS}")
    layers = int(_get(config, "num_hidden_layers", 0))
    moe = set(moe_layers(config))
    rules: dict[str, object] = {}
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if kind == "deepseek_v3":
            if _get(config, "q_lora_rank") is not None:  # vLLM fuses MLA's two down-projections
                rules[f"{a}.fused_qkv_a_proj.weight"] = [
                    f"{a}.q_a_proj.weight",
                    f"{a}.kv_a_proj_with_mqa.weight",
                ]
        else:
            rules[f"{a}.qkv_proj.weight"] = [f"{a}.{x}_proj.weight" for x in "qkv"]
            if kind == "qwen2" or _get(config, "attention_bias", False):
                rules[f"{a}.qkv_proj.bias"] = [f"{a}.{x}_proj.bias" for x in "qkv"]
        if i in moe:
            rules.update(_moe(config, f"{p}.mlp", experts, ep, placement))
            if kind == "deepseek_v3" and int(_get(config, "n_shared_experts", 0) or 0):
                s = f"{p}.mlp.shared_experts"
                rules[f"{s}.gate_up_proj.weight"] = [f"{s}.gate_proj.weight", f"{s}.up_proj.weight"]
        else:
            rules[f"{p}.mlp.gate_up_proj.weight"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
    if tied_head:
        rules["lm_head.weight"] = "model.embed_tokens.weight"
    return NameMap(rules)


def _moe(config: object, mlp: str, experts: str, ep: int, placement: str) -> dict[str, object]:
    """``experts.w13_weight`` and ``experts.w2_weight`` of one MoE layer, stacked in the
    rollout's expert order."""
    n = _experts(config)
    inter = _get(config, "moe_intermediate_size")
    if n < 1:
        raise LayoutError(f"hf_to_vllm: {mlp} is a MoE layer but the config gives no number of experts")
    order = expert_order(n, ep, placement)
    e = f"{mlp}.experts"
    if experts == "per_expert":
        w13 = stack_experts(lambda x: [f"{e}.{x}.gate_proj.weight", f"{e}.{x}.up_proj.weight"], order)
        w2 = stack_experts(lambda x: f"{e}.{x}.down_proj.weight", order)
    else:
        if inter is None:
            raise LayoutError(
                f"hf_to_vllm: {e}.gate_up_proj is packed gate ‖ up; the config must give moe_intermediate_size "
                "to cut it"
            )
        half = int(inter)
        w13 = stack_experts(
            lambda x: [
                {"source": f"{e}.gate_up_proj", "index": x, "start": 0, "stop": half},
                {"source": f"{e}.gate_up_proj", "index": x, "start": half, "stop": None},
            ],
            order,
        )
        w2 = stack_experts(lambda x: [{"source": f"{e}.down_proj", "index": x}], order)
    return {f"{e}.w13_weight": w13, f"{e}.w2_weight": w2}


__all__ = ["EXPERT_FORMS", "FAMILIES", "hf_to_vllm", "moe_layers"]
