"""Hypothesis properties of random layouts (up to 6 dims)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgroups import Layout

NAMES = ("a", "b", "c", "d", "e", "f")


@st.composite
def layouts(draw, max_dims=6):
    n = draw(st.integers(1, max_dims))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    offset = draw(st.sampled_from([0, 0, 3, 64]))
    lay = Layout(dict(zip(NAMES, sizes)), rank_offset=offset)
    if draw(st.booleans()):
        # an explicit placement: the same shape over a random permutation of the ranks
        perm = draw(st.permutations(range(lay.world_size)))
        lay = Layout.from_grid(np.array(perm, dtype=np.int64).reshape(lay.shape) + offset, lay.names)
    return lay


@st.composite
def layout_and_dims(draw):
    lay = draw(layouts())
    dims = draw(st.lists(st.sampled_from(lay.names), unique=True, max_size=lay.ndim))
    return lay, tuple(dims)


@settings(max_examples=150, deadline=None)
@given(layout_and_dims())
def test_groups_partition_the_layout(args):
    lay, dims = args
    rows = lay.groups(*dims)
    assert rows.shape == (
        lay.world_size // lay.size(*dims) if dims else lay.world_size,
        lay.size(*dims) if dims else 1,
    )
    assert np.array_equal(np.sort(rows, axis=None), np.sort(lay.grid, axis=None))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_disjoint_dim_sets_meet_in_at_most_one_rank(lay, data):
    dims = data.draw(st.lists(st.sampled_from(lay.names), unique=True))
    rest = [d for d in lay.names if d not in dims]
    other = data.draw(st.lists(st.sampled_from(rest), unique=True)) if rest else []
    for g in lay.groups(*dims):
        for h in lay.groups(*other):
            assert len(set(g.tolist()) & set(h.tolist())) <= 1


@settings(max_examples=150, deadline=None)
@given(layout_and_dims(), st.data())
def test_group_of_is_the_row_containing_the_rank(args, data):
    lay, dims = args
    rank = int(data.draw(st.sampled_from(lay.grid.ravel().tolist())))
    rows = lay.groups(*dims)
    expected = rows[(rows == rank).any(axis=1)][0]
    assert lay.group_of(rank, *dims).tolist() == expected.tolist()


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_coords_and_rank_at_are_inverse(lay, data):
    rank = int(data.draw(st.sampled_from(lay.grid.ravel().tolist())))
    coords = lay.coords(rank)
    assert lay.rank_at(**coords) == rank
    assert lay.grid[tuple(coords[n] for n in lay.names)] == rank


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_to_dict_round_trips(lay):
    again = Layout.from_dict(lay.to_dict())
    assert again == lay and hash(again) == hash(lay) and again.fingerprint() == lay.fingerprint()


@settings(max_examples=150, deadline=None)
@given(layout_and_dims())
def test_flatten_then_split_is_identity(args):
    lay, dims = args
    if not dims:
        return
    ordered = [d for d in lay.names if d in dims]
    flat = lay.flatten(*dims, name="merged")
    assert np.array_equal(flat.groups("merged"), lay.groups(*dims))
    back = flat.split("merged", **{d: lay.size(d) for d in ordered})
    # split puts the sub-dims where the merged dim was: compare after restoring the order
    assert np.array_equal(back.groups(*ordered), lay.groups(*dims))
    if [lay.names.index(d) for d in ordered] == list(
        range(lay.names.index(ordered[0]), lay.names.index(ordered[0]) + len(ordered))
    ):
        assert back == lay


@settings(max_examples=200, deadline=None)
@given(layouts(max_dims=4), st.data())
def test_select_equals_the_validated_layout_of_the_taken_positions(lay, data):
    # select builds its result by a trusted path (no re-validation, no copy of the source grid):
    # it must be the very layout from_grid validates from the same positions, in every respect
    dim = data.draw(st.sampled_from(lay.names))
    size = lay.size(dim)
    picked = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size, unique=True))
    got = lay.select(dim, picked)
    ref = Layout.from_grid(np.take(lay.grid, picked, axis=lay.names.index(dim)), lay.names)
    assert got == ref and hash(got) == hash(ref) and got.fingerprint() == ref.fingerprint()
    assert got.is_affine == ref.is_affine and np.array_equal(got.grid, ref.grid)
    for rank in lay.grid.ravel().tolist():
        assert (rank in got) == (rank in ref)
        if rank in ref:
            assert got.coords(rank) == ref.coords(rank)
    assert repr(got) == repr(ref)
