"""meshgroups.compat driven the way Megatron's unit tests and training code drive megatron-core,
on 8 gloo processes (one job): positional ``initialize_model_parallel(tp, pp, vpp, ...)``, every
order string Megatron's tests use, ``pytest.raises(AssertionError)`` / ``RuntimeError`` for
invalid configurations, destroy then re-initialise, the separate all-gather group, hierarchical
and hybrid context parallelism, module globals, ``ProcessGroupCollection`` repr — checked
against the independent oracle, and side by side with megatron-core when it is installed."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
from meshgroups.compat._megatron_version import installed_megatron_core

from ..support.dist import run
from ..support.megatron_oracle import megatron_expected, row_of
from ..support.megatron_style import CONFIGS, INVALID, ORDERS, scenario

pytestmark = pytest.mark.processes  # every test here starts processes

# MESHGROUPS_NO_MEGATRON_REF=1 runs the compat half alone (what CI runs, megatron-core absent).
HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None
    and importlib.util.find_spec("megatron.core") is not None
    and not os.environ.get("MESHGROUPS_NO_MEGATRON_REF")
)
# The scenario is 0.16 code (create_all_gather_group=...): with another megatron-core installed,
# compat reads it as that version's (and refuses 0.16's keywords, as megatron-core would)
OTHER_MCORE = installed_megatron_core()[1] not in (None, "0.16")


def _oracle_checks(out: dict, rank: int) -> int:
    """What must hold on compat whatever megatron-core says (and without it)."""
    checks = 0
    for i, ((tp, pp, vpp), kwargs) in enumerate(CONFIGS):
        for order in ORDERS if i < 4 else [ORDERS[0]]:
            seen = out[f"{i}:{order}"]
            cfg = {
                "tp": tp,
                "pp": pp,
                "cp": kwargs.get("context_parallel_size", 1),
                "ep": kwargs.get("expert_model_parallel_size", 1),
                "etp": kwargs.get("expert_tensor_parallel_size"),
                "n_opt": kwargs.get("num_distributed_optimizer_instances", 1),
                "order": order,
                "hcp": kwargs.get("hierarchical_context_parallel_sizes"),
            }
            want = megatron_expected(8, **cfg)
            assert seen["get_tensor_model_parallel_group"] == ("ok", row_of(want["tp"], rank))
            assert seen["_PIPELINE_GLOBAL_RANKS"] == row_of(want["pp"], rank)
            assert seen["_DATA_PARALLEL_GROUP_WITH_CP"] == row_of(want["dp_cp"], rank)
            assert seen["_EXPERT_DATA_PARALLEL_GROUP"] == row_of(want["expt_dp"], rank)
            assert seen["get_expert_tensor_and_model_parallel_group"] == ("ok", row_of(want["tp_ep"], rank))
            assert seen["_MODEL_PARALLEL_GROUP"] == row_of(want["mp"], rank)
            assert seen["get_virtual_pipeline_model_parallel_world_size"] == ("ok", vpp)
            assert seen["model_parallel_is_initialized"] == ("ok", True)
            assert seen["repr"].startswith("ProcessGroupCollection(tp(") and f"pp({pp})" in seen["repr"]
            ag = seen[
                "get_data_parallel_group[('independent_all_gather', True), ('with_context_parallel', True)]"
            ]
            assert ag == (
                ("ok", row_of(want["dp_cp"], rank))
                if kwargs.get("create_all_gather_group")
                else ("raised", "AssertionError")
            )
            assert seen["has_separate_all_gather_group"] == (
                "ok",
                bool(kwargs.get("create_all_gather_group")),
            )
            assert seen["get_data_parallel_group[('partial_data_parallel', True)]"] == (
                "raised",
                "AssertionError",
            )
            if vpp:
                assert seen["is_pipeline_first_stage[('ignore_virtual', False)]"] == (
                    "raised",
                    "AssertionError",
                )
            hcp = seen["get_hierarchical_context_parallel_groups"]
            assert hcp == ("ok", [row_of(want[f"hcp_{k}"], rank) for k in range(2)] if cfg["hcp"] else None)
            # already initialised -> AssertionError; destroy -> every group global None
            assert out[f"{i}:{order}:again"] == ("raised", "AssertionError")
            assert all(v is None for v in out[f"{i}:{order}:destroyed"].values())
            checks += 15
    assert out["11:hybrid"] == {
        2: ("ok", [rank - rank % 2, rank - rank % 2 + 1]),
        4: ("ok", list(range(rank - rank % 4, rank - rank % 4 + 4))),
        8: ("ok", list(range(8))),
    }
    for j, (_, _, error) in enumerate(INVALID):
        assert out[f"invalid{j}"] == ("raised", error.__name__), (j, out[f"invalid{j}"])
        checks += 1
    assert out["before"]["get_tensor_model_parallel_world_size"] == ("raised", "AssertionError")
    assert out["before"]["is_rank_in_embedding_group"] == ("ok", False)
    assert out["before"]["get_expert_tensor_parallel_world_size"] == ("ok", None)
    assert out["before_repr"] == "ProcessGroupCollection(empty)"
    assert out["hierarchical"] == [[rank - rank % 2, rank - rank % 2 + 1], list(range(rank % 2, 8, 2))]
    return checks + 5


def worker(rank: int, world: int, with_megatron: bool) -> dict:
    import meshgroups.compat.parallel_state as ps
    from meshgroups.compat.process_groups_config import ProcessGroupCollection

    warnings.simplefilter("ignore")
    ours = scenario(ps, ProcessGroupCollection)
    result = {"checks": _oracle_checks(ours, rank), "compared": 0}
    if with_megatron:
        from megatron.core import parallel_state as mcore
        from megatron.core.process_groups_config import ProcessGroupCollection as Theirs

        theirs = scenario(mcore, Theirs, light=True)  # megatron-core: fewer configurations (slow)
        diffs = [
            d
            for d in _differences({k: v for k, v in ours.items() if k in theirs}, theirs)
            # megatron-core's repr calls .size() on the hcp list and raises; compat prints sizes
            if not (
                d[0].startswith("/7:")
                and d[0].endswith("/collection")
                and d[2] == ("raised", "AttributeError")
            )
        ]
        assert not diffs, (sorted({path.split("/")[-1] for path, _, _ in diffs}), diffs[:5])
        result["compared"] = sum(len(v) if isinstance(v, dict) else 1 for v in theirs.values())
    return result


def _differences(ours: dict, theirs: dict, path: str = "") -> list:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in sorted(set(ours) | set(theirs), key=str):
            out += _differences(ours.get(key), theirs.get(key), f"{path}/{key}")
        return out
    return [] if ours == theirs else [(path, ours, theirs)]


@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    OTHER_MCORE, reason="the scenario is megatron-core 0.16 code; another version is installed"
)
def test_megatron_style_world8():
    results = run(worker, 8, HAVE_MCORE, timeout=1700)
    assert all(r["checks"] > 200 for r in results)
    if HAVE_MCORE:
        assert all(r["compared"] > 1000 for r in results)
