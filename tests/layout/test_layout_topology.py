"""Topology levels, spans, placing dims on a machine, reading groups and DeviceMeshes back."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshgroups import Layout, LayoutError, Topology, init_mesh, layout_of
from meshgroups.render._formats import span_table

from ..support.timing import scaled

NAMES = ("pp", "dp", "cp", "tp")


def test_topology_levels_and_errors():
    t = Topology(node=8, domain=32)
    assert t.levels == (("node", 8), ("domain", 32)) and t.names == ("node", "domain")
    assert Topology.parse("node=8, domain=32") == t and repr(t) == "Topology(node=8, domain=32)"
    for kwargs, message in [
        ({}, "at least one level"),
        ({"node": 0}, "level node=0 must be between 1"),
        ({"node": 8, "domain": 12}, "domain=12 must be a multiple of the level below it, node=8"),
        ({"node": 8, "rack": 8}, "rack=8 must be a multiple"),
        ({"world": 8}, "'world' is the level above every other"),
        ({"node": 2.5}, "must be an int"),
    ]:
        with pytest.raises((LayoutError, TypeError), match=message):
            Topology(**kwargs)
    with pytest.raises(LayoutError, match="unknown level 'rack'; levels are node, domain"):
        t.size("rack")
    with pytest.raises(LayoutError, match="name=size separated by commas"):
        Topology.parse("node:8")


def test_span_and_crossings():
    t = Topology(node=8, domain=32)
    lay = Layout(pp=4, dp=8, cp=2, tp=8)
    assert [lay.span(d, topology=t) for d in lay.names] == ["world", "world", "domain", "node"]
    assert lay.span("cp", "tp", topology=t) == "domain" and lay.span(topology=t) == "node"  # every rank alone
    assert t.crossings(lay.groups("cp")) == {"node": 256, "domain": 0}
    # node_locality is the one-level case
    one = Topology(node=8)
    for d in lay.names:
        intra = lay.node_locality(d, ranks_per_node=8) == "intra"
        assert intra == (lay.span(d, topology=one) == "node")
    table = span_table(lay, t)
    assert "cp   2     domain  256     256         0" in table
    with pytest.raises(TypeError, match="topology must be a meshgroups.Topology"):
        lay.span("tp", topology={"node": 8})


@st.composite
def layouts(draw, permuted=True):
    n = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    lay = Layout(dict(zip(NAMES, sizes)))
    if permuted and draw(st.booleans()):
        perm = draw(st.permutations(range(lay.world_size)))
        lay = Layout.from_grid(np.array(perm).reshape(lay.shape), lay.names)
    return lay


def _as_sets(rows):
    return sorted(tuple(sorted(r)) for r in rows)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.permutations(NAMES))
def test_infer_reads_any_layout_back(lay, order):
    families = {d: lay.groups(d).tolist() for d in order if d in lay.names}
    got = Layout.infer(families)
    for d, rows in families.items():
        assert _as_sets(got.groups(d).tolist()) == _as_sets(rows), d
    if lay.is_row_major and len(set(lay.shape)) == lay.ndim and min(lay.shape) > 1:
        assert got == lay  # distinct sizes: the dim order is recovered too


def test_infer_errors_name_the_family():
    with pytest.raises(LayoutError, match="family 'dp' is not a factor of the others: its group"):
        Layout.infer({"tp": [[0, 1], [2, 3]], "dp": [[0, 1], [2, 3]]})
    with pytest.raises(LayoutError, match=r"tp=2 × dp=4 = 8 do not multiply to the 4 ranks"):
        Layout.infer({"tp": [[0, 1], [2, 3]], "dp": [[0, 1, 2, 3]]})
    with pytest.raises(LayoutError, match="family 'dp' does not cover the same 4 ranks"):
        Layout.infer({"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 4]]})
    with pytest.raises(LayoutError, match="equal-sized lists of integer ranks"):
        Layout.infer({"tp": [[0, 1], [2]]})
    with pytest.raises(TypeError, match="mapping of family name"):
        Layout.infer([[0, 1]])
    # size-1 families are dims of size 1
    lay = Layout.infer({"tp": [[0, 1], [2, 3]], "cp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]]})
    assert lay.size("cp") == 1 and _as_sets(lay.groups("dp").tolist()) == [(0, 2), (1, 3)]


def _spans(lay, topology, dims):
    levels = [*topology.names, "world"]
    return tuple(levels.index(lay.span(d, topology=topology)) for d in dims)


def _brute_force(sizes, topology, dims):
    """Every arrangement of the dims' prime factors in the rank index (innermost first):
    the lexicographically best span vector for ``dims``."""
    names = list(sizes)
    pieces = []
    for name in names:
        n, p = sizes[name], 2
        while n > 1:
            while n % p == 0:
                pieces.append((name, p))
                n //= p
            p += 1
    best = None
    for order in set(itertools.permutations(range(len(pieces)))):
        flat = [pieces[i] for i in order]  # innermost first
        strides, stride = [], 1
        for _, size in flat:
            strides.append(stride)
            stride *= size
        coords = {name: [] for name in names}
        for (name, size), s in zip(flat, strides):
            coords[name].append((size, s))
        # a dim's coordinate: its pieces, inner first; the grid follows
        grids = []
        for name in names:
            values = np.zeros(1, dtype=np.int64)
            for size, s in coords[name]:
                values = (values[None, :] + (np.arange(size) * s)[:, None]).ravel()
            grids.append(np.sort(values))
        grid = np.zeros([sizes[n] for n in names], dtype=np.int64)
        for axis, values in enumerate(grids):
            shape = [1] * len(names)
            shape[axis] = len(values)
            grid = grid + values.reshape(shape)
        lay = Layout.from_grid(grid, names)
        vector = _spans(lay, topology, dims)
        best = vector if best is None or vector < best else best
    return best


@st.composite
def machines(draw):
    node = draw(st.sampled_from([2, 4, 8]))
    domain = node * draw(st.sampled_from([2, 4]))
    world = domain * draw(st.sampled_from([1, 2]))
    sizes, left = {}, world
    for name in NAMES[:3]:
        divisors = [d for d in (1, 2, 4, 8) if left % d == 0]
        sizes[name] = draw(st.sampled_from(divisors))
        left //= sizes[name]
    sizes["tp"] = left
    fast = draw(st.permutations(list(sizes)))
    return sizes, Topology(node=node, domain=domain), fast[: draw(st.integers(1, 4))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines())
def test_place_covers_every_rank_and_is_as_local_as_brute_force(machine):
    sizes, topology, fast = machine
    lay = Layout.place(sizes, topology, fast_first=fast)
    world = int(np.prod(list(sizes.values())))
    assert lay.names == tuple(sizes) and lay.shape == tuple(sizes.values())
    assert sorted(lay.grid.ravel().tolist()) == list(range(world))  # every rank exactly once
    assert _spans(lay, topology, fast) <= _brute_force(sizes, topology, fast)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines(), st.sampled_from(["node", "domain"]), st.data())
def test_place_honours_require_or_says_why(machine, level, data):
    sizes, topology, fast = machine
    dim = data.draw(st.sampled_from(list(sizes)))
    try:
        lay = Layout.place(sizes, topology, fast_first=fast, require={dim: level})
    except LayoutError as exc:
        assert f"{dim}={sizes[dim]} cannot stay inside a {level}" in str(exc)
        assert _brute_force(sizes, topology, [dim])[0] > topology.names.index(level)  # truly impossible
        return
    assert [*topology.names, "world"].index(lay.span(dim, topology=topology)) <= topology.names.index(level)


def test_place_splits_a_dim_across_levels_like_jax_hybrid_mesh():
    t = Topology(node=8)
    lay = Layout.place({"dp": 4, "tp": 16}, t, fast_first=["tp"])
    assert lay.groups("tp")[0].tolist() == list(range(16))  # 8 inside a node, the outer 2 across
    assert lay.span("tp", topology=t) == "world" and lay.is_affine
    lay = Layout.place({"pp": 2, "dp": 4, "tp": 4}, Topology(node=8), fast_first=["tp", "dp"])
    assert lay.span("tp", topology=Topology(node=8)) == "node"
    assert lay.groups("dp")[0].tolist() == [0, 4, 8, 12]  # dp: 2 inside the node, 2 across
    for bad, message in [
        (
            lambda: Layout.place({"tp": 16, "dp": 4}, t, require={"tp": "node"}),
            "tp=16 cannot stay inside a node",
        ),
        (lambda: Layout.place({"tp": 8}, t, fast_first=["xp"]), "fast_first names 'xp'"),
        (lambda: Layout.place({"tp": 8}, t, require={"tp": "rack"}), "unknown level 'rack'"),
        (lambda: Layout.place({"tp": 12}, t), "not a whole number of units of 8 ranks"),
        (lambda: Layout.place({}, t), "non-empty mapping"),
    ]:
        with pytest.raises((LayoutError, TypeError), match=message):
            bad()


@pytest.fixture
def fake_world():
    def start(rank, world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("permuted", [False, True])
def test_layout_of_reads_device_meshes_back(fake_world, permuted):
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(5, 16)
    mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=("pp", "dp", "tp"))
    assert layout_of(mesh) == Layout(pp=2, dp=2, tp=4)
    assert layout_of(mesh["tp"]) == Layout.from_grid([4, 5, 6, 7], ("tp",))  # this rank's slice
    lay = Layout(pp=2, dp=2, tp=4)
    if permuted:
        lay = Layout.from_grid(np.random.default_rng(0).permutation(16).reshape(2, 2, 4), ("pp", "dp", "tp"))
    mg = init_mesh(lay, flatten=[("dp", "tp")])
    assert layout_of(mg.mesh) == lay
    assert layout_of(mg.mesh["dp_tp"]) == Layout.from_grid(lay.group_of(5, "dp", "tp"), ("dp_tp",))
    with pytest.raises(TypeError, match="takes a torch DeviceMesh"):
        layout_of(lay)


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "meshgroups", *args], capture_output=True, text=True, timeout=scaled(120)
    )


@pytest.mark.processes
def test_cli_place_show_topology_and_from_json(tmp_path):
    out = cli(
        "place", "pp=4", "dp=8", "cp=2", "tp=8", "--topology", "node=8,domain=32", "--fast-first", "tp,cp"
    )
    assert out.returncode == 0, out.stderr
    assert "tp   8     node" in out.stdout and "cp   2     domain" in out.stdout
    out = cli("place", "tp=16", "dp=4", "--topology", "node=8", "--require", "tp=node")
    assert out.returncode == 2 and "tp=16 cannot stay inside a node" in out.stderr
    out = cli("show", "pp=4", "dp=8", "tp=8", "--topology", "node=8,domain=64")
    assert out.returncode == 0 and "leave domain" in out.stdout
    lay = Layout.from_grid(np.random.default_rng(1).permutation(16).reshape(2, 4, 2), ("pp", "dp", "tp"))
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({d: lay.groups(d).tolist() for d in ("tp", "dp", "pp")}))
    out = cli("show", "--from-json", str(groups), "--json", "--full")
    assert out.returncode == 0, out.stderr
    back = Layout.from_dict(json.loads(out.stdout)["layout"])
    for d in lay.names:
        assert _as_sets(back.groups(d).tolist()) == _as_sets(lay.groups(d).tolist())
    groups.write_text(json.dumps({"tp": [[0, 1], [2, 3]], "dp": [[0, 1], [2, 3]]}))
    out = cli("show", "--from-json", str(groups))
    assert out.returncode == 2 and "family 'dp' is not a factor of the others" in out.stderr
    out = cli("show", "--from-json", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "cannot read --from-json" in out.stderr
    out = cli("show", "tp=2", "--topology", "node=8,domain=12")
    assert out.returncode == 2 and "must be a multiple of the level below it" in out.stderr


def test_place_says_whether_its_result_is_a_megatron_order_string():
    from meshgroups.layout._order import megatron_order

    machine = Topology(node=4, domain=8)
    placed = Layout.place({"tp": 4, "dp": 2, "pp": 2}, machine, fast_first=["tp", "dp"])
    order, _ = megatron_order(placed)
    assert order == "tp-dp-pp"
    megatron = Layout.from_order(order, tp=4, dp=2, pp=2)
    for d in placed.names:  # the order string states exactly the placed groups
        assert sorted(map(tuple, placed.groups(d).tolist())) == sorted(
            map(tuple, megatron.groups(d).tolist())
        )
    assert placed.span("tp", topology=machine) == "node"
    assert Layout(tp=4, dp=2, pp=2).span("tp", topology=machine) == "world"  # row-major: across
    split = Layout.place({"dp": 8, "tp": 2}, Topology(node=4), fast_first=["dp", "tp"])
    order, why = megatron_order(split)
    assert order is None and "members of dim dp are not evenly spaced" in why
    assert megatron_order(Layout(a=2))[0] is None
    assert megatron_order(Layout(pp=2, dp=2, cp=1, tp=2))[0] == "tp-dp-pp-cp"


def test_place_search_is_bounded_and_the_result_affine():
    many = {f"d{i}": 4 for i in range(12)}  # 4**12 = 2**24 ranks, 12 ranked dims, 24 levels
    lay = Layout.place(many, Topology(**{f"l{i}": 2**i for i in range(1, 25)}), fast_first=list(many))
    assert lay.is_affine and lay.world_size == 2**24  # built from strides: no 16M-rank grid
