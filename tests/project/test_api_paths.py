"""Old import paths and names (``meshgroups._deprecated``) and the paths the docs teach now.

- Every import path and name the README, the docs, the CHANGELOG and the notebooks of the
  previous release (0.4.1) showed still resolves to the same object, with exactly one
  ``DeprecationWarning`` where it is old (``tests/data/api_paths_0.4.1.json``: each path and
  what it resolved to then, recorded before the restructuring of 0.5.0).
- The table itself, walked entry by entry.
- Every path the pages show *now* resolves with no warning at all: the docs teach only the
  new paths.

No process, no torch collective: imports and attribute lookups only.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
import warnings
from pathlib import Path

import pytest

from meshgroups import _deprecated

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BEFORE = json.loads((ROOT / "tests" / "data" / "api_paths_0.4.1.json").read_text())

# Names the pages mention that are history or not a Python path.
HISTORY = {"meshgroups._checks", "meshgroups.md"}


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


def _forget_aliases() -> None:
    """Drop every alias module (from ``sys.modules`` and from its parent package), so the next
    import of an old path runs (and warns) again."""
    for name in list(sys.modules):
        if name in _deprecated.MODULES:
            alias = sys.modules.pop(name)
            parent, _, child = name.rpartition(".")
            if getattr(sys.modules.get(parent), child, None) is alias:
                delattr(sys.modules[parent], child)


def _resolve_counting(path: str) -> tuple[object, list[warnings.WarningMessage]]:
    _forget_aliases()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = _resolve(path)
    return obj, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def _is_old(path: str) -> bool:
    """Whether resolving ``path`` goes through the table: an old name, or an old module path
    that attribute access does not answer first (``meshgroups.transfer.execute`` is the
    function; ``meshgroups.transfer.execute.Report`` needs the old module)."""
    parts = path.split(".")
    obj: object = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        module, name = ".".join(parts[:i]), parts[i]
        if (module, name) in _deprecated.NAMES:
            return True
        if isinstance(obj, types.ModuleType) and name in getattr(obj, "__all__", ()):
            obj = getattr(obj, name)
            continue
        if f"{module}.{name}" in _deprecated.MODULES or not isinstance(obj, types.ModuleType):
            return any(".".join(parts[:j]) in _deprecated.MODULES for j in range(i, len(parts) + 1))
        try:
            obj = importlib.import_module(f"{module}.{name}")
        except ImportError:
            return False
    return False


# Objects that moved to another package in 0.5.0, beyond the table's renames: the model
# description cost and transfer share.
MOVED_PACKAGE = {"meshgroups.cost.model": "meshgroups.models"}


def _home(module: str) -> str:
    """Where the objects of a 0.4.1 module live now (the table moved them, nothing else)."""
    return _deprecated.MODULES.get(module, module)


@pytest.mark.parametrize("path", sorted(BEFORE), ids=sorted(BEFORE))
def test_a_path_the_previous_release_showed_gives_the_same_object_with_one_warning(path):
    then = BEFORE[path]
    if "error" in then:
        pytest.skip(f"{path} needed an optional dependency when it was recorded: {then['error']}")
    try:
        obj, caught = _resolve_counting(path)
    except ImportError as exc:
        if exc.name and not exc.name.startswith("meshgroups"):
            pytest.skip(f"{path} needs the optional {exc.name}")
        raise
    parts = path.split(".")
    renamed_in_old_module = (".".join(parts[:-1]), parts[-1]) in _deprecated.NAMES and ".".join(
        parts[:-1]
    ) in _deprecated.MODULES
    expected = (
        2 if renamed_in_old_module else 1 if _is_old(path) else 0
    )  # an old module's old name: both warn
    assert len(caught) == expected, [str(w.message) for w in caught]
    if caught:
        assert _deprecated.REMOVED_IN in str(caught[0].message)
    if then["kind"] == "object":
        # the same class or function: defined where the table moved its module (or, moved within
        # its package since, beside it), under the same name
        home = _home(then["module"])
        assert obj.__qualname__ == then["qualname"], path
        moved = MOVED_PACKAGE.get(then["module"])
        assert (
            obj.__module__ == home
            or obj.__module__.rsplit(".", 1)[0] == home.rsplit(".", 1)[0]
            or (moved is not None and obj.__module__.startswith(moved + "."))
        ), path
    elif then["kind"] == "module":
        assert isinstance(obj, types.ModuleType)
        assert _deprecated.MODULES.get(obj.__name__, obj.__name__) == _home(then["name"])
    else:
        assert repr(obj)[:200] == then["repr"]


@pytest.mark.parametrize("old", sorted(_deprecated.MODULES), ids=sorted(_deprecated.MODULES))
def test_every_old_module_path_warns_once_and_answers_with_its_new_homes_objects(old):
    _forget_aliases()
    try:
        new = importlib.import_module(_deprecated.MODULES[old])
    except ImportError as exc:
        if exc.name and not exc.name.startswith("meshgroups"):
            pytest.skip(f"{old} needs the optional {exc.name}")
        raise
    names = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert names
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
        getattr(alias, names[0])  # an old package warns at its first use (see _deprecated._Alias)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1 and old in messages[0] and _deprecated.REMOVED_IN in messages[0], messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # attributes of an alias never warn again
        for name in names:
            assert getattr(alias, name) is getattr(new, name), (old, name)
    assert set(names) <= set(dir(alias))


@pytest.mark.parametrize(
    "key", sorted(_deprecated.NAMES), ids=[f"{m}.{n}" for m, n in sorted(_deprecated.NAMES)]
)
def test_every_old_name_warns_and_is_its_new_object(key):
    module, name = key
    new_module, new_name = _deprecated.NAMES[key]
    obj, caught = _resolve_counting(f"{module}.{name}")
    # an old module's old name: one warning for the module, one for the name
    assert len(caught) == (2 if module in _deprecated.MODULES else 1), [str(w.message) for w in caught]
    assert obj is getattr(importlib.import_module(new_module), new_name)


@pytest.mark.parametrize(
    "statement",
    [
        "import meshgroups.heal",
        "from meshgroups.transfer.execute import Report",
        "from meshgroups import RanksLost",
    ],
)
def test_the_warning_points_at_the_users_line(statement):
    _forget_aliases()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(statement, "user_training_script.py", "exec"), {})
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert (warning.filename, warning.lineno) == ("user_training_script.py", 1)


def test_a_renamed_attribute_warns_and_answers():
    from meshgroups.elastic import Elastic

    prop = Elastic.__dict__["group"]
    holder = types.SimpleNamespace(live_group="the group")
    with pytest.warns(DeprecationWarning, match=r"Elastic.group is now Elastic.live_group .*0\.7\.0"):
        assert prop.fget(holder) == "the group"


def test_an_unknown_name_is_still_an_attribute_error():
    import meshgroups
    import meshgroups.mesh

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshgroups.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshgroups.mesh.nope  # noqa: B018


def test_the_function_execute_survives_importing_the_old_module_of_that_name():
    import meshgroups.transfer as transfer

    function = transfer.execute
    _forget_aliases()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("meshgroups.transfer.execute")
    assert transfer.execute is function and inspect.isfunction(transfer.execute)


def _shown_paths() -> list[tuple[str, str]]:
    """(where, dotted path) for every ``meshgroups.x.y`` and every name of a
    ``from meshgroups.x import a, b`` the pages and notebooks show now."""
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
def test_every_path_the_pages_show_now_resolves_without_a_warning(where, path):
    try:
        obj, caught = _resolve_counting(path)
    except ImportError as exc:
        if exc.name and not exc.name.startswith("meshgroups"):
            pytest.skip(f"{path} needs the optional {exc.name}")
        pytest.fail(f"{where} shows {path}, which does not resolve: {exc!r}")
    except AttributeError as exc:
        pytest.fail(f"{where} shows {path}, which does not resolve: {exc!r}")
    assert not caught, f"{where} teaches {path}, which is deprecated: {caught[0].message}"
    if inspect.isclass(obj) or inspect.isfunction(obj):
        home = importlib.import_module(obj.__module__)
        assert getattr(home, obj.__qualname__.split(".")[0], None) is not None, path
