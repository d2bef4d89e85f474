"""The argument, return and error sections of ``parallel_state``'s docstrings, written from the
table (``megatron_api.API``) instead of by hand in some 90 functions.

``complete(module)`` appends, to each public function of ``module`` that megatron-core has, an
``Args:`` line for every argument its docstring does not name yet (megatron-core's meaning of
that keyword), a ``Returns:`` section where it says nothing of the return value (from the
function's kind: a group, a size, a rank, a source rank, a flag) and the error megatron-core
raises when the value is not there::

    >>> from meshgroups.compat import parallel_state as ps
    >>> "check_initialized:" in ps.get_tensor_model_parallel_group.__doc__
    True
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

from meshgroups.compat._megatron_api import API, Api

ARGS = {
    "check_initialized": "raise ``NotInitializedError`` (an ``AssertionError``, also a ``ValueError``) "
    "when this rank has no such group; with False, return ``None`` instead",
    "with_context_parallel": "the data-parallel group combined with context parallelism (``dp×cp``)",
    "partial_data_parallel": "only this rank's distributed-optimizer instance's part of it",
    "partial_expert_data_parallel": "only this rank's distributed-optimizer instance's part of the "
    "expert data-parallel group",
    "independent_all_gather": "the separate all-gather communicator built by "
    "``create_all_gather_group=True`` (the data-parallel group itself otherwise)",
    "ignore_virtual": "answer for the physical stage only, ignoring virtual pipeline stages",
    "vp_stage": "the virtual pipeline stage asked about (default: the current one)",
    "tp_only_amax_red": "reduce FP8 amax over tensor parallelism (× cp) only, not over data parallelism",
    "group_size": "the number of ranks of the hybrid data × context group asked for",
    "tensor_model_parallel_size": "tp, the ranks that split each layer's tensors",
    "pipeline_model_parallel_size": "pp, the pipeline stages",
    "virtual_pipeline_model_parallel_size": "the virtual stages per pipeline rank (interleaving), or None",
    "pipeline_model_parallel_comm_backend": 'only None or ``"nccl"``: ``"ucc"`` raises ``NotImplementedError``',
    "use_sharp": "only False: SHARP raises ``NotImplementedError``",
    "context_parallel_size": "cp, the ranks that split each sequence",
    "hierarchical_context_parallel_sizes": "cp split into levels (innermost first), or None",
    "hybrid_context_parallel": "also build the hybrid data × context groups of every power-of-two size",
    "expert_model_parallel_size": "ep, the ranks that split the experts",
    "num_distributed_optimizer_instances": "how many distributed-optimizer instances share dp×cp",
    "expert_tensor_parallel_size": "etp, the tensor split inside an expert (default: tp)",
    "nccl_communicator_config_path": "only None: NCCL communicator configs raise ``NotImplementedError``",
    "distributed_timeout_minutes": "the groups' timeout, in minutes",
    "get_embedding_ranks": "``pp_ranks -> ranks`` of the embedding group (default: first and last stage)",
    "get_position_embedding_ranks": "``pp_ranks -> ranks`` of the position-embedding group (default: first stage)",
    "create_gloo_process_groups": "also build a gloo twin of every group",
    "high_priority_stream_groups": "only None: high-priority streams raise ``NotImplementedError``",
    "sharp_enabled_group": "only None (SHARP is not implemented)",
    "create_all_gather_group": "also build a separate dp×cp communicator for all-gathers",
    "ranks": "the global ranks of the group, in order",
    "timeout": "the group's timeout (a ``timedelta``), or None for the default group's",
    "backend": "the group's backend, or None for the default group's",
    "pg_options": "backend options for the group, or None",
    "group_desc": "the group's description (torch's logs and flight recorder show it)",
    "hierarchical_group_sizes": "the sizes of the levels, innermost first (their product is the group's size)",
    "key_value_pair": "``(name, value)`` of one NCCL communicator setting",
    "nccl_comm_cfgs": "NCCL communicator settings by group name",
    "pp_ranks": "the global ranks of one pipeline, first stage first",
    "parallel_size": "the grid's sizes, fastest-varying first",
    "mask": "per dim of the grid, whether it varies within a group",
    "with_gtp_remat": "megatron-core 0.19: the full data-distribution group, which spans "
    "gtp_remat (``False``: the replicate group without it)",
    "with_egtp_remat": "megatron-core 0.19: the group merged across expert gtp_remat peers",
    "gtp_remat_size": "megatron-core 0.19: generalized tensor parallelism, the ranks that shard "
    "each weight and re-gather it (a dim after tp; counts toward the model size)",
    "expert_gtp_remat_size": "megatron-core 0.19: gtp_remat of the experts (a dim after ep)",
    "rank_offset": "megatron-core 0.19: the first global rank the groups cover",
    "local_world_size": "megatron-core 0.19: the number of ranks the groups cover (default: the world)",
    "for_expert_parallelism": "also create the expert data-parallel all-gather groups (with ep > 1)",
}
# ``world_size`` and ``rank``: a setter's value, else what the name says.
SETTER_ARGS = {
    "world_size": "the value to set (``None`` clears it, so the group's size answers again)",
    "rank": "the value to set (``None`` clears it, so the group's rank answers again)",
}
OTHER_ARGS = {"world_size": "the number of ranks", "rank": "a global rank"}

RETURNS = {
    "group": "This rank's process group of that family (``None`` where it has none and "
    "``check_initialized`` is False).",
    "size": "The size of that group (the value set by the matching setter, if any).",
    "size0": "The size of that group (the value set by the matching setter, if any; 0 without "
    "``torch.distributed``).",
    "rank": "This rank's index in that group (the value set by the matching setter, if any).",
    "rank0": "This rank's index in that group (the value set by the matching setter, if any; 0 "
    "without ``torch.distributed``).",
    "src": "The global rank of the first member of this rank's group.",
    "size_or0": "The size of that group (0 without the group or without ``torch.distributed``).",
    "rank_or0": "This rank's index in that group (0 without the group or without ``torch.distributed``).",
    "ranks": "The global ranks of this rank's group of that family (``None`` where it has none and "
    "``check_initialized`` is False).",
}


def _returns(name: str, api: Api, fn: object) -> str | None:
    if api.kind in RETURNS:
        return RETURNS[api.kind]
    returns = inspect.signature(fn).return_annotation  # type: ignore[arg-type]
    if returns in (None, "None"):
        return None
    if name.startswith(("is_", "has_", "model_parallel_is")):
        return "True or False, as the first line says."
    if name.endswith(("_ranks", "rank_groups")):
        return "The list of global ranks the first line describes."
    if "group" in name:
        return "The process group (or groups) the first line describes, as megatron-core returns it."
    if name.endswith(("_world_size", "_rank")):
        return "The integer the first line describes."
    return "The value the first line describes, as megatron-core returns it."


def complete(module: ModuleType) -> None:
    """Add the missing argument, return and error sections to ``module``'s megatron functions.

    Args:
        module: ``meshgroups.compat.parallel_state`` (its functions are changed in place).
    """
    for name, api in API.items():
        fn = getattr(module, name, None)
        if not inspect.isfunction(fn):
            continue
        doc = inspect.cleandoc(fn.__doc__ or f"megatron-core's ``{name}``.")
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not p.name.startswith("_")
        ]
        missing = [p for p in params if not re.search(rf"\b{p}\b", doc)]
        extra = []
        if missing:
            words = {**ARGS, **(SETTER_ARGS if api.kind == "set" else OTHER_ARGS)}
            extra.append(
                "Args:\n" + "\n".join(f"    {p}: {words.get(p, 'as in megatron-core.')}" for p in missing)
            )
        if not re.search("return", doc, re.IGNORECASE) and (returns := _returns(name, api, fn)):
            extra.append(f"Returns:\n    {returns}")
        if (
            api.error is AssertionError
            and api.kind in ("group", "size", "rank", "src")
            and "Raises" not in doc
        ):
            extra.append(
                "Raises:\n    NotInitializedError: (an ``AssertionError``, also a ``ValueError``) where "
                "megatron-core asserts: before ``initialize_model_parallel``, or no such group here."
            )
        if extra:
            fn.__doc__ = doc + "\n\n" + "\n\n".join(extra)
