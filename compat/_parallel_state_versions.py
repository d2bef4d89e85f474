"""The ``parallel_state`` functions whose arguments or answers differ between megatron-core 0.16
and 0.19, one implementation per version, served by ``_versioned.versioned`` (the caller's
version decides; see ``megatron_version``).

Re-exported by ``meshgroups.compat.parallel_state``, after the 0.16-only module
``parallel_state_ranks`` (whose data-parallel getters are the 0.16 implementations here)::

    >>> from meshgroups.compat import parallel_state as ps
    >>> list(ps.get_data_parallel_group._signatures["0.19"].parameters)   # 0.16's: partial second
    ['with_context_parallel', 'with_gtp_remat', 'partial_data_parallel']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from meshgroups.compat import _parallel_state_ranks as v16
from meshgroups.compat._errors import MegatronAssertionError
from meshgroups.compat._megatron_state import (
    FUNCTIONS,
    SLOTS,
    legacy_group,
    local_rank_of,
    lookup,
    override,
    ranks_of,
)
from meshgroups.compat._versioned import versioned
from meshgroups.compat.megatron_layout import inject_gtp_remat

from meshgroups import GroupCache, Layout, LayoutError, MeshGroups, init_mesh

__all__ = [
    "create_all_gather_groups",
    "get_all_ranks",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group",
]

_PS = "meshgroups.compat.parallel_state"


def _call(name: str) -> Any:
    fn: Callable[[], Any] = FUNCTIONS[name]
    return fn()


# ------------------------------------------------------------------ data parallel, 0.19
_DP19 = {  # (with_gtp_remat, with_context_parallel, partial_data_parallel) -> family
    (True, False, False): "dp_gtp_remat",
    (True, True, False): "dp_cp_gtp_remat",
    (True, True, True): "intra_dp_cp_gtp_remat",
    (False, False, False): "dp",
    (False, True, False): "dp_cp",
    (False, True, True): "intra_dp_cp",
}


def _dp19_family(with_context_parallel: bool, with_gtp_remat: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise MegatronAssertionError(
            "Partial DP for Optimizer needs to include CP: partial_data_parallel=True needs with_context_parallel=True"
        )
    return _DP19[(bool(with_gtp_remat), bool(with_context_parallel), bool(partial_data_parallel))]


def _dp_group_19(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> Any:
    """The data-parallel group. ``with_gtp_remat=True`` (the default): the full
    data-distribution group, which spans gtp_remat (batch split, loss reductions);
    ``False``: the replicate group (gradient all-reduce, optimizer sharding)."""
    return lookup(_dp19_family(with_context_parallel, with_gtp_remat, partial_data_parallel))


def _dp_size_19(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> int:
    """Size of that data-parallel group (the override first; 0 without ``torch.distributed``)."""
    if override("_MPU_DATA_PARALLEL_WORLD_SIZE") is not None:
        return int(override("_MPU_DATA_PARALLEL_WORLD_SIZE"))
    if not dist.is_initialized():
        return 0
    family = _dp19_family(with_context_parallel, with_gtp_remat, partial_data_parallel)
    lookup(family)
    return len(ranks_of(family))


def _dp_rank_19(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> int:
    """This rank's index in that data-parallel group (the override first; 0 without ``torch.distributed``)."""
    if override("_MPU_DATA_PARALLEL_RANK") is not None:
        return int(override("_MPU_DATA_PARALLEL_RANK"))
    if not dist.is_initialized():
        return 0
    family = _dp19_family(with_context_parallel, with_gtp_remat, partial_data_parallel)
    lookup(family)
    return local_rank_of(family)


# ------------------------------------------------------------------ expert data parallel
def _edp19_family(with_gtp_remat: bool, partial_expert_data_parallel: bool) -> str:
    base = "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"
    return f"{base}_gtp_remat" if with_gtp_remat else base


def _edp_group_19(
    check_initialized: bool = True, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
) -> Any:
    """The expert data-parallel group: with ``with_gtp_remat`` (the default) the full one,
    spanning expert gtp_remat; the intra-instance part with ``partial_expert_data_parallel``."""
    return lookup(_edp19_family(with_gtp_remat, partial_expert_data_parallel), check_initialized)


def _edp_size_19(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    """Size of that expert data-parallel group (0 without ``torch.distributed``)."""
    if not dist.is_initialized():
        return 0
    family = _edp19_family(with_gtp_remat, partial_expert_data_parallel)
    lookup(family)
    return len(ranks_of(family))


def _edp_rank_19(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    """This rank's index in that expert data-parallel group (0 without ``torch.distributed``)."""
    if not dist.is_initialized():
        return 0
    family = _edp19_family(with_gtp_remat, partial_expert_data_parallel)
    lookup(family)
    return local_rank_of(family)


def _tp_ep_pp_16(check_initialized: bool = True) -> Any:
    """The expert tensor × model × pipeline parallel group."""
    return lookup("tp_ep_pp", check_initialized)


def _tp_ep_pp_19(check_initialized: bool = True, with_egtp_remat: bool = False) -> Any:
    """The expert tensor × model × pipeline parallel group (merged across expert gtp_remat
    peers with ``with_egtp_remat``: the expert twin of the model-parallel group)."""
    return lookup("tp_ep_pp_with_egtp_remat" if with_egtp_remat else "tp_ep_pp", check_initialized)


# ------------------------------------------------------------------ get_all_ranks
def _all_ranks(with_gtp: bool) -> str:
    ranks = [
        _call("get_tensor_model_parallel_rank"),
        *([_call("get_gtp_weight_remat_rank")] if with_gtp else []),
        _dp_rank_19() if with_gtp else v16.get_data_parallel_rank(),
        _call("get_context_parallel_rank"),
        _call("get_pipeline_model_parallel_rank"),
        _call("get_expert_model_parallel_rank"),
    ]
    return "_".join(str(r or 0) for r in ranks)


def _all_ranks_16() -> str:
    """``tp_dp_cp_pp_ep`` ranks of this rank, joined with ``_``."""
    return _all_ranks(False)


def _all_ranks_19() -> str:
    """``tp_gtp_dp_cp_pp_ep`` ranks of this rank (gtp_remat's second), joined with ``_``."""
    return _all_ranks(True)


def _served(name: str, v016: Callable[..., Any], v019: Callable[..., Any]) -> Callable[..., Any]:
    return versioned(name, {"0.16": v016, "0.19": v019}, _PS)


get_data_parallel_group = _served("get_data_parallel_group", v16.get_data_parallel_group, _dp_group_19)
get_data_parallel_world_size = _served(
    "get_data_parallel_world_size", v16.get_data_parallel_world_size, _dp_size_19
)
get_data_parallel_rank = _served("get_data_parallel_rank", v16.get_data_parallel_rank, _dp_rank_19)
get_expert_data_parallel_group = _served(
    "get_expert_data_parallel_group", v16.get_expert_data_parallel_group, _edp_group_19
)
get_expert_data_parallel_world_size = _served(
    "get_expert_data_parallel_world_size", v16.get_expert_data_parallel_world_size, _edp_size_19
)
get_expert_data_parallel_rank = _served(
    "get_expert_data_parallel_rank", v16.get_expert_data_parallel_rank, _edp_rank_19
)
get_expert_tensor_model_pipeline_parallel_group = _served(
    "get_expert_tensor_model_pipeline_parallel_group", _tp_ep_pp_16, _tp_ep_pp_19
)
get_all_ranks = _served("get_all_ranks", _all_ranks_16, _all_ranks_19)


# ------------------------------------------------------------------ initialize_model_parallel
def read_options_16(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp=False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel=False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[..., list[int]] | None = None,
    get_position_embedding_ranks: Callable[..., list[int]] | None = None,
    create_gloo_process_groups=True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
    *,
    strategy: Any = None,
) -> dict[str, Any]:
    """megatron-core 0.16's ``initialize_model_parallel`` arguments, as the options of both."""
    return {
        **locals(),
        "gtp_remat_size": 1,
        "expert_gtp_remat_size": 1,
        "rank_offset": 0,
        "local_world_size": None,
    }


def read_options_19(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[..., list[int]] | None = None,
    get_position_embedding_ranks: Callable[..., list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    rank_offset: int = 0,
    local_world_size: int | None = None,
    *,
    strategy: Any = None,
) -> dict[str, Any]:
    """megatron-core 0.19's ``initialize_model_parallel`` arguments, as the options of both."""
    return {**locals(), "create_all_gather_group": False}


# ------------------------------------------------------------------ create_all_gather_groups
def create_all_gather_groups(
    for_expert_parallelism: bool = False, timeout: Any = None, nccl_comm_cfgs: Any = None
) -> tuple[Any, Any]:
    """megatron-core 0.19: separate communicators over the ranks of the dp×cp groups (and, with
    ``for_expert_parallelism`` and ep > 1, of the expert dp groups) for all-gathers that overlap
    reduce-scatters. As megatron-core, the grid is laid out in the default order
    ``tp-cp-ep-dp-pp`` from the current sizes (getters, so overrides count); every rank calls
    it. The groups live until ``destroy_model_parallel``.

    Returns:
        ``(dp_cp_ag, expt_dp_ag)`` (``expt_dp_ag`` is None unless asked for with ep > 1).

    Raises:
        RuntimeError: before ``initialize_model_parallel``.
    """
    state = SLOTS.state
    if state is None or lookup("dp", check_initialized=False) is None:
        raise RuntimeError(
            "create_all_gather_groups() requires parallel state to be initialized. "
            "Call initialize_model_parallel() first."
        )
    sizes = {
        "tp": _call("get_tensor_model_parallel_world_size"),
        "pp": _call("get_pipeline_model_parallel_world_size"),
        "cp": _call("get_context_parallel_world_size"),
        "dp": _dp_size_19(),
        "gtp_remat": _call("get_gtp_weight_remat_world_size") or 1,
        "ep": 1,
    }
    ep = _call("get_expert_model_parallel_world_size")
    dense = Layout.from_order(inject_gtp_remat("tp-cp-ep-dp-pp", "tp"), **sizes)
    _fits(dense, "tp × gtp_remat × cp × dp × pp", sizes)
    built = [own_communicators(dense, [("dp", "cp")], timeout=timeout)]
    state.extra.append(built[0])
    expt = None
    if for_expert_parallelism and ep > 1:
        expert_sizes = {
            "tp": v16.get_expert_tensor_parallel_world_size(),
            "ep": ep,
            "dp": _edp_size_19(),
            "pp": sizes["pp"],
            "cp": 1,
            "gtp_remat": _call("get_expert_gtp_weight_remat_world_size") or 1,
        }
        expert = Layout.from_order(inject_gtp_remat("tp-cp-ep-dp-pp", "ep"), **expert_sizes)
        _fits(expert, "expert tp × ep × gtp_remat × dp × pp", expert_sizes)
        mesh = own_communicators(expert, [("dp",)], timeout=timeout)
        state.extra.append(mesh)
        expt = legacy_group(mesh.group("dp"))
    return legacy_group(built[0].group("dp", "cp")), expt


def _fits(layout: Layout, what: str, sizes: dict[str, int]) -> None:
    """megatron-core sizes the all-gather grid with the data-parallel size *with* gtp_remat and
    gtp_remat again, so under gtp_remat it is larger than the world and ``new_group`` refuses
    it (``ValueError``); compat refuses it first, naming the sizes."""
    world = dist.get_world_size()
    if layout.world_size > world:
        raise LayoutError(
            f"create_all_gather_groups: {what} = {layout.world_size} ranks ({sizes}) is more than the "
            f"world's {world}: megatron-core 0.19 takes dp from get_data_parallel_world_size(), which "
            "already spans gtp_remat, and multiplies by gtp_remat again (its new_group then fails the same way)"
        )


def own_communicators(layout: Layout, dim_sets: list[tuple[str, ...]], **options: Any) -> MeshGroups:
    """Groups over ``layout``'s ``dim_sets`` that are communicators of their own, even where their
    ranks are another group's or the whole world's (megatron-core's all-gather groups exist to
    progress apart from the dp×cp reduce-scatters): a cache of their own, and the default
    backend named explicitly, so a world-spanning set is not the default group.

    Args:
        layout: the layout (its views too).
        dim_sets: the dim sets to build.
        options: ``init_mesh`` keywords (``timeout``, ``strategy``).

    Returns:
        The ``MeshGroups`` (close it to destroy them).
    """
    backend = str(dist.get_backend())
    names: dict[int | str, object] = {"_".join(dims): backend for dims in dim_sets}
    # partial: Megatron's groups may cover part of the world (rank_offset, local_world_size)
    return init_mesh(
        layout, only=dim_sets, cache=GroupCache(), backend_override=names, partial=True, **options
    )
