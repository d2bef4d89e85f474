"""One rank of ``tests/support/torch_dm_harness.py``: runs torch's own DeviceMesh tests, one at a time,
in a process that lives for many tests (harness helper; not collected by pytest).

In ``meshgroups`` mode every mesh the tests build goes through ``meshgroups.init_mesh``: the
test modules' (and torch's test base class's) ``init_device_mesh`` and ``DeviceMesh(...)`` are
replaced, after import, by the two functions below. ``DeviceMesh``'s static methods
(``from_group``, ``_concatenate``) and every other torch API stay torch's. A constructor call with
torch's private arguments (``_init_backend=False``, ``_rank``, ``_layout``...) builds no groups
and stays torch's own.

A test runs as torch's ``MultiProcessTestCase`` runs it in a spawned process (instance,
``rank``, ``file_name``, the method), but the process is reused: after each test every
``MeshGroups`` the test built is closed (a ``close()`` that raises fails the test) and the default
group is destroyed.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import traceback
import unittest
from datetime import timedelta
from typing import Any

_TORCH_KEYS = ("_init_backend", "_rank", "_layout", "_rank_map", "_root_mesh")
_OPEN: list[Any] = []  # MeshGroups built during the current test (closed after it)
_BUILT = [0]  # init_mesh calls made by the current test


def _names(count: int, given: Any) -> tuple[str, ...]:
    # meshgroups' layouts are named: an unnamed torch mesh gets torch's default names for dims
    return tuple(given) if given is not None else tuple(f"dim_{i}" for i in range(count))


def _build(device_type: str, grid: Any, names: Any, backend_override: Any) -> Any:
    from meshgroups import Layout, init_mesh

    layout = Layout.from_grid(grid, _names(grid.ndim, names))
    _BUILT[0] += 1
    # torch's DeviceMesh may cover part of the world: so may these
    mg = init_mesh(layout, device_type, backend_override=backend_override, partial=True)
    _OPEN.append(mg)
    return mg.mesh


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    backend_override: dict[Any, Any] | None = None,
) -> Any:
    """torch's ``init_device_mesh`` through ``meshgroups.init_mesh`` (same arguments)."""
    import numpy as np

    shape = tuple(int(s) for s in mesh_shape)
    grid = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    return _build(device_type, grid, mesh_dim_names, backend_override)


def _device_mesh_class() -> type:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    class DeviceMesh(TorchDeviceMesh):
        """``DeviceMesh(device_type, mesh, mesh_dim_names=...)`` through ``meshgroups.init_mesh``;
        the class attributes (``from_group``, ``_concatenate``) are torch's."""

        def __new__(cls, device_type: str, mesh: Any = None, **kwargs: Any) -> Any:  # type: ignore[misc]
            import torch

            if mesh is None or any(k in kwargs for k in _TORCH_KEYS):
                return TorchDeviceMesh(device_type, mesh, **kwargs)
            grid = (mesh.detach().cpu() if isinstance(mesh, torch.Tensor) else torch.tensor(mesh)).numpy()
            override = kwargs.get("backend_override")
            if override is not None:  # the constructor's form: one (backend, options) per dim
                override = {i: v for i, v in enumerate(override) if v != (None, None)}
            return _build(device_type, grid, kwargs.get("mesh_dim_names"), override)

    return DeviceMesh


def _load(path: str, name: str) -> Any:
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def redirect(modules: list[Any]) -> None:
    """Every ``init_device_mesh`` / ``DeviceMesh(...)`` the tests reach goes to meshgroups."""
    from torch.testing._internal.distributed._tensor import common_dtensor

    cls = _device_mesh_class()
    for module in [*modules, common_dtensor]:
        if hasattr(module, "init_device_mesh"):
            module.init_device_mesh = init_device_mesh
        if hasattr(module, "DeviceMesh"):
            module.DeviceMesh = cls


def _bound_default_group(seconds: float) -> None:
    """Every default group a test makes gets ``seconds`` as its timeout, so a rank left waiting
    by another rank's failure raises instead of hanging."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("timeout", timedelta(seconds=seconds))
        original(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group


def _cleanup() -> str:
    """Close every ``MeshGroups`` the test built, then destroy the default group; returns the
    first error a ``close()`` raised ("" if none). ``close()`` must work whatever the test did
    to torch's groups (``DeviceMesh.abort()``, ``destroy_process_group``), so an error here
    fails a test that passed."""
    import torch.distributed as dist

    error = ""
    while _OPEN:
        try:
            _OPEN.pop().close()
        except Exception:
            error = error or traceback.format_exc(limit=-2)
    if dist.is_initialized():
        dist.destroy_process_group()
    return error


def run_one(module: Any, cls_name: str, test: str, rank: int, file_name: str) -> tuple[str, str]:
    """Run ``cls_name.test`` as rank ``rank``: ``("pass"|"fail"|"skip", detail)``; a test that
    passed but left a ``MeshGroups`` whose ``close()`` raises fails."""
    try:
        status, detail = _run(module, cls_name, test, rank, file_name)
    finally:
        closing = _cleanup()
    if closing and status == "pass":
        return "fail", f"MeshGroups.close() after the test raised:\n{closing}"
    return status, detail


def _run(module: Any, cls_name: str, test: str, rank: int, file_name: str) -> tuple[str, str]:
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcessTestCase

    cls = getattr(module, cls_name)
    if getattr(cls, "__unittest_skip__", False):
        return "skip", getattr(cls, "__unittest_skip_why__", "")
    expecting_failure = getattr(getattr(cls, test), "__unittest_expecting_failure__", False)
    try:
        if issubclass(cls, MultiProcessTestCase):
            case = cls(test)
            case.rank, case.file_name = rank, file_name
            common_utils.set_rng_seed()
            getattr(case, test)()
        else:  # a plain TestCase: unittest's own run (setUp, tearDown)
            result = unittest.TestResult()
            cls(test).run(result)
            for _, text in result.errors + result.failures:
                raise AssertionError(text)
            if result.skipped:
                return "skip", result.skipped[0][1]
            if result.expectedFailures:
                return "pass", "expected failure"
            if result.unexpectedSuccesses:
                return "fail", "unexpected success"
            return "pass", ""
    except unittest.SkipTest as exc:
        return "skip", str(exc)
    except SystemExit as exc:
        reasons = {v.exit_code: v.message for v in TEST_SKIPS.values()}
        if exc.code in reasons:
            return "skip", reasons[exc.code]
        return "fail", f"SystemExit({exc.code})"
    except BaseException:
        if expecting_failure:
            return "pass", "expected failure"
        return "fail", traceback.format_exc(limit=-4)
    if expecting_failure:
        return "fail", "unexpected success"
    return "pass", ""


def serve(rank: int, mode: str, paths: list[str], pg_timeout: float, conn: Any) -> None:
    """Worker loop: receive ``(module, class, test, file_name)``, send ``(status, detail, number
    of meshes the test built through init_mesh)``."""
    import warnings

    warnings.simplefilter("ignore")
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "0"
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    modules = {}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        modules[name] = _load(path, name)
    if mode == "meshgroups":
        redirect(list(modules.values()))
    _bound_default_group(pg_timeout)
    conn.send(("ready", ""))
    while True:
        job = conn.recv()
        if job is None:
            return
        module, cls_name, test, file_name = job
        _BUILT[0] = 0
        conn.send((*run_one(modules[module], cls_name, test, rank, file_name), _BUILT[0]))
