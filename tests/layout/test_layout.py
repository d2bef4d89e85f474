"""Layout core: construction, groups, single-rank queries, algebra, serialisation, errors."""

import json
import pickle

import numpy as np
import pytest

from meshgroups import Layout


def test_keyword_mapping_and_pairs_are_the_same_layout():
    a = Layout(pp=2, dp=2, cp=1, tp=4)
    b = Layout({"pp": 2, "dp": 2, "cp": 1, "tp": 4})
    c = Layout([("pp", 2), ("dp", 2), ("cp", 1), ("tp", 4)])
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert a.names == ("pp", "dp", "cp", "tp") and a.shape == (2, 2, 1, 4)
    assert a.world_size == 16 and a.size("tp") == 4 and a.size("dp", "tp") == 8


def test_grid_is_row_major_read_only_int64():
    lay = Layout(pp=2, dp=2, cp=1, tp=4)
    assert lay.grid.dtype == np.int64 and lay.grid.flags.c_contiguous
    assert np.array_equal(lay.grid, np.arange(16).reshape(2, 2, 1, 4))
    with pytest.raises(ValueError):
        lay.grid[0, 0, 0, 0] = 5


def test_rank_offset():
    lay = Layout(dp=2, tp=4, rank_offset=64)
    assert lay.grid.min() == 64 and lay.grid.max() == 71
    assert lay.groups("tp").tolist() == [[64, 65, 66, 67], [68, 69, 70, 71]]
    assert lay.coords(69) == {"dp": 1, "tp": 1} and lay.rank_at(dp=1, tp=1) == 69
    assert 63 not in lay and 64 in lay
    with pytest.raises(ValueError, match="rank 3 is not in this layout .ranks 64..71"):
        lay.coords(3)


def test_groups_examples():
    lay = Layout(pp=2, dp=2, cp=1, tp=4)
    assert lay.groups("tp").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert lay.groups("dp")[:3].tolist() == [[0, 4], [1, 5], [2, 6]]
    assert lay.groups("pp")[:2].tolist() == [[0, 8], [1, 9]]
    # order of dims in the call does not matter; in-group order follows the layout
    assert np.array_equal(lay.groups("tp", "pp"), lay.groups("pp", "tp"))
    assert lay.groups("pp", "tp")[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert lay.groups().shape == (16, 1)
    assert lay.groups(*lay.names).tolist() == [list(range(16))]


def test_group_of_and_coords():
    lay = Layout(pp=2, dp=2, cp=2, tp=2)
    assert lay.group_of(5, "dp", "cp").tolist() == [1, 3, 5, 7]
    assert lay.group_of(13, "pp").tolist() == [5, 13]
    assert lay.coords(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}
    assert lay.rank_at(pp=1, dp=1, cp=0, tp=1) == 13
    assert lay.group_of(6).tolist() == [6]


def test_from_grid_permuted_placement():
    lay = Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp"))
    assert lay.groups("tp").tolist() == [[3, 1], [2, 0]]
    assert lay.groups("dp").tolist() == [[3, 2], [1, 0]]
    assert lay.coords(0) == {"dp": 1, "tp": 1}
    assert lay.group_of(2, "tp").tolist() == [2, 0]
    assert lay.rank_at(dp=0, tp=1) == 1


def test_from_grid_detects_affine_and_subsets():
    transposed = Layout.from_grid(np.arange(16).reshape(4, 4).T, ("a", "b"))
    assert transposed.groups("b")[0].tolist() == [0, 4, 8, 12]
    assert transposed.coords(4) == {"a": 0, "b": 1}
    sparse = Layout.from_grid([[0, 2], [4, 6]], ("a", "b"))
    assert 1 not in sparse and 6 in sparse
    with pytest.raises(ValueError, match="rank 1 is not in this layout"):
        sparse.coords(1)


def test_flatten_adjacent_and_non_adjacent():
    lay = Layout(pp=2, dp=2, cp=2, tp=2)
    flat = lay.flatten("dp", "cp")
    assert flat.names == ("pp", "dp_cp", "tp") and flat.shape == (2, 4, 2)
    assert np.array_equal(flat.groups("dp_cp"), lay.groups("dp", "cp"))
    far = lay.flatten("tp", "pp", name="outer_inner")
    assert far.names == ("outer_inner", "dp", "cp")
    assert np.array_equal(far.groups("outer_inner"), lay.groups("pp", "tp"))
    assert far.group_of(5, "outer_inner").tolist() == lay.group_of(5, "pp", "tp").tolist()
    assert far.coords(9) == {"outer_inner": 3, "dp": 0, "cp": 0}


def test_split_is_unflatten():
    lay = Layout(pp=2, dp=8, tp=2)
    hsdp = lay.split("dp", dp_replicate=2, dp_shard=4)
    assert hsdp.names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert np.array_equal(hsdp.groups("dp_replicate", "dp_shard"), lay.groups("dp"))
    assert hsdp.flatten("dp_replicate", "dp_shard", name="dp") == lay
    permuted = Layout.from_grid(np.arange(8)[::-1].reshape(2, 4), ("a", "b")).split("b", c=2, d=2)
    assert permuted.groups("d")[0].tolist() == [7, 6]


def test_select_embedding_ranks():
    lay = Layout(pp=4, dp=1, tp=2)
    emb = lay.select("pp", [0, -1])
    assert emb.shape == (2, 1, 2)
    assert emb.groups("pp").tolist() == [[0, 6], [1, 7]]
    assert 2 not in emb and emb.world_size == 4
    one_stage = Layout(pp=1, tp=2).select("pp", [0, -1])
    assert one_stage.shape == (1, 2)
    assert lay.select("pp", 2).groups("tp").tolist() == [[4, 5]]


def test_to_dict_json_round_trip_and_fingerprint():
    layouts = [
        Layout(pp=2, dp=2, cp=1, tp=4),
        Layout(tp=4, rank_offset=8),
        Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp")),
        Layout(pp=4, tp=2).select("pp", [0, -1]),
        Layout(pp=2, dp=2, tp=2).with_views(expert=Layout(pp=2, ep=4)),
    ]
    for lay in layouts:
        again = Layout.from_dict(json.loads(json.dumps(lay.to_dict())))
        assert again == lay and again.fingerprint() == lay.fingerprint()
        assert pickle.loads(pickle.dumps(lay)) == lay
    fps = {lay.fingerprint() for lay in layouts}
    assert len(fps) == len(layouts) and all(len(fp) == 16 for fp in fps)
    assert Layout(pp=2, tp=2) != Layout(tp=2, pp=2)
    assert Layout(a=4) != Layout(a=4, rank_offset=4)


def test_equal_placements_built_differently_are_equal():
    assert Layout.from_grid(np.arange(8).reshape(2, 4), ("a", "b")) == Layout(a=2, b=4)
    assert Layout(a=2, b=2, c=2).flatten("b", "c") == Layout(a=2, b_c=4)


def test_repr_is_concise():
    assert repr(Layout(pp=2, dp=2, cp=1, tp=4)) == "Layout(pp=2, dp=2, cp=1, tp=4)"
    assert repr(Layout(tp=4, rank_offset=64)) == "Layout(tp=4, rank_offset=64)"
    assert "grid=[3, 1, 2, 0]" in repr(Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp")))
    assert len(repr(Layout(a=1024, b=1024).flatten("b", "a"))) < 200


def test_world_size_check_and_inference():
    assert Layout(pp=2, dp=-1, tp=4, world_size=64).shape == (2, 8, 4)
    with pytest.raises(ValueError, match=r"pp=2 × tp=3 = 6 does not divide world_size=16"):
        Layout(pp=2, dp=-1, tp=3, world_size=16)
    with pytest.raises(ValueError, match=r"pp=2 × tp=4 = 8 does not match world_size=16"):
        Layout(pp=2, tp=4, world_size=16)
    with pytest.raises(ValueError, match="needs world_size"):
        Layout(dp=-1)
    with pytest.raises(ValueError, match="only one size may be -1"):
        Layout(dp=-1, tp=-1, world_size=4)


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"tp": 0}, ValueError, r"tp=0: dim sizes must be positive"),
        ({"tp": -3}, ValueError, r"tp=-3: dim sizes must be positive"),
        ({"tp": 2.0}, TypeError, r"size of dim 'tp' must be an int, got 2.0"),
        ({"tp": True}, TypeError, r"size of dim 'tp' must be an int"),
        ({"tp": "4"}, TypeError, r"must be an int, got '4'"),
        ({"tp": 2, "rank_offset": -1}, ValueError, r"rank_offset=-1 must be >= 0"),
        ({"tp": 2, "rank_offset": 1.5}, TypeError, r"rank_offset must be an int"),
    ],
)
def test_bad_sizes(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Layout(**kwargs)


def test_bad_names():
    with pytest.raises(ValueError, match="duplicate dim name 'tp'"):
        Layout([("tp", 2), ("tp", 2)])
    with pytest.raises(ValueError, match="'my-dim' is not a Python identifier"):
        Layout({"my-dim": 2})
    with pytest.raises(TypeError, match="dim names must be str, got 3"):
        Layout([(3, 2)])
    with pytest.raises(ValueError, match="needs at least one dim"):
        Layout()
    with pytest.raises(TypeError, match="not both"):
        Layout({"a": 2}, b=2)


def test_unknown_and_repeated_dims_in_every_method():
    lay = Layout(pp=2, dp=2, tp=2)
    for call in (
        lambda: lay.groups("xp"),
        lambda: lay.group_of(0, "xp"),
        lambda: lay.size("xp"),
        lambda: lay.flatten("xp"),
        lambda: lay.split("xp", a=1),
        lambda: lay.select("xp", [0]),
        lambda: lay.rank_at(pp=0, dp=0, tp=0, xp=0),
        lambda: lay.node_locality("xp", ranks_per_node=2),
        lambda: lay.split_by_node("xp", 2),
    ):
        with pytest.raises(ValueError, match="unknown dim 'xp'; dims .*pp, dp, tp"):
            call()
    with pytest.raises(ValueError, match="dim 'tp' given twice"):
        lay.groups("tp", "tp")
    with pytest.raises(TypeError, match="dims are named by str"):
        lay.groups(0)


def test_split_select_rank_errors():
    lay = Layout(pp=4, dp=2)
    with pytest.raises(ValueError, match=r"split sizes a=3 × b=2 = 6 do not multiply to dp=2"):
        lay.split("dp", a=3, b=2)
    with pytest.raises(ValueError, match="index 4 is out of range for dim 'pp' of size 4"):
        lay.select("pp", [0, 4])
    with pytest.raises(ValueError, match="index -5 is out of range"):
        lay.select("pp", -5)
    with pytest.raises(ValueError, match="keeps no ranks"):
        lay.select("pp", [])
    with pytest.raises(ValueError, match="rank 8 is not in this layout .ranks 0..7"):
        lay.group_of(8, "dp")
    with pytest.raises(ValueError, match="rank -1 is not in this layout"):
        lay.coords(-1)
    with pytest.raises(TypeError, match="rank must be an int"):
        lay.coords("3")
    with pytest.raises(ValueError, match="pp=4 is out of range; dim 'pp' has size 4"):
        lay.rank_at(pp=4, dp=0)
    with pytest.raises(ValueError, match="missing dp"):
        lay.rank_at(pp=0)
    with pytest.raises(ValueError, match="duplicate dim name 'pp'"):
        lay.flatten("dp", name="pp")


def test_from_grid_errors():
    with pytest.raises(ValueError, match="holds rank 1 more than once"):
        Layout.from_grid([[0, 1], [1, 2]], ("a", "b"))
    with pytest.raises(ValueError, match="holds rank -1; ranks must be between 0"):
        Layout.from_grid([[0, -1]], ("a", "b"))
    with pytest.raises(ValueError, match="grid has 2 dims but 1 names were given"):
        Layout.from_grid([[0, 1]], ("a",))
    with pytest.raises(ValueError, match="not a rectangular array"):
        Layout.from_grid([[0, 1], [2]], ("a", "b"))
    with pytest.raises(TypeError, match="integer ranks"):
        Layout.from_grid([[0.5, 1.0]], ("a", "b"))
    with pytest.raises(ValueError, match="is empty"):
        Layout.from_grid(np.zeros((0, 2), dtype=int), ("a", "b"))


def test_from_dict_errors():
    with pytest.raises(ValueError, match="format must be"):
        Layout.from_dict({"dims": [["a", 2]]})
    with pytest.raises(ValueError, match="unknown keys"):
        Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "junk": 1})
    with pytest.raises(ValueError, match="'dims' must be a list"):
        Layout.from_dict({"format": "meshgroups.Layout/1", "dims": {"a": 2}})


@pytest.mark.processes
def test_layout_core_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, meshgroups, meshgroups.layout._core; meshgroups.Layout(a=2).groups('a'); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_large_world_layout_only():
    lay = Layout(pp=16, dp=256, cp=4, tp=8)
    assert lay.world_size == 131072
    dp_cp = lay.groups("dp", "cp")
    assert dp_cp.shape == (16 * 8, 1024)
    # each dim partitions the world
    for dim in lay.names:
        rows = lay.groups(dim)
        assert np.array_equal(np.sort(rows, axis=None), np.arange(131072))
    rank = 98765
    c = lay.coords(rank)
    assert lay.rank_at(**c) == rank
    row = lay.group_of(rank, "dp", "cp")
    assert rank in row and np.array_equal(row, dp_cp[np.nonzero((dp_cp == rank).any(axis=1))[0][0]])


def test_docstring_examples_run():
    import doctest

    import meshgroups.errors
    import meshgroups.layout._core
    import meshgroups.layout._layout_topology
    import meshgroups.layout._topology
    from meshgroups import Layout, Topology

    for module in (
        meshgroups.layout._core,
        meshgroups.layout._layout_topology,
        meshgroups.layout._topology,
        meshgroups.errors,
    ):
        result = doctest.testmod(module, extraglobs={"Layout": Layout, "Topology": Topology})
        assert result.attempted >= 1 and result.failed == 0, module.__name__
