"""Tiny Hugging Face configs of the model families the ready-made maps know, and the names and
shapes of the real ``transformers`` classes built from them (``from_config``, random init, no
download). Shared by the vLLM and Megatron family-map tests."""

from __future__ import annotations

#: Sizes every family shares (each adds its heads, experts, MLA ranks).
SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)
#: The families, as ``config(kind)`` names them (``deepseek_v3_q_proj``: MLA without q LoRA).
KINDS = ("llama", "qwen2", "qwen3", "gemma", "qwen3_moe", "deepseek_v3", "deepseek_v3_q_proj")


def config(kind: str) -> object:
    """The tiny config of ``kind`` (one of :data:`KINDS`)."""
    import transformers as t

    if kind.startswith("deepseek_v3"):
        return t.DeepseekV3Config(
            **SMALL,
            num_key_value_heads=4,
            moe_intermediate_size=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            q_lora_rank=None if kind == "deepseek_v3_q_proj" else 8,
            kv_lora_rank=4,
            qk_rope_head_dim=2,
            qk_nope_head_dim=4,
            v_head_dim=4,
            n_group=2,
            topk_group=1,
        )
    if kind == "qwen3_moe":
        return t.Qwen3MoeConfig(
            **SMALL,
            num_key_value_heads=2,
            head_dim=4,
            moe_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )
    return {
        "llama": lambda: t.LlamaConfig(**SMALL, num_key_value_heads=2),
        "qwen2": lambda: t.Qwen2Config(**SMALL, num_key_value_heads=2),
        "qwen3": lambda: t.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=4),
        "gemma": lambda: t.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=4),
    }[kind]()


def hf_shapes(cfg: object) -> dict[str, tuple[int, ...]]:
    """The class's own parameters and the router's correction-bias buffer, as a trainer's
    state dict names them (a tied head once, as the embedding)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(cfg)
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return out
