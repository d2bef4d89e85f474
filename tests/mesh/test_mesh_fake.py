"""Large worlds without processes: torch's "fake" backend lets this process act as one rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshgroups import GroupCache, Layout, init_mesh

BIG = Layout(pp=16, dp=256, cp=4, tp=8)  # 131,072 ranks


@pytest.fixture
def fake_rank(request):
    rank, world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield rank
    finally:
        dist.destroy_process_group()


def _expected_distinct_rows(layout, families):
    rows = set()
    for dims in families:
        for row in layout.groups(*dims).tolist():
            if 1 < len(row) < layout.world_size:
                rows.add(tuple(row))
    return rows


@pytest.mark.parametrize("fake_rank", [(98765, BIG.world_size)], indirect=True)
def test_global_strategy_at_131k(fake_rank):
    cache = GroupCache()
    mg = init_mesh(BIG, flatten=[("dp", "cp")], cache=cache)
    families = [(d,) for d in BIG.names] + [("dp", "cp")]
    for dims in families:
        assert mg.ranks(*dims) == BIG.group_of(fake_rank, *dims).tolist()
        assert dist.get_process_group_ranks(mg.group(*dims)) == mg.ranks(*dims)
    # one creation call per distinct rank set, no world-sized loops of singletons
    assert cache.calls == len(_expected_distinct_rows(BIG, families))
    assert tuple(mg.mesh.get_coordinate()) == tuple(BIG.coords(fake_rank).values())


@pytest.mark.parametrize("fake_rank", [(0, BIG.world_size), (131071, BIG.world_size)], indirect=True)
def test_local_strategy_at_131k_costs_one_call_per_family(fake_rank):
    lay = BIG.with_views(expert=Layout(pp=16, edp=32, ep=64, etp=4))
    cache = GroupCache()
    mg = init_mesh(lay, flatten=[("dp", "cp"), ("edp", "ep")], strategy="local", cache=cache)
    for dims in [
        ("pp",),
        ("dp",),
        ("cp",),
        ("tp",),
        ("dp", "cp"),
        ("edp",),
        ("ep",),
        ("etp",),
        ("edp", "ep"),
    ]:
        assert mg.ranks(*dims) == lay.group_of(fake_rank, *dims).tolist()
        assert dist.get_rank(mg.group(*dims)) == mg.local_rank(*dims)
    assert cache.calls == 9  # 9 families, each one step; expert pp is the dense pp


@pytest.mark.parametrize("fake_rank", [(5, 1024)], indirect=True)
def test_subset_non_member_gets_a_mesh_and_none_groups(fake_rank):
    lay = Layout(pp=4, dp=32, tp=8)
    mg = init_mesh(lay, subsets={"embd": (lay.select("pp", [0, -1]), "pp")}, strategy="local")
    assert mg.ranks("embd") == [5, 773] and mg.local_rank("embd") == 0
    mg_far = init_mesh(Layout(tp=8, rank_offset=512), strategy="local", partial=True)
    # every rank gets a mesh, as in torch; this rank's group is torch's non-member sentinel
    assert mg_far.mesh.get_coordinate() is None and mg_far.mesh.mesh.tolist() == list(range(512, 520))
    assert mg_far.group("tp") == dist.GroupMember.NON_GROUP_MEMBER
    assert mg_far.ranks("tp") is None and mg_far.size("tp") == 8
    embd = mg.submesh("embd")
    assert embd.get_coordinate() == (0,) and embd.mesh.tolist() == [5, 773]


@st.composite
def _layout_and_rank(draw):
    n = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    lay = Layout(dict(zip("abcd", sizes)))
    if draw(st.booleans()):
        perm = draw(st.permutations(range(lay.world_size)))
        lay = Layout.from_grid(np.array(perm).reshape(lay.shape), lay.names)
    return lay, draw(st.integers(0, lay.world_size - 1)), draw(st.sampled_from(["global", "local"]))


@settings(max_examples=40, deadline=None)
@given(_layout_and_rank())
def test_every_group_matches_the_layout_for_random_layouts(args):
    lay, rank, strategy = args
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
    try:
        pairs = [(a, b) for i, a in enumerate(lay.names) for b in lay.names[i + 1 :]]
        mg = init_mesh(lay, flatten=pairs, strategy=strategy)
        for dims in [(d,) for d in lay.names] + pairs:
            expected = lay.group_of(rank, *dims).tolist()
            assert mg.ranks(*dims) == expected
            assert dist.get_process_group_ranks(mg.group(*dims)) == expected
            assert dist.get_rank(mg.group(*dims)) == expected.index(rank) == mg.local_rank(*dims)
        assert tuple(mg.mesh.get_coordinate()) == tuple(lay.coords(rank).values())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fake_rank", [(98765, BIG.world_size)], indirect=True)
def test_root_and_derived_meshes_skip_torch_world_scans_at_131k(fake_rank, monkeypatch):
    """The root, every declared flattened dim, slices and their coordinates come from layout
    arithmetic: no torch DeviceMesh constructor (O(world) each) and no rank tuple until a mesh
    is hashed or compared; then the answers equal torch's."""
    from torch.distributed.device_mesh import DeviceMesh

    from meshgroups.mesh._torch_seam import self_test

    self_test()  # once per process, at the first mesh: its twins come from torch's constructor
    calls = []
    original = DeviceMesh.__init__
    monkeypatch.setattr(
        DeviceMesh, "__init__", lambda self, *a, **k: calls.append(a) or original(self, *a, **k)
    )
    flatten = [("dp", "cp"), ("cp", "tp"), ("pp", "dp", "cp", "tp")]
    mg = init_mesh(BIG, flatten=flatten, strategy="local")
    root = mg.mesh
    meshes = [root, root["dp", "tp"], root["cp"], *(root["_".join(dims)] for dims in flatten)]
    assert calls == [] and "_mg_rank_tuple" not in vars(root)
    coords = BIG.coords(fake_rank)
    assert root.get_coordinate() == tuple(coords.values())
    assert root["dp", "tp"].get_coordinate() == (coords["dp"], coords["tp"])
    for dims in flatten:
        flat = root["_".join(dims)]
        assert flat.get_coordinate() == (mg.local_rank(*dims),) and flat.get_group() is mg.group(*dims)
    # hashing and equality as torch's: a torch-built mesh over the same ranks is equal
    twin = DeviceMesh("cpu", root.mesh, mesh_dim_names=BIG.names, _init_backend=False)
    assert hash(root) == hash(twin) and root == twin and root._flatten_rank_map is meshes[1]._flatten_rank_map
    assert twin.get_coordinate() == root.get_coordinate()


@pytest.mark.parametrize("fake_rank", [(5, 16)], indirect=True)
def test_mesh_options_build_what_the_keywords_build(fake_rank):
    from datetime import timedelta

    from meshgroups import MeshOptions

    lay = Layout(dp=4, tp=4)
    opts = MeshOptions(strategy="local", timeout=30, gloo_twins=False)
    with init_mesh(lay, flatten=[("dp", "tp")], options=opts, check=None) as by_value:
        with init_mesh(lay, flatten=[("dp", "tp")], strategy="local", timeout=30) as by_keywords:
            for dims in [("dp",), ("tp",), ("dp", "tp")]:
                assert by_value.ranks(*dims) == by_keywords.ranks(*dims)
            # what the mesh reports it was built with is the value it was given
            assert by_value.options == by_keywords.options
            assert by_value.options.strategy == "local"
            assert by_value.options.timeout == timedelta(seconds=30)
            assert by_value.declared_flatten == (("dp", "tp"),)
    # frozen: a value compared across ranks cannot change under the caller
    with pytest.raises(AttributeError):
        opts.strategy = "global"  # type: ignore[misc]
    override = {"tp": "gloo"}
    held = MeshOptions(backend_override=override)
    override["dp"] = "gloo"
    assert dict(held.backend_override) == {"tp": "gloo"}


@pytest.mark.parametrize("fake_rank", [(0, 4)], indirect=True)
def test_options_and_option_keywords_together_are_refused(fake_rank):
    from meshgroups import MeshOptions

    with pytest.raises(TypeError, match="not both.*strategy"):
        init_mesh(Layout(dp=2, tp=2), options=MeshOptions(), strategy="local")
    with pytest.raises(TypeError, match="options must be a meshgroups.MeshOptions"):
        init_mesh(Layout(dp=2, tp=2), options={"strategy": "local"})  # type: ignore[arg-type]
    # the refused calls left the protocol in step: the next call builds
    with init_mesh(Layout(dp=2, tp=2)) as mg:
        assert mg.size() == 4 and mg.size("tp") == 2


def test_close_releases_what_torch_has_not_destroyed():
    """``close()`` skips groups torch destroyed itself: one the user destroyed by hand, and
    every group once the default group is destroyed (torch's ``with_comms`` tests end so, and
    torch >= 2.15's ``DeviceMesh.abort()`` does it per mesh). It neither raises nor counts them."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
    try:
        mg = init_mesh(Layout(dp=2, cp=2, tp=2), flatten=[("dp", "cp")])
        other = init_mesh(Layout(dp=4, tp=2))
        dist.destroy_process_group(mg.group("tp"))
        assert mg.close() == 3  # dp, cp and dp_cp; tp was gone already
    finally:
        dist.destroy_process_group()  # every group with it, other's too
    assert other.close() == 0 and other.closed and other.close() == 0


@pytest.mark.parametrize("fake_rank", [(3, 8)], indirect=True)
def test_the_plan_is_made_once_and_later_builds_derive_theirs(fake_rank, monkeypatch):
    """issue 45: init_mesh plans once (make_plan), builds that plan; a later flatten (ours or
    torch's _flatten) builds a plan derived from it, with its options, never planned again."""
    from datetime import timedelta

    from meshgroups import MeshOptions
    from meshgroups.mesh import _families, _mesh_groups, _planning

    planned, built = [], []
    make_plan, build = _planning.make_plan, _mesh_groups.build

    def counting_make_plan(*args, **kwargs):
        planned.append(args[0])
        return make_plan(*args, **kwargs)

    def recording_build(plan, call, **kwargs):
        built.append(plan)
        return build(plan, call, **kwargs)

    monkeypatch.setattr(_planning, "make_plan", counting_make_plan)
    monkeypatch.setattr(_mesh_groups, "build", recording_build)
    monkeypatch.setattr(_families, "build", recording_build)

    lay = Layout(pp=2, dp=2, tp=2)
    opts = MeshOptions(
        backend="fake", strategy="local", timeout=42, heartbeat=0.5, lease=3.0, report_every=7.0
    )
    with init_mesh(lay, options=opts) as mg:
        assert planned == [lay] and len(built) == 1
        first = built[0]
        assert [spec.key for spec in first.specs] == [("pp",), ("dp",), ("tp",)]
        mg.flatten("dp", "tp")
        mg.mesh["pp", "dp"]._flatten("pd")  # torch's own, on our mesh
        assert planned == [lay], "a later build made a plan from the options again"
        assert [[spec.desc for spec in plan.specs] for plan in built[1:]] == [["mesh_dp_tp"], ["mesh_pd"]]
        for later in built[1:]:
            assert later is not first and later.partial  # the mesh's coverage was settled once
            assert later.timeout == first.timeout == timedelta(seconds=42)
            assert (later.backend, later.strategy, later.device_type) == ("fake", "local", "cpu")
            assert later.liveness == first.liveness == (0.5, 3.0, 7.0)
