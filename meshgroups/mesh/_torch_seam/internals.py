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

Names are not enough: torch 2.15 added a field (``_preserve_rank_order``) that its ``__hash__`` and
``__eq__`` read, and every name above was still there. So the seam also checks *completeness*:
``unknown_fields`` compares the fields torch's own constructor assigns (read from its source) with
``CONSTRUCTOR_FIELDS``, the fields ``rooted_mesh.new_mesh`` fills, and ``signature_mismatches``
compares the private methods ``RootedMesh`` overrides with torch's. What neither can see (a field
whose meaning changed) the behavioural self-test in ``self_test`` catches at first use.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Iterable, Sequence

import torch

from meshgroups.errors import TorchInternalsError

#: The torch versions the test suite runs on (``pyproject.toml`` states the same range).
TESTED_TORCH = ("2.13.0", "2.14.1", "2.15.0")

#: Every instance field torch's ``DeviceMesh.__init__`` assigns (2.13 to 2.15), with how
#: ``rooted_mesh.new_mesh`` fills it. A field torch's constructor sets that is not here is a field
#: meshgroups' meshes would lack: ``check`` refuses such a torch by name.
CONSTRUCTOR_FIELDS: dict[str, str] = {
    "_device_type": "the root's device type",
    "_layout": "the mesh's _MeshLayout (slices, flattened and unflattened dims: layout arithmetic)",
    "_rank_map": "the root's rank map, shared by every mesh derived from it",
    "_mesh_dim_names": "the dim names",
    "_root_mesh": "None on a root, else the root",
    "_preserve_rank_order": "torch >= 2.15: whether some dim's ranks do not increase (see new_mesh)",
    "_flatten_rank_map": "RootedMesh's property, derived from _rank_map on first use",
    "_thread_id": "the thread under the 'threaded' backend, else None (as torch)",
    "_flatten_mapping": "an empty dict, filled by register_flattened",
    "_pg_registry": "the groups meshgroups built for the mesh",
    "_dim_group_names": "this rank's group of each dim (empty off the mesh)",
    "_rank": "the global rank",
    "_coordinate_on_dim": "this rank's coordinate, from layout arithmetic (None off the mesh)",
    "_hash": "None: computed by torch's __hash__ on first use",
}

#: The fields every torch the seam supports sets; the others (``_preserve_rank_order``) are
#: written only where this torch's constructor sets them (``present_fields``).
MESH_FIELDS = tuple(f for f in CONSTRUCTOR_FIELDS if f != "_preserve_rank_order")

Requirement = tuple[str, str, str, tuple[str, ...]]

REQUIRED: tuple[Requirement, ...] = (
    ("torch.distributed.distributed_c10d", "_world", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_world.pg_map", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_world.pg_names", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_world.group_count", "attribute", ()),
    ("torch.distributed.distributed_c10d", "_get_default_group", "callable", ()),
    ("torch.distributed.distributed_c10d", "_get_default_store", "callable", ()),
    ("torch.distributed.distributed_c10d", "_hash_ranks_to_str", "params", ("ranks",)),
    # torch 2.15 made it public (``dist.set_timeout``) and deprecated the private one
    *(
        ()
        if hasattr(torch.distributed, "set_timeout")
        else (("torch.distributed.distributed_c10d", "_set_pg_timeout", "params", ("timeout", "group")),)
    ),
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


def _mesh_class() -> type:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


def constructor_fields(cls: type | None = None) -> frozenset[str] | None:
    """The ``self.<field>`` names ``cls.__init__`` assigns (``DeviceMesh`` by default), read from
    its source; ``None`` where no source is shipped (nothing to compare then).

    >>> "_rank_map" in constructor_fields()
    True
    """
    init = getattr(cls or _mesh_class(), "__init__", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    fields: set[str] = set()
    for node in ast.walk(tree):
        targets: Iterable[ast.expr] = ()
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = (node.target,)
        for target in targets:
            for leaf in ast.walk(target):
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == "self"
                ):
                    fields.add(leaf.attr)
    return frozenset(fields)


def unknown_fields(cls: type | None = None) -> list[str]:
    """Fields ``cls``'s constructor sets that ``new_mesh`` does not fill, sorted.

    >>> unknown_fields()
    []
    """
    fields = constructor_fields(cls)
    return sorted(fields - CONSTRUCTOR_FIELDS.keys()) if fields is not None else []


@functools.cache
def present_fields() -> frozenset[str]:
    """The fields of ``CONSTRUCTOR_FIELDS`` this torch's constructor sets (all of them where the
    source cannot be read): what ``new_mesh`` writes."""
    fields = constructor_fields()
    return frozenset(CONSTRUCTOR_FIELDS) if fields is None else frozenset(fields & CONSTRUCTOR_FIELDS.keys())


def _parameters(cls: type, name: str) -> list[inspect.Parameter] | None:
    """The parameters a call through an instance passes (``self`` dropped, unless static)."""
    raw = inspect.getattr_static(cls, name)
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    return parameters if isinstance(raw, staticmethod) else parameters[1:]


def signature_mismatches(ours: type, theirs: type | None = None) -> list[str]:
    """The private methods ``ours`` overrides whose parameters no longer fit ``theirs``' (torch's
    ``DeviceMesh``), as readable strings. torch calls these overrides itself, often positionally
    (2.15's ``_init_process_groups`` got a fifth parameter), so torch's parameters must be ours
    in the same order, and any parameter of ours beyond them must have a default.
    """
    theirs = theirs or _mesh_class()
    out: list[str] = []
    for name, function in vars(ours).items():
        if not (name.startswith("_") and inspect.isfunction(function)) or not hasattr(theirs, name):
            continue
        mine, torch_side = _parameters(ours, name), _parameters(theirs, name)
        if mine is None or torch_side is None:
            continue
        torch_names = [p.name for p in torch_side if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        my_names = [p.name for p in mine if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        extra = [p.name for p in mine[len(torch_names) :] if p.default is inspect.Parameter.empty]
        if my_names[: len(torch_names)] != torch_names or extra:
            out.append(
                f"{theirs.__name__}.{name}({', '.join(torch_names)}) is overridden by "
                f"{ours.__name__}.{name}({', '.join(my_names)})"
            )
    return out


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


def refuse(what: str) -> TorchInternalsError:
    """The error for an untested torch that does not fit: its version, ``what``, the tested ones."""
    return TorchInternalsError(
        f"meshgroups' torch seam does not fit torch {torch.__version__}: {what}. meshgroups is tested "
        f"on torch {', '.join(TESTED_TORCH)} (pyproject.toml: torch>=2.13,<2.16); install one of them, "
        "or see docs/index.md#torch-versions"
    )


def check(table: Sequence[Requirement] = REQUIRED, mesh_class: type | None = None) -> None:
    """Raise ``TorchInternalsError`` when this torch lacks what ``table`` names, or its
    ``DeviceMesh`` constructor (``mesh_class``, for tests) sets a field the seam does not fill.

    Raises:
        TorchInternalsError: naming torch's version, each missing piece or new field and the
            tested versions.
    """
    lacking = missing(table)
    if lacking:
        raise refuse("missing " + "; ".join(lacking))
    new = unknown_fields(mesh_class)
    if new:
        raise refuse(
            f"DeviceMesh's constructor sets {', '.join(new)}, which meshgroups' meshes would lack "
            "(rooted_mesh.new_mesh writes the fields of internals.CONSTRUCTOR_FIELDS)"
        )


def check_overrides(ours: type, theirs: type | None = None) -> None:
    """Raise ``TorchInternalsError`` when a private method ``ours`` overrides no longer has torch's
    parameters (``signature_mismatches``)."""
    mismatched = signature_mismatches(ours, theirs)
    if mismatched:
        raise refuse("torch's parameters changed: " + "; ".join(mismatched))


__all__ = [
    "CONSTRUCTOR_FIELDS",
    "MESH_FIELDS",
    "REQUIRED",
    "TESTED_TORCH",
    "TorchInternalsError",
    "check",
    "check_overrides",
    "constructor_fields",
    "missing",
    "present_fields",
    "refuse",
    "signature_mismatches",
    "unknown_fields",
]
