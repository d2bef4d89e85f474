"""The private torch internals this seam relies on, checked once before any of them is used.

The seam builds DeviceMesh objects from torch's private fields and swaps c10d's private state
(see the package docstring). A torch release that renames one of them would otherwise break
far from the cause: a half-built mesh, a group created under the wrong name. ``check()`` runs
when the seam is first imported and raises ``TorchInternalsError`` naming the torch version,
the missing piece and the versions meshgroups is tested on.

The table is data: ``(module, attribute path, kind)``; a kind of ``"field"`` names an instance
field that ``DeviceMesh`` sets in its own source (there is no instance to look at before a
process group exists), ``"callable"`` one that must be callable, ``"params"`` a callable whose
parameters must include the names given.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence

import torch

#: The torch versions the test suite runs on (``pyproject.toml`` states the same range).
TESTED_TORCH = ("2.13.0", "2.14.1")

#: DeviceMesh's instance fields that ``rooted_mesh.new_mesh`` writes as torch 2.13's
#: constructor does.
MESH_FIELDS = (
    "_device_type",
    "_layout",
    "_rank_map",
    "_mesh_dim_names",
    "_root_mesh",
    "_flatten_mapping",
    "_dim_group_names",
    "_coordinate_on_dim",
)

Requirement = tuple[str, str, str, tuple[str, ...]]

REQUIRED: tuple[Requirement, ...] = (
    ("torch.distributed.distributed_c10d", "_world", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_world.pg_map", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_world.pg_names", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_world.group_count", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_get_default_group", "callable", ()),
    ("torch.distributed.distributed_c10d", "_get_default_store", "callable", ()),
    ("torch.distributed.distributed_c10d", "_hash_ranks_to_str", "params", ("ranks",)),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "params", ("timeout", "group")),
    ("torch._C._distributed_c10d", "Backend.Options", "attribute", ()),
    ("torch.distributed._mesh_layout", "_MeshLayout", "callable", ()),
    ("torch.distributed._mesh_layout", "_MeshLayout.from_sizes_strides", "callable", ()),
    ("torch.distributed._mesh_layout", "_MeshLayout.collapse", "callable", ()),
    ("torch.distributed._mesh_layout", "_MeshLayout.remap_to_tensor", "callable", ()),
    ("torch.distributed.device_mesh", "_normalize_backend_override", "callable", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._get_root_mesh", "callable", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._init_process_groups", "callable", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._get_slice_mesh_layout", "callable", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", "callable", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten", "callable", ()),
    ("torch.distributed.tensor.placement_types", "_StridedShard", "callable", ()),
    *(("torch.distributed.device_mesh", f"DeviceMesh.{f}", "field", ()) for f in MESH_FIELDS),
)


class TorchInternalsError(ImportError):
    """This torch lacks a private piece meshgroups' torch seam relies on."""


def _resolve(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing(table: Sequence[Requirement] = REQUIRED) -> list[str]:
    """What of ``table`` this torch lacks, as ``module.path (why)`` strings; empty when all is there."""
    out: list[str] = []
    for module, path, kind, params in table:
        where = f"{module}.{path}"
        if kind == "field":
            cls_path, field = path.rsplit(".", 1)
            try:
                source = inspect.getsource(_resolve(module, cls_path))  # type: ignore[arg-type]
            except (ImportError, AttributeError) as e:
                out.append(f"{module}.{cls_path} ({type(e).__name__}: {e})")
                continue
            except (OSError, TypeError):
                continue  # no source shipped: nothing to read, nothing refused
            if f"self.{field}" not in source:
                out.append(f"{where} (DeviceMesh no longer sets this field)")
            continue
        try:
            obj = _resolve(module, path)
        except (ImportError, AttributeError) as e:
            out.append(f"{where} ({type(e).__name__}: {e})")
            continue
        if kind in ("callable", "params") and not callable(obj):
            out.append(f"{where} (not callable)")
        elif kind == "params":
            try:
                names = set(inspect.signature(obj).parameters)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                continue
            lacking = [p for p in params if p not in names]
            if lacking:
                out.append(f"{where} (its parameters {sorted(names)} lack {lacking})")
    return out


def check(table: Sequence[Requirement] = REQUIRED) -> None:
    """Raise ``TorchInternalsError`` when this torch lacks what ``table`` names.

    Raises:
        TorchInternalsError: naming torch's version, each missing piece and the tested versions.
    """
    lacking = missing(table)
    if lacking:
        raise TorchInternalsError(
            f"meshgroups' torch seam does not fit torch {torch.__version__}: missing "
            + "; ".join(lacking)
            + f". meshgroups is tested on torch {' and '.join(TESTED_TORCH)} (pyproject.toml: "
            "torch>=2.13,<2.15); install one of them, or see docs/index.md#torch-versions"
        )


__all__ = ["MESH_FIELDS", "REQUIRED", "TESTED_TORCH", "TorchInternalsError", "check", "missing"]
