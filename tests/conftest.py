"""Suite-wide settings: pytest-timeout's per-test limit scales with MESHGROUPS_TEST_TIME_SCALE,
hypothesis has no per-example deadline (a loaded machine misses any fixed one), Ctrl-C or SIGTERM
stops the run and every process it started (``tests/support/reaper.py``), and the tests that start
processes carry the ``processes`` marker (``tests/support/processes.py`` keeps it true).

The tests live in one folder per package (``tests/mesh/``, ``tests/transfer/``, ...; the
project-wide checks in ``tests/project/``); ``tests/support/`` holds what they share.

``pytest --fast`` (the same as ``pytest -m "not processes"``): only the tests that start no
process (no gloo ranks, CLI subprocesses or notebook kernels), chosen by the marker alone.

The limit (``timeout`` in pyproject.toml, or a test's own ``@pytest.mark.timeout(n)``) only stops
a hang; on a loaded machine the waits inside a test grow with the scale (``tests/support/timing.py``), so
the limit around them must grow with it too. An explicit ``--timeout`` or PYTEST_TIMEOUT wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .support import processes
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"run only the tests that start no process (no gloo ranks, CLI subprocesses or notebook "
        f'kernels): the same as -m "not {processes.MARKER}"',
    )


def pytest_configure(config: pytest.Config) -> None:
    install()  # Ctrl-C / SIGTERM: stop the run and kill every process it started
    processes.install()  # the marker (declared in pyproject.toml) kept true
    if config.getoption("fast", False):  # pytest's own -m selection, joined with any given
        given = config.option.markexpr
        config.option.markexpr = (
            f"({given}) and not {processes.MARKER}" if given else f"not {processes.MARKER}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    marked = item.get_closest_marker(processes.MARKER) is not None
    processes.unmarked(None if marked else item.nodeid)
    try:
        return (yield)
    finally:
        processes.unmarked(None)


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
