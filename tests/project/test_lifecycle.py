"""One lifecycle for every object holding process groups (``meshgroups._lifecycle.Closeable``),
one error class per kind in ``meshgroups.errors``, and one options value end to end — checked on
torch's fake backend (no process)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import meshgroups.errors
from meshgroups import ClosedError, Layout, MeshOptions, init_mesh
from meshgroups._lifecycle import Closeable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_object_holding_groups_is_a_closeable():
    from meshgroups.elastic import Elastic
    from meshgroups.mesh import MeshGroups
    from meshgroups.transfer import Job, TransferGroups, WeightSync

    for cls in (MeshGroups, Elastic, Job, TransferGroups, WeightSync):
        assert issubclass(cls, Closeable), cls
        # no hand-written lifecycle beside the base's: only _release (and a typed __enter__)
        assert "close" not in vars(cls) and "__exit__" not in vars(cls) and "closed" not in vars(cls), cls


def test_a_mesh_closes_once_counts_its_groups_and_refuses_use_after(fake_world):
    with init_mesh(Layout(dp=2, tp=2), check=False) as mg:
        assert not mg.closed
        assert mg.group("tp") is not None
    assert mg.closed
    assert mg.close() == 0  # idempotent: nothing left to destroy
    for use in (lambda: mg.group("tp"), lambda: mg.mesh, lambda: mg.submesh("tp")):
        with pytest.raises(ClosedError, match=r"this MeshGroups was closed \((group\(\)|mesh|submesh\(\))"):
            use()
    assert issubclass(ClosedError, RuntimeError)  # what `except RuntimeError` caught before 0.5


def test_close_returns_what_it_destroyed(fake_world):
    mg = init_mesh(Layout(dp=2, tp=2), check=False)
    assert mg.close() > 0


def test_every_error_class_lives_in_errors_and_is_named_error():
    offenders = []
    for path in sorted((ROOT / "meshgroups").rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                "Error" in ast.unparse(b) or "Exception" in ast.unparse(b) for b in node.bases
            ):
                offenders.append(f"{path.relative_to(ROOT)}: class {node.name}")
    assert not offenders, offenders
    for name, obj in vars(meshgroups.errors).items():
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == "meshgroups.errors":
            assert name.endswith("Error"), name
            assert name in meshgroups.errors.__all__, name


def test_one_options_value_is_accepted_wherever_groups_are_built(fake_world):
    from meshgroups.elastic import Elastic
    from meshgroups.engines import TransferWorld
    from meshgroups.transfer import WeightSync, init_job

    for call in (init_mesh, init_job, Elastic, WeightSync, TransferWorld):
        assert "options" in inspect.signature(call).parameters, call
    options = MeshOptions(timeout=30)
    job = init_job({"a": Layout(dp=2, tp=2)}, options=options.replace(check=False))
    assert job.options.timeout == 30 and job["a"].options.timeout is not None
    job.close()
    with pytest.raises(TypeError, match="not both"):
        init_job({"a": Layout(dp=2, tp=2)}, options=options, timeout=5, check=False)
