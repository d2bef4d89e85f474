"""Every import path the README, the docs, the CHANGELOG and the notebooks have shown still
resolves, to the object that lives in the restructured package (issue 36): users have code
against these paths. No process, no torch collective: imports and attribute lookups only."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Paths the CHANGELOG names as gone or renamed in their own entry (history, not an API).
HISTORY = {"meshgroups._checks", "meshgroups.md"}

# Where each path shown before the restructuring (0.4.0) lives now; the old path must give the
# very object of the new one.
MOVED = {
    "meshgroups.recover.rebuild": "meshgroups.elastic.recover.rebuild",
    "meshgroups.recover.mesh_options": "meshgroups.elastic.recover.mesh_options",
    "meshgroups.heal.fill_replicas": "meshgroups.elastic.heal.fill_replicas",
    "meshgroups.heal.training_state": "meshgroups.elastic.heal.training_state",
    "meshgroups.verdict.agree_lost": "meshgroups.elastic.verdict.agree_lost",
    "meshgroups.cohort.use_cohort": "meshgroups.mesh.cohort.use_cohort",
    "meshgroups.cohort.current_cohort": "meshgroups.mesh.cohort.current_cohort",
    "meshgroups.collective.publish_refusal": "meshgroups.mesh.collective.publish_refusal",
    "meshgroups.collective.collective_call": "meshgroups.mesh.collective.collective_call",
    "meshgroups.placement.MAX_BRANCHING": "meshgroups.layout.placement.MAX_BRANCHING",
    "meshgroups.checks.is_int": "meshgroups.layout.checks.is_int",
    "meshgroups.demo.MAX_PROCESSES": "meshgroups.cli.demo.MAX_PROCESSES",
    "meshgroups.widgets.layout_explorer": "meshgroups.render.widgets.layout_explorer",
    "meshgroups.elastic.plan_shrink": "meshgroups.elastic.plans.plan_shrink",
    "meshgroups.elastic.RecoveryPlan": "meshgroups.elastic.recovery_plan.RecoveryPlan",
    "meshgroups.render.text": "meshgroups.render.formats.text",
    "meshgroups.render.plot": "meshgroups.render.formats.plot",
    "meshgroups.mesh.init_mesh": "meshgroups.mesh.mesh_groups.init_mesh",
    "meshgroups.mesh.MeshGroups": "meshgroups.mesh.mesh_groups.MeshGroups",
    "meshgroups.cli.main": "meshgroups.cli.app.main",
    "meshgroups.transfer.sync.WeightSync": "meshgroups.transfer.WeightSync",
    "meshgroups.transfer.jobs.init_job": "meshgroups.transfer.init_job",
    "meshgroups.transfer.execute.execute": "meshgroups.transfer.execute",
    "meshgroups.transfer.Plan": "meshgroups.transfer.TransferPlan",
    "meshgroups.GroupSpec": "meshgroups.mesh.plan.GroupSpec",
    "meshgroups.RanksLost": "meshgroups.RanksLostError",
    "meshgroups.StepFailed": "meshgroups.StepFailedError",
    "meshgroups.Excluded": "meshgroups.ExcludedError",
}


def _resolve(path: str) -> object:
    """The object at a dotted path, as Python's attribute access sees it: a package's attribute
    (``meshgroups.transfer.execute``, the function) before a submodule of the same name; where
    attributes run out, the longest importable module and attributes from there
    (``meshgroups.transfer.execute.execute``, as ``from ... import`` reads it)."""
    parts = path.split(".")
    obj: object = importlib.import_module(parts[0])
    try:
        for i, part in enumerate(parts[1:], 1):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                obj = importlib.import_module(".".join(parts[: i + 1]))
        return obj
    except ImportError as exc:
        if exc.name and not exc.name.startswith("meshgroups"):
            raise  # an optional dependency (vLLM): the caller skips

    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def _shown_paths() -> list[tuple[str, str]]:
    """(where, dotted path) for every ``meshgroups.x.y`` and every name of a
    ``from meshgroups.x import a, b`` the pages and notebooks show."""
    texts = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in PAGES]
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text())["cells"]
        texts.append((nb.relative_to(ROOT).as_posix(), "\n".join("".join(c["source"]) for c in cells)))
    found: dict[str, str] = {}
    for where, text in texts:
        for module, names in re.findall(r"from (meshgroups[\w.]*) import ([\w, ]+)", text):
            for name in (n.strip().split(" as ")[0] for n in names.split(",")):
                if name:
                    found.setdefault(f"{module}.{name}", where)
        for path in re.findall(r"\b(meshgroups(?:\.\w+)+)", text):
            found.setdefault(path.rstrip("."), where)
    return sorted((where, path) for path, where in found.items() if path not in HISTORY)


SHOWN = _shown_paths()


def test_the_pages_show_many_paths():
    assert len(SHOWN) > 60, len(SHOWN)


@pytest.mark.parametrize("where,path", SHOWN, ids=[p for _, p in SHOWN])
def test_every_shown_path_resolves(where, path):
    try:
        obj = _resolve(path)
    except ImportError as exc:
        if exc.name and not exc.name.startswith("meshgroups"):
            pytest.skip(f"{path} needs the optional {exc.name}")
        pytest.fail(f"{where} shows {path}, which no longer resolves: {exc!r}")
    except AttributeError as exc:
        pytest.fail(f"{where} shows {path}, which no longer resolves: {exc!r}")
    if inspect.isclass(obj) or inspect.isfunction(obj):
        # the object is the one its defining module holds: an alias, not a copy
        home = importlib.import_module(obj.__module__)
        assert getattr(home, obj.__qualname__.split(".")[0], None) is not None, path


@pytest.mark.parametrize("old,new", sorted(MOVED.items()), ids=sorted(MOVED))
def test_a_moved_path_gives_the_same_object_as_its_new_home(old, new):
    assert _resolve(old) is _resolve(new)


def test_the_old_error_names_are_the_new_classes():
    import meshgroups

    with pytest.raises(meshgroups.RanksLost):
        raise meshgroups.RanksLostError("r", lost=(3,))
    assert issubclass(meshgroups.RanksLostError, meshgroups.StepFailed)
