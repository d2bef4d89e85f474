"""Suite-wide settings: pytest-timeout's per-test limit scales with MESHGROUPS_TEST_TIME_SCALE,
hypothesis has no per-example deadline (a loaded machine misses any fixed one), Ctrl-C or SIGTERM
stops the run and every process it started (``tests/support/reaper.py``), and ``--fast`` runs only what
spawns no process.

``pytest --fast``: every test runs up to the point where it would start a process (a
``subprocess``, a ``multiprocessing`` process: gloo ranks, the CLI, notebook kernels), and is
skipped there, so the subset needs no list kept by hand and picks up new tests by itself.

The limit (``timeout`` in pyproject.toml, or a test's own ``@pytest.mark.timeout(n)``) only stops
a hang; on a loaded machine the waits inside a test grow with the scale (``tests/support/timing.py``), so
the limit around them must grow with it too. An explicit ``--timeout`` or PYTEST_TIMEOUT wins.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any

import pytest

from .support.reaper import install
from .support.timing import TIME_SCALE, scaled

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
else:
    # A test's own @settings(...) overrides only the fields it names; these fill in the rest.
    # derandomize: CI explores the same examples every run, so its verdict is reproducible; a new
    # seed is a deliberate change (MESHGROUPS_HYPOTHESIS_RANDOM=1 explores afresh).
    settings.register_profile(
        "meshgroups",
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=os.environ.get("MESHGROUPS_HYPOTHESIS_RANDOM", "0") != "1",
    )
    settings.load_profile("meshgroups")


FAST_SKIP = "spawns a process: not in the --fast subset"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="run only what spawns no process (no gloo ranks, CLI subprocesses or notebook "
        "kernels): a test is skipped where it would start one",
    )


def _refuse_to_spawn(*args: Any, **kwargs: Any) -> Any:
    pytest.skip(FAST_SKIP)


def pytest_configure(config: pytest.Config) -> None:
    install()  # Ctrl-C / SIGTERM: stop the run and kill every process it started
    if config.getoption("fast", False):
        subprocess.Popen.__init__ = _refuse_to_spawn  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = _refuse_to_spawn  # type: ignore[method-assign]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TIME_SCALE == 1 or not config.pluginmanager.hasplugin("timeout"):
        return
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        return  # the caller chose the limit for this run
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        nominal = float(marker.args[0]) if marker and marker.args else default
        if nominal > 0:  # 0 means no limit
            item.add_marker(pytest.mark.timeout(scaled(nominal)), append=False)


def pytest_report_header(config: pytest.Config) -> str:
    return f"MESHGROUPS_TEST_TIME_SCALE={TIME_SCALE:g} (waits and per-test limits scaled by it)"
