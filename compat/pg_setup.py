"""megatron-core's ``ProcessGroupCollection.setup_process_groups_for_optimizer`` / ``..._for_ddp``.

Given a collection (or ``None``: the groups of ``meshgroups.compat.parallel_state``), the
dictionaries of groups megatron-core's distributed optimizer and DDP wrapper take, with
megatron-core's fallbacks (dp×cp is dp without context parallelism, intra-instance groups are
the whole groups with one optimizer instance) and its ``ValueError`` for a missing group::

    >>> for_ddp(None, config, ddp_config)["dp_cp_group"]      # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from meshgroups.compat import parallel_state as ps

__all__ = ["for_ddp", "for_optimizer"]

logger = logging.getLogger(__name__)


def _require(pgs: Any, *names: str, hint: str = "") -> None:
    missing = [n for n in names if not hasattr(pgs, n)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} process group{'s are' if len(missing) > 1 else ' is'} required "
            f"but not provided in pg_collection{hint}"
        )


def _model_config(module: Any) -> Any:
    """megatron-core's ``get_model_config``: ``.config`` of the module or a wrapped one."""
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return getattr(module, "config", None)


def _dp_cp(pgs: Any, cp_size: int) -> Any:
    if hasattr(pgs, "dp_cp"):
        return pgs.dp_cp
    if cp_size == 1:
        return pgs.dp  # without context parallelism dp×cp is dp
    raise ValueError(
        "dp_cp process group is required when context_parallel_size > 1 but not provided in pg_collection"
    )


def _from_parallel_state(use_gloo: bool) -> dict[str, Any]:
    return {
        "dp_group": ps.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False),
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False),
        "intra_dp_cp_group": ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        "expt_dp_group": ps.get_expert_data_parallel_group(),
        "intra_expt_dp_group": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        "intra_dp_cp_group_gloo": (
            ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)
            if use_gloo
            else None
        ),
        "intra_expt_dp_group_gloo": (
            ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True) if use_gloo else None
        ),
    }


def for_optimizer(
    pg_collection: Any, model_chunks: list[Any], use_gloo_process_groups: bool = True
) -> dict[str, Any]:
    """dp, dp×cp, intra dp×cp, expert dp (and intra), mp, expert tp×ep×pp, the distributed
    optimizer's inter/intra instance groups, and the intra gloo twins."""
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if pg_collection is None:
        out = _from_parallel_state(use_gloo_process_groups)
        multi = ddp_config is not None and ddp_config.num_distributed_optimizer_instances > 1
        out.update(
            mp_group=ps.get_model_parallel_group(),
            expt_tp_pp_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
            inter_dist_opt_group=ps.get_inter_distributed_optimizer_instance_group() if multi else None,
            intra_dist_opt_group=ps.get_intra_distributed_optimizer_instance_group(),
        )
        return out
    _require(pg_collection, "dp")
    cp_size = (
        getattr(_model_config(model_chunks[0]), "context_parallel_size", 1)
        if not hasattr(pg_collection, "dp_cp")
        else 1
    )
    dp_cp = _dp_cp(pg_collection, cp_size)
    _require(pg_collection, "expt_dp", hint=". Please explicitly set it to None if you don't need it.")
    expt_dp = pg_collection.expt_dp
    intra_dp_cp, intra_expt_dp, inter, intra_opt = dp_cp, expt_dp, None, None
    if ddp_config is not None:
        if ddp_config.num_distributed_optimizer_instances > 1:
            _require(pg_collection, "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt")
            intra_dp_cp, intra_expt_dp = pg_collection.intra_dp_cp, pg_collection.intra_expt_dp
            inter = pg_collection.inter_dist_opt
        if ddp_config.use_distributed_optimizer:
            _require(
                pg_collection,
                "intra_dist_opt",
                hint=". Please explicitly set it to None if you don't need it.",
            )
            intra_opt = pg_collection.intra_dist_opt
    _require(pg_collection, "mp", hint=". Please explicitly set it to None if you don't need it.")
    _require(pg_collection, "tp_ep_pp", hint=". Please explicitly set it to None if you don't need it.")
    if use_gloo_process_groups:
        raise ValueError(
            "Gloo process groups are not supported when pg_collection is provided. "
            "Please set use_gloo_process_groups to False."
        )
    return {
        "dp_group": pg_collection.dp,
        "dp_cp_group": dp_cp,
        "intra_dp_cp_group": intra_dp_cp,
        "expt_dp_group": expt_dp,
        "intra_expt_dp_group": intra_expt_dp,
        "mp_group": pg_collection.mp,
        "expt_tp_pp_group": pg_collection.tp_ep_pp,
        "inter_dist_opt_group": inter,
        "intra_dist_opt_group": intra_opt,
        "intra_dp_cp_group_gloo": None,
        "intra_expt_dp_group_gloo": None,
    }


def for_ddp(pg_collection: Any, config: Any, ddp_config: Any) -> dict[str, Any]:
    """dp, dp×cp, intra dp×cp, expert dp (and intra), tp, pp, ep and the distributed
    optimizer's inter/intra instance groups, as megatron-core's DDP wrapper takes them."""
    if pg_collection is None:
        out = _from_parallel_state(False)
        del out["intra_dp_cp_group_gloo"], out["intra_expt_dp_group_gloo"]
        out.update(
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            inter_dist_opt_group=(
                ps.get_inter_distributed_optimizer_instance_group()
                if ddp_config.num_distributed_optimizer_instances > 1
                else None
            ),
            intra_dist_opt_group=(
                ps.get_intra_distributed_optimizer_instance_group()
                if ddp_config.use_distributed_optimizer
                else None
            ),
        )
        return out
    _require(pg_collection, "dp")
    result: dict[str, Any] = {"dp_group": pg_collection.dp}
    result["dp_cp_group"] = _dp_cp(pg_collection, getattr(config, "context_parallel_size", 1))
    if getattr(pg_collection, "expt_dp", None) is not None:
        result["expt_dp_group"] = pg_collection.expt_dp
    else:  # megatron-core makes a one-rank group here (every rank calls new_group)
        logger.warning(
            "No expert data parallel group provided in pg_collection, creating a new one with just the current rank"
        )
        result["expt_dp_group"] = dist.new_group(ranks=[dist.get_rank()])
    if ddp_config.num_distributed_optimizer_instances == 1:
        result.update(
            intra_dp_cp_group=result["dp_cp_group"],
            intra_expt_dp_group=result["expt_dp_group"],
            inter_dist_opt_group=None,
        )
    else:
        _require(pg_collection, "intra_dp_cp", "intra_expt_dp", "inter_dist_opt")
        result.update(
            intra_dp_cp_group=pg_collection.intra_dp_cp,
            intra_expt_dp_group=pg_collection.intra_expt_dp,
            inter_dist_opt_group=pg_collection.inter_dist_opt,
        )
    _require(pg_collection, "tp", "pp", "ep")
    result.update(tp_group=pg_collection.tp, pp_group=pg_collection.pp, ep_group=pg_collection.ep)
    return result
