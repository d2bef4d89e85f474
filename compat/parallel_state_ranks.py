"""Megatron's rank, size and pipeline-stage helpers, every value read off the layout.

Re-exported by ``meshgroups.compat.parallel_state`` (model code calls them as
``parallel_state.get_tensor_model_parallel_rank()`` and so on). World sizes and ranks come from
the layout's arithmetic on the groups ``initialize_model_parallel`` built (``MeshGroups.size``
and ``local_rank``) — no second source of truth — except where a Megatron setter overrode them
(``set_tensor_model_parallel_world_size`` ...), exactly as in Megatron.
"""

from __future__ import annotations

import torch.distributed as dist

from . import parallel_state as _ps

__all__ = [
    "get_context_parallel_global_ranks",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_src_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_model_parallel_src_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "set_data_parallel_rank",
    "set_expert_model_parallel_rank",
    "set_expert_model_parallel_world_size",
    "set_expert_tensor_parallel_rank",
    "set_expert_tensor_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_world_size",
]

# Megatron's setters write these overrides; they live as long as the state (and before it).
_OVERRIDES: dict[str, int | None] = {}


def _ranks(field: str, what: str) -> list[int]:
    state = _ps._require(what)
    dims = state.plan.fields[field]
    ranks = state.mesh_groups.ranks(*((dims,) if isinstance(dims, str) else dims))
    if ranks is None:
        raise RuntimeError(f"{what}: rank {dist.get_rank()} is in no such group")
    return ranks


def _size(field: str, what: str) -> int:
    override = _OVERRIDES.get(f"{field}_size")
    return override if override is not None else len(_ranks(field, what))


def _rank(field: str, what: str) -> int:
    override = _OVERRIDES.get(f"{field}_rank")
    return override if override is not None else _ranks(field, what).index(dist.get_rank())


def reset_overrides() -> None:
    """Called by ``destroy_model_parallel`` (Megatron resets its globals there too)."""
    _OVERRIDES.clear()


# ------------------------------------------------------------------ tensor / pipeline
def get_tensor_model_parallel_world_size() -> int:
    """Size of the tensor-model-parallel group."""
    return _size("tp", "tensor model parallel group")


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-model-parallel group."""
    return _rank("tp", "tensor model parallel group")


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["tp_rank"] = rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of local rank 0 in this rank's tensor-model-parallel group."""
    return _ranks("tp", "tensor model parallel group")[0]


def get_model_parallel_src_rank() -> int:
    """The global rank of local rank 0 in this rank's model-parallel (tp × pp) group."""
    return _ranks("mp", "model parallel group")[0]


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp", "pipeline model parallel group")


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return _rank("pp", "pipeline model parallel group")


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["pp_size"] = world_size


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["pp_rank"] = rank


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp", "pipeline model parallel group")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp", "pipeline model parallel group")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """The global rank of the next pipeline stage (wrapping around)."""
    ranks = _ranks("pp", "pipeline model parallel group")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """The global rank of the previous pipeline stage (wrapping around)."""
    ranks = _ranks("pp", "pipeline model parallel group")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


# ------------------------------------------------------------------ virtual pipeline
def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _OVERRIDES.get("vp_rank")


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["vp_rank"] = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _OVERRIDES.get("vp_size")


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["vp_size"] = world_size


def _vp_stage_ok(vp_stage: int | None, wanted: int) -> bool:
    if vp_stage is None:
        raise ValueError("vp_stage must be passed if virtual pipeline is enabled (ignore_virtual=False)")
    return vp_stage == wanted


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the first pipeline stage (and, with ``ignore_virtual=False`` under virtual
    pipelining, only for virtual stage 0)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None and not _vp_stage_ok(vp_stage, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage (and, with ``ignore_virtual=False`` under virtual
    pipelining, only for the last virtual stage)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None and not _vp_stage_ok(vp_stage, vp_size - 1):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds (a copy of) the word embeddings; see Megatron's rule for
    virtual pipelining (first rank: first virtual stage; last rank: last virtual stage)."""
    state = _ps._require("embedding group")
    ranks = state.mesh_groups.ranks("embd")
    rank = dist.get_rank()
    if ranks is None or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    state = _ps._require("position embedding group")
    ranks = state.mesh_groups.ranks("pos_embd")
    return ranks is not None and dist.get_rank() in ranks


# ------------------------------------------------------------------ data / context
def _dp_field(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    return _ps._dp_name(with_context_parallel, partial_data_parallel)


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    override = _OVERRIDES.get("dp_size")
    if override is not None:
        return override
    return len(_ranks(_dp_field(with_context_parallel, partial_data_parallel), "data parallel group"))


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    override = _OVERRIDES.get("dp_rank")
    if override is not None:
        return override
    ranks = _ranks(_dp_field(with_context_parallel, partial_data_parallel), "data parallel group")
    return ranks.index(dist.get_rank())


def set_data_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["dp_rank"] = rank


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _ranks(_dp_field(with_context_parallel, False), "data parallel group")[0]


def get_context_parallel_world_size() -> int:
    return _size("cp", "context parallel group")


def get_context_parallel_rank() -> int:
    return _rank("cp", "context parallel group")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """The global ranks of this rank's context-parallel group."""
    if _ps._STATE is None and not check_initialized:
        return None
    return _ranks("cp", "context parallel group")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp", "tensor and context parallel group")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp", "tensor and context parallel group")


# ------------------------------------------------------------------ expert
def get_expert_model_parallel_world_size() -> int:
    return _size("ep", "expert model parallel group")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep", "expert model parallel group")


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["ep_size"] = world_size


def set_expert_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["ep_rank"] = rank


def get_expert_model_parallel_src_rank() -> int:
    return _ranks("ep", "expert model parallel group")[0]


def get_expert_tensor_parallel_world_size() -> int:
    return _size("expt_tp", "expert tensor parallel group")


def get_expert_tensor_parallel_rank() -> int:
    return _rank("expt_tp", "expert tensor parallel group")


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["expt_tp_size"] = world_size


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["expt_tp_rank"] = rank


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("tp_ep", "expert tensor and model parallel group")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank("tp_ep", "expert tensor and model parallel group")


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    field = "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"
    return len(_ranks(field, "expert data parallel group"))


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    field = "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"
    return _ranks(field, "expert data parallel group").index(dist.get_rank())
