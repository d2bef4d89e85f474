"""Every Megatron rank/size/stage helper, read through a ``parallel_state`` module (ours or
megatron-core's), and the same values derived from the independent oracle (tests only)."""

from __future__ import annotations

from .megatron_oracle import row_of

# getter name -> (oracle field, what the getter returns from this rank's row)
ROW_GETTERS = {
    "get_tensor_model_parallel_world_size": ("tp", "size"),
    "get_tensor_model_parallel_rank": ("tp", "rank"),
    "get_tensor_model_parallel_src_rank": ("tp", "first"),
    "get_model_parallel_src_rank": ("mp", "first"),
    "get_pipeline_model_parallel_world_size": ("pp", "size"),
    "get_pipeline_model_parallel_rank": ("pp", "rank"),
    "get_pipeline_model_parallel_first_rank": ("pp", "first"),
    "get_pipeline_model_parallel_last_rank": ("pp", "last"),
    "get_pipeline_model_parallel_next_rank": ("pp", "next"),
    "get_pipeline_model_parallel_prev_rank": ("pp", "prev"),
    "get_data_parallel_world_size": ("dp", "size"),
    "get_data_parallel_rank": ("dp", "rank"),
    "get_data_parallel_src_rank": ("dp", "first"),
    "get_context_parallel_world_size": ("cp", "size"),
    "get_context_parallel_rank": ("cp", "rank"),
    "get_context_parallel_global_ranks": ("cp", "row"),
    "get_tensor_and_context_parallel_world_size": ("tp_cp", "size"),
    "get_tensor_and_context_parallel_rank": ("tp_cp", "rank"),
    "get_expert_model_parallel_world_size": ("ep", "size"),
    "get_expert_model_parallel_rank": ("ep", "rank"),
    "get_expert_model_parallel_src_rank": ("ep", "first"),
    "get_expert_tensor_parallel_world_size": ("expt_tp", "size"),
    "get_expert_tensor_parallel_rank": ("expt_tp", "rank"),
    "get_expert_tensor_and_model_parallel_world_size": ("tp_ep", "size"),
    "get_expert_tensor_and_model_parallel_rank": ("tp_ep", "rank"),
    "get_expert_data_parallel_world_size": ("expt_dp", "size"),
    "get_expert_data_parallel_rank": ("expt_dp", "rank"),
}
# getters with Megatron's keywords
KEYWORD_GETTERS = {
    ("get_data_parallel_world_size", "with_context_parallel"): ("dp_cp", "size"),
    ("get_data_parallel_rank", "with_context_parallel"): ("dp_cp", "rank"),
    ("get_data_parallel_src_rank", "with_context_parallel"): ("dp_cp", "first"),
    ("get_expert_data_parallel_world_size", "partial_expert_data_parallel"): ("intra_expt_dp", "size"),
    ("get_expert_data_parallel_rank", "partial_expert_data_parallel"): ("intra_expt_dp", "rank"),
}
GROUP_GETTERS = {
    ("get_tensor_and_data_parallel_group", False): "tp_dp",
    ("get_tensor_and_data_parallel_group", True): "tp_dp_cp",
    ("get_intra_distributed_optimizer_instance_group", None): "intra_dist_opt",
}


def _from_row(row, rank, kind):
    position = row.index(rank)
    return {
        "size": len(row),
        "rank": position,
        "first": row[0],
        "last": row[-1],
        "next": row[(position + 1) % len(row)],
        "prev": row[(position - 1) % len(row)],
        "row": row,
    }[kind]


def snapshot(ps, vp_size=None):
    """Every helper's value on this rank, read through ``ps``."""
    import torch.distributed as dist

    out = {name: getattr(ps, name)() for name in ROW_GETTERS}
    for (name, keyword), _ in KEYWORD_GETTERS.items():
        out[f"{name}({keyword})"] = getattr(ps, name)(**{keyword: True})
    for (name, flag), _ in GROUP_GETTERS.items():
        group = getattr(ps, name)() if flag is None else getattr(ps, name)(with_context_parallel=flag)
        out[f"{name}({flag})"] = sorted(dist.get_process_group_ranks(group))
    out["is_pipeline_first_stage"] = ps.is_pipeline_first_stage()
    out["is_pipeline_last_stage"] = ps.is_pipeline_last_stage()
    out["is_rank_in_embedding_group"] = ps.is_rank_in_embedding_group()
    out["is_rank_in_position_embedding_group"] = ps.is_rank_in_position_embedding_group()
    out["vp"] = (
        ps.get_virtual_pipeline_model_parallel_rank(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    if vp_size:
        for stage in range(vp_size):
            out[f"first_stage(vp={stage})"] = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
            out[f"last_stage(vp={stage})"] = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
            out[f"in_embedding(vp={stage})"] = ps.is_rank_in_embedding_group(
                ignore_virtual=False, vp_stage=stage
            )
    return out


def expected_snapshot(rows, rank, vp_size=None):
    """The same values from the oracle's rows."""
    out = {
        name: _from_row(row_of(rows[field], rank), rank, kind) for name, (field, kind) in ROW_GETTERS.items()
    }
    for (name, keyword), (field, kind) in KEYWORD_GETTERS.items():
        out[f"{name}({keyword})"] = _from_row(row_of(rows[field], rank), rank, kind)
    for (name, flag), field in GROUP_GETTERS.items():
        out[f"{name}({flag})"] = sorted(row_of(rows[field], rank))
    pp = row_of(rows["pp"], rank)
    first, last = pp.index(rank) == 0, pp.index(rank) == len(pp) - 1
    embd = row_of(rows["embd"], rank)
    out["is_pipeline_first_stage"], out["is_pipeline_last_stage"] = first, last
    out["is_rank_in_embedding_group"] = embd is not None
    out["is_rank_in_position_embedding_group"] = row_of(rows["pos_embd"], rank) is not None
    out["vp"] = (0, vp_size) if vp_size else (None, None)
    if vp_size:
        for stage in range(vp_size):
            out[f"first_stage(vp={stage})"] = first and stage == 0
            out[f"last_stage(vp={stage})"] = last and stage == vp_size - 1
            if embd is None:
                out[f"in_embedding(vp={stage})"] = False
            elif rank == embd[0]:
                out[f"in_embedding(vp={stage})"] = first and stage == 0
            elif rank == embd[-1]:
                out[f"in_embedding(vp={stage})"] = last and stage == vp_size - 1
            else:
                out[f"in_embedding(vp={stage})"] = True
    return out
