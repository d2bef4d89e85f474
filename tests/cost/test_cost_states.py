"""States exactly as torch cuts them, and the traffic that moves them, rank by rank (no processes).

Property tests over random models and layouts, uneven cuts included (a vocabulary tp does not
divide, rows FSDP2's shards do not divide): each rank's parameter bytes equal the pieces
``torch.chunk`` makes — tp's chunk of the tensor's axis (DTensor's ``Shard``), ep's chunk of the
experts, then FSDP2's chunk of dim 0 over the flattened sharding dims — and
:func:`meshgroups.cost.collectives` charges every rank FSDP2's padded buffers of *its own*
chunks, the chunks :func:`meshgroups.cost.rank_states` and :func:`meshgroups.cost.rank_memory`
hold (issue 49: the vocabulary's uneven tp chunks once disagreed)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgroups import Layout
from meshgroups.cost import Model, Parallelism, Precision, collectives, rank_memory, rank_states
from meshgroups.cost._calls import rank_payload
from meshgroups.cost._memory import data_parallel_dims
from meshgroups.cost._states import rank_tensors

LAYOUTS = [
    {"dp_shard": 4},
    {"dp_shard": 3, "tp": 2},
    {"tp": 3, "dp_shard": 2},
    {"dp_replicate": 2, "dp_shard": 3},
    {"pp": 2, "dp_shard": 2, "tp": 2},
    {"dp_shard": 2, "cp": 2, "tp": 2},
    {"pp": 3, "dp_shard": 2},
    {"dp_replicate": 2, "tp": 3},
    {"dp_shard": 2, "ep": 2, "tp": 2},
]


@st.composite
def cases(draw):
    sizes = draw(st.sampled_from(LAYOUTS))
    tp = sizes.get("tp", 1)
    kv = tp * draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 2))
    hd = draw(st.sampled_from([2, 4]))
    moe = "ep" in sizes
    model = Model(
        layers=draw(st.integers(3, 6)),
        hidden=draw(st.integers(3, 13)),
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        ffn=draw(st.integers(3, 17)),
        vocab=draw(st.integers(5, 41)),  # tp and the shards rarely divide it
        gated_mlp=draw(st.booleans()),
        fused_projections=draw(st.booleans()),
        experts=2 * sizes.get("ep", 1) if moe else 0,
        top_k=1 if moe else 0,
        seq_len=8,
    )
    plan = Parallelism(
        precision=draw(st.sampled_from([Precision(), Precision.fsdp2()])),
        vocab_parallel=draw(st.booleans()),
        micro_batches=draw(st.integers(1, 2)),
        zero=0,
    )
    return model, Layout(**sizes), plan


def _flat_index(layout: Layout, rank: int, dims: tuple[str, ...]) -> int:
    """The rank's index in the flattened sub-mesh of ``dims`` (row-major, layout order), as a
    DeviceMesh flattens them: computed from coordinates, not from the accounting's groups."""
    coords = layout.coords(rank)
    index = 0
    for d in dims:
        index = index * layout.size(d) + coords[d]
    return index


def _torch_piece(t, layout: Layout, rank: int, plan: Parallelism, fsdp: bool = True) -> torch.Tensor:
    """``rank``'s piece of tensor ``t`` (a ParamTensor), cut with torch.chunk on a meta tensor."""
    x = torch.empty(t.shape, device="meta")
    coords = layout.coords(rank)
    if t.tp_axis is not None and "tp" in layout.names and (plan.vocab_parallel or t.where == "layer"):
        pieces = torch.chunk(x, layout.size("tp"), dim=t.tp_axis)
        x = pieces[coords["tp"]] if coords["tp"] < len(pieces) else x.narrow(t.tp_axis, 0, 0)
    if t.expert and "ep" in layout.names:
        pieces = torch.chunk(x, layout.size("ep"), dim=0)
        x = pieces[coords["ep"]] if coords["ep"] < len(pieces) else x.narrow(0, 0, 0)
    shard, _ = data_parallel_dims(layout, plan, t.expert)
    if fsdp and shard:
        n = math.prod(layout.size(d) for d in shard)
        pieces = torch.chunk(x, n, dim=0) if x.shape[0] else ()
        i = _flat_index(layout, rank, shard)
        x = pieces[i] if i < len(pieces) else x.narrow(0, 0, 0)
    return x


@settings(max_examples=60, deadline=None)
@given(cases())
def test_states_are_torch_chunk_pieces(case):
    model, layout, plan = case
    stored = 2 if plan.precision.params == "bfloat16" else 4
    for rank in layout.grid.ravel().tolist():
        numel = sum(
            n * _torch_piece(t, layout, rank, plan).numel()
            for t, n, _ in rank_tensors(model, layout, rank, plan)
        )
        states = rank_states(model, layout, rank, plan)
        assert states.params == numel * stored, (model, layout, rank)
        assert rank_memory(model, layout, rank, plan).params == states.params


@settings(max_examples=60, deadline=None)
@given(cases())
def test_fsdp_traffic_is_each_ranks_own_chunks(case):
    """Per rank, FSDP2's gathers and reduce-scatters of one step carry the padded buffers of
    that rank's own tp/ep chunks, whose FSDP2 pieces are the rank's states."""
    model, layout, plan = case
    found = collectives(model, layout, plan)
    gather = 2 if plan.precision.gather == "bfloat16" else 4
    reduce = 2 if plan.precision.reduction == "bfloat16" else 4
    for rank in layout.grid.ravel().tolist():
        for expert in (False, True) if model.is_moe else (False,):
            shard, _ = data_parallel_dims(layout, plan, expert)
            s = math.prod(layout.size(d) for d in shard) if shard else 1
            if s == 1:
                continue
            held = [(t, n) for t, n, _ in rank_tensors(model, layout, rank, plan) if t.expert == expert]
            want = 0
            for t, n in held:
                whole = _torch_piece(t, layout, rank, plan, fsdp=False)
                padded = -(-whole.shape[0] // s) * s * (whole.numel() // max(1, whole.shape[0]))
                # its FSDP2 pieces over the shard group add up to the chunk the rank gathers
                mine = layout.coords(rank)
                others = [d for d in layout.names if d not in shard]
                group = [
                    r
                    for r in layout.grid.ravel().tolist()
                    if all(layout.coords(r)[d] == mine[d] for d in others)
                ]
                assert sum(_torch_piece(t, layout, r, plan).numel() for r in group) == whole.numel()
                calls = plan.micro_batches * (n if t.where == "layer" else 1)  # n: the chunk's layers
                gathers = 2 if t.where == "layer" else 1  # the root stays gathered for backward
                want += calls * padded * (gathers * gather + reduce)
            family = "+".join(shard)
            got = rank_payload(found, layout, rank, plan).get(family, 0)
            assert got == want, (model, layout, rank, family)
