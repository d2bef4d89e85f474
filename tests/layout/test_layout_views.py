"""Views (several factorisations of one world) and node topology."""

import numpy as np
import pytest

from meshgroups import Layout


def dense_expert():
    dense = Layout(pp=2, dp=2, cp=1, tp=2)
    return dense.with_views(expert=Layout(pp=2, edp=1, ep=4, etp=1))


def test_views_resolve_dims_and_share_pp():
    lay = dense_expert()
    assert lay.groups("ep").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert np.array_equal(lay.views["expert"].groups("pp"), lay.groups("pp"))
    assert lay.resolve("etp", "ep") is lay.views["expert"]
    assert lay.resolve("tp") is lay
    assert lay.size("ep") == 4
    assert lay.group_of(5, "edp", "ep").tolist() == [4, 5, 6, 7]


def test_views_mismatch_names_first_differing_group():
    dense = Layout(dp=2, pp=2, tp=2)
    with pytest.raises(
        ValueError,
        match=r"dim 'pp' of view 'expert' does not match the main layout: "
        r"rank 0 is in \[0, 4\] in view 'expert' but in \[0, 2\] in the main layout",
    ):
        dense.with_views(expert=Layout(pp=2, ep=4))


def test_views_may_enumerate_shared_groups_in_another_order():
    main = Layout(dp=2, pp=2, cp=2, tp=2)
    view = main.flatten("dp", "cp")  # dp_cp moves cp outside pp: tp rows come in another order
    assert not np.array_equal(view.groups("tp"), main.groups("tp"))
    assert main.with_views(v=view).views["v"] is view
    swapped = Layout.from_grid(main.grid.copy().reshape(2, 2, 2, 2)[:, :, :, ::-1], main.names)
    with pytest.raises(
        ValueError,
        match=r"dim 'tp' of view 'v' .*: rank 1 is in \[1, 0\] in view 'v' but in \[0, 1\] in the main layout",
    ):
        main.with_views(v=swapped)


def test_views_must_cover_the_same_ranks():
    with pytest.raises(ValueError, match="view 'e' has 4 ranks .* but the main layout has 8"):
        Layout(dp=8).with_views(e=Layout(ep=4))
    with pytest.raises(ValueError, match="covers other ranks"):
        Layout(dp=8).with_views(e=Layout(ep=8, rank_offset=8))
    with pytest.raises(TypeError, match="must be a Layout"):
        Layout(dp=8).with_views(e={"ep": 8})


def test_dims_from_two_factorisations_are_rejected():
    lay = dense_expert()
    with pytest.raises(ValueError, match=r"dims \('tp', 'ep'\) are not all in one factorisation"):
        lay.groups("tp", "ep")
    with pytest.raises(ValueError, match="unknown dim 'zz'"):
        lay.groups("zz")


def test_views_survive_flatten_and_split():
    lay = dense_expert().flatten("dp", "cp")
    assert "expert" in lay.views and lay.names == ("pp", "dp_cp", "tp")


def test_node_locality():
    lay = Layout(pp=2, dp=2, tp=4)
    assert lay.node_locality("tp", ranks_per_node=4) == "intra"
    assert lay.node_locality("pp", ranks_per_node=8) == "inter"
    assert lay.node_locality("dp", "tp", ranks_per_node=4) == "mixed"
    assert lay.node_locality("dp", "tp", ranks_per_node=8) == "intra"
    assert lay.node_locality(ranks_per_node=1) == "intra"
    with pytest.raises(ValueError, match="ranks_per_node=0 must be between 1 and"):
        lay.node_locality("tp", ranks_per_node=0)


def test_split_by_node_gives_legacy_intra_and_inter_groups():
    world = Layout(world=16).split_by_node("world", 4)
    assert world.names == ("world_inter", "world_intra")
    # legacy INTRA_NODE groups: consecutive blocks; INTER_NODE: same local rank on every node
    assert world.groups("world_intra").tolist()[1] == [4, 5, 6, 7]
    assert world.groups("world_inter").tolist()[1] == [1, 5, 9, 13]
    dp = Layout(dp=8, tp=2).split_by_node("dp", 8)
    assert dp.shape == (2, 4, 2)
    assert dp.node_locality("dp_intra", ranks_per_node=8) == "intra"
    assert dp.node_locality("dp_inter", ranks_per_node=8) == "inter"


def test_split_by_node_rejects_groups_that_do_not_split():
    lay = Layout.from_grid([0, 4, 1, 2], ("d",))
    with pytest.raises(ValueError, match="groups of dim 'd' do not split .* ranks_per_node=2"):
        lay.split_by_node("d", 2)
