"""Every public function and class says what it takes, what it gives and what it raises.

The public names come from ``tools/public_api.py`` (each package's ``__all__`` and every module
without a leading underscore), the same list the API reference is generated from. Two checks,
each failing with the list of names that break it:

- every public function and class has a docstring of its own;
- in the user-facing modules (``USER_MODULES``: the packages and the modules the docs tell users
  to import), every argument is named in the docstring (a class: its docstring and its
  ``__init__``'s), and a function that returns a value says ``return`` somewhere in it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from public_api import USER_MODULES, public_api  # noqa: E402

API = public_api()


def _objects(modules: set[str] | None = None):
    for module, names in API:
        if modules is not None and module not in modules:
            continue
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{module}.{name}", obj


def _doc(obj) -> str:
    doc = obj.__doc__ if inspect.isfunction(obj) else vars(obj).get("__doc__")
    if inspect.isclass(obj) and "__init__" in vars(obj):
        doc = (doc or "") + "\n" + (vars(obj)["__init__"].__doc__ or "")
    return doc or ""


def _arguments(obj) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in sig.parameters.values()
        if p.name not in ("self", "cls")
        and not p.name.startswith("_")
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def test_the_public_api_is_found():
    names = {f"{m}.{n}" for m, ns in API for n in ns}
    assert {"meshgroups.Layout", "meshgroups.init_mesh", "meshgroups.transfer.plan_transfer"} <= names
    assert "meshgroups.transfer.execute" in names and "meshgroups.transfer.WeightSync" in names
    assert "meshgroups.compat.parallel_state.initialize_model_parallel" in names
    assert set(USER_MODULES) <= {m for m, _ in API}, set(USER_MODULES) - {m for m, _ in API}


def test_every_public_function_and_class_has_a_docstring():
    lacking = [name for name, obj in _objects() if not _doc(obj).strip()]
    assert not lacking, f"{len(lacking)} public names lack a docstring:\n" + "\n".join(lacking)


def test_user_facing_docstrings_name_every_argument_and_the_return_value():
    lacking = []
    for name, obj in _objects(set(USER_MODULES)):
        doc = _doc(obj)
        missing = [a for a in _arguments(obj) if not re.search(rf"\b{re.escape(a)}\b", doc)]
        if missing:
            lacking.append(f"{name}: arguments not named: {', '.join(missing)}")
        if inspect.isfunction(obj):
            returns = inspect.signature(obj).return_annotation
            if returns not in (None, "None", inspect.Signature.empty, "NoReturn") and not re.search(
                r"return", doc, re.IGNORECASE
            ):
                lacking.append(f"{name}: the return value is not described")
    assert not lacking, f"{len(lacking)} docstrings are incomplete:\n" + "\n".join(lacking)


# Their examples need a running process group (they say so, or build one): run elsewhere.
NEEDS_PROCESSES = {"meshgroups.mesh._mesh_groups", "meshgroups.compat.process_groups_config"}


def test_the_examples_in_docstrings_run():
    import doctest

    import torch
    from meshgroups.compat import parallel_state

    from meshgroups import Layout, Topology

    failed = []
    for module in [m for m, _ in API if m not in NEEDS_PROCESSES]:
        result = doctest.testmod(
            importlib.import_module(module),
            extraglobs={"Layout": Layout, "Topology": Topology, "torch": torch, "ps": parallel_state},
            optionflags=doctest.ELLIPSIS,
        )
        if result.failed:
            failed.append(f"{module}: {result.failed} of {result.attempted} examples failed")
    assert not failed, "\n".join(failed)
