"""One script of Megatron-style calls, run against a ``parallel_state`` module (compat's or
megatron-core's): what each call returned or raised, on this rank (tests only).

``scenario(ps, pgc)`` drives ``ps`` the way Megatron's unit tests and training code do —
positional ``initialize_model_parallel(tp, pp, vpp, **kwargs)`` through a ``Utils``-like helper,
every order string Megatron's tests use, invalid configurations, destroy and re-initialise, the
separate all-gather group, hierarchical and hybrid context-parallel groups, module globals,
``ProcessGroupCollection`` — and returns a dict of observations that can be compared between
the two modules, plus the checks it asserted itself.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp", "tp-ep-dp-pp", "tp-pp-ep-dp"]

# (positional tp, pp, vpp), keywords — 8 ranks
CONFIGS: list[tuple[tuple[int, int, int | None], dict[str, Any]]] = [
    ((2, 4, None), {}),
    ((1, 8, None), {}),
    ((8, 1, None), {}),
    ((2, 2, 2), {}),
    ((1, 1, None), {"context_parallel_size": 8}),
    ((1, 1, None), {"expert_model_parallel_size": 8}),
    ((1, 1, None), {"expert_tensor_parallel_size": 8}),
    ((2, 1, None), {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}),
    ((1, 2, None), {"expert_model_parallel_size": 2, "num_distributed_optimizer_instances": 2}),
    ((2, 2, None), {"expert_model_parallel_size": 2, "create_gloo_process_groups": False}),
    ((1, 1, None), {"context_parallel_size": 2, "create_all_gather_group": True}),
    ((1, 1, None), {"context_parallel_size": 2, "hybrid_context_parallel": True}),
]

# invalid configurations: (args, kwargs, Megatron's exception class)
INVALID: list[tuple[tuple[Any, ...], dict[str, Any], type[BaseException]]] = [
    ((16,), {}, RuntimeError),
    ((1, 16), {}, RuntimeError),
    ((8, 8), {}, RuntimeError),
    ((1, 1, 2), {}, RuntimeError),
    ((), {"num_distributed_optimizer_instances": 3}, AssertionError),
    (
        (1, 2),
        {"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1, "order": "tp-cp-ep-pp-dp"},
        AssertionError,
    ),
    ((), {"sharp_enabled_group": "dp"}, AssertionError),
    ((1, 1), {"expert_model_parallel_size": 3}, RuntimeError),
]

GROUP_GETTERS = [
    "get_model_parallel_group",
    "get_tensor_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_context_parallel_group",
    "get_embedding_group",
    "get_position_embedding_group",
    "get_tensor_and_context_parallel_group",
    "get_expert_model_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_intra_distributed_optimizer_instance_group",
    "get_inter_distributed_optimizer_instance_group",
    "get_hierarchical_context_parallel_groups",
]
VALUE_GETTERS = [
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_context_parallel_world_size",
    "get_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_model_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_model_parallel_src_rank",
    "get_expert_model_parallel_src_rank",
    "get_data_parallel_src_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    "get_context_parallel_global_ranks",
    "get_all_ranks",
    "has_separate_all_gather_group",
    "model_parallel_is_initialized",
    "is_initialized",
]
# (getter, kwargs) with Megatron's keyword arguments
KEYWORD_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("get_data_parallel_group", {}),
    ("get_data_parallel_group", {"with_context_parallel": True}),
    ("get_data_parallel_group", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("get_data_parallel_group", {"partial_data_parallel": True}),
    ("get_data_parallel_group", {"with_context_parallel": True, "independent_all_gather": True}),
    ("get_data_parallel_group_gloo", {}),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("get_expert_data_parallel_group", {}),
    ("get_expert_data_parallel_group", {"partial_expert_data_parallel": True}),
    ("get_expert_data_parallel_group_gloo", {"partial_expert_data_parallel": True}),
    ("get_tensor_and_data_parallel_group", {}),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("get_amax_reduction_group", {}),
    ("get_amax_reduction_group", {"with_context_parallel": True}),
    ("get_amax_reduction_group", {"tp_only_amax_red": True}),
    ("get_amax_reduction_group", {"with_context_parallel": True, "tp_only_amax_red": True}),
    ("get_data_parallel_world_size", {"with_context_parallel": True}),
    ("get_data_parallel_rank", {"with_context_parallel": True, "partial_data_parallel": True}),
    ("get_data_parallel_src_rank", {"with_context_parallel": True}),
    ("get_expert_data_parallel_world_size", {"partial_expert_data_parallel": True}),
    ("is_pipeline_first_stage", {"ignore_virtual": False}),
    ("is_pipeline_first_stage", {"ignore_virtual": False, "vp_stage": 0}),
    ("is_pipeline_last_stage", {"ignore_virtual": False, "vp_stage": 1}),
    ("is_rank_in_embedding_group", {"ignore_virtual": False, "vp_stage": 1}),
]
MODULE_GLOBALS = [
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_PIPELINE_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_EMBEDDING_GROUP",
    "_POSITION_EMBEDDING_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_GLOO",
    "_TENSOR_AND_DATA_PARALLEL_GROUP",
    "_EXPERT_MODEL_PARALLEL_GROUP",
    "_EXPERT_TENSOR_PARALLEL_GROUP",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_CONTEXT_PARALLEL_GROUP",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_DATA_PARALLEL_GROUP_WITH_CP",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    "_EMBEDDING_GLOBAL_RANKS",
    "_POSITION_EMBEDDING_GLOBAL_RANKS",
    "_PIPELINE_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
    "_EXPERT_MODEL_PARALLEL_RANKS",
    "_MODEL_PARALLEL_GLOBAL_RANKS",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
]
# globals megatron-core's destroy_model_parallel resets (it leaves some rank lists, the intra
# partial dp×cp group and the hierarchical cp groups set; compat resets everything)
RESET_BY_DESTROY = [
    g
    for g in MODULE_GLOBALS
    if not g.endswith("RANKS")
    and g not in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS")
    and g != "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP"
]


def ranks(value: Any) -> Any:
    """Groups as rank lists (lists and dicts of groups too); other values as they are."""
    if isinstance(value, dist.ProcessGroup):
        return dist.get_process_group_ranks(value)
    if isinstance(value, list):
        return [ranks(v) for v in value]
    if isinstance(value, dict):
        return {k: ranks(v) for k, v in sorted(value.items())}
    return value


def outcome(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``("ok", ranks(result))`` or ``("raised", Megatron's exception class name)``."""
    try:
        return ("ok", ranks(fn(*args, **kwargs)))
    except AssertionError:
        return ("raised", "AssertionError")
    except RuntimeError:
        return ("raised", "RuntimeError")
    except Exception as exc:
        return ("raised", type(exc).__name__)


class Utils:
    """Megatron's test helper, minus CUDA: destroy, then positional initialize."""

    def __init__(self, ps: Any) -> None:
        self.ps = ps

    def initialize_model_parallel(
        self, tp: int = 1, pp: int = 1, vpp: int | None = None, **kwargs: Any
    ) -> None:
        self.ps.destroy_model_parallel()
        self.ps.initialize_model_parallel(tp, pp, vpp, **kwargs)

    def destroy_model_parallel(self) -> None:
        dist.barrier()
        # megatron-core's destroy forgets its groups without destroying them; release them here
        # so dozens of re-initialisations don't pile up gloo connections (compat closes its own)
        leftover = [g for g in (getattr(self.ps, "_global_process_group_list", None) or []) if g is not None]
        self.ps.destroy_model_parallel()
        if not self.ps.__name__.startswith("meshgroups"):
            # megatron-core's destroy leaves these set (stale on the next configuration's
            # non-members); clear them so the comparison is about the configuration
            for name in [g for g in MODULE_GLOBALS if g.endswith("RANKS")] + [
                "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
                "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
            ]:
                setattr(self.ps, name, None)
            self.ps._HYBRID_DP_CP_GROUPS.clear()
            for group in leftover:
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):  # one megatron-core destroyed itself (gloo twins)
                    pass


def observe(ps: Any, pgc: Any) -> dict[str, Any]:
    """Every getter, keyword variant and module global on this rank."""
    seen: dict[str, Any] = {}
    for name in GROUP_GETTERS:
        seen[name] = outcome(getattr(ps, name), check_initialized=False)
        seen[name + "()"] = outcome(getattr(ps, name))
    for name in VALUE_GETTERS:
        seen[name] = outcome(getattr(ps, name))
    for name, kwargs in KEYWORD_CALLS:
        seen[f"{name}{sorted(kwargs.items())}"] = outcome(getattr(ps, name), **kwargs)
    for name in MODULE_GLOBALS:
        seen[name] = ranks(getattr(ps, name))
    collection = pgc.use_mpu_process_groups(["tp", "pp", "dp", "cp", "ep", "embd"])
    seen["repr"] = repr(collection)
    seen["collection"] = outcome(lambda: repr(pgc.use_mpu_process_groups()))
    return seen


def scenario(ps: Any, pgc: Any, light: bool = False) -> dict[str, Any]:
    """The whole Megatron-style script; returns observations keyed by step. ``light``: every
    order for the first configuration only (megatron-core creates each group with its own
    rendezvous, slow on a loaded machine)."""
    utils = Utils(ps)
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    ps.destroy_model_parallel()
    # before initialisation: megatron-core's answers
    out["before"] = {name: outcome(getattr(ps, name)) for name in VALUE_GETTERS if "src" not in name}
    out["before_repr"] = repr(pgc())
    for i, ((tp, pp, vpp), kwargs) in enumerate(CONFIGS):
        for order in ORDERS if i < (1 if light else 4) else [ORDERS[0]]:
            utils.initialize_model_parallel(tp, pp, vpp, order=order, **kwargs)
            out[f"{i}:{order}"] = observe(ps, pgc)
            if kwargs.get("hybrid_context_parallel"):
                out[f"{i}:hybrid"] = {
                    g: outcome(ps.get_hybrid_data_context_parallel_groups, group_size=g) for g in (2, 4, 8)
                }
            # already initialised: megatron-core asserts
            out[f"{i}:{order}:again"] = outcome(
                ps.initialize_model_parallel, tp, pp, vpp, order=order, **kwargs
            )
            utils.destroy_model_parallel()
            out[f"{i}:{order}:destroyed"] = {g: ranks(getattr(ps, g)) for g in RESET_BY_DESTROY}
    for j, (args, kwargs, _) in enumerate(INVALID):
        out[f"invalid{j}"] = outcome(ps.initialize_model_parallel, *args, **kwargs)
        ps.destroy_model_parallel()
    # helpers on an initialised state
    utils.initialize_model_parallel(2, 2)
    if ps.__name__.startswith("meshgroups"):  # megatron-core's calls torch.cuda.synchronize()
        ps.update_pg_timeout(timedelta(minutes=10))
        out_timeout = ps._global_process_group_list
        assert out_timeout is not None and out_timeout[0] is None and len(out_timeout) > 1
    group = ps.create_group([0, 1], group_desc="TEST")
    out["create_group"] = ranks(group) if dist.get_rank() in (0, 1) else "non-member"
    hier, _ = ps.create_hierarchical_groups(dist.get_rank(), list(range(world)), [2, 4])
    out["hierarchical"] = ranks(hier)
    buffer = ps.get_global_memory_buffer()
    out["buffer"] = type(buffer).__name__
    if ps.__name__.startswith("meshgroups"):  # megatron-core's allocates on CUDA
        assert tuple(buffer.get_tensor((2, 3), torch.float32, "x").shape) == (2, 3)
    utils.destroy_model_parallel()
    return out
