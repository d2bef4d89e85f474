"""The ``custom`` rows of ``megatron_api.API``: megatron-core functions whose arguments choose
among several group families, or that combine a value with megatron-core's fallbacks.

Re-exported by ``meshgroups.compat.parallel_state``. Each reads its groups through
``parallel_state.lookup`` / ``ranks_of`` (one source of truth: the layout) and follows
megatron-core 0.16.1's answers, fallbacks and exception classes::

    >>> ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from meshgroups.compat._errors import MegatronAssertionError, NotInitializedError
from meshgroups.compat._megatron_state import (
    FUNCTIONS,
    SLOTS,
    hcp_groups,
    hybrid_groups,
    local_rank_of,
    lookup,
    override,
    ranks_of,
    set_override,
)

__all__ = [
    "get_all_ranks",
    "get_amax_reduction_group",
    "get_context_parallel_global_ranks",
    "get_data_modulo_expert_parallel_group",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_group_gloo",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_hierarchical_context_parallel_groups",
    "get_hybrid_data_context_parallel_groups",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_tensor_and_data_parallel_group",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "has_separate_all_gather_group",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "set_virtual_pipeline_model_parallel_rank",
]


def _override(name: str) -> Any:
    return override(name)


def _call(name: str) -> int:
    """A table-generated function of ``parallel_state`` (made at its import, so not visible to
    type checkers)."""
    fn: Callable[[], int] = FUNCTIONS[name]
    return fn()


# ------------------------------------------------------------------ data parallel
def _dp_family(
    with_context_parallel: bool, partial_data_parallel: bool, independent_all_gather: bool = False
) -> str:
    if not with_context_parallel:
        return "dp"
    if partial_data_parallel:
        return "intra_dp_cp"
    return "dp_cp_ag" if independent_all_gather else "dp_cp"


def _no_partial_without_cp(with_context_parallel: bool, partial_data_parallel: bool) -> None:
    if partial_data_parallel and not with_context_parallel:
        raise MegatronAssertionError(
            "Partial DP for Optimizer needs to include CP: partial_data_parallel=True needs with_context_parallel=True"
        )


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
) -> Any:
    """The data-parallel group (``dp×cp`` with cp; the optimizer instance's part with
    ``partial_data_parallel``; the separate all-gather communicator with
    ``independent_all_gather``, built by ``create_all_gather_group=True``)."""
    family = _dp_family(with_context_parallel, partial_data_parallel, independent_all_gather)
    group = lookup(family)
    _no_partial_without_cp(with_context_parallel, partial_data_parallel)
    return group


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> Any:
    """The gloo twin of ``get_data_parallel_group``."""
    group = lookup(_dp_family(with_context_parallel, partial_data_parallel), gloo=True)
    _no_partial_without_cp(with_context_parallel, partial_data_parallel)
    return group


def has_separate_all_gather_group() -> bool:
    """True if ``create_all_gather_group=True`` built a separate dp×cp all-gather communicator."""
    return lookup("dp_cp_ag", check_initialized=False) is not None


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    """Size of the data-parallel group (0 without ``torch.distributed``)."""
    if _override("_MPU_DATA_PARALLEL_WORLD_SIZE") is not None:
        return _override("_MPU_DATA_PARALLEL_WORLD_SIZE")
    if not dist.is_initialized():
        return 0
    lookup(_dp_family(with_context_parallel, partial_data_parallel))
    _no_partial_without_cp(with_context_parallel, partial_data_parallel)
    return len(ranks_of(_dp_family(with_context_parallel, partial_data_parallel)))


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """This rank's index in its data-parallel group (0 without ``torch.distributed``)."""
    if _override("_MPU_DATA_PARALLEL_RANK") is not None:
        return _override("_MPU_DATA_PARALLEL_RANK")
    if not dist.is_initialized():
        return 0
    lookup(_dp_family(with_context_parallel, partial_data_parallel))
    _no_partial_without_cp(with_context_parallel, partial_data_parallel)
    return local_rank_of(_dp_family(with_context_parallel, partial_data_parallel))


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """The first global rank of this rank's data-parallel group."""
    return ranks_of("dp_cp" if with_context_parallel else "dp")[0]


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> Any:
    """The tensor × data (× context with ``with_context_parallel``) parallel group."""
    return lookup("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False) -> Any:
    """FP8 amax reduction group: tp×dp(×cp), or tp(×cp) with ``tp_only_amax_red``."""
    if tp_only_amax_red:
        family = "tp_cp" if with_context_parallel else "tp"
    else:
        family = "tp_dp_cp" if with_context_parallel else "tp_dp"
    return lookup(family, what="FP8 amax reduction group")


# ------------------------------------------------------------------ context parallel
def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """The global ranks of this rank's context-parallel group."""
    if not check_initialized and lookup("cp", check_initialized=False) is None:
        return None  # before initialisation, or a rank outside the groups (rank_offset)
    return ranks_of("cp")


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> Any:
    """This rank's hierarchical context-parallel groups, level 0 (innermost) first."""
    groups = hcp_groups()
    if groups is None and check_initialized:
        raise NotInitializedError(
            "hierarchical context parallel groups are not initialized "
            "(initialize_model_parallel(hierarchical_context_parallel_sizes=...) was not given)"
        )
    return groups


def get_hybrid_data_context_parallel_groups(
    check_initialized: bool = True, group_size: int | None = None
) -> Any:
    """The hybrid DP×CP group of ``group_size`` ranks (the dp×cp group at full size)."""
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return lookup("dp_cp", check_initialized)
    groups = hybrid_groups() if SLOTS.state is not None else {}
    if group_size not in groups:
        raise KeyError(group_size)  # megatron-core: a plain dict lookup
    return groups[group_size]


# ------------------------------------------------------------------ expert
def get_expert_tensor_parallel_world_size() -> int | None:
    """Size of the expert tensor-parallel group (tp's override when there is no such group)."""
    if _override("_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE") is not None:
        return _override("_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE")
    if lookup("expt_tp", check_initialized=False) is None:
        return _override("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE")
    return len(ranks_of("expt_tp"))


def get_expert_tensor_parallel_rank() -> int | None:
    """This rank's index in its expert tensor-parallel group (tp's override without a group)."""
    if _override("_MPU_EXPERT_TENSOR_PARALLEL_RANK") is not None:
        return _override("_MPU_EXPERT_TENSOR_PARALLEL_RANK")
    if lookup("expt_tp", check_initialized=False) is None:
        return _override("_MPU_TENSOR_MODEL_PARALLEL_RANK")
    return local_rank_of("expt_tp")


def _edp(partial: bool) -> str:
    return "intra_expt_dp" if partial else "expt_dp"


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> Any:
    """The expert data-parallel group, or its intra-instance part."""
    return lookup(_edp(partial_expert_data_parallel), check_initialized)


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel: bool = False) -> Any:
    """Deprecated in megatron-core: ``get_expert_data_parallel_group``."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> Any:
    """The gloo twin of ``get_expert_data_parallel_group``."""
    return lookup(_edp(partial_expert_data_parallel), gloo=True)


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of the expert data-parallel group (0 without ``torch.distributed``)."""
    if not dist.is_initialized():
        return 0
    lookup(_edp(partial_expert_data_parallel))
    return len(ranks_of(_edp(partial_expert_data_parallel)))


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """This rank's index in its expert data-parallel group (0 without ``torch.distributed``)."""
    if not dist.is_initialized():
        return 0
    lookup(_edp(partial_expert_data_parallel))
    return local_rank_of(_edp(partial_expert_data_parallel))


# ------------------------------------------------------------------ pipeline stages
def _pp_ranks() -> list[int]:
    return ranks_of("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    """The global rank of the first stage of this rank's pipeline."""
    return _pp_ranks()[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """The global rank of the last stage of this rank's pipeline."""
    ranks = _pp_ranks()
    return ranks[_call("get_pipeline_model_parallel_world_size") - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """The global rank of the next pipeline stage (wrapping around)."""
    ranks = _pp_ranks()
    size = _call("get_pipeline_model_parallel_world_size")
    return ranks[(_call("get_pipeline_model_parallel_rank") + 1) % size]


def get_pipeline_model_parallel_prev_rank() -> int:
    """The global rank of the previous pipeline stage (wrapping around)."""
    ranks = _pp_ranks()
    size = _call("get_pipeline_model_parallel_world_size")
    return ranks[(_call("get_pipeline_model_parallel_rank") - 1) % size]


def _virtual_stage_is(vp_stage: Any, wanted: int) -> bool:
    if vp_stage is None:
        raise MegatronAssertionError(
            "vp_stage must be passed if virtual pipeline is enabled (ignore_virtual=False)"
        )
    return bool(vp_stage == wanted)


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the first pipeline stage (with ``ignore_virtual=False`` under virtual
    pipelining: only for virtual stage 0)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None and not _virtual_stage_is(vp_stage, 0):
        return False
    return _call("get_pipeline_model_parallel_rank") == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage (with ``ignore_virtual=False`` under virtual
    pipelining: only for the last virtual stage)."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None and not _virtual_stage_is(vp_stage, vp_size - 1):
        return False
    return _call("get_pipeline_model_parallel_rank") == _call("get_pipeline_model_parallel_world_size") - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds (a copy of) the word embeddings; False before initialisation."""
    ranks = None if SLOTS.state is None else SLOTS.state.ranks("embd")
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
    """True if this rank holds the position embeddings; False before initialisation."""
    ranks = None if SLOTS.state is None else SLOTS.state.ranks("pos_embd")
    return ranks is not None and dist.get_rank() in ranks


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The virtual pipeline rank (None unless set or virtual pipelining is on)."""
    return _override("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK")


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated in megatron-core (pass ``vp_stage`` instead); sets the virtual pipeline rank."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
        "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
        stacklevel=2,
    )
    set_override("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", rank)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """The virtual pipeline size (None without virtual pipelining)."""
    return _override("_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE")


def get_all_ranks() -> str:
    """``"tp_dp_cp_pp_ep"`` ranks of this rank, joined with ``_``."""
    ranks = [
        _call("get_tensor_model_parallel_rank"),
        get_data_parallel_rank(),
        _call("get_context_parallel_rank"),
        _call("get_pipeline_model_parallel_rank"),
        _call("get_expert_model_parallel_rank"),
    ]
    return "_".join(str(r or 0) for r in ranks)
