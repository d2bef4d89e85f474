"""Layout as an immutable value: canonical identity, no mutation path, hostile input."""

from __future__ import annotations

import json
import math
import pathlib
import pickle
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshgroups import Layout
from meshgroups._checks import MAX_RANK, MAX_WORLD_SIZE
from meshgroups.errors import LayoutError

NAMES = ("pp", "dp", "cp", "tp", "ep")


@st.composite
def placements(draw):
    """(row-major layout, the same placement as an explicit grid, a permutation of its dims)."""
    n = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    offset = draw(st.integers(0, 50))
    lay = Layout(dict(zip(NAMES, sizes)), rank_offset=offset)
    perm = draw(st.permutations(range(n)))
    return lay, perm


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements())
def test_affine_and_explicit_constructions_are_one_value(case):
    lay, perm = case
    explicit = Layout.from_grid(lay.grid.tolist(), lay.names)
    assert explicit == lay and hash(explicit) == hash(lay)
    assert explicit.fingerprint() == lay.fingerprint()
    # A transposed placement is affine with other strides: from_strides and from_grid agree too.
    names = tuple(lay.names[i] for i in perm)
    grid = np.transpose(lay.grid, perm)
    by_grid = Layout.from_grid(grid, names)
    by_strides = Layout.from_strides(names, grid.shape, [lay.strides[i] for i in perm], lay.rank_offset)
    assert by_grid == by_strides and hash(by_grid) == hash(by_strides)
    assert by_grid.fingerprint() == by_strides.fingerprint()
    assert by_grid.is_affine
    for value in (lay, by_grid):
        for copy in (
            pickle.loads(pickle.dumps(value)),
            Layout.from_dict(json.loads(json.dumps(value.to_dict()))),
        ):
            assert copy == value and hash(copy) == hash(value) and copy.fingerprint() == value.fingerprint()
            assert np.array_equal(copy.grid, value.grid)


@settings(max_examples=40, deadline=None)
@given(placements(), st.randoms(use_true_random=False))
def test_explicit_placements_round_trip(case, rnd):
    lay, _ = case
    flat = lay.grid.ravel().tolist()
    rnd.shuffle(flat)
    explicit = Layout.from_grid(np.array(flat).reshape(lay.shape), lay.names)
    for copy in (
        pickle.loads(pickle.dumps(explicit)),
        Layout.from_dict(json.loads(json.dumps(explicit.to_dict()))),
    ):
        assert copy == explicit and hash(copy) == hash(explicit)
        assert copy.fingerprint() == explicit.fingerprint()
    for rank in flat:
        assert explicit.rank_at(**explicit.coords(rank)) == rank
    assert (lay.max_rank + 1) not in explicit


def test_identity_distinguishes_placements():
    a = Layout(dp=2, tp=2)
    assert a != Layout.from_strides(("dp", "tp"), (2, 2), (1, 2))
    assert a != Layout(dp=2, tp=2, rank_offset=1)
    assert a != Layout(dp=2, xp=2)
    assert a.fingerprint() != Layout(tp=2, dp=2).fingerprint()
    assert a != a.with_views(e=Layout(ep=4))
    assert a.with_views(e=Layout(ep=4)) == Layout(dp=2, tp=2).with_views(e=Layout(ep=4))


def _mutators(lay: Layout):
    import torch

    def setflags_grid():
        g = lay.grid
        g.setflags(write=True)
        g += 10

    def torch_grid():
        torch.from_numpy(lay.grid).add_(10)

    def torch_groups():
        torch.from_numpy(lay.groups("tp")).add_(10)
        torch.from_numpy(lay.groups("dp", "tp")).add_(10)

    def torch_group_of():
        torch.from_numpy(lay.group_of(1, "tp")).add_(10)

    return [setflags_grid, torch_grid, torch_groups, torch_group_of]


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("explicit", [False, True])
def test_no_public_operation_mutates_a_layout(explicit):
    lay = Layout(dp=2, tp=2) if not explicit else Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp"))
    before = (lay.grid.tolist(), lay.groups("tp").tolist(), lay.group_of(1, "tp").tolist(), hash(lay))
    blob = pickle.dumps(lay)
    for mutate in _mutators(lay):
        try:
            mutate()
        except ValueError:
            pass  # numpy refusing to make a read-only array writable is also fine
    after = (lay.grid.tolist(), lay.groups("tp").tolist(), lay.group_of(1, "tp").tolist(), hash(lay))
    assert after == before
    assert pickle.loads(blob) == lay
    with pytest.raises(AttributeError, match="immutable"):
        lay._names = ("a", "b")
    with pytest.raises(AttributeError, match="immutable"):
        lay.extra = 1
    with pytest.raises(AttributeError, match="immutable"):
        del lay._shape
    with pytest.raises(TypeError, match="immutable"):
        lay.__init__(dp=3)
    assert lay.shape == (2, 2) and hash(lay) == before[3]


def test_identity_is_o_ndim_for_affine_layouts():
    # The largest layout allowed: hash, ==, fingerprint and `in` never build its 16M-rank grid.
    big = Layout(a=MAX_WORLD_SIZE // 8, b=8)
    other = Layout(a=MAX_WORLD_SIZE // 8, b=8)
    assert big == other and hash(big) == hash(other) and big.fingerprint() == other.fingerprint()
    assert (MAX_WORLD_SIZE - 1) in big and MAX_WORLD_SIZE not in big
    assert big.group_of(MAX_WORLD_SIZE - 1, "b").tolist() == list(range(MAX_WORLD_SIZE - 8, MAX_WORLD_SIZE))
    assert "_rank_array" not in vars(big) and "_rank_array" not in vars(other)


def test_explicit_lookups_use_memory_of_the_layout_not_its_rank_range():
    lay = Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "grid": [2**30, 0]})
    assert 5 not in lay and 2**30 in lay and lay.coords(2**30) == {"a": 0}
    ranks, where = lay._sorted_ranks
    assert ranks.nbytes + where.nbytes <= 64


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: Layout(a=2, rank_offset=2**63 - 1), LayoutError, r"above the largest rank 2147483647"),
        (lambda: Layout(a=2, rank_offset=2**64), LayoutError, r"above the largest rank"),
        (lambda: Layout(a=2**40), LayoutError, r"a=1099511627776 exceeds the 16777216 ranks"),
        (lambda: Layout(a=2**20, b=2**20), LayoutError, r"exceeds the 16777216 \(2\*\*24\)"),
        (
            lambda: Layout(a=8).node_locality("a", ranks_per_node=2**63),
            LayoutError,
            r"ranks_per_node=\d+ must be between 1",
        ),
        (lambda: Layout.from_grid([0, 2**40], ("a",)), LayoutError, r"holds rank 1099511627776"),
        (lambda: Layout.from_grid([0, 2**64], ("a",)), LayoutError, r"holds rank 18446744073709551616"),
        (lambda: Layout.from_grid(5, ()), LayoutError, r"needs at least one dim"),
        (lambda: Layout.from_grid(5, ("a",)), LayoutError, r"single number"),
        (lambda: Layout.from_grid([[0, 1]], "dp"), TypeError, r"got the string 'dp'"),
        (lambda: Layout.from_grid([[0, 1]], {"dp", "tp"}), TypeError, r"ordered sequence"),
        (lambda: Layout(dp=2).with_views(**{"class": Layout(dp=2)}), LayoutError, r"view name 'class'"),
        (lambda: Layout(**{"for": 2}), LayoutError, r"dim name 'for' is not a Python identifier"),
        (
            lambda: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "stride": [1]}),
            LayoutError,
            r"unknown keys \['stride'\]",
        ),
        (
            lambda: Layout.from_strides(("a", "b"), (2, 2), (1, 1)),
            LayoutError,
            r"map two coordinates to one rank",
        ),
        (lambda: Layout.from_strides(("a",), (2,), (-1,)), LayoutError, r"stride -1 must be positive"),
        (lambda: Layout.from_strides(("a",), (2,), (1,), -3), LayoutError, r"rank_offset=-3 must be >= 0"),
    ],
)
def test_validation_messages(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_from_dict_honours_strides():
    lay = Layout.from_strides(("dp", "tp"), (2, 4), (1, 2), rank_offset=8)
    data = lay.to_dict()
    assert data["strides"] == [1, 2] and data["rank_offset"] == 8 and "grid" not in data
    assert Layout.from_dict(data) == lay
    assert repr(lay) == "Layout(dp=2, tp=4, strides=(1, 2), rank_offset=8)"


def test_names_that_are_method_parameters_work():
    lay = Layout(self=2, cls=2, dim=2, order=2, dims=2, indices=2, rank=2, name=2)
    assert lay.rank_at(self=1, cls=0, dim=0, order=0, dims=0, indices=0, rank=0, name=1) == 129
    assert lay.split("dim", dims_a=1, dims_b=2).names[2:4] == ("dims_a", "dims_b")
    assert lay.with_views(self_view=Layout(cls_=256)).views["self_view"].names == ("cls_",)
    assert Layout.from_order("self-order", self=2, order=4).names == ("order", "self")
    with pytest.raises(LayoutError, match="reserved"):
        Layout(**{"a": 2}).split("a", rank_offset=2)


def test_errors_are_typed_and_keep_builtin_bases():
    assert issubclass(LayoutError, ValueError)
    with pytest.raises(LayoutError, match="unknown dim 'xp'; dims of this layout are pp, tp"):
        Layout(pp=2, tp=2).groups("xp")


# ------------------------------------------------------------------------------ fuzzing
WEIRD = [
    None,
    "x",
    "",
    1.5,
    math.inf,
    math.nan,
    -1,
    0,
    2**31,
    2**63,
    2**64,
    -(2**63),
    10**30,
    True,
    [],
    {},
    (1, 2),
    [[1], [2, 3]],
    np.int64(3),
    np.uint64(2**63),
    np.float32(2),
    object(),
    b"dp",
    {"dp", "tp"},
]
BASE = Layout(pp=2, dp=2, tp=2)
EXPLICIT = Layout.from_grid([[3, 1], [2, 0]], ("dp", "tp"))

ENTRY_POINTS = [
    lambda v: Layout(a=v),
    lambda v: Layout(v),
    lambda v: Layout(a=2, rank_offset=v),
    lambda v: Layout(a=-1, b=2, world_size=v),
    lambda v: Layout({v: 2}),
    lambda v: Layout([(v, 2)]),
    lambda v: Layout.from_grid(v, ("a",)),
    lambda v: Layout.from_grid([[0, 1]], v),
    lambda v: Layout.from_grid([[0, v]], ("a", "b")),
    lambda v: Layout.from_strides(("a",), (2,), (v,)),
    lambda v: Layout.from_strides(("a",), (v,), (1,)),
    lambda v: Layout.from_strides(("a",), (2,), (1,), v),
    lambda v: Layout.from_strides(v, (2,), (1,)),
    lambda v: Layout.from_order(v, tp=2),
    lambda v: Layout.from_order("tp-pp", tp=2, pp=v),
    lambda v: Layout.from_dict(v),
    lambda v: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": v}),
    lambda v: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "grid": v}),
    lambda v: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "rank_offset": v}),
    lambda v: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "strides": v}),
    lambda v: Layout.from_dict({"format": "meshgroups.Layout/1", "dims": [["a", 2]], "views": v}),
    lambda v: BASE.groups(v),
    lambda v: BASE.group_of(v, "tp"),
    lambda v: BASE.group_of(1, v),
    lambda v: EXPLICIT.group_of(v, "tp"),
    lambda v: BASE.coords(v),
    lambda v: EXPLICIT.coords(v),
    lambda v: BASE.rank_at(pp=v, dp=0, tp=0),
    lambda v: EXPLICIT.rank_at(dp=v, tp=0),
    lambda v: BASE.size(v),
    lambda v: v in BASE,
    lambda v: v in EXPLICIT,
    lambda v: BASE.select("pp", v),
    lambda v: BASE.select(v, 0),
    lambda v: BASE.select("pp", [v]),
    lambda v: BASE.split("dp", a=v),
    lambda v: BASE.split(v, a=2),
    lambda v: BASE.flatten(v),
    lambda v: BASE.flatten("dp", "tp", name=v),
    lambda v: BASE.with_views(e=v),
    lambda v: BASE.resolve(v),
    lambda v: BASE.node_locality("tp", ranks_per_node=v),
    lambda v: BASE.split_by_node("dp", v),
    lambda v: EXPLICIT.node_locality("tp", ranks_per_node=v),
]


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=400, deadline=None)
@given(st.sampled_from(range(len(ENTRY_POINTS))), st.sampled_from(WEIRD))
def test_fuzz_only_value_or_type_errors(entry, value):
    try:
        ENTRY_POINTS[entry](value)
    except (ValueError, TypeError):
        pass


def test_fuzz_covers_every_combination():
    for entry in ENTRY_POINTS:
        for value in WEIRD:
            try:
                entry(value)
            except (ValueError, TypeError):
                pass


def test_core_modules_use_public_layout_api_only():
    root = pathlib.Path(__file__).resolve().parents[2]
    private = re.compile(r"(?<![.\w])(layout|main|view|other|a|b|owner|source|out)\._[a-z]")
    for module in (
        "layout/_algebra.py",
        "layout/_views.py",
        "layout/_serialize.py",
        "layout/_topology.py",
        "render/_formats.py",
        "render/_window.py",
        "render/_figure.py",
        "render/_spans.py",
    ):
        text = (root / "meshgroups" / module).read_text()
        assert not private.search(text), f"{module} reaches into a Layout's private fields"
        # The one exception: algebra builds selections of a layout's own positions with the
        # trusted constructor (no re-validation of ranks that cannot have changed).
        allowed = {"layout/_algebra.py": {"_derived"}}.get(module, set())
        used = set(re.findall(r"\)\.(_[a-z]\w*)", text))
        assert used <= allowed, f"{module} uses private Layout members {sorted(used - allowed)}"
    for path in (root / "meshgroups" / "layout").glob("*.py"):  # no arrow up, not even lazily
        text = path.read_text()
        assert "from meshgroups.render" not in text and "import meshgroups.render" not in text, path.name
    for path in (root / "compat").glob("*.py"):
        assert not re.search(r"meshgroups\._", path.read_text()), f"{path.name} imports a private module"


@pytest.mark.processes
def test_layout_value_and_errors_need_no_torch_or_renderer():
    import subprocess
    import sys

    code = (
        "import sys, meshgroups; from meshgroups.errors import LayoutError; "
        "L = meshgroups.Layout(a=2, b=2); L.groups('a'); L.flatten('a', 'b'); hash(L); L.select('a', 0); "
        "repr(L); L.to_dict(); "
        "assert 'torch' not in sys.modules and 'meshgroups.render._formats' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_max_rank_bounds():
    top = Layout(a=2, rank_offset=MAX_RANK - 1)
    assert top.max_rank == MAX_RANK and MAX_RANK in top
    assert Layout.from_grid([MAX_RANK, 0], ("a",)).max_rank == MAX_RANK


@settings(max_examples=60, deadline=None)
@given(placements(), st.data())
def test_select_stays_affine_and_equals_the_grid_selection(case, data):
    lay, _ = case
    dim = data.draw(st.sampled_from(lay.names))
    size = lay.size(dim)
    indices = data.draw(st.lists(st.integers(-size, size - 1), min_size=1, max_size=4))
    picked = lay.select(dim, indices)
    axis = lay.names.index(dim)
    order = list(dict.fromkeys(i % size for i in indices))
    expected = np.take(lay.grid, order, axis=axis)
    assert np.array_equal(picked.grid, expected)
    assert picked == Layout.from_grid(expected, lay.names)
    steps = {b - a for a, b in zip(order, order[1:])}
    if len(steps) <= 1 and (not steps or min(steps) > 0):
        assert picked.is_affine  # evenly spaced picks of an affine layout: no grid kept


def test_grid_as():
    lay = Layout(pp=2, tp=3, rank_offset=5)
    small = lay.grid_as(np.int32)
    assert small.dtype == np.int32 and small.flags.writeable and small.tolist() == lay.grid.tolist()
    small += 1  # the caller's own array
    assert lay.grid.min() == 5
    explicit = Layout.from_grid([[3, 1], [2, 0]], ("a", "b"))
    assert explicit.grid_as(np.int16).tolist() == [[3, 1], [2, 0]]
    with pytest.raises(TypeError, match="integer dtype"):
        lay.grid_as(np.float32)
    with pytest.raises(LayoutError, match="does not fit int8"):
        Layout(a=2, rank_offset=200).grid_as(np.int8)
