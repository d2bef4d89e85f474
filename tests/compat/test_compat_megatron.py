"""meshgroups.compat.parallel_state / process_groups_config against an independent Megatron oracle."""

from __future__ import annotations

import pytest
from meshgroups.compat.megatron_layout import megatron_plan

from ..support.dist import run
from ..support.megatron_oracle import CONFIGS_8, megatron_expected, row_of


def plan_kwargs(cfg):
    return {
        "tensor_model_parallel_size": cfg.get("tp", 1),
        "pipeline_model_parallel_size": cfg.get("pp", 1),
        "context_parallel_size": cfg.get("cp", 1),
        "hierarchical_context_parallel_sizes": cfg.get("hcp"),
        "expert_model_parallel_size": cfg.get("ep", 1),
        "expert_tensor_parallel_size": cfg.get("etp"),
        "num_distributed_optimizer_instances": cfg.get("n_opt", 1),
        "order": cfg.get("order", "tp-cp-ep-dp-pp"),
    }


CONFIGS_1024 = [
    {"tp": 8, "pp": 4, "cp": 2, "ep": 8, "etp": 1, "n_opt": 2},
    {"tp": 4, "pp": 8, "cp": 4, "hcp": [2, 2], "ep": 4, "etp": 2, "n_opt": 4},
    {"tp": 2, "pp": 2, "cp": 2, "ep": 4, "etp": 1, "order": "tp-cp-ep-pp-dp"},
    {"tp": 8, "pp": 16, "ep": 2, "etp": 4, "order": "tp-ep-pp-dp"},
]


@pytest.mark.parametrize("cfg", CONFIGS_8 + CONFIGS_1024)
def test_plan_rows_equal_megatron_without_processes(cfg):
    world = 1024 if cfg in CONFIGS_1024 else 8
    plan = megatron_plan(world, **plan_kwargs(cfg))
    expected = megatron_expected(world, **cfg)
    for name, rows in expected.items():
        got = plan.rows(name)
        assert sorted(map(tuple, got)) == sorted(map(tuple, rows)), name
        if name not in (
            "intra_dp_cp",
            "intra_expt_dp",
            "inter_dist_opt",
            "intra_dist_opt",
        ) and not name.startswith("hcp"):
            assert got == rows, name  # same order too, as Megatron enumerates them


def worker_parallel_state(rank, world, strategy="global"):
    import torch
    import torch.distributed as dist
    from meshgroups.compat import parallel_state as ps
    from meshgroups.compat.process_groups_config import GradCommProcessGroups, ModelCommProcessGroups

    checked = 0
    for cfg in CONFIGS_8:
        kwargs = plan_kwargs(cfg)
        ps.initialize_model_parallel(
            **kwargs, create_gloo_process_groups=cfg.get("n_opt", 1) > 1, strategy=strategy
        )
        assert ps.get_mesh_groups().strategy == strategy
        expected = megatron_expected(world, **cfg)
        model = ModelCommProcessGroups.use_mpu_process_groups()
        grad = GradCommProcessGroups.use_mpu_process_groups()
        fields = {**{k: getattr(model, k) for k in vars(model)}, **{k: getattr(grad, k) for k in vars(grad)}}
        for name, group in fields.items():
            if name == "hcp":
                levels = [f"hcp_{i}" for i in range(len(cfg.get("hcp") or []))]
                assert (group is None) == (not levels)
                pairs = [(level, g) for level, g in zip(levels, group or [])]
            elif name == "inter_dist_opt" and cfg.get("n_opt", 1) == 1:
                assert group is None  # Megatron builds no inter-instance group for one instance
                continue
            else:
                pairs = [(name, group)]
            for key, g in pairs:
                want = row_of(expected[key], rank)
                if want is None:
                    assert g is None, key
                    continue
                assert dist.get_process_group_ranks(g) == want, (cfg, key)
                assert dist.get_rank(g) == want.index(rank)
                value = torch.tensor([rank + 1.0])
                dist.all_reduce(value, group=g)
                assert value.item() == sum(r + 1 for r in want), (cfg, key)
                checked += 1
        # the getters with Megatron's extra arguments
        assert (
            ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            is grad.intra_dp_cp
        )
        assert ps.get_expert_data_parallel_group(partial_expert_data_parallel=True) is grad.intra_expt_dp
        if cfg.get("n_opt", 1) > 1:
            gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True)
            assert dist.get_process_group_ranks(gloo) == row_of(expected["dp_cp"], rank)
            assert ps.get_inter_distributed_optimizer_instance_group() is grad.inter_dist_opt
        else:
            with pytest.raises(RuntimeError, match="create_gloo_process_groups=True"):
                ps.get_data_parallel_group_gloo()
        # no mesh-side duplicates: equal rank sets are one group
        if cfg.get("cp", 1) == 1:
            assert ps.get_data_parallel_group(with_context_parallel=True) is ps.get_data_parallel_group()
        assert ps.model_parallel_is_initialized()
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
    # misuse: clear errors, not asserts or hangs
    with pytest.raises(RuntimeError, match="not initialized: call initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(NotImplementedError, match="use_sharp=True"):
        ps.initialize_model_parallel(2, use_sharp=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_parallel'"):
        ps.initialize_model_parallel(tensor_parallel=2)
    with pytest.raises(ValueError, match=r"world_size=8 is not divisible by tp=3 × pp=1 × cp=1 = 3"):
        ps.initialize_model_parallel(3)
    ps.initialize_model_parallel(2, use_sharp=False, virtual_pipeline_model_parallel_size=None)
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(2)
    ps.destroy_model_parallel()
    dist.barrier()
    return checked


@pytest.mark.processes
def test_parallel_state_and_dataclasses_world8():
    checked = run(worker_parallel_state, 8, timeout=240)
    assert all(c > 40 for c in checked)


@pytest.mark.processes
def test_parallel_state_with_the_local_strategy_world8():
    checked = run(worker_parallel_state, 8, "local", timeout=240)
    assert all(c > 40 for c in checked)


def test_dataclass_behaviour_without_processes():
    from meshgroups.compat.process_groups_config import GradCommProcessGroups, ModelCommProcessGroups

    with pytest.raises(ValueError, match="Unknown attribute: nope"):
        ModelCommProcessGroups(nope=1)
    with pytest.raises(ValueError, match=r"Invalid process groups requested: \['nope'\]"):
        GradCommProcessGroups.use_mpu_process_groups(["dp", "nope"])
    pgs = GradCommProcessGroups(dp=None)
    assert hasattr(pgs, "dp") and not hasattr(pgs, "dp_cp")
    with pytest.raises(AttributeError, match="GradCommProcessGroups.dp_cp was not set"):
        _ = pgs.dp_cp
    assert repr(pgs) == "GradCommProcessGroups(dp=None)"
    field_names = [
        "tp",
        "pp",
        "mp",
        "embd",
        "pos_embd",
        "cp",
        "tp_cp",
        "hcp",
        "ep",
        "expt_tp",
        "tp_ep",
        "tp_ep_pp",
        "expt_dp",
    ]
    import dataclasses

    assert [f.name for f in dataclasses.fields(ModelCommProcessGroups)] == field_names
    assert [f.name for f in dataclasses.fields(GradCommProcessGroups)] == [
        "dp",
        "dp_cp",
        "expt_dp",
        "intra_dp_cp",
        "intra_expt_dp",
        "inter_dist_opt",
    ]


def worker_from_mesh_groups(rank, world):
    import torch.distributed as dist
    from meshgroups.compat.process_groups_config import GradCommProcessGroups, ModelCommProcessGroups

    from meshgroups import Layout, init_mesh

    lay = Layout(pp=2, dp=2, cp=1, tp=2)
    mg = init_mesh(
        lay, flatten=[("dp", "cp"), ("pp", "tp")], subsets={"embd": (lay.select("pp", [0, -1]), "pp")}
    )
    model = ModelCommProcessGroups.from_mesh_groups(mg)
    grad = GradCommProcessGroups.from_mesh_groups(mg)
    assert model.tp is mg.group("tp") and model.mp is mg.group("pp", "tp") and model.embd is mg.group("embd")
    assert grad.dp_cp is grad.dp is mg.group("dp")
    assert not hasattr(model, "ep") and not hasattr(model, "tp_cp")  # not built: left unset
    try:
        ModelCommProcessGroups.from_mesh_groups(mg, {"tp_cp": ("cp", "tp")})
    except ValueError as exc:
        message = str(exc)
    dist.barrier()
    return message


@pytest.mark.processes
def test_from_mesh_groups_world8():
    for message in run(worker_from_mesh_groups, 8):
        assert "group ('cp', 'tp') was not built" in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_model_parallel_size": 3}, r"world_size=8 is not divisible by tp=3 × pp=1 × cp=1 = 3"),
        ({"expert_model_parallel_size": 3}, r"not divisible by expert_tp=1 × ep=3 × pp=1 = 3"),
        (
            {"num_distributed_optimizer_instances": 3},
            r"dp×cp = 8 is not divisible by num_distributed_optimizer_instances=3",
        ),
        (
            {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 3]},
            r"multiply to 6, not context_parallel_size=4",
        ),
        (
            {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2, "order": "tp-cp-ep-pp-dp"},
            "does not end in pp",
        ),
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size=0 must be a positive integer"),
        ({"order": "tp-xp-dp-pp"}, "token 'xp'"),
    ],
)
def test_plan_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        megatron_plan(8, **kwargs)


def test_custom_embedding_callbacks():
    plan = megatron_plan(
        8, 1, 4, get_embedding_ranks=lambda r: [r[0], r[1]], get_position_embedding_ranks=lambda r: [r[-1]]
    )
    assert plan.rows("embd") == [[0, 2], [1, 3]]
    assert plan.rows("pos_embd") == [[6], [7]]
    with pytest.raises(ValueError, match="different sizes"):
        megatron_plan(8, 1, 4, get_embedding_ranks=lambda r: r[: 1 + r[0] % 2])


GETTER_CONFIGS = [
    *CONFIGS_8,
    {"tp": 2, "pp": 2, "vp": 2},  # virtual pipelining
    {"pp": 4, "embd_first_only": True},  # an embedding callback: only the first stage
]


def _ps_kwargs(cfg):
    from meshgroups.compat.megatron_layout import megatron_plan  # noqa: F401  (same module as ps uses)

    kwargs = plan_kwargs(cfg)
    if cfg.get("vp"):
        kwargs["virtual_pipeline_model_parallel_size"] = cfg["vp"]
    if cfg.get("embd_first_only"):
        kwargs["get_embedding_ranks"] = lambda ranks: [ranks[0]]
    return kwargs


def _oracle_rows(world, cfg):
    rows = megatron_expected(world, **{k: v for k, v in cfg.items() if k not in ("vp", "embd_first_only")})
    if cfg.get("embd_first_only"):
        rows["embd"] = [[r[0]] for r in rows["pp"]]
    return rows


def worker_getters(rank, world):
    import meshgroups.compat.parallel_state as ps
    from meshgroups.compat.process_groups_config import ProcessGroupCollection

    from ..support.megatron_getters import expected_snapshot, snapshot

    compared = 0
    for cfg in GETTER_CONFIGS:
        ps.initialize_model_parallel(**_ps_kwargs(cfg))
        got = snapshot(ps, cfg.get("vp"))
        want = expected_snapshot(_oracle_rows(world, cfg), rank, cfg.get("vp"))
        for key, value in want.items():
            assert got[key] == value, (cfg, key, got[key], value)
            compared += 1
        collection = ProcessGroupCollection.use_mpu_process_groups()
        assert collection.tp_dp_cp is ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        assert collection.intra_dist_opt is ps.get_intra_distributed_optimizer_instance_group()
        assert collection.tp is ps.get_tensor_model_parallel_group() and ps.is_initialized()
        # Megatron's setters override, destroy resets them
        ps.set_tensor_model_parallel_world_size(3)
        ps.set_pipeline_model_parallel_rank(5)
        assert ps.get_tensor_model_parallel_world_size() == 3 and ps.get_pipeline_model_parallel_rank() == 5
        ps.destroy_model_parallel()
        assert not ps.is_initialized() and ps.get_virtual_pipeline_model_parallel_world_size() is None
    with pytest.raises(RuntimeError, match="greater than 1 with interleaved schedule"):
        ps.initialize_model_parallel(2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="not initialized: call initialize_model_parallel"):
        ps.get_tensor_model_parallel_rank()
    return compared


@pytest.mark.processes
def test_every_getter_matches_megatron_semantics_world8():
    compared = run(worker_getters, 8, timeout=240)
    assert all(c > 7 * 40 for c in compared)


def worker_against_megatron_core(rank, world):
    """Side by side in the same processes: megatron-core's own helpers, then ours."""
    import meshgroups.compat.parallel_state as ps
    import torch.distributed as dist
    from megatron.core import parallel_state as mcore

    from ..support.megatron_getters import snapshot

    compared = 0
    for cfg in GETTER_CONFIGS:
        kwargs = _ps_kwargs(cfg)
        # megatron-core's destroy leaves these set (a stale embedding group would answer True)
        mcore._EMBEDDING_GLOBAL_RANKS = mcore._POSITION_EMBEDDING_GLOBAL_RANKS = None
        mcore.initialize_model_parallel(**kwargs)
        theirs = snapshot(mcore, cfg.get("vp"))
        groups = [g for g in mcore._get_all_pgs()] if hasattr(mcore, "_get_all_pgs") else []
        mcore.destroy_model_parallel()
        for g in groups:
            dist.destroy_process_group(g)
        ps.initialize_model_parallel(**kwargs)
        ours = snapshot(ps, cfg.get("vp"))
        ps.destroy_model_parallel()
        assert ours == theirs, (cfg, {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs.get(k)})
        compared += len(ours)
    return compared


@pytest.mark.processes
def test_getters_equal_megatron_core_world8():
    pytest.importorskip(
        "megatron.core", reason="optional: pip install --no-deps megatron-core==0.16.1 packaging einops"
    )
    assert all(c > 200 for c in run(worker_against_megatron_core, 8, timeout=300))


@pytest.mark.parametrize("cfg", CONFIGS_1024)
@pytest.mark.parametrize("rank", [0, 517, 1023])
def test_every_getter_at_1024_ranks_on_the_fake_backend(cfg, rank):
    import meshgroups.compat.parallel_state as ps
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..support.megatron_getters import expected_snapshot, snapshot

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=1024)
    try:
        ps.initialize_model_parallel(
            **plan_kwargs(cfg),
            strategy="local",
            virtual_pipeline_model_parallel_size=2,
            create_gloo_process_groups=False,  # gloo twins cannot live on the fake store
        )
        got = snapshot(ps, 2)
        want = expected_snapshot(megatron_expected(1024, **cfg), rank, 2)
        assert {k: got[k] for k in want} == want
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
