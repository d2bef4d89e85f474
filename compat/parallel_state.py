"""A Megatron-style parallel state served by meshgroups.

    import torch.distributed as dist
    from meshgroups.compat import parallel_state as ps

    dist.init_process_group("nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    ps.get_tensor_model_parallel_group()          # same ranks as Megatron's
    ps.destroy_model_parallel()

Megatron's keyword names and meanings; the groups are the dims of ``megatron_plan(...)``'s
layout, built by ``meshgroups.init_mesh`` (each distinct rank set once, in mesh order, after a
cross-rank check). The state is one explicit module-level object, reset by
``destroy_model_parallel()``.

Differences from Megatron: misuse raises ``RuntimeError``/``ValueError`` instead of
``AssertionError``; equal rank sets share one group (e.g. ``dp_cp`` is ``dp`` when cp=1);
``create_gloo_process_groups`` (default True, as in Megatron) builds a gloo twin of every group
(Megatron twins only the data-parallel family; with a gloo default group the twin is the group).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshgroups import GroupCache, MeshGroups, Strategy, init_mesh
from meshgroups.collective import collective_entry

from .megatron_layout import MegatronPlan, RanksCallback, megatron_plan

__all__ = [
    "destroy_model_parallel",
    "get_context_parallel_group",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_embedding_group",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_group_gloo",
    "get_expert_model_parallel_group",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_hierarchical_context_parallel_groups",
    "get_inter_distributed_optimizer_instance_group",
    "get_intra_distributed_optimizer_instance_group",
    "get_mesh_groups",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_position_embedding_group",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_data_parallel_group",
    "get_tensor_model_parallel_group",
    "initialize_model_parallel",
    "is_initialized",
    "model_parallel_is_initialized",
]

# Megatron keywords this layer does not implement, with the value that means "off". Passing the
# "off" value is accepted (callers often spell out every keyword); anything else is refused.
_UNSUPPORTED: dict[str, Any] = {
    "pipeline_model_parallel_comm_backend": None,
    "use_sharp": False,
    "hybrid_context_parallel": False,
    "nccl_communicator_config_path": None,
    "high_priority_stream_groups": None,
    "sharp_enabled_group": None,
    "create_all_gather_group": False,
}


class _State:
    def __init__(self, plan: MegatronPlan, mesh_groups: MeshGroups, cache: GroupCache) -> None:
        self.plan = plan
        self.mesh_groups = mesh_groups
        self.cache = cache

    def group(self, name: str, gloo: bool = False) -> dist.ProcessGroup | None:
        dims = self.plan.fields[name]
        return self.mesh_groups.group(*((dims,) if isinstance(dims, str) else dims), gloo=gloo)


_STATE: _State | None = None


@collective_entry("initialize_model_parallel")  # numbered first: an error on one rank reaches all
def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: RanksCallback | None = None,
    get_position_embedding_ranks: RanksCallback | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    create_gloo_process_groups: bool = True,
    distributed_timeout_minutes: int = 30,
    strategy: Strategy = "global",
    **megatron_only: Any,
) -> None:
    """Build Megatron's model- and data-parallel groups on the default process group.

    The data-parallel size is ``world_size // (tp × pp × cp)``; the expert data-parallel size
    ``world_size // (expert_tp × ep × pp)``. Call on every rank. Other Megatron keywords raise
    ``NotImplementedError`` naming the keyword unless given their "off" value.

    ``strategy`` (meshgroups' own keyword, not Megatron's) picks how groups are created:
    ``"global"`` (default; every rank makes every creation call, what Megatron does) or
    ``"local"`` (each rank creates only its own groups: per-rank start-up cost flat in the
    world size, ~1000x faster than Megatron at 131k ranks; see ``benchmarks/bench_megatron.py``).
    Both run the cross-rank check; ``destroy_model_parallel`` closes either.

    Raises:
        RuntimeError: no default process group, or already initialised.
        ValueError: sizes that don't divide the world (the message shows the formula), or ranks
            that disagree on the configuration (raised on every rank).
    """
    global _STATE
    for key, value in megatron_only.items():
        if key not in _UNSUPPORTED:
            raise TypeError(f"initialize_model_parallel() got an unexpected keyword argument {key!r}")
        if value != _UNSUPPORTED[key]:
            raise NotImplementedError(
                f"{key}={value!r} is not supported by meshgroups.compat.parallel_state (only {_UNSUPPORTED[key]!r})"
            )
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs an initialised default process group")
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size <= 1:
        raise RuntimeError("pipeline-model-parallel size should be greater than 1 with interleaved schedule")
    if _STATE is not None:
        raise RuntimeError(
            "model parallel groups are already initialized; call destroy_model_parallel() first"
        )
    plan = megatron_plan(
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        order=order,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
    )
    cache = GroupCache()
    mesh_groups = init_mesh(
        plan.layout,
        only=plan.group_sets(),
        subsets=plan.subsets,
        gloo_twins=create_gloo_process_groups,
        timeout=timedelta(minutes=distributed_timeout_minutes),
        cache=cache,
        strategy=strategy,
    )
    _STATE = _State(plan, mesh_groups, cache)
    if virtual_pipeline_model_parallel_size is not None:
        set_virtual_pipeline_model_parallel_rank(0)
        set_virtual_pipeline_model_parallel_world_size(virtual_pipeline_model_parallel_size)


def _require(what: str) -> _State:
    if _STATE is None:
        raise RuntimeError(f"{what} is not initialized: call initialize_model_parallel first")
    return _STATE


def is_initialized() -> bool:
    """Megatron's check for code that runs with or without model parallelism."""
    return _STATE is not None


def model_parallel_is_initialized() -> bool:
    """True between ``initialize_model_parallel`` and ``destroy_model_parallel``."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Destroy every group ``initialize_model_parallel`` created and reset the state."""
    global _STATE
    if _STATE is not None and dist.is_initialized():
        _STATE.mesh_groups.close()
    _STATE = None
    reset_overrides()


def get_mesh_groups() -> MeshGroups:
    """The ``meshgroups.MeshGroups`` behind the state (``.mesh`` is the dense DeviceMesh)."""
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized: call initialize_model_parallel first")
    return _STATE.mesh_groups


def _get(name: str, what: str, check_initialized: bool, gloo: bool = False) -> dist.ProcessGroup | None:
    if _STATE is None:
        if check_initialized:
            raise RuntimeError(f"{what} is not initialized: call initialize_model_parallel first")
        return None
    if gloo and not _STATE.mesh_groups.gloo_twins:
        raise RuntimeError(f"{what} (gloo) is not initialized: pass create_gloo_process_groups=True")
    group = _STATE.group(name, gloo=gloo)
    if group is None and check_initialized:
        raise RuntimeError(
            f"{what} is not initialized on rank {dist.get_rank()} (this rank is in no such group)"
        )
    return group


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the tensor-model-parallel group the caller rank belongs to."""
    return _get("tp", "tensor model parallel group", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the pipeline-model-parallel group the caller rank belongs to."""
    return _get("pp", "pipeline model parallel group", check_initialized)


def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the model-parallel (tensor × pipeline) group the caller rank belongs to."""
    return _get("mp", "model parallel group", check_initialized)


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the context-parallel group the caller rank belongs to."""
    return _get("cp", "context parallel group", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the tensor × context parallel group the caller rank belongs to."""
    return _get("tp_cp", "tensor and context parallel group", check_initialized)


def get_hierarchical_context_parallel_groups(
    check_initialized: bool = True,
) -> list[dist.ProcessGroup] | None:
    """Get the hierarchical context-parallel groups (level 0 first), or None if not configured."""
    if _STATE is None or not _STATE.plan.hcp_levels:
        if check_initialized:
            raise RuntimeError("hierarchical context parallel groups are not initialized")
        return None
    return [_STATE.group(level[0]) for level in _STATE.plan.hcp_levels]  # type: ignore[misc]


def get_expert_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the expert-model-parallel group the caller rank belongs to."""
    return _get("ep", "expert model parallel group", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the expert-tensor-parallel group the caller rank belongs to."""
    return _get("expt_tp", "expert tensor parallel group", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the expert tensor × expert model parallel group."""
    return _get("tp_ep", "expert tensor and model parallel group", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """Get the expert tensor × expert model × pipeline parallel group."""
    return _get("tp_ep_pp", "expert tensor, model and pipeline parallel group", check_initialized)


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the embedding group (first and last pipeline stage) the caller rank belongs to."""
    return _get("embd", "embedding group", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Get the position-embedding group (first pipeline stage) the caller rank belongs to."""
    return _get("pos_embd", "position embedding group", check_initialized)


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
) -> dist.ProcessGroup | None:
    """Get the expert data-parallel group, or its intra-instance part."""
    if partial_expert_data_parallel:
        return _get("intra_expt_dp", "intra partial expert data parallel group", check_initialized)
    return _get("expt_dp", "expert data parallel group", check_initialized)


def get_expert_data_parallel_group_gloo(
    partial_expert_data_parallel: bool = False,
) -> dist.ProcessGroup | None:
    """The gloo twin of ``get_expert_data_parallel_group``."""
    name = "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"
    return _get(name, "expert data parallel group", True, gloo=True)


def get_data_parallel_group(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> dist.ProcessGroup | None:
    """Get the data-parallel group (with cp: ``dp×cp``; partial: the optimizer instance's part)."""
    return _get(_dp_name(with_context_parallel, partial_data_parallel), "data parallel group", True)


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> dist.ProcessGroup | None:
    """The gloo twin of ``get_data_parallel_group``."""
    return _get(
        _dp_name(with_context_parallel, partial_data_parallel), "data parallel group", True, gloo=True
    )


def _dp_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise ValueError("partial_data_parallel=True needs with_context_parallel=True (as in Megatron)")
    if partial_data_parallel:
        return "intra_dp_cp"
    return "dp_cp" if with_context_parallel else "dp"


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> dist.ProcessGroup | None:
    """Get the tensor × data parallel group (× context parallel with ``with_context_parallel``)."""
    name = "tp_dp_cp" if with_context_parallel else "tp_dp"
    return _get(name, "tensor and data parallel group", check_initialized)


def get_intra_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """Get the group of every rank of this rank's distributed-optimizer instance (the world
    with one instance)."""
    return _get("intra_dist_opt", "intra distributed optimizer instance group", check_initialized)


def get_inter_distributed_optimizer_instance_group(
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """Get the group spanning the distributed-optimizer instances (the inter-instance part of the
    expert data-parallel group, as in Megatron). Not initialized with a single instance."""
    if _STATE is not None and _STATE.plan.sizes["n_opt"] == 1:
        if check_initialized:
            raise RuntimeError(
                "inter distributed optimizer instance group is not initialized (num_distributed_optimizer_instances=1)"
            )
        return None
    return _get("inter_dist_opt", "inter distributed optimizer instance group", check_initialized)


# Megatron's rank/size/stage helpers live beside this module and are part of its namespace.
from .parallel_state_ranks import *  # noqa: E402, F403
from .parallel_state_ranks import __all__ as _rank_helpers  # noqa: E402
from .parallel_state_ranks import (  # noqa: E402
    reset_overrides,
    set_virtual_pipeline_model_parallel_rank,
    set_virtual_pipeline_model_parallel_world_size,
)

__all__ += _rank_helpers
