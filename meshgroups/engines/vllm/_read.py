"""A vLLM worker's model read as data (:class:`~meshgroups.engines.vllm.Param` s),
and its post-load processing run again after a commit. Imports vLLM (the worker side only).

Each parameter's layer says how it is sharded: ``QKVParallelLinear`` (q/k/v parts, each
sharded on its own; fewer kv heads than tp ranks: repeated heads), ``MergedColumnParallelLinear``
(gate/up), ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` /
``ParallelLMHead``, replicated layers (a MoE router, MLA's fused ``q_a`` ‖ ``kv_a``) whole
(MLA's ``W_UK_T`` / ``W_UV`` are no destinations: vLLM derives them from ``kv_b_proj``) — and
vLLM's routed experts
(``RoutedExperts``: ``w13_weight`` ``[E_local, 2·I/tp, H]`` = gate ‖ up per expert,
``w2_weight`` ``[E_local, H, I/tp]``), stacked along axis 0 in the order of the layer's own expert
map: sharded over tp (each worker all experts, ``I/tp`` of each) or, with
``enable_expert_parallel``, over experts (each worker ``E/ep`` whole experts). The shapes are
the ones the checkpoint loads (vLLM records them before its post-load processing).

    >>> params, tp_rank, tp = read_params(model)                       # doctest: +SKIP
    >>> [p for p in params if p.experts][0]                           # doctest: +SKIP
    Param(name='model.layers.0.mlp.experts.routed_experts.w13_weight', local_shape=(4, 128, 256), ..., axis=1, ..., experts=(0, 1, 2, 3))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from meshgroups.engines.vllm._destination import Param, fused_parts
from meshgroups.errors import LayoutError

#: Post-load processing this backend knows how to run again after a commit (unquantized only:
#: a quantized layer's processing is not idempotent and needs its scales from the sender).
REPROCESSABLE = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")
#: vLLM's attention layers keep their KV cache's quantization scales as persistent buffers
#: (1.0 for an unquantized cache; a quantized cache's come from calibration, not from training):
#: no destinations.
KV_CACHE_SCALES = frozenset({"_k_scale", "_v_scale", "_q_scale", "_prob_scale"})
#: The stacked expert parameters this backend writes (no expert biases, no scales).
EXPERT_LEAVES = ("w13_weight", "w2_weight")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _loaded_shape(module: torch.nn.Module, leaf: str, param: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype the checkpoint loads ``module.<leaf>`` in: vLLM records it before
    post-load processing (``record_metadata_for_reloading``), which may leave an empty tensor
    in its place (CPU linear layers keep only a packed copy)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    meta = get_layerwise_info(module).restore_metadata[0].get(leaf)
    if meta is not None:
        return meta.shape, meta.dtype
    return param.shape, param.dtype


def _experts(name: str, leaf: str, module: Any, tp: int) -> tuple[int | None, tuple[int, ...]]:
    """A routed-experts parameter: ``(axis it is sharded along over the engine's ranks,
    the global expert at each local slot)``, from the layer's parallel config and expert map."""
    if leaf not in EXPERT_LEAVES:
        raise LayoutError(
            f"vLLM parameter {name!r}: this backend writes a MoE layer's {EXPERT_LEAVES} only (no expert biases "
            "or scales)"
        )
    pc = module.moe_config.moe_parallel_config
    total, local = int(module.global_num_experts), int(module.local_num_experts)
    if pc.use_ep and pc.ep_size > 1:
        if pc.ep_size != tp or pc.tp_size != 1:
            raise LayoutError(
                f"vLLM parameter {name!r}: experts over ep={pc.ep_size} with tp={pc.tp_size} in an engine of tp={tp}; "
                "this backend places experts over the engine's tp ranks (ep = tp, data_parallel_size=1)"
            )
        if local * pc.ep_size != total:
            raise LayoutError(
                f"vLLM parameter {name!r}: {local} local experts x ep={pc.ep_size} != {total} experts (redundant or "
                "uneven experts, EPLB); the rule: ep divides the experts and no expert is held twice"
            )
        emap = module.expert_map
        if emap is None or emap.numel() != total:
            raise LayoutError(
                f"vLLM parameter {name!r}: the layer has no expert map over its {total} experts"
            )
        slots = {int(slot): e for e, slot in enumerate(emap.tolist()) if slot >= 0}
        if sorted(slots) != list(range(local)):
            raise LayoutError(
                f"vLLM parameter {name!r}: the expert map {emap.tolist()} does not fill the {local} local slots"
            )
        return 0, tuple(slots[j] for j in range(local))
    if local != total:
        raise LayoutError(f"vLLM parameter {name!r}: {local} of {total} experts without expert parallelism")
    if pc.tp_size not in (1, tp):
        raise LayoutError(
            f"vLLM parameter {name!r}: experts sharded over tp={pc.tp_size} in an engine of tp={tp}"
        )
    axis = None if pc.tp_size == 1 else (1 if leaf == "w13_weight" else 2)
    return axis, tuple(range(total))


def read_params(model: torch.nn.Module) -> tuple[list[Param], int, int]:
    """Every parameter of this worker's model as a :class:`Param` (tied ones once, as
    ``named_parameters`` lists them), from vLLM's own layers, then its persistent buffers.

    Args:
        model: the worker's model (what vLLM hands the engine).

    Returns:
        ``(params, tp rank, tp size)``.

    Raises:
        LayoutError: a layer this backend cannot describe (a tensor-parallel layer of another
            kind, a padded vocabulary, a quantized layer, expert biases or scales, redundant
            experts), naming the parameter and the rule.
    """
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    modules = dict(model.named_modules())
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    params: list[Param] = []
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = modules[owner]
        # an engine with LoRA slots wraps each layer (its own in `base_layer`): the checkpoint's name
        logical = name.replace(".base_layer.", ".")
        if isinstance(module, MLAAttention):
            continue  # W_UK_T / W_UV: derived from kv_b_proj by its post-load processing (reprocess)
        shape, dtype = _loaded_shape(module, leaf, param)
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in REPROCESSABLE:
            raise LayoutError(
                f"vLLM parameter {name!r}: its layer is quantized ({type(method).__name__}); this backend "
                f"writes unquantized weights only (the rule: {' / '.join(REPROCESSABLE)})"
            )
        axis: int | None = None
        parts: tuple[tuple[str, int, int], ...] | None = None
        experts: tuple[int, ...] | None = None
        layer_tp = getattr(module, "tp_size", 1)
        if isinstance(module, RoutedExperts):
            axis, experts = _experts(name, leaf, module, tp)
            layer_tp = tp
        elif isinstance(module, QKVParallelLinear):
            axis = 0
            real = [
                module.total_num_heads * module.head_size,
                module.total_num_kv_heads * module.head_size,
                module.total_num_kv_heads * module.v_head_size,
            ]
            parts = tuple(zip(_fused(logical, packed), module.output_sizes, real))
        elif isinstance(module, MergedColumnParallelLinear):
            axis = 0
            parts = tuple(zip(_fused(logical, packed), module.output_sizes, module.output_sizes))
        elif isinstance(module, ColumnParallelLinear):
            axis = 0
        elif isinstance(module, RowParallelLinear):
            axis = 1 if leaf == "weight" and module.input_is_parallel else None
        elif isinstance(module, VocabParallelEmbedding):
            if module.num_embeddings_padded != module.org_vocab_size:
                raise LayoutError(
                    f"vLLM parameter {name!r}: the vocabulary ({module.org_vocab_size}) is padded to "
                    f"{module.num_embeddings_padded} rows; this backend needs a vocabulary that is a multiple of "
                    f"64 x tp={tp} (vLLM's padding unit times the tp size)"
                )
            axis = 0
        elif isinstance(module, ReplicatedLinear) or layer_tp == 1:
            axis = None
        else:
            raise LayoutError(
                f"vLLM parameter {name!r}: layer {type(module).__name__} is tensor-parallel (tp_size={layer_tp}) "
                "and not one this backend knows (QKV / MergedColumn / Column / Row parallel linear, vocab embedding, "
                "routed experts)"
            )
        if layer_tp == 1:  # disable_tp layers: whole on every rank
            axis, parts = None, None if parts is None else tuple((s, v, v) for s, _, v in parts)
        params.append(Param(logical, tuple(shape), _dtype_name(dtype), axis, parts, experts=experts))
    params.extend(_buffers(model, tp))
    return params, tp_rank, tp


def _buffers(model: torch.nn.Module, tp: int) -> list[Param]:
    """The model's persistent buffers, destinations like its parameters (a checkpoint holds
    them; vLLM's own caches and expert maps are non-persistent, derived at load), except the
    attention layers' KV-cache scales (:data:`KV_CACHE_SCALES`). Whole on every rank; a buffer
    of a tensor-parallel layer would be sharded in a way no layer says: refused."""
    out = []
    for owner, module in model.named_modules():
        for leaf, buf in module._buffers.items():
            if buf is None or leaf in module._non_persistent_buffers_set or leaf in KV_CACHE_SCALES:
                continue
            name = f"{owner}.{leaf}" if owner else leaf
            if tp > 1 and getattr(module, "tp_size", 1) > 1:
                raise LayoutError(
                    f"vLLM buffer {name!r}: a persistent buffer of tensor-parallel layer {type(module).__name__}; this "
                    "backend writes buffers whole on every rank (the rule: persistent buffers of replicated layers)"
                )
            out.append(Param(name, tuple(buf.shape), _dtype_name(buf.dtype)))
    return out


def _fused(name: str, packed: dict) -> list[str]:
    fused = fused_parts(name, packed)
    if fused is None:
        raise LayoutError(f"vLLM parameter {name!r}: the model's packed_modules_mapping has no entry for it")
    return fused[1]


def reprocess(model: torch.nn.Module, written: Iterable[int], act_dtype: torch.dtype) -> None:
    """Run vLLM's post-load processing again on every layer holding a written parameter
    (``id``\\ s in ``written``; also a layer sharing one, a tied head), after the raw weights
    were copied in.

    Linear and embedding layers: their method's ``process_weights_after_loading`` (on CPU it
    repacks the weight; the packed copy is rebuilt from the raw one each time). Routed experts:
    vLLM's CPU MoE kernel prepacks ``w13_weight`` / ``w2_weight`` in place (same shape, not
    idempotent: a second prepack of packed data is wrong) and only at the first load — its
    method's own reprocessing (vLLM's path for RL weight updates) skips that step — so after the
    raw copy the kernel's ``process_weights_after_loading`` runs (pad, prepack) once; other MoE
    kernels get the method's reprocessing. Then, as at load, the attention layers with
    post-load processing of their own over a written parameter: MLA's ``W_UK_T`` / ``W_UV``,
    derived from ``kv_b_proj`` (in ``act_dtype``), are derived again.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    ids = set(written)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or type(method).__name__ not in REPROCESSABLE:
            continue
        if not any(id(p) in ids for p in module.parameters(recurse=False)):
            continue
        if isinstance(module, RoutedExperts):
            kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if isinstance(kernel, CPUUnquantizedExperts):
                kernel.process_weights_after_loading(module)
                continue
        method.process_weights_after_loading(module)
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    layer: Any
    for layer in model.modules():
        if is_deferred_attention_layer(layer) and any(id(p) in ids for p in layer.parameters()):
            layer.process_weights_after_loading(act_dtype)


__all__ = ["EXPERT_LEAVES", "KV_CACHE_SCALES", "REPROCESSABLE", "read_params", "reprocess"]
