"""Megatron-Core's parameter names and shapes for the families of
``meshgroups.transfer._names.families_megatron``, read from megatron-core itself: a ``GPTModel`` built
on CPU (gloo, world 1) with the *local* spec (``get_gpt_layer_local_spec``, SequentialMLP
experts), one tiny config per family — the same sizes as the Hugging Face configs of
``tests/transfer/test_transfer_families_megatron.py``. Parameters and persistent buffers (the router's
``expert_bias``) are listed, as a trainer's state dict names them.

Transformer Engine is not installed here, so the TE spec's names are not built; its four
differences from the local spec are read from megatron-core's source and written in the test:
the local spec's own ``sharded_state_dict_keys_map`` (``input_layernorm.`` →
``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` → ``mlp.linear_fc1.layer_norm_``),
``get_gpt_layer_with_transformer_engine_spec`` (``input_layernorm``/``pre_mlp_layernorm``
IdentityOp outside MLA and MoE layers; MLA's q/kv norms fused into ``linear_q_up_proj`` /
``linear_kv_up_proj``) and ``TEGroupedLinear``'s ``weight<i>``.

The committed table ``tests/data/megatron_core_0.16.1_family_names.json`` was made with
megatron-core 0.16.1 (and torch) installed::

    python -m tests.support.megatron_family_names > tests/data/megatron_core_0.16.1_family_names.json
"""

from __future__ import annotations

import json
import os
from typing import Any

TABLE = "megatron_core_0.16.1_family_names.json"

#: The tiny sizes every family shares (the Hugging Face test's ``SMALL``).
VOCAB, HIDDEN, FFN, LAYERS, HEADS = 32, 16, 24, 2, 4

#: Per family: TransformerConfig keywords beyond the shared ones, and the spec's.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"config": {"num_query_groups": 2}, "spec": {}},
    "qwen2": {"config": {"num_query_groups": 2, "add_qkv_bias": True}, "spec": {}},
    "qwen3": {
        "config": {"num_query_groups": 2, "kv_channels": 4, "qk_layernorm": True},
        "spec": {"qk_layernorm": True},
    },
    "gemma": {"config": {"num_query_groups": 1, "kv_channels": 4}, "spec": {}, "tied": True},
    "qwen3_moe": {
        "config": {
            "num_query_groups": 2,
            "kv_channels": 4,
            "qk_layernorm": True,
            "num_moe_experts": 4,
            "moe_ffn_hidden_size": 8,
            "moe_router_topk": 2,
            "moe_layer_freq": [0, 1],
        },
        "spec": {"qk_layernorm": True, "moe": True},
    },
    "deepseek_v3": {
        "config": {
            "num_query_groups": 4,
            "num_moe_experts": 4,
            "moe_ffn_hidden_size": 8,
            "moe_router_topk": 2,
            "moe_layer_freq": [0, 1],
            "moe_shared_expert_intermediate_size": 8,
            "moe_router_enable_expert_bias": True,
            "moe_router_score_function": "sigmoid",
            "q_lora_rank": 8,
            "kv_lora_rank": 4,
            "qk_head_dim": 4,
            "qk_pos_emb_head_dim": 2,
            "v_head_dim": 4,
            "qk_layernorm": True,
        },
        "spec": {"qk_layernorm": True, "moe": True, "mla": True},
        "mla": True,
    },
}
#: DeepSeek-V3's MLA without a q LoRA (``q_lora_rank=None``: ``linear_q_proj``, as DeepSeek-V2-Lite).
FAMILIES["deepseek_v3_q_proj"] = {
    **FAMILIES["deepseek_v3"],
    "config": {**FAMILIES["deepseek_v3"]["config"], "q_lora_rank": None},
}


def init() -> None:
    """gloo, world 1, megatron-core's model-parallel state (idempotent)."""
    import importlib.util

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        # megatron-core 0.16.1 sets HAVE_TE when its TE extension module imports, which it does
        # without TE, and then tests isinstance(..., TELinear) with TELinear None: say no TE.
        multi_latent_attention.HAVE_TE = False
    if not torch.cuda.is_available():  # the router's buffers are made on the current device
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def _no_weights() -> type:
    import torch

    class NoWeights(torch.nn.Module):
        """Stands in for the core attention (a computation without parameters)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__()

    return NoWeights


def family_names(kind: str) -> dict[str, list[int]]:
    """``{name: shape}`` of the family's ``GPTModel`` under the local spec (SequentialMLP)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fam = FAMILIES[kind]
    cls = MLATransformerConfig if fam.get("mla") else TransformerConfig
    cfg = cls(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **fam["config"],
    )
    if fam["spec"].get("moe"):
        spec: Any = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=bool(fam["spec"].get("qk_layernorm"))
        )
    if fam.get("mla"):  # the local DotProductAttention takes no MLA head sizes; it holds no weights
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _no_weights()
    model = GPTModel(
        cfg,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        share_embeddings_and_output_weights=bool(fam.get("tied")),
        position_embedding_type="rope",
    )
    out = {n: list(p.shape) for n, p in model.named_parameters()}
    for n, t in model.state_dict().items():
        if n.endswith("expert_bias"):
            out[n] = list(t.shape)
    return dict(sorted(out.items()))


def main() -> None:
    import warnings

    import megatron.core

    warnings.filterwarnings("ignore")
    init()
    table = {
        "megatron_core": megatron.core.__version__,
        "spec": "get_gpt_layer_local_spec / get_gpt_decoder_block_spec(use_transformer_engine=False)",
        "families": {k: family_names(k) for k in FAMILIES},
    }
    print(json.dumps(table, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
