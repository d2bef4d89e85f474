"""Where torch 2.13 raises for a misuse, meshgroups raises torch's class with torch's sentence in
its message (after its own explanation), so ``assertRaisesRegex`` written against torch's text —
torch's own DeviceMesh tests, for one — matches meshgroups' error too. One process, torch's
``fake`` backend: each misuse is made on torch's ``init_device_mesh`` mesh and on a meshgroups
mesh, and the pattern torch's tests match must match both messages (so a change of torch's text
shows here first). Also: a list of names slices like a tuple, on root and derived meshes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshgroups import Layout, init_mesh
from meshgroups.errors import torch_says


def _raised(call):
    try:
        call()
    except Exception as exc:  # the class and message are what is compared
        return exc
    raise AssertionError(f"{call} did not raise")


def _same_misuse(theirs, ours, error: type, pattern: str) -> None:
    """torch's call and ours raise ``error``; torch's tests' ``pattern`` matches both messages."""
    expected, got = _raised(theirs), _raised(ours)
    assert isinstance(expected, error), (pattern, expected)
    assert isinstance(got, error), (pattern, type(got).__mro__, got)
    assert re.search(pattern, str(expected)), ("torch's own text changed", pattern, str(expected))
    assert re.search(pattern, str(got)), (pattern, str(got))
    if type(got).__module__.startswith("meshgroups"):
        assert isinstance(got, ValueError), got  # still meshgroups' (ValueError) error, its message first
        assert not str(got).startswith(str(expected)), got


def test_device_index_is_told_before_the_default_group():
    assert not dist.is_initialized()
    _same_misuse(
        lambda: init_device_mesh("cpu:0", (2, 4), mesh_dim_names=("dp", "tp")),
        lambda: init_mesh(Layout(dp=2, tp=4), "cpu:0"),
        RuntimeError,
        "Device type with index is not supported",
    )
    assert "init_mesh needs an initialised default process group" in str(
        _raised(lambda: init_mesh(Layout(dp=2, tp=4), "cpu"))
    )


@pytest.fixture
def fake8():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torch_sentences_in_meshgroups_errors(fake8):
    grid = np.arange(8).reshape(2, 2, 2)
    theirs = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    mg = init_mesh(Layout.from_grid(grid, ("dp", "cp", "tp")))
    ours = mg.mesh
    theirs["dp", "tp"]._flatten()
    ours["dp", "tp"]._flatten()
    lay = Layout(dp=2, tp=4)
    cases = [  # (torch's call, ours, class, the pattern torch's own tests match)
        (
            lambda: init_device_mesh("cpu", (2, 4), mesh_dim_names=["dp", "dp"]),
            lambda: Layout.from_grid(grid.reshape(2, 4), ["dp", "dp"]),
            RuntimeError,
            "Each mesh_dim_name must be unique.",
        ),
        (
            lambda: init_device_mesh("cpu", (8,), mesh_dim_names=["dp", "tp"]),
            lambda: Layout.from_grid(grid.reshape(8), ["dp", "tp"]),
            RuntimeError,
            "mesh_shape and mesh_dim_names should have same length!",
        ),
        (
            lambda: init_device_mesh(
                "cpu", (2, 4), mesh_dim_names=("dp", "tp"), backend_override={"dp": "foo", 0: "bar"}
            ),
            lambda: init_mesh(lay, backend_override={"dp": "foo", 0: "bar"}),
            RuntimeError,
            "Found redundant dim index 0 and name dp in backend_override",
        ),
        (
            lambda: init_device_mesh(
                "cpu", (2, 4), mesh_dim_names=("dp", "tp"), backend_override={"cp": "foo"}
            ),
            lambda: init_mesh(lay, backend_override={"cp": "foo"}),
            RuntimeError,
            r"Found invalid keys in backend_override: got \['cp'\]",
        ),
        (
            lambda: init_device_mesh(
                "cpu", (2, 4), mesh_dim_names=("dp", "tp"), backend_override={42: "bar"}
            ),
            lambda: init_mesh(lay, backend_override={42: "bar"}),
            RuntimeError,
            r"Found invalid keys in backend_override: got \[42\]",
        ),
        (
            lambda: init_device_mesh("cpu:0", (2, 4)),
            lambda: init_mesh(lay, "cpu:0"),
            RuntimeError,
            "Device type with index is not supported",
        ),
        (
            lambda: init_device_mesh("cpu", (16,)),
            lambda: init_mesh(Layout(dp=16)),
            RuntimeError,
            "Mesh should not be bigger than default world size 8, but found 16 ranks!",
        ),
        (
            lambda: theirs._flatten("dp"),
            lambda: ours._flatten("dp"),
            ValueError,
            "dp already exists for submesh of the DeviceMesh",
        ),
        (
            lambda: theirs["cp", "tp"]._flatten("dp_tp"),
            lambda: ours["cp", "tp"]._flatten("dp_tp"),
            ValueError,
            "Flatten mesh with mesh_dim_name dp_tp has been created before",
        ),
        (
            lambda: theirs["tp"]._unflatten(0, (3,), ("a",)),
            lambda: ours["tp"]._unflatten(0, (3,), ("a",)),
            ValueError,
            r"The product of mesh_sizes=\(3,\) is 3, but the original dimension at dim=0 has size 2\. "
            "These must be equal for unflatten to work correctly.",
        ),
        (lambda: theirs[("PP",)], lambda: ours[("PP",)], KeyError, "Invalid mesh_dim_name"),
        (lambda: theirs["cp", "dp"], lambda: ours["cp", "dp"], KeyError, "Invalid mesh_dim_names"),
        (
            lambda: theirs["dp_tp", "cp"],
            lambda: ours["dp_tp", "cp"],
            KeyError,
            "Mesh dim indices should be in ascending order",
        ),
        (lambda: theirs["dp", "dp"], lambda: ours["dp", "dp"], RuntimeError, "Slicing overlapping dim_names"),
        (
            lambda: theirs.get_local_rank(),
            lambda: ours.get_local_rank(),
            RuntimeError,
            "Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.",
        ),
    ]
    for their_call, our_call, error, pattern in cases:
        _same_misuse(their_call, our_call, error, pattern)
    # meshgroups' own API, for the same misuse, says torch's sentence too
    assert "already exists for submesh of the DeviceMesh" in str(
        _raised(lambda: mg.flatten("dp", "cp", name="tp"))
    )
    _same_misuse(lambda: theirs["nope"], lambda: mg.submesh("nope"), KeyError, "Invalid mesh_dim_name")
    _same_misuse(
        lambda: theirs["dp", "dp"],
        lambda: mg.submesh("dp", "dp"),
        RuntimeError,
        "Slicing overlapping dim_names",
    )
    mg.close()


def test_list_of_names_slices_like_a_tuple(fake8):
    grid = np.array([[[6, 3], [0, 5]], [[2, 7], [4, 1]]])  # ranks do not increase: mesh order kept
    mg = init_mesh(Layout.from_grid(grid, ("dp", "cp", "tp")), flatten=[("cp", "tp")])
    root = mg.mesh
    assert root[["dp", "cp", "tp"]] is root  # all names: the mesh itself, as for the tuple
    derived = {
        "root": root,
        "slice": root["dp", "tp"],
        "flattened": root["cp_tp"],
        "unflattened": root["tp"]._unflatten(0, (2, 1), ("t1", "t2")),
        "flattened, unflattened": root["cp", "tp"]._flatten("ct")._unflatten(0, (2, 2), ("c", "t")),
    }
    for label, mesh in derived.items():
        names = list(mesh.mesh_dim_names)
        for pick in ([names[-1]], names[:2] if len(names) > 1 else names, names):
            by_list, by_tuple = mesh[pick], mesh[tuple(pick)]
            assert by_list == by_tuple and by_list.mesh_dim_names == tuple(pick), (label, pick)
            assert by_list.get_coordinate() == by_tuple.get_coordinate(), (label, pick)
            assert by_list._dim_group_names == by_tuple._dim_group_names, (label, pick)
    # what is no list of names is still refused as torch would (a KeyError), saying why
    for bad in ([0], [b"dp"], ["dp", 1]):
        error = _raised(lambda bad=bad: root[bad])
        assert isinstance(error, KeyError) and "tuple (or list) of str" in str(error), error
    mg.close()


def test_torch_says_keeps_our_words_first():
    text = torch_says("duplicate dim name 'dp'", "Each mesh_dim_name must be unique.")
    assert text == "duplicate dim name 'dp' [torch: Each mesh_dim_name must be unique.]"
