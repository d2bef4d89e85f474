"""The one table behind ``meshgroups.compat.parallel_state``: megatron-core 0.16.1's and 0.19's public surface.

``API`` maps every public function of megatron-core's ``parallel_state`` to how compat serves
it: a *kind* (a group getter, a size, a rank, a source rank, a setter, or ``custom`` — written
out in ``parallel_state_ranks.py`` / ``megatron_helpers.py`` because its arguments pick among
several groups), the *group family* (a field of ``megatron_plan``) it reads, the module global a
setter writes and a getter honours first, and the exception class megatron-core raises when the
value is not there. ``parallel_state`` generates the regular kinds from it; the signature test
reads it (``tests/data/megatron_core_<version>_signatures.json``). Functions whose signature
or answer differs between the versions are ``custom`` here and served per version
(``parallel_state_versions.py``); ``SINCE`` names those that exist in one version only.
``GLOBALS`` maps megatron-core's
module globals to the family (and twin/rank list) they hold, served by the module's
``__getattr__``::

    >>> API["get_tensor_model_parallel_world_size"]
    Api(kind='size', field='tp', override='_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE', error=<class 'AssertionError'>)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["API", "CLASSES", "FIELD_WHAT", "GLOBALS", "OVERRIDES", "PGC_API", "SINCE", "Api"]


@dataclass(frozen=True)
class Api:
    """How compat serves one megatron-core function.

    ``kind``: ``group`` ``(check_initialized=True)``; ``size`` / ``rank`` (the override, else
    the group's; Megatron asserts without a group); ``size0`` / ``rank0`` (same, but 0 when
    ``torch.distributed`` is not initialised); ``size_or0`` / ``rank_or0`` (the group's, 0 when
    there is none: 0.19's gtp_remat accessors); ``ranks`` (the group's global ranks,
    ``(check_initialized=True)``); ``src`` (the group's first global rank); ``set`` (writes
    ``override``); ``custom``.
    """

    kind: str
    field: str | None = None
    override: str | None = None
    error: type[BaseException] | None = AssertionError


# Megatron's own words for each family (used in "... is not initialized" messages).
FIELD_WHAT: dict[str, str] = {
    "tp": "tensor model parallel group",
    "pp": "pipeline model parallel group",
    "mp": "model parallel group",
    "cp": "context parallel group",
    "tp_cp": "tensor and context parallel group",
    "dp": "data parallel group",
    "dp_cp": "data parallel group with context parallel combined",
    "dp_cp_ag": "data parallel group with context parallel AG",
    "intra_dp_cp": "intra partial data parallel group",
    "tp_dp": "tensor and data parallel group",
    "tp_dp_cp": "tensor and data parallel group with context parallel",
    "ep": "expert model parallel group",
    "expt_tp": "expert tensor parallel group",
    "tp_ep": "expert tensor and model parallel group",
    "tp_ep_pp": "expert tensor-model-pipeline parallel group",
    "expt_dp": "expert data parallel group",
    "intra_expt_dp": "intra partial expert data parallel group",
    "inter_dist_opt": "inter distributed optimizer instance group",
    "intra_dist_opt": "intra distributed optimizer instance group",
    "embd": "embedding group",
    "pos_embd": "position embedding group",
    "gtp_remat": "generalized tensor parallel group",
    "expt_gtp_remat": "expert generalized tensor parallel group",
    "dp_gtp_remat": "data parallel group (with GTP_remat)",
    "dp_cp_gtp_remat": "data parallel group with CP (with GTP_remat)",
    "intra_dp_cp_gtp_remat": "intra partial data parallel group with CP (with GTP_remat)",
    "expt_dp_gtp_remat": "Expert data parallel group (with GTP_remat)",
    "intra_expt_dp_gtp_remat": "Intra partial expert data parallel group (with GTP_remat)",
    "tp_ep_pp_with_egtp_remat": "Expert tensor-model-pipeline parallel group with EGTP",
}

_TP_SIZE = "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE"
_TP_RANK = "_MPU_TENSOR_MODEL_PARALLEL_RANK"
_PP_SIZE = "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"
_PP_RANK = "_MPU_PIPELINE_MODEL_PARALLEL_RANK"
_EP_SIZE = "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE"
_EP_RANK = "_MPU_EXPERT_MODEL_PARALLEL_RANK"
_ETP_SIZE = "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE"
_ETP_RANK = "_MPU_EXPERT_TENSOR_PARALLEL_RANK"
_VP_SIZE = "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"
_VP_RANK = "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK"

# Module globals megatron-core keeps as plain values (setters write them, destroy resets them).
OVERRIDES: tuple[str, ...] = (
    _TP_SIZE,
    _TP_RANK,
    _PP_SIZE,
    _PP_RANK,
    _EP_SIZE,
    _EP_RANK,
    _ETP_SIZE,
    _ETP_RANK,
    _VP_SIZE,
    _VP_RANK,
    "_MPU_DATA_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_RANK",
)

_C = Api("custom", error=None)

API: dict[str, Api] = {
    # ---- state and set-up
    "initialize_model_parallel": _C,
    "destroy_model_parallel": _C,
    "is_initialized": _C,
    "is_unitialized": _C,
    "model_parallel_is_initialized": _C,
    "get_all_ranks": _C,
    # ---- helpers (megatron_helpers.py)
    "get_nccl_options": _C,
    "update_pg_timeout": _C,
    "create_group": _C,
    "generate_masked_orthogonal_rank_groups": _C,
    "create_hierarchical_groups": _C,
    "create_hybrid_dp_cp_groups": _C,
    "default_embedding_ranks": _C,
    "default_position_embedding_ranks": _C,
    "overwrite_nccl_comm_cfgs": _C,
    # ---- group getters
    "get_model_parallel_group": Api("group", "mp"),
    "get_tensor_model_parallel_group": Api("group", "tp"),
    "get_pipeline_model_parallel_group": Api("group", "pp"),
    "get_context_parallel_group": Api("group", "cp"),
    "get_embedding_group": Api("group", "embd"),
    "get_position_embedding_group": Api("group", "pos_embd"),
    "get_tensor_and_context_parallel_group": Api("group", "tp_cp"),
    "get_expert_model_parallel_group": Api("group", "ep"),
    "get_expert_tensor_parallel_group": Api("group", "expt_tp"),
    "get_expert_tensor_and_model_parallel_group": Api("group", "tp_ep"),
    "get_expert_tensor_model_pipeline_parallel_group": Api("custom", "tp_ep_pp"),
    "get_intra_distributed_optimizer_instance_group": Api("group", "intra_dist_opt"),
    "get_inter_distributed_optimizer_instance_group": Api("group", "inter_dist_opt"),
    "get_data_parallel_group": Api("custom", "dp"),
    "get_data_parallel_group_gloo": Api("custom", "dp"),
    "has_separate_all_gather_group": Api("custom", "dp_cp_ag", error=None),
    "get_context_parallel_global_ranks": Api("custom", "cp"),
    "get_hierarchical_context_parallel_groups": Api("custom", "cp"),
    "get_hybrid_data_context_parallel_groups": Api("custom", "dp_cp"),
    "get_amax_reduction_group": Api("custom", "tp_dp"),
    "get_tensor_and_data_parallel_group": Api("custom", "tp_dp"),
    "get_expert_data_parallel_group": Api("custom", "expt_dp"),
    "get_data_modulo_expert_parallel_group": Api("custom", "expt_dp"),
    "get_expert_data_parallel_group_gloo": Api("custom", "expt_dp"),
    # ---- sizes and ranks
    "get_tensor_model_parallel_world_size": Api("size", "tp", _TP_SIZE),
    "get_tensor_model_parallel_rank": Api("rank", "tp", _TP_RANK),
    "get_pipeline_model_parallel_world_size": Api("size", "pp", _PP_SIZE),
    "get_pipeline_model_parallel_rank": Api("rank", "pp", _PP_RANK),
    "get_context_parallel_world_size": Api("size0", "cp"),
    "get_context_parallel_rank": Api("rank0", "cp"),
    "get_tensor_and_context_parallel_world_size": Api("size0", "tp_cp"),
    "get_tensor_and_context_parallel_rank": Api("rank0", "tp_cp"),
    "get_expert_model_parallel_world_size": Api("size0", "ep", _EP_SIZE),
    "get_expert_model_parallel_rank": Api("rank0", "ep", _EP_RANK),
    "get_expert_tensor_and_model_parallel_world_size": Api("size0", "tp_ep"),
    "get_expert_tensor_and_model_parallel_rank": Api("rank0", "tp_ep"),
    "get_expert_tensor_parallel_world_size": Api("custom", "expt_tp", _ETP_SIZE, error=None),
    "get_expert_tensor_parallel_rank": Api("custom", "expt_tp", _ETP_RANK, error=None),
    "get_data_parallel_world_size": Api("custom", "dp", "_MPU_DATA_PARALLEL_WORLD_SIZE"),
    "get_data_parallel_rank": Api("custom", "dp", "_MPU_DATA_PARALLEL_RANK"),
    "get_expert_data_parallel_world_size": Api("custom", "expt_dp"),
    "get_expert_data_parallel_rank": Api("custom", "expt_dp"),
    "get_tensor_model_parallel_src_rank": Api("src", "tp"),
    "get_model_parallel_src_rank": Api("src", "mp"),
    "get_expert_model_parallel_src_rank": Api("src", "ep"),
    "get_data_parallel_src_rank": Api("custom", "dp"),
    # ---- pipeline stages
    "get_pipeline_model_parallel_first_rank": Api("custom", "pp"),
    "get_pipeline_model_parallel_last_rank": Api("custom", "pp"),
    "get_pipeline_model_parallel_next_rank": Api("custom", "pp"),
    "get_pipeline_model_parallel_prev_rank": Api("custom", "pp"),
    "is_pipeline_first_stage": Api("custom", "pp"),
    "is_pipeline_last_stage": Api("custom", "pp"),
    "is_rank_in_embedding_group": Api("custom", "embd", error=None),
    "is_rank_in_position_embedding_group": Api("custom", "pos_embd", error=None),
    "get_virtual_pipeline_model_parallel_rank": Api("custom", None, _VP_RANK, error=None),
    "get_virtual_pipeline_model_parallel_world_size": Api("custom", None, _VP_SIZE, error=None),
    # ---- setters
    "set_tensor_model_parallel_world_size": Api("set", "tp", _TP_SIZE, error=None),
    "set_tensor_model_parallel_rank": Api("set", "tp", _TP_RANK, error=None),
    "set_pipeline_model_parallel_world_size": Api("set", "pp", _PP_SIZE, error=None),
    "set_pipeline_model_parallel_rank": Api("set", "pp", _PP_RANK, error=None),
    "set_virtual_pipeline_model_parallel_world_size": Api("set", None, _VP_SIZE, error=None),
    "set_virtual_pipeline_model_parallel_rank": Api("custom", None, _VP_RANK, error=None),
    "set_data_parallel_rank": Api("set", "dp", "_MPU_DATA_PARALLEL_RANK", error=None),
    "set_expert_model_parallel_world_size": Api("set", "ep", _EP_SIZE, error=None),
    "set_expert_model_parallel_rank": Api("set", "ep", _EP_RANK, error=None),
    "set_expert_tensor_parallel_world_size": Api("set", "expt_tp", _ETP_SIZE, error=None),
    "set_expert_tensor_parallel_rank": Api("set", "expt_tp", _ETP_RANK, error=None),
    # ---- megatron-core 0.19: generalized tensor parallelism (gtp_remat) and its expert twin
    "get_gtp_weight_remat_group": Api("group", "gtp_remat"),
    "get_gtp_weight_remat_world_size": Api("size_or0", "gtp_remat"),
    "get_gtp_weight_remat_rank": Api("rank_or0", "gtp_remat"),
    "get_gtp_weight_remat_global_ranks": Api("ranks", "gtp_remat"),
    "get_expert_gtp_weight_remat_group": Api("group", "expt_gtp_remat"),
    "get_expert_gtp_weight_remat_world_size": Api("size_or0", "expt_gtp_remat"),
    "get_expert_gtp_weight_remat_rank": Api("rank_or0", "expt_gtp_remat"),
    "get_expert_gtp_weight_remat_global_ranks": Api("ranks", "expt_gtp_remat"),
    "create_all_gather_groups": _C,
    # ---- memory buffers
    "get_global_memory_buffer": _C,
    "get_global_symmetric_memory_buffer": _C,
    "destroy_global_memory_buffer": _C,
    "destroy_global_symmetric_memory_buffer": _C,
}

# The functions that exist in one served version only (the others are in both).
SINCE: dict[str, str] = {
    **dict.fromkeys(
        (
            "is_unitialized",
            "get_data_modulo_expert_parallel_group",
            "has_separate_all_gather_group",
            "get_global_symmetric_memory_buffer",
            "destroy_global_symmetric_memory_buffer",
        ),
        "0.16 only",
    ),
    **dict.fromkeys((n for n in API if "gtp_weight_remat" in n), "0.19"),
    "create_all_gather_groups": "0.19",
}

# Public classes of parallel_state, and the public surface of process_groups_config.
CLASSES: tuple[str, ...] = ("RankGenerator",)
PGC_API: tuple[str, ...] = (
    "ProcessGroupCollection",
    "ProcessGroupCollection.use_mpu_process_groups",
    "ProcessGroupCollection.setup_process_groups_for_optimizer",
    "ProcessGroupCollection.setup_process_groups_for_ddp",
    "ProcessGroupHelperMeta",
    # megatron-core 0.19
    "ProcessGroupCollection.is_gtp_remat_active",
    "MultiModuleProcessGroupCollection",
    "MultiModuleProcessGroupCollection.get_language_model_collection",
    "MultiModuleProcessGroupCollection.get_language_model_cp_size",
    "MultiModuleProcessGroupCollection.get_module_collection",
    "MultiModuleProcessGroupCollection.has_language_model",
    "MultiModuleProcessGroupCollection.items",
    "MultiModuleProcessGroupCollection.keys",
    "MultiModuleProcessGroupCollection.values",
)

# megatron-core's module globals -> (family, what): "group", "gloo" twin, or "ranks" (its
# global rank list). Special families: "hcp" (list per level), "hybrid" (dict by size).
GLOBALS: dict[str, tuple[str, str]] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp", "group"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp", "group"),
    "_MODEL_PARALLEL_GROUP": ("mp", "group"),
    "_EMBEDDING_GROUP": ("embd", "group"),
    "_POSITION_EMBEDDING_GROUP": ("pos_embd", "group"),
    "_DATA_PARALLEL_GROUP": ("dp", "group"),
    "_DATA_PARALLEL_GROUP_GLOO": ("dp", "gloo"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": ("tp_dp", "group"),
    "_EXPERT_MODEL_PARALLEL_GROUP": ("ep", "group"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("expt_tp", "group"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("tp_ep", "group"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("tp_ep_pp", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP": ("expt_dp", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": ("expt_dp", "gloo"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("intra_expt_dp", "group"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": ("intra_expt_dp", "gloo"),
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("inter_dist_opt", "group"),
    "_CONTEXT_PARALLEL_GROUP": ("cp", "group"),
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": ("hcp", "group"),
    "_HYBRID_DP_CP_GROUPS": ("hybrid", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": ("dp_cp_ag", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": ("dp_cp", "gloo"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("intra_dp_cp", "group"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": ("intra_dp_cp", "gloo"),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("tp_cp", "group"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("tp_dp_cp", "group"),
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": ("intra_dist_opt", "group"),
    "_EMBEDDING_GLOBAL_RANKS": ("embd", "ranks"),
    "_POSITION_EMBEDDING_GLOBAL_RANKS": ("pos_embd", "ranks"),
    "_PIPELINE_GLOBAL_RANKS": ("pp", "ranks"),
    "_DATA_PARALLEL_GLOBAL_RANKS": ("dp", "ranks"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ("tp", "ranks"),
    "_EXPERT_MODEL_PARALLEL_RANKS": ("ep", "ranks"),
    "_MODEL_PARALLEL_GLOBAL_RANKS": ("mp", "ranks"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": ("cp", "ranks"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ("dp_cp", "ranks"),
    # megatron-core 0.19 (with gtp_remat sizes 1 they are the groups above, as in megatron-core)
    "_GTP_WEIGHT_REMAT_GROUP": ("gtp_remat", "group"),
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": ("gtp_remat", "ranks"),
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": ("expt_gtp_remat", "group"),
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": ("expt_gtp_remat", "ranks"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": ("tp_ep_pp_with_egtp_remat", "group"),
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("dp_gtp_remat", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("dp_cp_gtp_remat", "group"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("intra_dp_cp_gtp_remat", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("expt_dp_gtp_remat", "group"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("intra_expt_dp_gtp_remat", "group"),
}
