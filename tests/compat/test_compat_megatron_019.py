"""meshgroups.compat against megatron-core 0.19's own answers: every ``parallel_state`` accessor on
every rank, for configurations with GTP sizes > 1, expert tp != tp, cp and pp (8 and 16 gloo
processes), the configurations it refuses, and the calls whose meaning changed between 0.16 and
0.19 read per declared version.

megatron-core 0.19 is not in CI (the registry serves 0.16.1; 0.19 is built from Megatron-LM's
tag, docs/megatron-tests.md): its answers are the committed table
``tests/data/megatron_core_0.19.1_answers.json`` (``tests/support/megatron_answers.py`` made it
with megatron-core 0.19.1 on the same configurations); with megatron-core 0.19 installed,
``test_the_committed_answers_are_megatron_core_0_19`` checks the table against it live.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from meshgroups.compat._megatron_version import installed_megatron_core

from ..support.dist import run
from ..support.megatron_answers import CONFIGS, REFUSALS, TABLE

ANSWERS = json.loads((Path(__file__).parents[1] / "data" / TABLE).read_text())
INSTALLED = installed_megatron_core()[1]


def _compare(got: dict, want: dict, name: str) -> int:
    for key, value in want.items():
        assert got.get(key, "<missing>") == value, (name, key, got.get(key, "<missing>"), value)
    return len(want)


def _collectives(ps, rank: int) -> int:
    """A real all-reduce on every gtp_remat-era group this rank holds: the groups work."""
    import torch
    import torch.distributed as dist

    checked = 0
    for group in {
        id(g): g
        for g in (
            ps.get_gtp_weight_remat_group(),
            ps.get_expert_gtp_weight_remat_group(),
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group(),
            ps.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True),
            ps.get_model_parallel_group(),
        )
    }.values():
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value, group=group)
        assert value.item() == sum(r + 1 for r in dist.get_process_group_ranks(group))
        checked += 1
    return checked


def worker_answers(rank: int, world: int, names: list[str]) -> int:
    import warnings

    import torch.distributed as dist
    from meshgroups.compat import parallel_state as ps
    from meshgroups.compat import process_groups_config as pgc

    from ..support.megatron_answers import error_name, snapshot_config

    warnings.simplefilter("ignore")
    ps.set_megatron_version("0.19")
    compared = 0
    for name in names:
        kwargs = CONFIGS[name][1]
        ps.initialize_model_parallel(**kwargs)
        got = snapshot_config(ps, pgc, kwargs)
        compared += _compare(got, ANSWERS["answers"][name][rank], name)
        compared += _collectives(ps, rank) if ps.is_initialized() else 0
        ps.destroy_model_parallel()
    if world == 8:
        for name, kwargs in REFUSALS.items():
            try:
                ps.initialize_model_parallel(**kwargs)
                outcome = "accepted"
                ps.destroy_model_parallel()
            except Exception as exc:  # compared with megatron-core's class below
                outcome = error_name(exc)
            assert outcome == ANSWERS["answers"][f"refusal {name}"], (name, outcome)
            compared += 1
        compared += _positional_meanings(ps, dist, rank)
        compared += _collections_from_layouts(names, rank)
        compared += _hyper_comm_grid(rank)
    dist.barrier()
    return compared


def _plan(world: int, kwargs: dict):
    from meshgroups.compat.megatron_layout import megatron_plan

    return megatron_plan(
        kwargs.get("local_world_size", world),
        kwargs.get("tensor_model_parallel_size", 1),
        kwargs.get("pipeline_model_parallel_size", 1),
        context_parallel_size=kwargs.get("context_parallel_size", 1),
        hierarchical_context_parallel_sizes=kwargs.get("hierarchical_context_parallel_sizes"),
        expert_model_parallel_size=kwargs.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=kwargs.get("expert_tensor_parallel_size"),
        num_distributed_optimizer_instances=kwargs.get("num_distributed_optimizer_instances", 1),
        order=kwargs.get("order", "tp-cp-ep-dp-pp"),
        gtp_remat_size=kwargs.get("gtp_remat_size", 1),
        expert_gtp_remat_size=kwargs.get("expert_gtp_remat_size", 1),
        **({"rank_offset": kwargs["rank_offset"]} if "rank_offset" in kwargs else {}),
    )


def _collections_from_layouts(names: list[str], rank: int) -> int:
    """Groups passed, not read: ``ProcessGroupCollection.from_layout`` equals megatron-core's
    ``use_mpu_process_groups()`` field by field, with no parallel_state initialised; the
    all-gather communicators are groups of their own over the dp×cp / expert dp ranks; a
    two-module ``MultiModuleProcessGroupCollection`` keeps this rank's module."""
    import torch
    import torch.distributed as dist
    from meshgroups.compat import parallel_state as ps
    from meshgroups.compat.process_groups_config import (
        MultiModuleProcessGroupCollection,
        ProcessGroupCollection,
    )

    checks = 0
    assert not ps.is_initialized()
    for i, name in enumerate(names):
        pgs = ProcessGroupCollection.from_layout(_plan(8, CONFIGS[name][1]), all_gather=i == 0)
        want = ANSWERS["answers"][name][rank]["ProcessGroupCollection"]
        for field, ranks in want.items():
            if isinstance(ranks, str):  # megatron-core raises (a rank outside its groups): none here
                assert getattr(pgs, field) is None, (name, field)
                continue
            got = getattr(pgs, field)
            got = [dist.get_process_group_ranks(g) for g in got] if isinstance(got, list) else got
            got = dist.get_process_group_ranks(got) if isinstance(got, dist.ProcessGroup) else got
            if field in ("dp_cp_ag", "expt_dp_ag") and i == 0:  # megatron-core leaves them None
                assert got == want[field.replace("_ag", "")] and getattr(pgs, field) is not pgs.dp_cp
                continue
            assert got == ranks, (name, field, got, ranks)
            checks += 1
        if pgs.dp_cp_gtp_remat is not None:  # None on a rank outside the layout (rank_offset)
            value = torch.tensor([1.0])
            dist.all_reduce(value, group=pgs.dp_cp_gtp_remat)
            assert value.item() == pgs.dp_cp_gtp_remat.size()
        pgs.close()
    encoder, llm = (
        _plan(4, {"tensor_model_parallel_size": 2}),
        _plan(4, {"pipeline_model_parallel_size": 2, "context_parallel_size": 2, "rank_offset": 4}),
    )
    multi = MultiModuleProcessGroupCollection.from_layouts(
        {"encoder": encoder, "llm": llm}, language_model_module_name="llm"
    )
    if rank < 4:
        assert list(multi.keys()) == ["encoder"] and not multi.has_language_model()
        assert dist.get_process_group_ranks(multi["encoder"].tp) == [rank - rank % 2, rank - rank % 2 + 1]
    else:
        assert list(multi.keys()) == ["llm"] and multi.get_language_model_cp_size() == 2
        assert dist.get_process_group_ranks(multi.get_module_collection("llm").pp) == [
            rank % 2 + 4,
            rank % 2 + 6,
        ]
    multi.close()
    return checks + 2


def _hyper_comm_grid(rank: int) -> int:
    """megatron-core's HyperCommGrid on compat, real groups: views, a shared dim's group reused,
    a view's private dims that enumerate an existing group's rank sets get that group."""
    import torch
    import torch.distributed as dist
    from meshgroups.compat.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
    grid.register_view("expert", [2, 2, 2], ["expt_tp", "ep", "pp"], shared_dims=["pp"])
    grid.register_view("flat", [4, 2], ["tp_dp", "pp"], shared_dims=["pp"])
    tp, tp_dp, pp = grid.create_pg("tp"), grid.create_pg(["dp", "tp"]), grid.create_pg("pp")
    assert grid.create_pg("tp_dp", view="flat") is tp_dp  # the same rank sets: one group
    assert grid.get_pg("pp", view="expert") is pp and grid._cache.created == 3
    ep = grid.create_pg(["ep", "expt_tp"], view="expert")
    for group in (tp, tp_dp, pp, ep):
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value, group=group)
        assert value.item() == sum(r + 1 for r in dist.get_process_group_ranks(group))
    assert dist.get_process_group_ranks(tp_dp) == grid.get_rank_enum(["tp", "dp"])[rank // 4]
    assert grid.is_current_rank_in_grid()
    with pytest.raises(KeyError, match="has already been created"):
        grid.create_pg("tp")
    grid.destroy()
    assert grid._pgs == {}
    return 8


def _positional_meanings(ps, dist, rank: int) -> int:
    """``get_data_parallel_group(True, False)`` / ``(True, True)`` under each declared version,
    and unknown: served when both readings agree, else an error naming both. (With a
    megatron-core installed, only its version: the switch is not ours to turn.)"""

    def ranks(group):
        return dist.get_process_group_ranks(group)

    free = INSTALLED is None
    checks = _meanings_016(ps, ranks) if free else 0
    # 0.19: the second positional is with_gtp_remat; positions 10 and 11 are the gtp sizes
    ps.set_megatron_version("0.19")
    ps.initialize_model_parallel(2, 1, None, None, False, 1, None, False, 1, 2)  # tp 2, gtp_remat 2
    full = ps.get_data_parallel_group(True)  # the default: with gtp_remat
    replicate = ps.get_data_parallel_group(True, False)
    assert ps.get_data_parallel_group(True, True) is full
    assert len(ranks(full)) == 4 and len(ranks(replicate)) == 2
    assert ranks(replicate) == ranks(ps._DATA_PARALLEL_GROUP_WITH_CP)
    assert ps.get_gtp_weight_remat_world_size() == 2 and ps.get_all_ranks().count("_") == 5
    with pytest.raises(TypeError, match="create_all_gather_group"):
        ps.initialize_model_parallel(create_all_gather_group=True)  # not a 0.19 argument
    checks += 5
    if free:
        ps.set_megatron_version(None)
        with pytest.raises(ps.AmbiguousCallError, match="get_data_parallel_group()"):
            ps.get_data_parallel_group()  # 0.16: dp; 0.19: dp x gtp_remat, different groups here
        assert ps.get_data_parallel_group(with_gtp_remat=False) is ps._DATA_PARALLEL_GROUP  # 0.19's only
        with pytest.raises(ps.AmbiguousCallError, match="get_all_ranks"):
            ps.get_all_ranks()
        checks += 3
    ps.destroy_model_parallel()
    return checks


def _meanings_016(ps, ranks) -> int:
    # 0.16: the second positional is partial_data_parallel (2 optimizer instances make it differ)
    ps.set_megatron_version("0.16")
    ps.initialize_model_parallel(
        2, 1, None, None, False, 1, None, False, 2, 2, 1
    )  # tp 2, ep 2, 2 inst., etp 1
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    intra = ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
    assert (
        ps.get_data_parallel_group(True, False) is dp_cp and ps.get_data_parallel_group(True, True) is intra
    )
    assert len(ranks(dp_cp)) == 4 and len(ranks(intra)) == 2
    assert (
        ps.get_data_parallel_world_size(True, True) == 2 and ps.get_expert_data_parallel_world_size(True) == 2
    )
    with pytest.raises(TypeError, match="with_gtp_remat"):
        ps.get_data_parallel_group(with_gtp_remat=False)  # not a 0.16 argument
    ps.set_megatron_version(None)  # unknown: (True, True) reads differently -> an error naming both
    with pytest.raises(
        ps.AmbiguousCallError, match=r"0\.16 reads it as .*partial_data_parallel=True.*0\.19 reads"
    ):
        ps.get_data_parallel_group(True, True)
    assert ps.get_data_parallel_group(True, False) is dp_cp  # both read it as dp x cp
    ps.destroy_model_parallel()
    return 7


@pytest.mark.processes
@pytest.mark.parametrize("world", [8, 16])
def test_every_accessor_equals_megatron_core_0_19(world):
    if INSTALLED == "0.16":
        pytest.skip("megatron-core 0.16 is installed, which reads every call as 0.16")
    names = [n for n, (w, _) in CONFIGS.items() if w == world]
    for compared in run(worker_answers, world, names, timeout=400 if world == 16 else 300, pg_timeout=120):
        assert compared > 150 * len(names)


@pytest.mark.processes
def test_the_committed_answers_are_megatron_core_0_19(tmp_path):
    if INSTALLED != "0.19":
        pytest.skip("optional: megatron-core 0.19 installed (docs/megatron-tests.md)")
    from ..support.megatron_answers import _answers

    for world in (8, 16):
        names = [n for n, (w, _) in CONFIGS.items() if w == world]
        for rank, live in enumerate(run(_answers, world, names, timeout=900, pg_timeout=300)):
            for name in names:
                assert live[name] == ANSWERS["answers"][name][rank], (name, rank)
            for name in REFUSALS if world == 8 else ():
                assert live[f"refusal {name}"] == ANSWERS["answers"][f"refusal {name}"], name


def test_the_version_switch_and_collection_reads_without_processes():
    from meshgroups.compat import parallel_state as ps
    from meshgroups.compat.process_groups_config import ProcessGroupCollection

    if INSTALLED is not None:
        pytest.skip(f"megatron-core {INSTALLED} is installed, which decides the version")
    assert ps.megatron_version() is None
    with pytest.raises(ValueError, match="'0.18' is not served by meshgroups.compat; served: 0.16, 0.19"):
        ps.set_megatron_version("0.18")
    pgs = ProcessGroupCollection(tp=None)
    with pytest.raises(ps.AmbiguousCallError, match="0.16 reports as a missing attribute"):
        _ = pgs.dp  # unset: absent in 0.16, None in 0.19
    assert not hasattr(pgs, "dp")  # hasattr reads the ambiguity as absent, as 0.16 code expects
    try:
        ps.set_megatron_version("0.19.1")
        assert (
            ps.megatron_version() == "0.19"
            and pgs.dp is None
            and repr(pgs) == "ProcessGroupCollection(empty)"
        )
        assert not ProcessGroupCollection.is_gtp_remat_active({"gtp_remat_group": None})
        ps.set_megatron_version("0.16")
        assert repr(pgs) == "ProcessGroupCollection(tp(None))"
        with pytest.raises(AttributeError, match="ProcessGroupCollection.dp was not set"):
            _ = pgs.dp
        with pytest.raises(TypeError, match="gtp_remat"):
            ps.RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-dp", gtp_remat=2)
    finally:
        ps.set_megatron_version(None)
    generator = ps.RankGenerator(2, 1, 2, 1, 1, "tp-gtp_remat-dp", 0, 2)  # only 0.19 has the 8th argument
    assert generator.get_gtp_ranks(2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(AssertionError, match=r"gtp_remat axis size \(2\) != requested gtp_remat_size \(4\)"):
        generator.get_gtp_ranks(4)
