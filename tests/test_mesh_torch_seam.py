"""The torch seam's check of the private internals it relies on, and the rule that every private
torch name is reached through the seam only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from meshgroups.mesh.torch_seam import internals

ROOT = Path(__file__).resolve().parent.parent


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
    assert "tested on torch 2.13.0 and 2.14.1" in text
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
            if "torch_seam" in path.parts:
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
    assert "torch==2.14.1" in ci and "tools/torch_tests.txt" in ci
    assert all(v in (ROOT / "docs" / "index.md").read_text() for v in internals.TESTED_TORCH)
