"""megatron-core 0.19's own answers, recorded: every ``parallel_state`` accessor on every rank for
a set of configurations, and the error class of each configuration it refuses (tests' helper).

``snapshot(ps, pgc)`` reads every accessor through a ``parallel_state`` module (megatron-core's
or compat's) after ``initialize_model_parallel``: group getters as their global ranks (with
``check_initialized=False`` where megatron-core has it), sizes and ranks, pipeline and embedding
helpers, the module globals, ``ProcessGroupCollection.use_mpu_process_groups()`` and
``create_all_gather_groups``; an accessor that raises is recorded as ``"raises <Class>"`` (the
builtin class megatron-core raises: compat's errors are subclasses of it). Calls are made by
keyword, plus the positional ``get_data_parallel_group(True, False)`` family that changed meaning
in 0.19. The committed table ``tests/data/megatron_core_0.19.1_answers.json`` was made with
megatron-core 0.19.1 installed (docs/megatron-tests.md), on 8 and 16 gloo processes::

    TORCH_GLOO_LAZY_INIT=1 python -m tests.support.megatron_answers > tests/data/megatron_core_0.19.1_answers.json
"""

from __future__ import annotations

import json
import os
from typing import Any

TABLE = "megatron_core_0.19.1_answers.json"

#: name -> (world, initialize_model_parallel keywords (0.19's)); GTP sizes > 1, expert tp != tp,
#: cp, pp, orders, optimizer instances, hierarchical cp, virtual pp.
CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "gtp2_tp2_pp2_ep2_etp1_egtp2": (
        8,
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            gtp_remat_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
        ),
    ),
    "gtp2_cp2_dp2_ep2_etp2": (
        8,
        dict(
            context_parallel_size=2,
            gtp_remat_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=2,
        ),
    ),
    "gtp4_tp2_ep4_etp1_egtp2": (
        8,
        dict(
            tensor_model_parallel_size=2,
            gtp_remat_size=4,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
        ),
    ),
    "egtp2_tp2_pp2_ep2_etp1_vp2": (
        8,
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
        ),
    ),
    "gtp2_tp2_pp2_order_pp_not_last": (
        8,
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            gtp_remat_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
            order="tp-cp-ep-pp-dp",
        ),
    ),
    "gtp1_tp2_cp2_hcp_ep2_etp1_nopt2": (
        8,
        dict(
            tensor_model_parallel_size=2,
            context_parallel_size=2,
            hierarchical_context_parallel_sizes=[2, 1],
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            num_distributed_optimizer_instances=2,
        ),
    ),
    "offset4_local4_tp2_gtp2": (  # megatron-core 0.19's groups over ranks 4..7 of 8 only
        8,
        dict(tensor_model_parallel_size=2, gtp_remat_size=2, rank_offset=4, local_world_size=4),
    ),
    "gtp2_tp2_cp2_pp2_ep2_etp1_egtp2": (
        16,
        dict(
            tensor_model_parallel_size=2,
            context_parallel_size=2,
            pipeline_model_parallel_size=2,
            gtp_remat_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
            expert_gtp_remat_size=2,
        ),
    ),
    "gtp2_tp2_pp2_dp2_ep4_etp2": (
        16,
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            gtp_remat_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=2,
        ),
    ),
}

#: Configurations megatron-core 0.19 refuses on 8 ranks (the class it raises is recorded).
REFUSALS: dict[str, dict[str, Any]] = {
    "gtp_with_two_optimizer_instances": dict(gtp_remat_size=2, num_distributed_optimizer_instances=2),
    "egtp_with_two_optimizer_instances": dict(
        expert_model_parallel_size=2, expert_gtp_remat_size=2, num_distributed_optimizer_instances=2
    ),
    "gtp_not_dividing_the_world": dict(gtp_remat_size=3),
    "egtp_not_dividing_the_world": dict(expert_model_parallel_size=2, expert_gtp_remat_size=3),
    "dp_equal_order_pp_not_last": dict(
        pipeline_model_parallel_size=2, gtp_remat_size=2, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp"
    ),
    "dp_differs_order_pp_not_last": dict(
        pipeline_model_parallel_size=2, gtp_remat_size=2, order="tp-cp-ep-pp-dp"
    ),
    "vpp_without_pp": dict(gtp_remat_size=2, virtual_pipeline_model_parallel_size=2),
}

_CLASSES = (AssertionError, KeyError, TypeError, RuntimeError, ValueError, AttributeError)


def error_name(exc: BaseException) -> str:
    """The builtin class megatron-core would name for ``exc``."""
    return "raises " + next((c.__name__ for c in _CLASSES if isinstance(exc, c)), type(exc).__name__)


def _ranks(value: Any) -> Any:
    import torch.distributed as dist

    if value is dist.GroupMember.NON_GROUP_MEMBER:
        return "non-member"
    if isinstance(value, dist.ProcessGroup):
        try:
            return list(dist.get_process_group_ranks(value))
        except KeyError:  # a group object torch does not know (destroyed, or a non-member's)
            return "unregistered group"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], dist.ProcessGroup):
        return [_ranks(v) for v in value]
    return value


def _read(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return _ranks(fn(*args, **kwargs))
    except Exception as exc:  # the answer is the error megatron-core raises
        return error_name(exc)


_NO_ARGS = (
    "get_tensor_model_parallel_world_size get_tensor_model_parallel_rank get_tensor_model_parallel_src_rank "
    "get_pipeline_model_parallel_world_size get_pipeline_model_parallel_rank get_model_parallel_src_rank "
    "get_pipeline_model_parallel_first_rank get_pipeline_model_parallel_last_rank "
    "get_pipeline_model_parallel_next_rank get_pipeline_model_parallel_prev_rank "
    "get_context_parallel_world_size get_context_parallel_rank get_tensor_and_context_parallel_world_size "
    "get_tensor_and_context_parallel_rank get_expert_model_parallel_world_size get_expert_model_parallel_rank "
    "get_expert_model_parallel_src_rank get_expert_tensor_parallel_world_size get_expert_tensor_parallel_rank "
    "get_expert_tensor_and_model_parallel_world_size get_expert_tensor_and_model_parallel_rank "
    "get_gtp_weight_remat_world_size get_gtp_weight_remat_rank get_expert_gtp_weight_remat_world_size "
    "get_expert_gtp_weight_remat_rank get_virtual_pipeline_model_parallel_rank "
    "get_virtual_pipeline_model_parallel_world_size is_pipeline_first_stage is_pipeline_last_stage "
    "is_rank_in_embedding_group is_rank_in_position_embedding_group get_all_ranks is_initialized "
    "model_parallel_is_initialized get_data_parallel_world_size get_data_parallel_rank "
    "get_expert_data_parallel_world_size get_expert_data_parallel_rank get_data_parallel_src_rank"
).split()
_GROUPS = (
    "get_model_parallel_group get_tensor_model_parallel_group get_pipeline_model_parallel_group "
    "get_context_parallel_group get_embedding_group get_position_embedding_group "
    "get_tensor_and_context_parallel_group get_expert_model_parallel_group get_expert_tensor_parallel_group "
    "get_expert_tensor_and_model_parallel_group get_intra_distributed_optimizer_instance_group "
    "get_inter_distributed_optimizer_instance_group get_gtp_weight_remat_group "
    "get_expert_gtp_weight_remat_group get_hierarchical_context_parallel_groups "
    "get_context_parallel_global_ranks get_gtp_weight_remat_global_ranks "
    "get_expert_gtp_weight_remat_global_ranks"
).split()
GLOBALS = (
    "_TENSOR_MODEL_PARALLEL_GROUP _PIPELINE_MODEL_PARALLEL_GROUP _MODEL_PARALLEL_GROUP _EMBEDDING_GROUP "
    "_POSITION_EMBEDDING_GROUP _DATA_PARALLEL_GROUP _DATA_PARALLEL_GROUP_GLOO _TENSOR_AND_DATA_PARALLEL_GROUP "
    "_EXPERT_MODEL_PARALLEL_GROUP _EXPERT_TENSOR_PARALLEL_GROUP _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP "
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP _EXPERT_DATA_PARALLEL_GROUP _EXPERT_DATA_PARALLEL_GROUP_GLOO "
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO "
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP _CONTEXT_PARALLEL_GROUP _DATA_PARALLEL_GROUP_WITH_CP "
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP "
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO _TENSOR_AND_CONTEXT_PARALLEL_GROUP "
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP _INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP "
    "_EMBEDDING_GLOBAL_RANKS _POSITION_EMBEDDING_GLOBAL_RANKS _PIPELINE_GLOBAL_RANKS _DATA_PARALLEL_GLOBAL_RANKS "
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS _EXPERT_MODEL_PARALLEL_RANKS _MODEL_PARALLEL_GLOBAL_RANKS "
    "_CONTEXT_PARALLEL_GLOBAL_RANKS _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP _GTP_WEIGHT_REMAT_GROUP "
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS _EXPERT_GTP_WEIGHT_REMAT_GROUP _EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS "
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP _DATA_PARALLEL_GROUP_WITH_GTP_REMAT "
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT "
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT"
).split()


def snapshot(ps: Any, pgc: Any, vp: int | None = None, all_gather: bool = True) -> dict[str, Any]:
    """Every accessor's answer on this rank, read through ``ps`` (and ``pgc``'s collection);
    ``all_gather``: also call ``create_all_gather_groups`` (collective: not where some ranks are
    outside the groups, which megatron-core refuses there before the others' ``new_group``)."""
    out: dict[str, Any] = {}
    for name in _NO_ARGS:
        out[name] = _read(getattr(ps, name))
    for name in _GROUPS:
        out[f"{name}(False)"] = _read(getattr(ps, name), check_initialized=False)
    for cp in (False, True):
        out[f"get_data_parallel_src_rank({cp})"] = _read(
            ps.get_data_parallel_src_rank, with_context_parallel=cp
        )
        out[f"get_tensor_and_data_parallel_group(False, {cp})"] = _read(
            ps.get_tensor_and_data_parallel_group, check_initialized=False, with_context_parallel=cp
        )
        for tp_only in (False, True):
            out[f"get_amax_reduction_group({cp}, {tp_only})"] = _read(
                ps.get_amax_reduction_group, with_context_parallel=cp, tp_only_amax_red=tp_only
            )
        for partial in (False, True):
            kw = dict(with_context_parallel=cp, partial_data_parallel=partial)
            out[f"get_data_parallel_group_gloo({cp}, {partial})"] = _read(
                ps.get_data_parallel_group_gloo, **kw
            )
            for gtp in (False, True):
                key = f"({cp}, {gtp}, {partial})"
                for getter in (
                    "get_data_parallel_group",
                    "get_data_parallel_world_size",
                    "get_data_parallel_rank",
                ):
                    out[f"{getter}{key}"] = _read(getattr(ps, getter), with_gtp_remat=gtp, **kw)
                out[f"positional get_data_parallel_group{key}"] = _read(
                    ps.get_data_parallel_group, cp, gtp, partial
                )
    for gtp in (False, True):
        for partial in (False, True):
            kw = dict(with_gtp_remat=gtp, partial_expert_data_parallel=partial)
            out[f"get_expert_data_parallel_group(False, {gtp}, {partial})"] = _read(
                ps.get_expert_data_parallel_group, check_initialized=False, **kw
            )
            for getter in ("get_expert_data_parallel_world_size", "get_expert_data_parallel_rank"):
                out[f"{getter}({gtp}, {partial})"] = _read(getattr(ps, getter), **kw)
        out[f"get_expert_tensor_model_pipeline_parallel_group(False, {gtp})"] = _read(
            ps.get_expert_tensor_model_pipeline_parallel_group, check_initialized=False, with_egtp_remat=gtp
        )
    for partial in (False, True):
        out[f"get_expert_data_parallel_group_gloo({partial})"] = _read(
            ps.get_expert_data_parallel_group_gloo, partial_expert_data_parallel=partial
        )
    for stage in range(vp or 0):
        for name in ("is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group"):
            out[f"{name}(False, {stage})"] = _read(getattr(ps, name), ignore_virtual=False, vp_stage=stage)
    for name in GLOBALS:
        out[name] = _ranks(getattr(ps, name))
    from dataclasses import fields

    collection = {}
    for f in fields(pgc.ProcessGroupCollection):  # field by field: on a rank outside, some assert
        one = _read(pgc.ProcessGroupCollection.use_mpu_process_groups, [f.name])
        collection[f.name] = getattr(one, f.name) if isinstance(one, pgc.ProcessGroupCollection) else one
    out["ProcessGroupCollection"] = {k: _ranks(v) for k, v in sorted(collection.items())}
    if all_gather:
        out["create_all_gather_groups(True)"] = _read(
            ps.create_all_gather_groups, for_expert_parallelism=True
        )
    return out


def snapshot_config(ps: Any, pgc: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` after ``initialize_model_parallel(**kwargs)`` with that config's options."""
    return snapshot(
        ps,
        pgc,
        kwargs.get("virtual_pipeline_model_parallel_size"),
        all_gather="local_world_size" not in kwargs,
    )


def _answers(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """megatron-core's answers on this rank (its own processes), config by config."""
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import process_groups_config as pgc

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for name in names:
        ps.initialize_model_parallel(**CONFIGS[name][1])
        out[name] = snapshot_config(ps, pgc, CONFIGS[name][1])
        _destroy(ps, dist)
    if world == 8:
        for name, kwargs in REFUSALS.items():
            try:
                ps.initialize_model_parallel(**kwargs)
                out[f"refusal {name}"] = "accepted"
            except Exception as exc:  # what megatron-core raises is the answer
                out[f"refusal {name}"] = error_name(exc)
            _destroy(ps, dist)
    return out


def _destroy(ps: Any, dist: Any) -> None:
    """megatron-core's destroy, then its groups (it never destroys them: threads pile up); the
    globals its destroy leaves set are cleared too, so no configuration reads the previous one's."""
    ps.destroy_model_parallel()
    for name in [*GLOBALS, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"]:  # as in a fresh process
        setattr(ps, name, None)
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    dist.barrier()


def main() -> None:
    import megatron.core

    from .dist import run

    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    table: dict[str, Any] = {"megatron_core": megatron.core.__version__, "configs": {}, "answers": {}}
    for world in (8, 16):
        names = [n for n, (w, _) in CONFIGS.items() if w == world]
        per_rank = run(_answers, world, names, timeout=1200, pg_timeout=300)
        for name in [*names, *(f"refusal {r}" for r in REFUSALS if world == 8)]:
            if name in CONFIGS:
                table["configs"][name] = {"world": world, "kwargs": CONFIGS[name][1]}
                table["answers"][name] = [answers[name] for answers in per_rank]
            else:
                table["answers"][name] = per_rank[0][name]
    print(json.dumps(table, sort_keys=True, separators=(",", ":")))


if __name__ == "__main__":
    main()
