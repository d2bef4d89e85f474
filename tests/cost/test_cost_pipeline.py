"""Pipeline chunks and schedules as torch runs them (one process, torch's fake backend).

The interleaved order :func:`meshgroups.cost._pipeline.rank_actions` gives each stage is the
order torch's own ``ScheduleInterleaved1F1B`` computes (its ``pipeline_order``, built here from
real ``PipelineStage`` objects on a fake process group of each rank), for many stage, chunk and
micro-batch counts; what 1F1B keeps in flight is ``Schedule1F1B``'s warm-up (its order runs on
real processes in ``tests/cost/test_cost_memory.py``, whose peaks depend on it). Uneven splits and
the pieces of Llama 3.1 405B's 126 layers are checked too."""

from __future__ import annotations

import pytest

from meshgroups import Layout, LayoutError
from meshgroups.cost import Parallelism, peak_memory, preset
from meshgroups.cost._pipeline import chunk_layers, max_in_flight, rank_actions, stage_chunks

CASES = [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 3, 8), (2, 3, 6), (4, 2, 12), (8, 4, 32), (3, 2, 6)]


def _torch_order(pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    try:
        stages = [
            PipelineStage(
                torch.nn.Linear(2, 2), rank + k * pp, pp * v, torch.device("cpu"), group=dist.group.WORLD
            )
            for k in range(v)
        ]
        schedule = ScheduleInterleaved1F1B(stages, m)
        return [
            ("F" if str(a.computation_type) in ("F", "FORWARD", "_ComputationType.FORWARD") else "B", a.stage_index, a.microbatch_index)
            for a in schedule.pipeline_order[rank]
            if a is not None
        ]  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("pp", "v", "m"), CASES)
def test_interleaved_order_is_torchs(pp, v, m):
    for rank in range(pp):
        mine = [tuple(a) for a in rank_actions(pp, v, m, rank)]
        theirs = _torch_order(pp, v, m, rank)
        assert {k for k, _, _ in theirs} == {"F", "B"}
        assert mine == theirs, (pp, v, m, rank)


def test_one_f_one_b_keeps_min_of_m_and_the_stages_after():
    for pp, m in [(4, 8), (4, 4), (8, 32), (3, 2)]:
        assert [max_in_flight(pp, 1, m, k) for k in range(pp)] == [min(m, pp - k) for k in range(pp)]
        for k in range(pp):
            acts = rank_actions(pp, 1, m, k)
            assert [a.kind for a in acts].count("F") == m and [a.mb for a in acts if a.kind == "B"] == list(
                range(m)
            )


def test_interleaved_keeps_more_in_flight_than_one_f_one_b():
    # the first stage: (v-1)·r + 2(p-1) + 1 chunks of L/(pv) layers against p chunks of L/p
    for pp, v, m in [(4, 2, 8), (8, 2, 16), (8, 4, 32)]:
        chunks = max_in_flight(pp, v, m, 0)
        assert chunks == (v - 1) * pp + 2 * (pp - 1) + 1
        assert chunks / v > max_in_flight(pp, 1, m, 0)


def test_uneven_stages():
    assert chunk_layers(126, 8) == [16] * 6 + [15] * 2
    assert chunk_layers(10, 4, [1, 4, 4, 1]) == [1, 4, 4, 1]
    with pytest.raises(LayoutError, match="must have 4 entries"):
        chunk_layers(10, 4, [5, 5])
    with pytest.raises(LayoutError, match="more than layers"):
        chunk_layers(3, 4)
    assert stage_chunks(4, 2, 3) == [3, 7]
    # Llama 3.1 405B on 8 stages: placeable now (126 layers do not divide by 8)
    model = preset("llama3.1-405b").with_(seq_len=8192)
    plan = Parallelism(micro_batches=8, recompute="full", sequence_parallel=True)
    even = peak_memory(model, Layout(pp=8, tp=8), plan)
    light_ends = peak_memory(
        model, Layout(pp=8, tp=8), Parallelism(micro_batches=8, recompute="full", sequence_parallel=True,
                                                layers_per_stage=(15, 16, 16, 16, 16, 16, 16, 15))
    )  # fmt: skip
    assert even.total > 0 and light_ends.total > 0
    with pytest.raises(LayoutError, match="layers_per_stage"):
        peak_memory(model, Layout(pp=8, tp=8), Parallelism(layers_per_stage=(16,) * 8))
