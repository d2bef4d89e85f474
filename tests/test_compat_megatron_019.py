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
from meshgroups.compat.megatron_version import installed_megatron_core

from .support.dist import run
from .support.megatron_answers import CONFIGS, REFUSALS, TABLE

ANSWERS = json.loads((Path(__file__).parent / "data" / TABLE).read_text())
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

    from .support.megatron_answers import error_name, snapshot

    warnings.simplefilter("ignore")
    ps.set_megatron_version("0.19")
    compared = 0
    for name in names:
        kwargs = CONFIGS[name][1]
        ps.initialize_model_parallel(**kwargs)
        got = snapshot(ps, pgc, kwargs.get("virtual_pipeline_model_parallel_size"))
        compared += _compare(got, ANSWERS["answers"][name][rank], name)
        compared += _collectives(ps, rank)
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
    dist.barrier()
    return compared


def _positional_meanings(ps, dist, rank: int) -> int:
    """``get_data_parallel_group(True, False)`` / ``(True, True)`` under each declared version,
    and unknown: served when both readings agree, else an error naming both."""

    def ranks(group):
        return dist.get_process_group_ranks(group)

    checks = 0
    # 0.16: the second positional is partial_data_parallel (2 optimizer instances make it differ)
    ps.set_megatron_version("0.16")
    ps.initialize_model_parallel(
        2, 1, None, None, False, 1, None, False, 2, 2, 1
    )  # tp 2, ep 2, 2 instances, etp 1
    dp_cp, intra = (
        ps.get_data_parallel_group(with_context_parallel=True),
        ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP,
    )
    assert (
        ps.get_data_parallel_group(True, False) is dp_cp and ps.get_data_parallel_group(True, True) is intra
    )
    assert len(ranks(dp_cp)) == 4 and len(ranks(intra)) == 2
    assert (
        ps.get_data_parallel_world_size(True, True) == 2 and ps.get_expert_data_parallel_world_size(True) == 2
    )
    with pytest.raises(TypeError, match="with_gtp_remat"):
        ps.get_data_parallel_group(with_gtp_remat=False)  # not a 0.16 argument
    checks += 5
    ps.set_megatron_version(None)  # unknown: (True, True) reads differently -> an error naming both
    with pytest.raises(
        ps.AmbiguousCallError, match=r"0\.16 reads it as .*partial_data_parallel=True.*0\.19 reads"
    ):
        ps.get_data_parallel_group(True, True)
    assert ps.get_data_parallel_group(True, False) is dp_cp  # both read it as dp x cp
    checks += 2
    ps.destroy_model_parallel()
    # 0.19: the second positional is with_gtp_remat; positions 10 and 11 are the gtp sizes
    ps.set_megatron_version("0.19")
    ps.initialize_model_parallel(2, 1, None, None, False, 1, None, False, 1, 2)  # tp 2, gtp_remat 2
    full = ps.get_data_parallel_group(True)  # the default: with gtp_remat
    replicate = ps.get_data_parallel_group(True, False)
    assert (
        ps.get_data_parallel_group(True, True) is full
        and len(ranks(full)) == 4
        and len(ranks(replicate)) == 2
    )
    assert ranks(replicate) == ranks(ps._DATA_PARALLEL_GROUP_WITH_CP)
    assert ps.get_gtp_weight_remat_world_size() == 2 and ps.get_all_ranks().count("_") == 5
    with pytest.raises(TypeError, match="create_all_gather_group"):
        ps.initialize_model_parallel(create_all_gather_group=True)  # not a 0.19 argument
    checks += 5
    ps.set_megatron_version(None)
    with pytest.raises(ps.AmbiguousCallError, match="get_data_parallel_group()"):
        ps.get_data_parallel_group()  # 0.16: dp; 0.19: dp x gtp_remat, different groups here
    assert ps.get_data_parallel_group(with_gtp_remat=False) is ps._DATA_PARALLEL_GROUP  # only 0.19 has it
    with pytest.raises(ps.AmbiguousCallError, match="get_all_ranks"):
        ps.get_all_ranks()
    checks += 3
    ps.destroy_model_parallel()
    return checks


@pytest.mark.parametrize("world", [8, 16])
def test_every_accessor_equals_megatron_core_0_19(world):
    if INSTALLED == "0.16":
        pytest.skip("megatron-core 0.16 is installed, which reads every call as 0.16")
    names = [n for n, (w, _) in CONFIGS.items() if w == world]
    for compared in run(worker_answers, world, names, timeout=400 if world == 16 else 300, pg_timeout=120):
        assert compared > 150 * len(names)


def test_the_committed_answers_are_megatron_core_0_19(tmp_path):
    if INSTALLED != "0.19":
        pytest.skip("optional: megatron-core 0.19 installed (docs/megatron-tests.md)")
    from .support.megatron_answers import _answers

    for world in (8, 16):
        names = [n for n, (w, _) in CONFIGS.items() if w == world]
        for rank, live in enumerate(run(_answers, world, names, timeout=900, pg_timeout=300)):
            for name in names:
                assert live[name] == ANSWERS["answers"][name][rank], (name, rank)
            for name in REFUSALS if world == 8 else ():
                assert live[f"refusal {name}"] == ANSWERS["answers"][f"refusal {name}"], name
