"""meshgroups' meshes behave as torch's (torch 2.13) for a torch user: real gloo, world 8.

Each placement (row-major and permuted) runs one job with every check:

- meshes that leave ranks out — a 1-D mesh of 4 on 8 ranks, a (1, 1, 1, 1) mesh, a
  ``DeviceMesh("cpu", [0, 2])``-shaped layout, and the same through subsets: every rank gets a
  mesh; a non-member's coordinate is ``None``; DTensor results equal plain torch's on every rank
  (members get the tensor, non-members torch's empty results); ``_flatten``, ``_unflatten`` and
  slicing take part collectively on members and non-members alike;
- ``copy.deepcopy`` / pickle round trips keep ``_flatten``/``_unflatten`` in the building process;
  another process and a closed ``MeshGroups`` are told exactly why not;
- every misuse torch refuses raises, from meshgroups, an error of torch's class for it, whose
  message holds the text torch's own tests match (``assertRaisesRegex``); a list of names
  slices like the tuple;
- ``backend_override`` by name, by index, on ``_flatten`` and ``_unflatten``, with gloo twins, and
  a mismatch on one rank -> ``MismatchError`` on every rank naming ``backend_override``;
- ``group_desc`` of every group is torch's ``mesh_<dim>`` (flattened dims and subsets by name);
- groups torch destroyed itself (``destroy_process_group``; ``DeviceMesh.abort()`` on torch >=
  2.15) are skipped by ``close()``, which releases the rest without raising.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ..support.dist import run

pytestmark = pytest.mark.processes  # every test here starts processes

# ranks do not increase along any dim: torch's sorted groups would permute data here
PERMUTED = np.array([[[6, 3], [0, 5]], [[2, 7], [4, 1]]])
PLACEMENTS = {
    "row_major": {"main": np.arange(8).reshape(2, 2, 2), "quarter": [0, 1, 2, 3], "one": 0, "pair": [0, 2]},
    "permuted": {"main": PERMUTED, "quarter": [6, 3, 0, 5], "one": 5, "pair": [7, 2]},
}


def _raised(call):
    try:
        call()
    except Exception as exc:  # the class is what is compared
        return exc
    return None


def _timeout_s(group):
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _check_group(group, expected, rank):
    import torch
    import torch.distributed as dist

    assert dist.get_process_group_ranks(group) == list(expected)
    assert dist.get_rank(group) == list(expected).index(rank)
    got = [torch.zeros(1, dtype=torch.int64) for _ in expected]
    dist.all_gather(got, torch.tensor([rank]), group=group)
    assert [int(t) for t in got] == list(expected)


def _conform(mesh, grid, rank, names, dtensor=True):
    """``mesh`` (a meshgroups mesh over ``grid``) against torch's own mesh over the same ranks:
    coordinate, groups in mesh order, and (``dtensor``) DTensor results on every rank, member
    or not."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    grid = np.asarray(grid)
    member = rank in grid
    coordinate = tuple(int(c) for c in np.argwhere(grid == rank)[0]) if member else None
    assert mesh.get_coordinate() == coordinate and mesh._is_current_rank_part_of_mesh() == member
    assert mesh.shape == grid.shape and mesh.mesh_dim_names == names
    if member:
        assert mesh.mesh.tolist() == grid.tolist()
        for i in range(grid.ndim):
            index = list(coordinate)
            index[i] = slice(None)
            _check_group(mesh.get_group(i), grid[tuple(index)].tolist(), rank)
    else:
        assert mesh._dim_group_names == []
    if not dtensor:
        return
    # torch's own mesh over the same ranks (sorted: torch is correct there) is the reference
    reference = DeviceMesh("cpu", np.sort(grid.ravel()).reshape(grid.shape), mesh_dim_names=names)
    x = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    placements = [Shard(i % 2) if i < 2 else Replicate() for i in range(grid.ndim)]
    ours, theirs = distribute_tensor(x, mesh, placements), distribute_tensor(x, reference, placements)
    assert torch.equal(ours.full_tensor(), theirs.full_tensor())
    assert torch.equal((ours * 2 + 1).sum().full_tensor(), (theirs * 2 + 1).sum().full_tensor())
    ours_r = ours.redistribute(mesh, [Replicate()] * grid.ndim).to_local()
    assert torch.equal(ours_r, theirs.redistribute(reference, [Replicate()] * grid.ndim).to_local())
    if member:
        assert torch.equal(ours.full_tensor(), x)
        shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
        assert torch.equal(ours.to_local(), x[tuple(slice(o, o + s) for o, s in zip(offset, shape))])
    else:
        assert ours.to_local().numel() == 0 and ours.full_tensor().numel() == 0 and ours.shape == x.shape


def _partial_meshes(rank, p):
    """Meshes that leave ranks out, as layouts and as subsets: coordinate, DTensor, and the
    collective ``_flatten``/``_unflatten``/slicing on members and non-members."""
    import copy
    import pickle

    import torch.distributed as dist

    from meshgroups import Layout, init_mesh

    quarter = np.asarray(p["quarter"])
    mg = init_mesh(Layout.from_grid(quarter, ("x",)), timeout=60, partial=True)
    mesh = mg.mesh
    _conform(mesh, quarter, rank, ("x",))
    _conform(mesh._flatten("x_alias"), quarter, rank, ("x_alias",), dtensor=False)
    assert mesh._flatten("x") is mesh
    split = mesh._unflatten("x", (2, 2), ("x1", "x2"))
    _conform(split, quarter.reshape(2, 2), rank, ("x1", "x2"))
    inner = split["x2"]  # slicing: torch itself raises here on a non-member; ours takes part
    assert inner.get_coordinate() == (
        None if rank not in quarter else (int(np.argwhere(quarter == rank)[0, 0]) % 2,)
    )
    _conform(split["x1", "x2"]._flatten("x12"), quarter, rank, ("x12",), dtensor=False)
    for again in (copy.deepcopy(mesh), pickle.loads(pickle.dumps(mesh))):  # copies, this process
        _conform(again._flatten("x_copy"), quarter, rank, ("x_copy",), dtensor=False)
        _conform(
            again._unflatten(0, (1, 4), ("c1", "c2")),
            quarter.reshape(1, 4),
            rank,
            ("c1", "c2"),
            dtensor=False,
        )
    assert mg.group("x") is (dist.GroupMember.NON_GROUP_MEMBER if rank not in quarter else mesh.get_group())
    assert mg.ranks("x") == (quarter.tolist() if rank in quarter else None)
    mg.close()

    one = np.full((1, 1, 1, 1), p["one"])
    mg = init_mesh(Layout.from_grid(one, ("a", "b", "c", "d")), timeout=60, partial=True)
    mesh = mg.mesh
    _conform(mesh, one, rank, ("a", "b", "c", "d"))
    _conform(mesh["a", "b"]._flatten(), one.reshape(1), rank, ("a_b",), dtensor=False)
    _conform(mesh._flatten(), one.reshape(1), rank, ("a_b_c_d",))
    _conform(mesh["b", "d"], one.reshape(1, 1), rank, ("b", "d"), dtensor=False)
    _conform(
        mesh._unflatten("c", (1, 1), ("c1", "c2")),
        one.reshape(1, 1, 1, 1, 1),
        rank,
        ("a", "b", "c1", "c2", "d"),
    )
    _conform(copy.deepcopy(mesh)["c", "d"]._flatten("cd"), one.reshape(1), rank, ("cd",), dtensor=False)
    # one shared one-rank group, described as torch names the first dim using it
    if rank == p["one"]:
        assert {mg.group(d).group_desc for d in "abcd"} == {"mesh_a"}
    mg.close()

    pair = np.asarray(p["pair"])  # what DeviceMesh("cpu", [0, 2]) is, as a layout
    mg = init_mesh(Layout.from_grid(pair, ("pair",)), timeout=60, partial=True)
    _conform(mg.mesh, pair, rank, ("pair",))
    _conform(mg.mesh._unflatten(0, (2, 1), ("p1", "p2")), pair.reshape(2, 1), rank, ("p1", "p2"))
    mg.close()

    # the same through subsets of a full layout: a 1-D root over the subset's group
    main = Layout.from_grid(p["main"], ("dp", "cp", "tp"))
    subsets = {
        "first": (main.select("dp", [0]), ("cp", "tp")),  # one group of 4
        "pair": (Layout.from_grid(pair, ("pair",)), "pair"),
    }
    mg = init_mesh(main, subsets=subsets, timeout=60)
    first = p["main"][0].ravel()
    for name, grid in (("first", first), ("pair", pair)):
        sub = mg.submesh(name)
        _conform(sub, grid, rank, (name,))
        _conform(sub._flatten(f"{name}_flat"), grid, rank, (f"{name}_flat",), dtensor=False)
        _conform(
            sub._unflatten(0, (2, len(grid) // 2), ("s1", "s2")), grid.reshape(2, -1), rank, ("s1", "s2")
        )
        outside = mg.group(name) == dist.GroupMember.NON_GROUP_MEMBER
        assert outside == (rank not in grid) and (mg.local_rank(name) is None) == (rank not in grid)
    _group_descs(mg)
    mg.close()


def _group_descs(mg):
    """Each group carries torch's description: ``mesh_<label>`` of the first family using it."""
    import torch.distributed as dist

    owner: dict[int, str] = {}
    for family in mg.families:
        dims = (family,) if isinstance(family, str) else family
        group = mg.group(*dims)
        if group == dist.GroupMember.NON_GROUP_MEMBER or group is dist.group.WORLD:
            continue
        label = family if isinstance(family, str) else "_".join(family)
        owner.setdefault(id(group), f"mesh_{label}")
        assert group.group_desc == owner[id(group)], (family, group.group_desc)


def _full_layout(rank, p):
    """The 8-rank layout: copies, torch's misuse classes, backend_override, group_desc."""
    import copy
    import pickle
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshgroups import Layout, MismatchError, init_mesh

    grid = p["main"]
    lay = Layout.from_grid(grid, ("dp", "cp", "tp"))
    mg = init_mesh(lay, flatten=[("dp", "cp")], timeout=60)
    root = mg.mesh
    held = len(mg.cache.groups())
    # copies in this process keep building, in mesh order, reusing equal groups
    twin = copy.deepcopy(root)
    _check_group(twin["dp", "cp"]._flatten("dp_cp_copy").get_group(), lay.group_of(rank, "dp", "cp"), rank)
    assert len(mg.cache.groups()) == held  # the dp_cp group itself
    tp = pickle.loads(pickle.dumps(root["tp"]))
    split = tp._unflatten("tp", (2, 1), ("t1", "t2"))
    _check_group(split["t1"].get_group(), lay.group_of(rank, "tp"), rank)
    assert split["t1"].get_group() is mg.group("tp")  # reused; t2 gets the one-rank group
    ct = root["cp", "tp"]._flatten("ct")
    _check_group(ct.get_group(), lay.group_of(rank, "cp", "tp"), rank)
    assert ct.get_group().group_desc == "mesh_ct"
    # in another process: the mesh says exactly why it cannot build there
    shipped = [pickle.dumps(root["dp", "cp"]) if rank == 0 else None]
    dist.broadcast_object_list(shipped, src=0)
    if rank != 0:
        elsewhere = pickle.loads(shipped[0])
        error = _raised(lambda: elsewhere._flatten("elsewhere"))
        assert isinstance(error, RuntimeError) and "unpickled in process" in str(error), error
        assert isinstance(_raised(lambda: elsewhere._unflatten("dp", (2, 1), ("a", "b"))), RuntimeError)
        assert elsewhere._flatten("dp_cp")._layout == root["dp_cp"]._layout  # registered: no build needed

    # every misuse torch refuses: meshgroups raises an error of torch's class (and its own message)
    torch_mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    torch_mesh["dp", "cp"]._flatten("dc")
    root["dp", "cp"]._flatten("dc")
    for names in (["dp", "tp"], ["tp"]):  # a list of names slices like the tuple, as in torch
        assert root[names] == root[tuple(names)] and root[names].mesh_dim_names == tuple(names)
        assert root[names]._dim_group_names == root[tuple(names)]._dim_group_names
    misuses = {
        "repeated dim names": (
            lambda: init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "dp")),
            lambda: Layout.from_grid(grid.reshape(2, 4), ("dp", "dp")),
            "Each mesh_dim_name must be unique.",
        ),
        "device index": (
            lambda: init_device_mesh("cpu:0", (8,)),
            lambda: init_mesh(lay, "cpu:0"),
            "Device type with index is not supported",
        ),
        "bigger than the world": (
            lambda: init_device_mesh("cpu", (16,)),
            lambda: init_mesh(Layout(dp=16)),
            "Mesh should not be bigger than default world size 8, but found 16 ranks!",
        ),
        "unknown dim": (lambda: torch_mesh["nope"], lambda: root["nope"], "Invalid mesh_dim_name"),
        "unknown dim, meshgroups API": (
            lambda: torch_mesh["nope"],
            lambda: mg.submesh("nope"),
            "Invalid mesh_dim_name",
        ),
        "descending dims": (
            lambda: torch_mesh["tp", "dp"],
            lambda: root["tp", "dp"],
            "Invalid mesh_dim_names",
        ),
        "repeated dim": (
            lambda: torch_mesh["dp", "dp"],
            lambda: root["dp", "dp"],
            "Slicing overlapping dim_names",
        ),
        "repeated dim, meshgroups API": (
            lambda: torch_mesh["dp", "dp"],
            lambda: mg.submesh("dp", "dp"),
            "Slicing overlapping dim_names",
        ),
        "flatten into a root dim": (
            lambda: torch_mesh["dp", "cp"]._flatten("tp"),
            lambda: root["dp", "cp"]._flatten("tp"),
            "tp already exists for submesh of the DeviceMesh",
        ),
        "flatten name taken": (
            lambda: torch_mesh["cp", "tp"]._flatten("dc"),
            lambda: root["cp", "tp"]._flatten("dc"),
            "Flatten mesh with mesh_dim_name dc has been created before",
        ),
        "unflatten sizes": (
            lambda: torch_mesh["tp"]._unflatten(0, (3,), ("a",)),
            lambda: root["tp"]._unflatten(0, (3,), ("a",)),
            "These must be equal for unflatten to work correctly.",
        ),
        "unflatten name count": (
            lambda: torch_mesh["tp"]._unflatten(0, (2, 1), ("a",)),
            lambda: root["tp"]._unflatten(0, (2, 1), ("a",)),
            "mesh_dim_names must have same length as mesh_sizes in _unflatten!",
        ),
        "unflatten dim": (
            lambda: torch_mesh._unflatten(5, (2,), ("a",)),
            lambda: root._unflatten(5, (2,), ("a",)),
            "specified in `_unflatten` is out of range",
        ),
        "unflatten unknown dim": (
            lambda: torch_mesh._unflatten("nope", (2,), ("a",)),
            lambda: root._unflatten("nope", (2,), ("a",)),
            "specified in `_unflatten` is not in",
        ),
        "backend_override twice": (
            lambda: init_device_mesh(
                "cpu", (8,), mesh_dim_names=("dp",), backend_override={0: "gloo", "dp": "gloo"}
            ),
            lambda: init_mesh(lay, backend_override={0: "gloo", "dp": "gloo"}),
            "Found redundant dim index 0 and name dp in backend_override",
        ),
        "backend_override unknown key": (
            lambda: init_device_mesh("cpu", (8,), mesh_dim_names=("dp",), backend_override={"xx": "gloo"}),
            lambda: init_mesh(lay, backend_override={"xx": "gloo"}),
            r"Found invalid keys in backend_override: got \['xx'\]",
        ),
        "backend_override index out of range": (
            lambda: init_device_mesh("cpu", (8,), mesh_dim_names=("dp",), backend_override={3: "gloo"}),
            lambda: init_mesh(lay, backend_override={3: "gloo"}),
            r"Found invalid keys in backend_override: got \[3\]",
        ),
    }
    for name, (theirs, ours, pattern) in misuses.items():
        expected, got = _raised(theirs), _raised(ours)
        assert expected is not None and got is not None, (name, expected, got)
        assert isinstance(got, type(expected)), (name, type(expected).__name__, type(got).__mro__)
        if pattern is not None:  # the text torch's own tests match (assertRaisesRegex) is in ours too
            assert re.search(pattern, str(expected)) and re.search(pattern, str(got)), (name, expected, got)
        if type(got).__module__.startswith("meshgroups"):
            assert isinstance(got, ValueError), name  # still meshgroups' (ValueError) error too

    # backend_override: by name, by index, on _flatten and _unflatten; gloo twins still work
    def options(seconds):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=seconds)
        return opts

    over = init_mesh(
        lay,
        flatten=[("dp", "cp")],
        backend_override={"tp": ("gloo", options(77)), 0: options(55), "dp_cp": "gloo"},
        gloo_twins=True,
        timeout=60,
    )
    assert _timeout_s(over.group("tp")) == 77 and _timeout_s(over.group("dp")) == 55
    assert _timeout_s(over.group("cp")) == 60 and _timeout_s(over.group("dp", "cp")) == 60
    for dims in (("dp",), ("cp",), ("tp",), ("dp", "cp")):
        _check_group(over.group(*dims), lay.group_of(rank, *dims), rank)
        assert over.group(*dims, gloo=True) is over.group(*dims)  # gloo already: the twin is the group
    assert over.group("tp") is not mg.group("tp")  # other options, another group
    flat = over.mesh["cp", "tp"]._flatten("ct33", backend_override=("gloo", options(33)))
    _check_group(flat.get_group(), lay.group_of(rank, "cp", "tp"), rank)
    assert _timeout_s(flat.get_group()) == 33 and flat.get_group().group_desc == "mesh_ct33"
    unflat = over.mesh["dp_cp"]._unflatten(0, (2, 2), ("d", "c"), backend_override={"c": options(22)})
    assert _timeout_s(unflat["c"].get_group()) == 22 and unflat["c"].get_group().group_desc == "mesh_c"
    _check_group(unflat["c"].get_group(), lay.group_of(rank, "cp"), rank)
    _group_descs(over)
    _group_descs(mg)
    over.close()
    # the same call with another override on rank 3: the same MismatchError on every rank
    bad = {"tp": "gloo"} if rank != 3 else {"tp": ("gloo", options(77))}
    error = _raised(lambda: init_mesh(lay, backend_override=bad, timeout=60))
    assert (
        isinstance(error, MismatchError) and error.argument == "backend_override" and error.ranks == (3,)
    ), error
    again = init_mesh(lay, backend_override={"tp": "gloo"}, timeout=60)  # the agreed retry builds
    _check_group(again.group("tp"), lay.group_of(rank, "tp"), rank)
    again.close()

    mg.close()
    for closed in (root, twin):  # a closed MeshGroups: said so, before any collective
        error = _raised(closed["cp", "tp"]._flatten)
        assert isinstance(error, RuntimeError) and "closed" in str(error), error


def _after_torch_destroys(rank, p):
    """Groups torch destroys behind meshgroups' back (the user's ``destroy_process_group``;
    torch >= 2.15's ``DeviceMesh.abort()``, which torch's own ``test_abort_2d_mesh`` calls on a
    meshgroups mesh in tests/support/torch_dm_harness.py): ``close()`` skips them, releases the
    rest, and neither raises nor leaks; the layout builds again afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from meshgroups import Layout, init_mesh
    from meshgroups.mesh._torch_seam import held_group_count

    lay = Layout.from_grid(p["main"], ("dp", "cp", "tp"))
    held = held_group_count()
    mg = init_mesh(lay, flatten=[("dp", "cp")], timeout=60)
    made = held_group_count() - held  # dp, cp, tp and dp_cp: those this rank is a member of
    dist.destroy_process_group(mg.group("tp"))
    assert mg.close() == made - 1 and held_group_count() == held and mg.close() == 0
    if hasattr(DeviceMesh, "abort"):  # torch >= 2.15
        mg = init_mesh(lay, flatten=[("dp", "cp")], timeout=60)
        mesh = mg.mesh
        names = {g.group_name for g in [*mesh.get_all_groups(), mesh["dp_cp"].get_group()]}
        mesh.abort()  # every dim's group and the flattened dim's, torch-side
        assert held_group_count() == held and not names & set(dist.distributed_c10d._world.pg_names.values())
        assert mg.close() == 0 and mg.close() == 0
    again = init_mesh(lay, flatten=[("dp", "cp")], timeout=60)
    for dims in (("dp",), ("tp",), ("dp", "cp")):
        _check_group(again.group(*dims), lay.group_of(rank, *dims), rank)
    again.close()
    assert held_group_count() == held


def worker(rank, world, kind):
    import torch.distributed as dist

    p = PLACEMENTS[kind]
    _partial_meshes(rank, p)
    _full_layout(rank, p)
    _after_torch_destroys(rank, p)
    dist.barrier()
    return True


@pytest.mark.timeout(900)  # a bound on hangs only; a few tens of seconds on an idle machine
@pytest.mark.parametrize("kind", ["row_major", "permuted"])
def test_torch_conformance_world8(kind):
    assert all(run(worker, 8, kind, timeout=600, pg_timeout=120))
