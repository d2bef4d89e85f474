"""Recovery plans (``meshgroups.elastic._plans``) against a brute force on random layouts.

The oracle works on plain grids with Python loops: it drops / renames / appends ranks in the
grid, enumerates every group of every family before and after (main dims, view dims, flattened
dims, subsets), and derives kept / created / gone and each rank's status by set comparison. The
plan must agree exactly — listings and every per-rank answer.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgroups import Layout, Topology
from meshgroups.elastic._plans import plan_grow, plan_shrink, plan_substitute
from meshgroups.errors import RecoveryError

from ..layout.test_layout_properties import layouts


# ------------------------------------------------------------------------------ the oracle
def brute_groups(grid: np.ndarray, names: tuple[str, ...], dims: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every group varying ``dims`` (members in layout order), by loops over the grid."""
    axes = [names.index(d) for d in names if d in dims]
    rest = [i for i in range(len(names)) if i not in axes]
    out = []
    for fixed in itertools.product(*(range(grid.shape[i]) for i in rest)):
        members = []
        for moving in itertools.product(*(range(grid.shape[i]) for i in axes)):
            index = [0] * len(names)
            for i, v in zip(rest, fixed):
                index[i] = v
            for i, v in zip(axes, moving):
                index[i] = v
            members.append(int(grid[tuple(index)]))
        out.append(tuple(members))
    return out


def position(grid: np.ndarray, rank: int) -> tuple[int, ...] | None:
    hits = np.argwhere(grid == rank)
    return tuple(int(c) for c in hits[0]) if len(hits) else None


def owners_before(lay, flatten, subsets):
    """{family label: (owner label, names, dims)} and {owner label: (grid, names)}, by hand."""
    grids = {"main": (lay.grid, lay.names)}
    fams = {d: ("main", d) for d in lay.names}
    for vname, view in lay.views.items():
        grids[f"view {vname}"] = (view.grid, view.names)
        fams.update({d: (f"view {vname}", d) for d in view.names if d not in lay.names})
    for dims in flatten:
        fams["_".join(d for d in lay.names if d in dims)] = ("main", tuple(dims))
    for sname, (sub, sdims) in subsets.items():
        grids[f"subset {sname}"] = (sub.grid, sub.names)
        fams[sname] = (f"subset {sname}", (sdims,) if isinstance(sdims, str) else tuple(sdims))
    return fams, grids


def check_against(plan, lay, fams, old_grids, new_grids, universe):
    """Listings, per-rank statuses and coordinates equal the oracle's."""
    new_main = new_grids["main"][0]
    assert np.array_equal(plan.new_layout.grid, new_main)
    assert plan.new_layout.shape == plan.new_shape()
    for vname in lay.views:
        assert np.array_equal(plan.new_layout.views[vname].grid, new_grids[f"view {vname}"][0])
    for label, (owner, dims) in fams.items():
        dims = (dims,) if isinstance(dims, str) else dims
        old_grid, names = old_grids[owner]
        new_grid = new_grids[owner][0]
        before = brute_groups(old_grid, names, dims)
        after = brute_groups(new_grid, names, dims) if new_grid is not None else []
        key = label if owner.startswith("subset") else tuple(d for d in names if d in dims)
        change = plan.change(key)
        assert change.label == label
        got = {k: [tuple(r) for r in getattr(change, k).tolist()] for k in ("kept", "created", "gone")}
        assert sorted(got["kept"]) == sorted(set(before) & set(after))
        assert sorted(got["created"]) == sorted(set(after) - set(before))
        assert sorted(got["gone"]) == sorted(set(before) - set(after))
        for rank in universe:
            mine_after = [g for g in after if rank in g]
            mine_before = [g for g in before if rank in g]
            if mine_after:
                expected = "kept" if mine_after[0] in set(before) else "created"
            else:
                expected = "gone" if mine_before else None
            assert plan.status(rank, key) == expected, (rank, key)
            assert plan.is_kept(rank, key) == (expected == "kept")
            group = plan.new_group(rank, key)
            assert (group is None and not mine_after) or tuple(group.tolist()) == mine_after[0]
            old_group = plan.old_group(rank, key)
            assert (old_group is None and not mine_before) or tuple(old_group.tolist()) == mine_before[0]
    for rank in universe:
        at_new, at_old = position(new_main, rank), position(lay.grid, rank)
        new_coords = plan.new_coords(rank)
        assert (new_coords is None) == (at_new is None)
        if at_new is not None:
            assert tuple(new_coords[n] for n in lay.names) == at_new
        assert plan.old_coords(rank) == (None if at_old is None else dict(zip(lay.names, at_old)))
        pred = plan.predecessor(rank)
        if at_new is None:
            assert pred is None
        elif pred is not None:
            assert plan.successor(pred) == rank


# ------------------------------------------------------------------------------ strategies
@st.composite
def with_extras(draw, min_replicas=2):
    """A random layout (row-major, offset, or a permuted grid), a replicate dim of size >= 2,
    maybe a view (a flatten or split of it), flattened dims and a subset."""
    lay = draw(layouts(max_dims=4).filter(lambda x: any(s >= min_replicas for s in x.shape)))
    dim = draw(st.sampled_from([n for n, s in zip(lay.names, lay.shape) if s >= min_replicas]))
    kind = draw(st.sampled_from(["none", "flatten", "split"]))
    others = [n for n in lay.names if n != dim]
    pairs = [p for p in zip(lay.names, lay.names[1:]) if dim not in p]
    if kind == "flatten" and pairs:
        lay = lay.with_views(v=lay.flatten(*draw(st.sampled_from(pairs)), name="m"))
    elif kind == "split" and any(lay.size(n) == 4 for n in others):
        name = next(n for n in others if lay.size(n) == 4)
        lay = lay.with_views(v=lay.split(name, s1=2, s2=2))
    flatten = []
    if len(lay.names) >= 2:
        flatten = [tuple(draw(st.lists(st.sampled_from(lay.names), min_size=2, max_size=3, unique=True)))]
    subsets = {}
    if draw(st.booleans()):
        sub_dim = draw(st.sampled_from(lay.names))
        idx = sorted(draw(st.sets(st.integers(0, lay.size(sub_dim) - 1), min_size=1)))
        sub = lay.without_views().select(sub_dim, idx)
        subsets["part"] = (sub, tuple(draw(st.lists(st.sampled_from(sub.names), min_size=1, unique=True))))
    return lay, dim, flatten, subsets


def drop_slabs(grid: np.ndarray, names, removed: set[int], prefer: str):
    """The grid with the removed ranks' slabs deleted along one dim (prefer first), or None if all
    removed; AssertionError if no dim fits (the plan must have refused such a case)."""
    mask = np.isin(grid, list(removed))
    if not mask.any():
        return grid
    if mask.all():
        return None
    for name in sorted(names, key=lambda n: (n != prefer, names.index(n))):
        axis = names.index(name)
        others = tuple(i for i in range(grid.ndim) if i != axis)
        idx = [i for i in range(grid.shape[axis]) if np.take(mask, i, axis=axis).any()]
        if all(np.take(mask, i, axis=axis).all() for i in idx):
            return np.delete(grid, idx, axis=axis)
        del others
    raise AssertionError("no dim fits")


# ------------------------------------------------------------------------------ shrink
@settings(max_examples=120)
@given(with_extras(), st.data())
def test_shrink_matches_brute_force(args, data):
    lay, dim, flatten, subsets = args
    axis = lay.names.index(dim)
    ranks = lay.grid.ravel().tolist()
    node = data.draw(st.sampled_from([None, 2, 4]))
    keep = data.draw(st.integers(0, lay.size(dim) - 1))  # one replica survives, whole
    keep_nodes = (
        set() if node is None else {r // node for r in np.take(lay.grid, keep, axis=axis).ravel().tolist()}
    )
    candidates = [
        r for r in ranks if lay.coords(r)[dim] != keep and (node is None or r // node not in keep_nodes)
    ]
    if not candidates:
        return
    lost = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=4, unique=True))
    topology = None if node is None else Topology(node=node)
    plan = plan_shrink(lay, lost, dim=dim, topology=topology, flatten=flatten, subsets=subsets)
    # the oracle: every layout rank that leaves, its replicas, the new grids
    out = set(lost) | ({r for r in ranks if r // node in {x // node for x in lost}} if node else set())
    dropped = sorted({position(lay.grid, r)[axis] for r in out})
    new_main = np.delete(lay.grid, dropped, axis=axis)
    removed = set(ranks) - set(new_main.ravel().tolist())
    fams, old_grids = owners_before(lay, flatten, subsets)
    new_grids = {label: (drop_slabs(g, n, removed, dim), n) for label, (g, n) in old_grids.items()}
    assert new_grids["main"][0].shape == new_main.shape
    universe = sorted(set(ranks) | {max(ranks) + 1})
    check_against(plan, lay, fams, old_grids, new_grids, universe)
    assert plan.dropped == tuple(dropped)
    assert plan.index_map == tuple(i for i in range(lay.size(dim)) if i not in dropped)
    assert not set(lost) & set(plan.new_layout.grid.ravel().tolist())
    drained = {r for r in out if r not in lost}
    assert plan.drained == tuple(sorted(drained))
    assert plan.spares == tuple(sorted(removed - out))
    assert plan.removed == tuple(sorted(removed))
    for r in universe:
        expected = (
            "lost"
            if r in lost
            else "drained"
            if r in drained
            else "spare"
            if r in removed
            else "survivor"
            if r in ranks
            else "outside"
        )
        assert plan.role(r) == expected
        coords = plan.new_coords(r)
        if coords is not None:  # coordinates stable except along the dim
            old = lay.coords(r)
            assert {k: v for k, v in coords.items() if k != dim} == {k: v for k, v in old.items() if k != dim}
            assert plan.index_map[coords[dim]] == old[dim]
            assert plan.data_index(r) == (old[dim], coords[dim])


# ------------------------------------------------------------------------------ substitute
@settings(max_examples=100)
@given(with_extras(min_replicas=1), st.data())
def test_substitute_matches_brute_force(args, data):
    lay, _, flatten, subsets = args
    ranks = lay.grid.ravel().tolist()
    node = data.draw(st.sampled_from([None, 2, 4]))
    lost = data.draw(st.lists(st.sampled_from(ranks), min_size=1, max_size=3, unique=True))
    top = max(ranks) + 1
    if node is None:
        out = sorted(lost)
        spares = data.draw(st.permutations(range(top, top + len(lost) + 2)))
        mapping = dict(zip(out, spares))
        unused = spares[len(lost) :]
    else:
        lost_nodes = sorted({r // node for r in lost})
        out = [r for r in ranks if r // node in lost_nodes]
        first = -(-top // node)  # the first node above the layout
        spare_nodes = [first + 2 * i for i in range(len(lost_nodes) + 1)]
        spares = [n * node + i for n in spare_nodes for i in range(node)]
        swap = dict(zip(lost_nodes, spare_nodes))
        mapping = {r: swap[r // node] * node + r % node for r in out}
        unused = [r for r in spares if r not in mapping.values()]  # a partly used node's rest too
    topology = None if node is None else Topology(node=node)
    plan = plan_substitute(lay, lost, spares, topology=topology, flatten=flatten, subsets=subsets)

    def rename(grid):
        return np.vectorize(lambda r: mapping.get(int(r), int(r)))(grid)

    fams, old_grids = owners_before(lay, flatten, subsets)
    new_grids = {label: (rename(g), n) for label, (g, n) in old_grids.items()}
    universe = sorted(set(ranks) | set(spares))
    check_against(plan, lay, fams, old_grids, new_grids, universe)
    assert dict(plan.replacements) == mapping
    assert plan.spares == tuple(sorted(unused))
    assert plan.admitted == tuple(sorted(mapping.values()))
    for old, new in mapping.items():
        assert plan.successor(old) == new and plan.predecessor(new) == old
        assert plan.new_coords(new) == lay.coords(old)
        assert plan.role(new) == "admitted" and plan.role(old) in ("lost", "drained")


# ------------------------------------------------------------------------------ grow
@settings(max_examples=100)
@given(with_extras(min_replicas=1), st.data())
def test_grow_matches_brute_force(args, data):
    lay, dim, flatten, subsets = args
    axis = lay.names.index(dim)
    ranks = lay.grid.ravel().tolist()
    slab_shape = lay.shape[:axis] + lay.shape[axis + 1 :]
    slab = int(np.prod(slab_shape))
    k = data.draw(st.integers(1, 2))
    top = max(ranks) + 1 + data.draw(st.sampled_from([0, 5]))
    new = data.draw(st.permutations(range(top, top + k * slab)))
    plan = plan_grow(lay, new, dim=dim, flatten=flatten, subsets=subsets)
    extra = np.moveaxis(np.array(new).reshape((k, *slab_shape)), 0, axis)
    new_main = np.concatenate([lay.grid, extra], axis=axis)
    fams, old_grids = owners_before(lay, flatten, subsets)
    new_grids = {}
    for label, (grid, names) in old_grids.items():
        # an owner with the dim over every replica grows like the main layout, by position
        if dim in names and grid.shape[names.index(dim)] == lay.size(dim):
            first = np.take(grid, [0], axis=names.index(dim))
            extras = []

            def moved(r: int, j: int) -> int:
                at = list(position(lay.grid, r))
                at[axis] = lay.size(dim) + j
                return int(new_main[tuple(at)])

            for j in range(k):
                extras.append(np.vectorize(moved)(first, j))
            aligned = all(
                position(lay.grid, int(r))[axis] == idx
                for idx in range(grid.shape[names.index(dim)])
                for r in np.take(grid, idx, axis=names.index(dim)).ravel()
            )
            grid = np.concatenate([grid, *extras], axis=names.index(dim)) if aligned else grid
        new_grids[label] = (grid, names)
    check_against(plan, lay, fams, old_grids, new_grids, sorted(set(ranks) | set(new)))
    assert plan.index_map == tuple(range(lay.size(dim))) + (None,) * k
    assert plan.admitted == tuple(sorted(new))
    for r in new:
        assert plan.role(r) == "admitted" and plan.predecessor(r) is None
        assert plan.data_index(r)[0] is None


def test_shrink_then_grow_restores_the_layout():
    lay = Layout(pp=2, dp=4, tp=8)
    shrunk = plan_shrink(lay, [13, 14], topology=Topology(node=8))
    assert shrunk.new_layout.shape == (2, 3, 8) and shrunk.drained == (8, 9, 10, 11, 12, 15)
    assert shrunk.spares == tuple(range(40, 48))
    back = plan_grow(shrunk.new_layout, list(range(8, 16)) + list(range(40, 48)), topology=Topology(node=8))
    # appended at the end, the replica is dp index 3 now: same groups as before for tp and pp
    assert back.new_layout.shape == (2, 4, 8)
    assert back.change("tp").counts() == {"kept": 6, "created": 2, "gone": 0}
    assert back.change("dp").counts() == {"kept": 0, "created": 16, "gone": 16}


# ------------------------------------------------------------------------------ at scale
def test_per_rank_answers_never_build_the_grid():
    """16M ranks (the largest layout): the plan and every per-rank answer use O(ndim + lost)
    arithmetic; the layout's grid is never materialised (it would take 128 MB)."""
    lay = Layout(pp=16, dp=1024, cp=4, tp=256)
    node = Topology(node=8)
    plan = plan_shrink(lay, [lay.rank_at(pp=3, dp=500, cp=1, tp=9)], topology=node, flatten=[("dp", "cp")])
    assert plan.dropped == (500,) and len(plan.drained) == 7
    survivor = lay.rank_at(pp=3, dp=501, cp=1, tp=9)
    assert plan.status(survivor, "tp") == "kept" and plan.status(survivor, ("dp", "cp")) == "created"
    assert plan.new_coords(survivor) == {"pp": 3, "dp": 500, "cp": 1, "tp": 9}
    assert plan.role(lay.rank_at(pp=0, dp=500, cp=0, tp=0)) == "spare"
    assert plan.new_shape() == (16, 1023, 4, 256)
    sub = plan_substitute(lay, [5, 6], list(range(2**24, 2**24 + 8)), topology=node)
    assert (
        sub.status(9, "tp") == "created"
        and sub.status(1, "tp") == "gone"
        and sub.status(300, "tp") == "kept"
        and sub.status(2**24 + 5, "tp") == "created"
    )
    assert sub.new_coords(2**24 + 5) == lay.coords(5)
    assert "_rank_array" not in lay.__dict__  # the cached grid was never computed


# ------------------------------------------------------------------------------ errors
LAY = Layout(pp=2, dp=4, tp=2)


def raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_errors_name_the_value_and_the_rule():
    raises(
        RecoveryError, r"hit every replica of dp \(dp=4: indices 0, 1, 2, 3", plan_shrink, LAY, [0, 2, 4, 6]
    )
    raises(
        RecoveryError,
        "hit every replica of dp .* or share its node",
        plan_shrink,
        LAY,
        [0],
        topology=Topology(node=8),
    )
    raises(RecoveryError, r"lost rank 16 is not in the layout \(ranks 0..15\)", plan_shrink, LAY, [16])
    raises(RecoveryError, "lost names rank 3 twice", plan_shrink, LAY, [3, 3])
    raises(RecoveryError, "lost is empty", plan_shrink, LAY, [])
    raises(RecoveryError, "lost holds rank -1", plan_shrink, LAY, [-1])
    raises(TypeError, "lost must hold int ranks, got 1.0", plan_shrink, LAY, [1.0])
    raises(TypeError, "lost must be a list of ranks", plan_shrink, LAY, 3)
    raises(TypeError, "layout must be a meshgroups.Layout", plan_shrink, "pp=2", [1])
    raises(RecoveryError, "dim 'ep' is not a dim of .*; dims are pp, dp, tp", plan_shrink, LAY, [1], dim="ep")
    raises(RecoveryError, "has no replicate dim .* with dim=", plan_shrink, Layout(pp=2, tp=2), [1])
    raises(RecoveryError, "2 lost ranks need 2 spares, got 1", plan_substitute, LAY, [1, 2], [16])
    raises(
        RecoveryError,
        r"spares rank 5 is already in the layout \(at \{'pp': 0, 'dp': 2, 'tp': 1\}\)",
        plan_substitute,
        LAY,
        [1],
        [5],
    )
    raises(RecoveryError, "spares names rank 17 twice", plan_substitute, LAY, [1], [17, 17])
    raises(
        RecoveryError,
        r"spare node 2 \(ranks 16..23\) is incomplete: ranks 23 are missing",
        plan_substitute,
        LAY,
        [1],
        list(range(16, 23)),
        topology=Topology(node=8),
    )
    raises(
        RecoveryError,
        "2 lost nodes .* need as many whole spare nodes, got 1",
        plan_substitute,
        LAY,
        [1, 9],
        list(range(16, 24)),
        topology=Topology(node=8),
    )
    raises(RecoveryError, "ranks rank 3 is already in the layout", plan_grow, LAY, [3, 20, 21, 22])
    raises(
        RecoveryError,
        "3 ranks do not fill whole replicas of dp: a replica has pp=2 × tp=2 = 4 ranks",
        plan_grow,
        LAY,
        [16, 17, 18],
    )
    raises(
        RecoveryError,
        "put a tp group across nodes .* list the new ranks a whole node at a time",
        plan_grow,
        Layout(dp=2, tp=4),
        [9, 10, 11, 12],
        topology=Topology(node=4),
    )
    expert = LAY.with_views(expert=Layout(pp=2, ep=4, etp=2))
    raises(
        RecoveryError,
        "view expert .* cannot follow a shrink of 'dp': the dropped ranks are not whole slabs",
        plan_shrink,
        LAY.with_views(expert=Layout(pp=2, edp=2, ep=2, etp=2)),
        [4],
    )
    raises(RecoveryError, "view expert .* has no dim 'dp'", plan_grow, expert, [16, 17, 18, 19])
    raises(
        RecoveryError,
        "no group family 'xp' in this plan; families are pp, dp, tp",
        plan_shrink(LAY, [1]).status,
        0,
        "xp",
    )
    raises(
        RecoveryError,
        "subset name 'tp' must be an identifier that is not a dim name",
        plan_shrink,
        LAY,
        [1],
        subsets={"tp": (LAY, "tp")},
    )


def test_a_view_follows_a_shrink_through_its_own_dim():
    """The expert view has no dim named dp; the dropped dense replicas are whole ep slabs."""
    lay = Layout(pp=2, dp=2, tp=4).with_views(expert=Layout(pp=2, ep=8))
    plan = plan_shrink(lay, [1])
    assert plan.new_layout.views["expert"].shape == (2, 4)
    assert plan.change("ep").counts() == {"kept": 0, "created": 2, "gone": 2}
    assert plan.status(4, "ep") == "created" and plan.status(0, "ep") == "gone"


def test_docstring_examples_run():
    import doctest

    from meshgroups.elastic import _plans as elastic
    from meshgroups.elastic import _recovery_plan as _elastic_plan

    for module in (elastic, _elastic_plan):
        result = doctest.testmod(module, extraglobs={"Layout": Layout, "Topology": Topology})
        assert result.failed == 0
    assert doctest.testmod(elastic, extraglobs={"Layout": Layout}).attempted >= 5


def test_a_spare_node_partly_used_leaves_the_rest_idle():
    """A layout starting mid-node (offset 4, nodes of 8): the lost node holds 4 layout ranks, so
    4 ranks of the spare node take their places and the other 4 stay spares."""
    plan = plan_substitute(Layout(dp=2, tp=4, rank_offset=4), [5], range(16, 24), topology=Topology(node=8))
    assert plan.replacements == {4: 20, 5: 21, 6: 22, 7: 23}
    assert plan.spares == (16, 17, 18, 19) and plan.drained == (4, 6, 7)
    assert [plan.role(r) for r in (16, 20, 5, 4, 8)] == ["spare", "admitted", "lost", "drained", "survivor"]
