"""The torch seam's check of the private internals it relies on, and the rule that every private
torch name is reached through the seam only."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from meshgroups.mesh._torch_seam import internals

ROOT = Path(__file__).resolve().parents[2]


def test_this_torch_has_everything_the_seam_needs():
    assert internals.missing() == []
    internals.check()


def test_a_missing_field_is_a_clear_error_naming_torch_and_the_piece(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    monkeypatch.delattr(DeviceMesh, "_get_root_mesh")
    with pytest.raises(internals.TorchInternalsError) as err:
        internals.check()
    text = str(err.value)
    assert f"torch {torch.__version__}" in text
    assert "torch.distributed.device_mesh.DeviceMesh._get_root_mesh" in text
    assert "tested on torch 2.13.0, 2.14.1, 2.15.0" in text
    assert isinstance(err.value, ImportError)


def test_a_missing_instance_field_and_a_changed_signature_are_named():
    table = (
        ("torch.distributed.device_mesh", "DeviceMesh._no_such_field", "field", ()),
        ("torch.distributed.distributed_c10d", "_set_pg_timeout", "params", ("timeout", "no_such_param")),
        ("torch.distributed.no_such_module", "x", "attribute", ()),
    )
    lacking = internals.missing(table)
    assert len(lacking) == 3, lacking
    assert "DeviceMesh._no_such_field (DeviceMesh no longer sets this field)" in lacking[0]
    assert "lack ['no_such_param']" in lacking[1]
    assert "ModuleNotFoundError" in lacking[2]


def test_a_field_torchs_constructor_adds_is_refused_at_import_by_name():
    """What torch 2.15 did (``_preserve_rank_order``, read by ``__hash__``): a field the
    constructor sets that ``new_mesh`` does not fill. Names alone passed; this check does not."""
    from torch.distributed.device_mesh import DeviceMesh

    class NewerMesh(DeviceMesh):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._shiny_new_field = True

    assert internals.unknown_fields() == []
    assert internals.unknown_fields(NewerMesh) == ["_shiny_new_field"]
    with pytest.raises(internals.TorchInternalsError) as err:
        internals.check(mesh_class=NewerMesh)
    text = str(err.value)
    assert "DeviceMesh's constructor sets _shiny_new_field" in text and f"torch {torch.__version__}" in text
    # every field this torch's constructor sets is one new_mesh writes
    assert internals.present_fields() == internals.constructor_fields()


def test_an_overridden_method_whose_torch_signature_changed_is_refused_by_name():
    from torch.distributed.device_mesh import DeviceMesh

    from meshgroups.mesh._torch_seam import RootedMesh

    assert internals.signature_mismatches(RootedMesh) == []
    internals.check_overrides(RootedMesh)

    class NewerMesh(DeviceMesh):  # torch gains a parameter RootedMesh does not take
        @staticmethod
        def _init_process_groups(layout, rank_map, mesh_dim_names, backend_override, preserve, fast=False):
            return []

    with pytest.raises(internals.TorchInternalsError) as err:
        internals.check_overrides(RootedMesh, NewerMesh)
    text = str(err.value)
    assert (
        "NewerMesh._init_process_groups(layout, rank_map, mesh_dim_names, backend_override, preserve, fast)"
        in text
    )
    assert "is overridden by RootedMesh._init_process_groups(layout, rank_map" in text

    class Renamed(RootedMesh):  # an override whose parameters moved
        def _flatten(self, backend_override=None, mesh_dim_name=None):
            return self

    (problem,) = internals.signature_mismatches(Renamed, RootedMesh)
    assert "_flatten(mesh_dim_name, backend_override)" in problem
    assert "Renamed._flatten(backend_override, mesh_dim_name)" in problem


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=4, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_self_test_passes_here_and_reads_a_wrong_rank_map_and_a_missing_field(fake_world):
    from meshgroups.mesh._torch_seam import behaviour, rooted_mesh

    assert behaviour.differences() == []

    def reversed_rank_map(*args, **kwargs):
        args = list(args)
        args[2] = args[2].flip(0)
        return rooted_mesh.new_mesh(*args, **kwargs)

    problems = behaviour.differences(reversed_rank_map)
    assert (
        "[[2, 0, 1], [5, 3, 4]]: the root: the meshgroups mesh holds ranks [[4, 3, 5], [1, 0, 2]], "
        "Layout says [[2, 0, 1], [5, 3, 4]]" in problems
    )
    assert (
        "[[0, 1, 2], [3, 4, 5]]: the root: a meshgroups mesh is not equal to torch's mesh over the same ranks"
        in problems
    )

    def without(field):
        def make(*args, **kwargs):
            mesh = rooted_mesh.new_mesh(*args, **kwargs)
            del mesh.__dict__[field]
            return mesh

        return make

    # torch 2.15's field, where this torch has it; a field every torch's hash reads, anyway
    field = "_preserve_rank_order" if "_preserve_rank_order" in internals.present_fields() else "_layout"
    problems = behaviour.differences(without(field))
    assert any("raised AttributeError" in p and field in p for p in problems), problems


def test_the_self_test_refuses_by_name_when_it_fails(fake_world, monkeypatch):
    from meshgroups.mesh._torch_seam import behaviour

    monkeypatch.setattr(behaviour, "differences", lambda: ["the root: an example difference"])
    behaviour.self_test.cache_clear()
    try:
        with pytest.raises(
            internals.TorchInternalsError, match="self-test failed: the root: an example difference"
        ):
            behaviour.self_test()
    finally:
        behaviour.self_test.cache_clear()


def test_a_meshgroups_mesh_equals_the_torch_mesh_with_the_same_groups(fake_world):
    """Row-major layouts equal torch's default mesh; permuted ones torch >= 2.15's
    ``preserve_rank_order=True`` mesh (whose groups keep mesh order, as meshgroups' do)."""
    import inspect

    from torch.distributed.device_mesh import DeviceMesh

    from meshgroups import Layout, init_mesh

    for layout, permuted in (
        (Layout(a=2, b=4), False),
        (Layout.from_grid([[1, 0, 3, 2], [5, 4, 7, 6]], ("a", "b")), True),
    ):
        mg = init_mesh(layout, check=False)
        try:
            extra = {}
            if "preserve_rank_order" in inspect.signature(DeviceMesh.__init__).parameters:
                extra["preserve_rank_order"] = permuted
                assert mg.mesh._preserve_rank_order is permuted
                assert mg.mesh["b"]._preserve_rank_order is permuted  # slices inherit, as in torch
            twin = DeviceMesh("cpu", layout.grid, mesh_dim_names=("a", "b"), _init_backend=False, **extra)
            assert mg.mesh == twin and hash(mg.mesh) == hash(twin)
            assert {mg.mesh: 1}[twin] == 1  # DTensor's and FSDP2's caches key on exactly this
        finally:
            mg.close()


def test_split_keeps_any_row_order_where_torch_does():
    """torch 2.13's split_group sorts each group's ranks; 2.14 and later keep the list's order."""
    from meshgroups import Layout
    from meshgroups.errors import MeshConfigError
    from meshgroups.mesh._plan import make_plan
    from meshgroups.mesh._strategies import refuse_unsorted
    from meshgroups.mesh._torch_seam import SPLIT_GROUP_SORTS

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert SPLIT_GROUP_SORTS is (version < (2, 14))
    permuted = Layout.from_grid([[1, 0], [3, 2]], ("dp", "tp"))
    specs = make_plan(
        permuted,
        device_type="cpu",
        flatten=(),
        subsets=None,
        only=None,
        backend=None,
        strategy="split",
        gloo_twins=False,
        timeout=timedelta(seconds=60),
    ).specs
    refuse_unsorted(specs, sorts=False)  # a torch that keeps order: nothing refused
    with pytest.raises(MeshConfigError, match=r"split_group sorts ranks, but \[1, 0\] does not increase"):
        refuse_unsorted(specs, sorts=True)


def _private_torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = (node.module or "").split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                found.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {', '.join(names)}"
                )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(p.startswith("_") for p in a.name.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}")
    return found


def test_every_private_torch_import_is_in_the_seam():
    offenders = []
    for folder in ("meshgroups", "compat"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_torch_seam" in path.parts:
                continue
            offenders += _private_torch_imports(path)
    assert offenders == [], offenders


def test_the_second_torchs_test_list_names_existing_files_and_ci_runs_it():
    listed = [
        line.strip()
        for line in (ROOT / "tools" / "torch_tests.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert listed and all((ROOT / p).is_file() for p in listed), [
        p for p in listed if not (ROOT / p).is_file()
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.15.0" in ci and "tools/torch_tests.txt" in ci
    assert all(v in (ROOT / "docs" / "index.md").read_text() for v in internals.TESTED_TORCH)
