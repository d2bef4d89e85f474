"""megatron-core's ``ProcessGroupCollection.setup_process_groups_for_optimizer`` / ``..._for_ddp``.

megatron-core 0.19 adds the gtp_remat groups to both dictionaries (``gtp_remat_group``,
``expt_gtp_remat_group``; the optimizer's also ``expt_tp_pp_with_egtp_remat_group``) and skips
the gloo groups under gtp_remat; they are left out for code written for 0.16.

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
from meshgroups.compat._megatron_state import lookup

__all__ = ["for_ddp", "for_optimizer"]

logger = logging.getLogger(__name__)


def _has(pgs: Any, name: str) -> bool:
    """Whether ``name`` was set on ``pgs`` (megatron-core 0.19 reads ``vars()``: an unset
    ``ProcessGroupCollection`` field reads as None there, yet counts as not provided)."""
    try:
        return name in vars(pgs)
    except TypeError:  # no __dict__
        return hasattr(pgs, name)


def _is_019() -> bool:
    from meshgroups.compat._megatron_version import megatron_version

    return megatron_version() != "0.16"


def _gtp_groups(pgs: Any) -> dict[str, Any]:
    if pgs is None:
        return {
            "gtp_remat_group": ps.get_gtp_weight_remat_group(check_initialized=False),
            "expt_gtp_remat_group": ps.get_expert_gtp_weight_remat_group(check_initialized=False),
        }
    return {
        "gtp_remat_group": getattr(pgs, "gtp_remat", None) if _has(pgs, "gtp_remat") else None,
        "expt_gtp_remat_group": getattr(pgs, "expt_gtp_remat", None) if _has(pgs, "expt_gtp_remat") else None,
    }


def _gtp_active(groups: dict[str, Any]) -> bool:
    return any(g is not None and g.size() > 1 for g in groups.values())


def _require(pgs: Any, *names: str, hint: str = "") -> None:
    missing = [n for n in names if not _has(pgs, n)]
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
    if _has(pgs, "dp_cp"):
        return pgs.dp_cp
    if cp_size == 1:
        return pgs.dp  # without context parallelism dp×cp is dp
    raise ValueError(
        "dp_cp process group is required when context_parallel_size > 1 but not provided in pg_collection"
    )


def _from_parallel_state(use_gloo: bool) -> dict[str, Any]:
    # families, not the per-version getters: these are the replicate groups in both versions
    out = {
        "dp_group": lookup("dp"),
        "dp_cp_group": lookup("dp_cp"),
        "intra_dp_cp_group": lookup("intra_dp_cp"),
        "expt_dp_group": lookup("expt_dp"),
        "intra_expt_dp_group": lookup("intra_expt_dp"),
    }
    gtp = _gtp_groups(None)
    use_gloo = use_gloo and not _gtp_active(gtp)  # megatron-core 0.19 builds no gloo twin then
    out["intra_dp_cp_group_gloo"] = lookup("intra_dp_cp", gloo=True) if use_gloo else None
    out["intra_expt_dp_group_gloo"] = lookup("intra_expt_dp", gloo=True) if use_gloo else None
    return out


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
            expt_tp_pp_group=lookup("tp_ep_pp"),
            inter_dist_opt_group=ps.get_inter_distributed_optimizer_instance_group() if multi else None,
            intra_dist_opt_group=ps.get_intra_distributed_optimizer_instance_group(),
        )
        if _is_019():
            out.update(_gtp_groups(None), expt_tp_pp_with_egtp_remat_group=lookup("tp_ep_pp_with_egtp_remat"))
        return out
    _require(pg_collection, "dp")
    cp_size = (
        getattr(_model_config(model_chunks[0]), "context_parallel_size", 1)
        if not _has(pg_collection, "dp_cp")
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
    out = {
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
    if _is_019():
        merged = "tp_ep_pp_with_egtp_remat"
        out.update(
            _gtp_groups(pg_collection),
            expt_tp_pp_with_egtp_remat_group=(
                getattr(pg_collection, merged) if _has(pg_collection, merged) else pg_collection.tp_ep_pp
            ),
        )
    return out


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
        if _is_019():
            out.update(_gtp_groups(None))
        return out
    _require(pg_collection, "dp")
    result: dict[str, Any] = {"dp_group": pg_collection.dp}
    result["dp_cp_group"] = _dp_cp(pg_collection, getattr(config, "context_parallel_size", 1))
    if _has(pg_collection, "expt_dp") and pg_collection.expt_dp is not None:
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
    if _is_019():
        result.update(_gtp_groups(pg_collection))
    return result
